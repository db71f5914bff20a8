"""Adapters under tensor parallelism: peft's LoRA beside a sharded Linear, split so the layer computes what it did
(docs/fine-tuning.md, "Adapters: LoRA under tensor parallelism")."""

from __future__ import annotations

import enum
import functools

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup

from tp_train.parallel.collectives import all_reduce_gradient
from tp_train.parallel.layers import ColumnParallelLinear, ModuleRegion, RowParallelLinear
from tp_train.parallel.random import SHARDED, TensorParallelRNG
from tp_train.parallel.sharding import ShardSpec, replicated_rows, shard_tensor, sum_replicated_gradient
from tp_train.plan.gradient_hooks import register_gradient_hook
from tp_train.plan.styles import adapted_base

COLUMN_STYLES = ("colwise", "packed_colwise", "fused_qkv_colwise")


def materialize_adapters(model: nn.Module, device: torch.device) -> None:
    """LoRA adapters peft built on the meta device (around a model built there, `empty_init`) get storage on `device`
    and peft's own initialisation (A as `nn.Linear`'s, B zero), so the adapted model starts as its base does; the
    same random numbers on every rank, whatever the tp."""
    for module in model.modules():
        if adapted_base(module) is None:
            continue
        adapters = [adapter for key in ("lora_A", "lora_B") for adapter in module._modules[key].values()]
        if any(param.is_meta for adapter in adapters for param in adapter.parameters()):
            for adapter in adapters:
                adapter.to_empty(device=device)
            for key in module.lora_A:
                module.reset_lora_parameters(key, True)


def adapter_specs(wrapper: nn.Module, style: str, base_spec: ShardSpec) -> dict[str, ShardSpec]:
    """How the LoRA layer `wrapper`'s adapter parameters split beside its base layer sharded as `style` (its weight
    split as `base_spec`), by parameter name under `wrapper` (`lora_B.default.weight`); the rest stay whole: beside a
    column base each B (weight and bias) like the base's output rows, beside a row base each A along its input."""
    if style in COLUMN_STYLES:
        spec = ShardSpec(dim=0, sections=base_spec.sections, units=base_spec.units)
        return {f"lora_B.{key}.{name}": spec for key, up in wrapper.lora_B.items() for name, _ in up.named_parameters()}
    if style == "rowwise":
        return {f"lora_A.{key}.weight": ShardSpec(dim=1, sections=(down.in_features,)) for key, down in
                wrapper.lora_A.items()}  # fmt: skip
    return {}


def shard_adapters(
    name: str, wrapper: nn.Module, base: nn.Module, style: str, group: ProcessGroup, rng: TensorParallelRNG
) -> None:
    """Splits the adapters of the LoRA layer `wrapper` (named `name`) to go with `base`, its base Linear already
    sharded as `style` (see the module docstring)."""
    _check_supported(name, wrapper, style)
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    specs = adapter_specs(wrapper, style, base.shard_specs["weight"])
    if style in COLUMN_STYLES:
        for key, up in list(wrapper.lora_B.items()):
            spec = specs[f"lora_B.{key}.weight"]
            layer = ColumnParallelLinear(
                up.in_features, up.out_features, group, bias=up.bias is not None, sections=spec.sections,
                units=spec.units, device="meta", dtype=up.weight.dtype,
            )  # fmt: skip
            for param_name in layer.shard_specs:
                original, param_spec = getattr(up, param_name), specs[f"lora_B.{key}.{param_name}"]
                shard = shard_tensor(original.detach(), param_spec, rank, tp)
                setattr(layer, param_name, nn.Parameter(shard, requires_grad=original.requires_grad))
                if original.requires_grad and replicated_rows(param_spec, tp):  # kv heads fewer than ranks
                    hook = functools.partial(sum_replicated_gradient, spec=param_spec, group=group)
                    register_gradient_hook(layer, param_name, hook)
            wrapper.lora_B[key] = layer
        return
    for key, down in list(wrapper.lora_A.items()):
        layer = RowParallelLinear(
            down.in_features, down.out_features, group, bias=False, device="meta", dtype=down.weight.dtype,
            partial_output=True,
        )  # fmt: skip
        shard = shard_tensor(down.weight.detach(), specs[f"lora_A.{key}.weight"], rank, tp)
        layer.weight = nn.Parameter(shard, requires_grad=down.weight.requires_grad)
        wrapper.lora_A[key] = layer
    for up in wrapper.lora_B.values():
        if up.weight.requires_grad:
            register_gradient_hook(up, "weight", lambda grad: all_reduce_gradient(grad, group))
    for dropout in wrapper.lora_dropout.values():
        rng.run_in(dropout, SHARDED)
    base.configure(partial_output=True)
    wrapper.tp_region = ModuleRegion(group, leave=True, bias=base.bias)
    wrapper.tp_region.install(wrapper)


def adapter_config_dict(config) -> dict:
    """A peft config as plain data (sets as sorted lists, enums as their values), for a checkpoint's metadata;
    `peft.LoraConfig(**d)` (the config's own class) builds it again."""

    def plain(value):
        if isinstance(value, enum.Enum):  # peft's PeftType and TaskType (str enums)
            return plain(value.value)
        if isinstance(value, dict):
            return {str(key): plain(item) for key, item in value.items()}
        if isinstance(value, (set, frozenset)):
            return sorted(plain(item) for item in value)
        if isinstance(value, (list, tuple)):
            return [plain(item) for item in value]
        if isinstance(value, (str, int, float, bool)) or value is None:
            return value
        return str(value)

    return plain(config.to_dict())


def _check_supported(name: str, wrapper: nn.Module, style: str) -> None:
    def refuse(what: str) -> ValueError:
        where = f"module '{name}' ({type(wrapper).__name__})"
        return ValueError(f"{where}: {what} is not supported under tensor parallelism")

    if style not in COLUMN_STYLES and style != "rowwise":
        raise refuse(f"a LoRA adapter beside a '{style}' layer (adapters go beside colwise or rowwise layers)")
    if getattr(wrapper, "merged", False):
        raise refuse("a merged adapter (unmerge it before sharding, or shard the merged model without peft)")
    if getattr(wrapper, "lora_variant", None) or any(getattr(wrapper, "use_dora", {}).values()):
        raise refuse("a LoRA variant (DoRA and others; plain LoRA is)")
    if style == "rowwise" and any(up.bias is not None for up in wrapper.lora_B.values()):
        raise refuse("a bias on lora_B beside a row-parallel layer (lora_bias=False is)")
