"""`python -m tp_train.tools.zoo --task causal-lm --train`: the user's whole path per family. For each family, a
few steps of `python train.py model=hf model.type=X tp=N` (the zoo's tiny fields as `model.config` overrides, the
data's own vocabulary) and of the same command at tp=1, compared loss by loss (`TRAIN_TOLERANCE`). `--as-typed`:
the command as a user types it, no model field (`TYPED`), its losses finite. Each run is its own process, as a
user's is; families run one after another."""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tp_train.tools.zoo.configs import VOCAB, tiny_config

TRAIN_TOLERANCE = 1e-4
FLOAT64_TOLERANCE = 1e-5  # the parity bar: the logged losses are float32 even from a float64 run (2 ulp near 5)
PARITY_PASSES = ("pass", "round-off")  # the parity check's classes; the train run's too (`TRAIN_PASSES`)
TRAIN_PASSES = ("trains", "round-off")
STEPS = 4
# The data's sizes, not the zoo's: the tokenizer trained on the corpus needs 258 tokens at least.
DATA = ("data.max_files=20", "data.vocab_size=300", "data.block_size=32")
SETTINGS = ("logger=csv", "ckpt_path=null", "scheduler=constant", f"trainer.max_steps={STEPS}",
            f"trainer.val_check_interval={STEPS}", "trainer.limit_val_batches=1", "trainer.log_every_n_steps=1",
            "trainer.enable_progress_bar=false", "~callbacks.progress_bar")  # fmt: skip
# `--as-typed`: what a user types after `model=hf model.type=X tp=N` (issue 54): hf.yaml's sizes, the family's own
# small config, nothing of the zoo's.
TYPED = ("trainer.max_steps=4", "trainer.val_check_interval=4", "logger=csv", "data.block_size=64",
         "data.batch_size=4", "data.vocab_size=512", "data.max_files=40")  # fmt: skip
# The data's: train.py's config sets the vocabulary, and the special token ids are its tokenizer's. The positions
# stay the zoo's (64, above the data's 32-token blocks: RoBERTa's embeddings count them from the pad id + 1).
DATA_VOCAB = "${data.vocab_size}"
NOT_FIELDS = ("vocab_size", "pad_token_id", "bos_token_id", "eos_token_id")


def train_overrides(model_type: str, fields: dict | None = None) -> list[str]:
    """`train.py` overrides building `model_type` from the zoo's tiny config with `fields` set (its kv heads), its
    dropout off: ranks draw their own masks in a sharded region, so with dropout on no tp=N run repeats tp=1's
    losses (GPT-2's 0.1 by default: 3e-3 apart at step 4)."""
    tiny = {**_no_dropout(model_type), **tiny_config(model_type), **(fields or {})}
    config = {key: _data_vocab(key, _data_sizes(value)) for key, value in tiny.items() if key not in NOT_FIELDS}
    overrides = [f"++model.config.{key}={hydra_value(value)}" for key, value in config.items()]
    return ["model=hf", f"model.type={model_type}", *overrides]


def _data_sizes(value):
    """A sub-config (a dict: dots3's `text_config`) with the data's vocabulary and blocks in place of the zoo's
    (its 128-token vocabulary refused the data's 300; its other token tables alike, Gemma 4's), and its own dropout
    off (emu3's text model: 0.1 by default, 1.2e-3 from tp=1 at step 4)."""
    if not isinstance(value, dict):
        return value
    data = {"vocab_size": "${data.vocab_size}", "max_position_embeddings": "${data.block_size}"}
    dropout = _no_dropout(value["model_type"]) if "model_type" in value else {}
    return {**dropout, **{key: data.get(key, _data_vocab(key, item)) for key, item in value.items()}}


def _data_vocab(key: str, value):
    """The data's vocabulary for another of the config's token tables at the zoo's vocabulary (Gemma 4's
    `vocab_size_per_layer_input`, looked up with the same ids: 128 rows refused the data's 300 tokens)."""
    return DATA_VOCAB if "vocab_size" in key and value == VOCAB else value


def _no_dropout(model_type: str) -> dict:
    """0.0 for each dropout probability of the family's config (`*dropout*`, `*pdrop*`) above 0."""
    from transformers import CONFIG_MAPPING

    try:
        defaults = vars(CONFIG_MAPPING[model_type]())
    except Exception:  # noqa: BLE001 - the run reports a family that does not build
        return {}
    return {
        key: 0.0
        for key, value in defaults.items()
        if ("dropout" in key or "pdrop" in key)
        and isinstance(value, float)
        and not isinstance(value, bool)
        and value > 0
    }


