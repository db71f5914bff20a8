"""Every config group composes and instantiates (after lightning-hydra-template's test_configs), and the
config vocabulary (precision names, trainer arguments) behaves."""

from __future__ import annotations

import inspect
from pathlib import Path

import lightning as L
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import open_dict

from tp_train.app.resolvers import lightning_precision, register_resolvers

CONF = Path(__file__).resolve().parents[1] / "conf"
register_resolvers()


def _options(group: str) -> list[str]:
    return sorted(path.stem for path in (CONF / group).glob("*.yaml"))


def _compose(tmp_path, overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(tmp_path)
        cfg.hydra.job.num = 0
    HydraConfig().set_config(cfg)  # resolves ${hydra:runtime.output_dir} as in a real run
    return cfg


@pytest.mark.parametrize("model", _options("model"))
def test_model_configs_build(tmp_path, model):
    cfg = _compose(tmp_path, [f"model={model}", "data.vocab_size=512", "data.block_size=32"])
    factory = instantiate(cfg.model)
    import torch

    with torch.device("meta"):  # gpt_small has 91M parameters: shapes only
        net = factory()
    context = getattr(net.config, "block_size", None) or net.config.max_position_embeddings  # GPT's or HF's name
    assert net.config.vocab_size == 512 and context == 32


@pytest.mark.parametrize("group", ["data", "optimizer", "scheduler", "logger", "callbacks", "experiment"])
def test_every_option_of_a_group_instantiates(tmp_path, group, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    for option in _options(group):
        overrides = [f"{group}={option}"]
        if option == "local_text":
            overrides.append(f"data.source={tmp_path}")
        cfg = _compose(tmp_path, overrides)
        node = cfg[group] if group != "experiment" else cfg
        if group == "callbacks":
            assert all(isinstance(instantiate(c), L.Callback) for c in node.values())
        elif group == "experiment":
            assert instantiate(cfg.trainer, precision=lightning_precision(cfg.precision)).max_steps > 0
        elif node:  # an empty option (logger=none) means "none"
            assert instantiate(node) is not None


def test_every_experiment_runs_with_every_scheduler(tmp_path):
    """An experiment's scheduler keys (smoke's warmup_steps) apply to whichever scheduler the user picks: smoke with
    scheduler=constant once composed a scheduler of warmup_steps alone, which train.py then called."""
    import torch

    for experiment in _options("experiment"):
        for scheduler in _options("scheduler"):
            cfg = _compose(tmp_path, [f"experiment={experiment}", f"scheduler={scheduler}"])
            optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
            schedule = instantiate(cfg.scheduler)(optimizer, total_steps=cfg.trainer.max_steps)
            assert isinstance(schedule, torch.optim.lr_scheduler.LRScheduler), (experiment, scheduler)


def test_the_constant_schedule_warms_up_then_holds_the_optimizers_lr_exactly():
    import torch

    from tp_train import constant_with_warmup

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.3)
    schedule = constant_with_warmup(optimizer, total_steps=10, warmup_steps=3)
    rates = []
    for _ in range(6):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert rates[:3] == pytest.approx([0.1, 0.2, 0.3], rel=1e-12)
    assert rates[3:] == [0.3] * 3  # then exactly the optimizer's lr


def test_trainer_config_instantiates_with_the_tensor_parallel_strategy(tmp_path):
    from tp_train import TensorParallelStrategy

    cfg = _compose(tmp_path, ["tp=2", "dp=2", "trainer.accelerator=cpu"])
    trainer = instantiate(cfg.trainer, precision=lightning_precision(cfg.precision))
    assert isinstance(trainer.strategy, TensorParallelStrategy)
    assert trainer.strategy.tensor_parallel_size == 2 and trainer.num_devices == 4


def test_samples_config_is_off_by_default_and_builds_the_callback(tmp_path):
    from tp_train import ValidationSamples

    assert list(_compose(tmp_path, []).samples.prompts) == []  # off: train.py adds no callback
    cfg = _compose(tmp_path, ['samples.prompts=["def "]', "samples.temperature=0.5"])
    samples = instantiate(cfg.samples)
    assert isinstance(samples, ValidationSamples) and samples.prompts == ["def "]
    assert samples.sampling.temperature == 0.5 and samples.sampling.seed == cfg.seed


def test_trainer_config_lists_every_trainer_argument():
    """So any Trainer argument can be overridden without Hydra's `+` (and stays so as Lightning grows)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        trainer_cfg = compose("train").trainer
    expected = set(inspect.signature(L.Trainer.__init__).parameters) - {"self", "precision", "plugins", "callbacks"}
    expected -= {"logger"}
    assert expected <= set(trainer_cfg), sorted(expected - set(trainer_cfg))


@pytest.mark.parametrize(
    "typed,lightning",
    [(32, "32-true"), (16, "16-mixed"), ("bf16", "bf16-mixed"), ("bf16-true", "bf16-true"), ("16-mixed", "16-mixed")],
)
def test_precision_as_users_type_it(typed, lightning):
    assert lightning_precision(typed) == lightning


def test_unknown_precision_is_a_one_line_error_naming_what_works():
    with pytest.raises(ValueError, match="precision=fp8 is not a precision; use one of 32, 16, bf16") as error:
        lightning_precision("fp8")
    assert "\n" not in str(error.value)


def test_the_optimizer_config_builds_adamw_foreach_on_cuda_and_torchs_choice_on_cpu(tmp_path):
    import torch

    from tp_train.tools.optimizer import auto_implementation

    factory = instantiate(_compose(tmp_path, []).optimizer)
    layer = torch.nn.Linear(4, 4)
    optimizer = factory([{"params": layer.parameters()}, {"params": [], "weight_decay": 0.0}])
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["lr"] == 1e-3
    assert optimizer.defaults["foreach"] is None and not optimizer.defaults["fused"]  # CPU: torch's own choice
    layer(torch.randn(2, 4)).sum().backward()
    optimizer.step()  # and it steps there
    assert auto_implementation({"cuda"}) == "foreach"
    assert auto_implementation({"cpu"}) == auto_implementation({"cpu", "cuda"}) == "default"
    fused = factory(layer.parameters(), implementation="fused")
    assert fused.defaults["fused"] is True
    with pytest.raises(ValueError, match="optimizer.implementation='fast': choose one of auto, fused, foreach"):
        factory(layer.parameters(), implementation="fast")
