"""`python -m tp_train.tools.zoo`: the command line (see `tp_train.tools.zoo`)."""

from __future__ import annotations

import argparse
import json
import time

import tp_train.tools.zoo as zoo
from tp_train.tools.zoo.check import check_family
from tp_train.tools.zoo.configs import SIZES
from tp_train.tools.zoo.init_check import check_init, init_summary
from tp_train.tools.zoo.runner import run_zoo, summary
from tp_train.tools.zoo.train_path import TRAIN_PASSES, parity_passing, run_train_zoo, run_typed_zoo, train_table
from tp_train.tools.zoo_tasks import TASKS, task_families


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tp_train.tools.zoo", description=zoo.__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="causal-lm", choices=[*TASKS, "all"], help="which families (default: LMs)")
    parser.add_argument("--families", help="comma-separated model types (default: every family of the task)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--jobs", type=int, default=2, help="families checked at once")
    parser.add_argument("--timeout", type=float, default=180, help="seconds per family")
    parser.add_argument("--output", help="write the results as JSON here ({task: results} with --task all)")
    parser.add_argument(
        "--kv-heads", type=int, help=f"kv heads of every family that has them (default: as many as the "
        f"{SIZES['num_attention_heads']} query heads; 2 is grouped-query attention)",
    )  # fmt: skip
    parser.add_argument(
        "--init", action="store_true", help="check the init column instead: each family built under deferred_init "
        "and sharded against its eager build, every parameter's and buffer's mean and std (tp_train.tools.zoo."
        "init_check)",
    )  # fmt: skip
    parser.add_argument(
        "--train", action="store_true", help="run the user's path instead: a few steps of `train.py model=hf "
        "model.type=X tp=N` per family, compared with tp=1 (causal LM only; tp_train.tools.zoo.train_path)",
    )  # fmt: skip
    parser.add_argument(
        "--as-typed", action="store_true", help="run the command a user types instead: `train.py model=hf "
        "model.type=X tp=N` with no model field (the family's own small config), 4 steps, finite losses (causal LM "
        "only)",
    )  # fmt: skip
    parser.add_argument(
        "--parity", help="with --train or --as-typed: only the families that pass parity (pass, round-off) in this "
        "JSON, the zoo's --output",
    )  # fmt: skip
    args = parser.parse_args(argv)
    fields = {"num_key_value_heads": args.kv_heads} if args.kv_heads else None
    if args.train or args.as_typed:
        if args.task != "causal-lm":
            parser.error("--train and --as-typed run train.py, which trains causal LMs: use --task causal-lm")
        chosen = args.families.split(",") if args.families else task_families(args.task)
        if args.parity:
            with open(args.parity) as file:
                chosen = parity_passing(chosen, json.load(file))
        timeout = max(args.timeout, 300)
        if args.as_typed:
            results = run_typed_zoo(chosen, args.tp, timeout=timeout, output=args.output)
            passes, what = ("trains",), f"train at tp={args.tp} with finite losses from model.type alone"
        else:
            results = run_train_zoo(chosen, args.tp, fields, timeout=timeout, output=args.output)
            passes, what = TRAIN_PASSES, f"train at tp={args.tp} with tp=1's losses (or float64's)"
        trained = sum(result["class"] in passes for result in results.values())
        print(f"\n{trained} of {len(results)} families {what}\n")
        print(train_table(results))
        return
    tasks = list(TASKS) if args.task == "all" else [args.task]
    everything = {}
    for task in tasks:
        chosen = args.families.split(",") if args.families else task_families(task)
        started = time.monotonic()
        check, summarise = (check_init, init_summary) if args.init else (check_family, summary)
        everything[task] = run_zoo(chosen, args.tp, args.jobs, args.timeout, task=task, fields=fields, check=check)
        print(f"\n{task}: {summarise(everything[task], args.tp)}\n({time.monotonic() - started:.0f} s)", flush=True)
    if args.output:
        with open(args.output, "w") as file:
            json.dump(everything if args.task == "all" else everything[args.task], file, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