def hydra_value(value) -> str:
    """`value` in Hydra's override grammar; an interpolation (`${data.vocab_size}`) unquoted: quoted, the ranks
    `train.py` starts read it back as the string '300', which a config refuses (emu3's `text_config`)."""
    if isinstance(value, str) and value.startswith("${") and value.endswith("}"):
        return value
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{key}:{hydra_value(item)}" for key, item in value.items()) + "}"
    return "'" + str(value).replace("'", "\\'") + "'"


def train_family(model_type: str, tp: int, fields: dict | None = None, timeout: float = 600) -> dict:
    """{"class": "trains" | "round-off" | "differs" | "fails", "reason", "losses": {tp: [...]}} for one family.
    Losses further apart than `TRAIN_TOLERANCE` in float32 are compared again with both runs in float64: within
    `FLOAT64_TOLERANCE` there, the difference is float32's rounding, amplified over the steps ("round-off", as the
    parity check's class), not the sharding."""
    losses, failure = _train_losses(model_type, tp, fields, timeout)
    if failure is not None:
        return {"class": "fails", "reason": failure, "losses": losses}
    worst = max(abs(a - b) for a, b in zip(losses[tp], losses[1], strict=True))
    if worst <= TRAIN_TOLERANCE:
        return {"class": "trains", "reason": f"{STEPS} steps, largest loss difference {worst:.1e}", "losses": losses}
    double, failure = _train_losses(model_type, tp, fields, timeout, ("precision=64",))
    if failure is None:
        worst_double = max(abs(a - b) for a, b in zip(double[tp], double[1], strict=True))
        if worst_double <= FLOAT64_TOLERANCE:
            reason = f"{STEPS} steps, losses {worst:.1e} apart in float32, {worst_double:.1e} in float64"
            return {"class": "round-off", "reason": reason, "losses": losses, "float64_losses": double}
    return {"class": "differs", "reason": f"losses differ from tp=1's by {worst:.1e}", "losses": losses}


def _train_losses(model_type: str, tp: int, fields: dict | None, timeout: float, extra: tuple[str, ...] = ()):
    """({size: losses} of the runs at tp and at 1, None), or (what ran, the first failure's one line)."""
    losses = {}
    with tempfile.TemporaryDirectory(prefix=f"zoo-train-{model_type}-") as directory:
        for size in (tp, 1):
            run_dir = Path(directory) / f"tp{size}"
            command = [sys.executable, "train.py", *train_overrides(model_type, fields), *DATA, *SETTINGS, *extra,
                       f"tp={size}", f"hydra.run.dir={run_dir}"]  # fmt: skip
            env = {**os.environ, "WANDB_MODE": "offline", "TRANSFORMERS_VERBOSITY": "error"}
            done = _run(command, env, timeout)
            if done is None:
                return losses, f"tp={size}: no end within {timeout:.0f} s"
            if done.returncode != 0:
                return losses, f"tp={size}: {_last_error(done.stderr)}"
            losses[size] = _losses(run_dir)
    if len(losses[tp]) != STEPS or not all(math.isfinite(loss) for loss in losses[tp]):
        return losses, f"tp={tp}: losses {losses[tp]}"
    return losses, None


def typed_family(model_type: str, tp: int, timeout: float = 600) -> dict:
    """{"class": "trains" | "fails", "reason", "losses": {tp: [...]}} for `python train.py model=hf
    model.type=X tp=N` and `TYPED` alone: no model field, so the family's small config at hf.yaml's sizes. Its
    losses are the run's summary's (`summary.json`: first, last and validation; the command logs no step's before
    Lightning's 50th), each finite, after `STEPS` steps."""
    with tempfile.TemporaryDirectory(prefix=f"zoo-typed-{model_type}-") as directory:
        run_dir = Path(directory) / "run"
        command = [sys.executable, "train.py", "model=hf", f"model.type={model_type}", f"tp={tp}", *TYPED,
                   f"hydra.run.dir={run_dir}"]  # fmt: skip
        done = _run(command, {**os.environ, "TRANSFORMERS_VERBOSITY": "error"}, timeout)
        if done is None:
            return {"class": "fails", "reason": f"no end within {timeout:.0f} s", "losses": {}}
        if done.returncode != 0:
            return {"class": "fails", "reason": _last_error(done.stderr), "losses": {}}
        summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    losses = [summary.get(key) for key in ("first_train_loss", "train_loss", "val_loss")]
    if summary.get("steps") != STEPS or not all(isinstance(loss, float) and math.isfinite(loss) for loss in losses):
        return {"class": "fails", "reason": f"{summary.get('steps')} steps, losses {losses}", "losses": {tp: losses}}
    reason = f"{STEPS} steps, train loss {losses[0]:.3f} -> {losses[1]:.3f}, validation {losses[2]:.3f}"
    return {"class": "trains", "reason": reason, "losses": {tp: losses}}


def run_train_zoo(
    model_types: list[str], tp: int, fields: dict | None = None, timeout: float = 600, echo=print, output=None
):
    """{family: train_family(...)} for each family, one after another (`each_family`)."""
    return each_family(model_types, lambda model_type: train_family(model_type, tp, fields, timeout), echo, output)


def run_typed_zoo(model_types: list[str], tp: int, timeout: float = 600, echo=print, output=None):
    """{family: typed_family(...)} for each family, one after another (`each_family`)."""
    return each_family(model_types, lambda model_type: typed_family(model_type, tp, timeout), echo, output)


def each_family(model_types: list[str], run, echo=print, output=None) -> dict[str, dict]:
    """{family: run(family)} for each family, one after another, each echoed as it ends with its seconds
    (`seconds`) and, with `output` (a path), all results so far written there as JSON: a run stopped part way is
    still read, and a run given the same `output` again resumes it: the families already there are kept, not re-run
    (delete one's entry to run it again)."""
    results = json.loads(Path(output).read_text()) if output is not None and Path(output).exists() else {}
    kept = [model_type for model_type in model_types if model_type in results]
    if kept:
        echo(f"{len(kept)} of {len(model_types)} families already in {output}: kept, not re-run")
    for model_type in model_types:
        if model_type in results:
            continue
        started = time.monotonic()
        results[model_type] = run(model_type)
        results[model_type]["seconds"] = round(time.monotonic() - started, 1)
        result = results[model_type]
        echo(f"{model_type:<28} {result['class']:<8} {result['reason']} ({result['seconds']:.0f} s)")
        if output is not None:
            Path(output).write_text(json.dumps(results, indent=1, sort_keys=True))
    return {model_type: results[model_type] for model_type in model_types}


def parity_passing(model_types: list[str], parity: dict[str, dict]) -> list[str]:
    """The families of `model_types` that pass the zoo's parity check in `parity` (its `--output` JSON): `pass` or
    `round-off`, the ones `--train` is asked to train."""
    return [model_type for model_type in model_types if parity.get(model_type, {}).get("class") in PARITY_PASSES]


def train_table(results: dict[str, dict], parity: dict[str, dict] | None = None) -> str:
    """A markdown table, per family: parity (the zoo's class, where given) and train."""
    lines = ["| family | parity | train |", "|---|---|---|"]
    for name, result in sorted(results.items()):
        shown = (parity or {}).get(name, {}).get("class", "")
        lines.append(f"| {name} | {shown} | {result['class']}: {result['reason']} |")
    return "\n".join(lines)


def _run(command: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess | None:
    """`command` run in the project's root in a session of its own; None at `timeout`, when the whole session is
    killed: the ranks `train.py` started too, which a kill of `train.py` alone left running."""
    with subprocess.Popen(command, cwd=_root(), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as process:  # fmt: skip
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            return None
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def _losses(run_dir: Path) -> list[float]:
    paths = sorted(run_dir.glob("csv/version_*/metrics.csv"))
    if not paths:
        return []
    with open(paths[0]) as metrics:
        return [float(row["train/loss"]) for row in csv.DictReader(metrics) if row.get("train/loss")]


def _last_error(stderr: str) -> str:
    """The run's one-line reason: its last `error:` line (the app's own, naming the rank that failed first and why;
    not one saying only that a rank exited), else its last line naming an error, else its last line. An error while
    Lightning tears a failed run down (moving a meta-built model to the CPU) came after the cause and hid it
    (inkling_text: the LM head `loss_parallel` needs)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    own = [line for line in lines if line.startswith("error:") and "exited with status" not in line]
    named = [line for line in lines if "Error" in line]
    line = (own or named or lines or ["no output"])[-1]
    return line if len(line) <= 300 else f"{line[:120]} ... {line[-175:]}"  # the error's own words are at the end


def _root() -> Path:
    """The project's root, where train.py and conf/ are."""
    return Path(__file__).resolve().parents[3]
