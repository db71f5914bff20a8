"""Adapters under tensor parallelism: peft's LoRA beside a sharded Linear, split so the layer computes what it did.

A LoRA layer computes `base(x) + B(A(dropout(x))) * scaling` with A: in -> r and B: r -> out. A plan entry naming
it (Hugging Face's `q_proj: colwise`, through the wrapper: `adapted_model`) shards its base Linear as usual
(`tp_train.plan.apply`), and its adapters with it (`shard_adapters`):

- Column-parallel base (output split): B is split like the base's output rows (sections and kv heads alike), A is
  whole on every rank and reads the replicated input, as the base does before it enters the parallel region. B is
  a `ColumnParallelLinear`: its input A(x) enters the region (`f`), so backward all-reduces the small r-wide
  gradient, which makes A's gradient whole and its input gradient complete on every rank (added outside the
  base's own `f`). Dropout on x draws from the replicated stream, as x is the same on every rank.
- Row-parallel base (input split): A is split along its input like the base (`RowParallelLinear` with
  `partial_output`), B is whole. Each rank's B(A_r x_r) is a partial sum, added to the base's own partial sum
  before the layer's one all-reduce (a `ModuleRegion` on the LoRA layer, which adds the base's bias after it). B's
  gradient (g times a partial A x) is all-reduced. Dropout on this rank's features draws from the per-rank stream.

`requires_grad` stays as it was (the frozen base, the trainable adapters), so the optimizer, clipping and
checkpoints see what trains. Refused in one line: DoRA and other LoRA variants, merged adapters, a bias on B
beside a row layer, and adapters beside other styles.
"""

from __future__ import annotations

import functools

import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup

from tp_train.parallel.collectives import all_reduce_gradient
from tp_train.parallel.layers import ColumnParallelLinear, ModuleRegion, RowParallelLinear
from tp_train.parallel.random import SHARDED, TensorParallelRNG
from tp_train.parallel.sharding import replicated_rows, shard_tensor, sum_replicated_gradient
from tp_train.plan.gradient_hooks import register_gradient_hook

COLUMN_STYLES = ("colwise", "packed_colwise", "fused_qkv_colwise")


def adapted_model(module: nn.Module) -> tuple[str, nn.Module] | None:
    """(name, model) of the model a peft wrapper holds (`PeftModel.get_base_model()`, a tuner's `model`), whose
    names the model's own plan is written in; None for anything else."""
    if not type(module).__module__.startswith("peft."):
        return None
    inner = module.get_base_model() if hasattr(type(module), "get_base_model") else module._modules.get("model")
    if not isinstance(inner, nn.Module) or inner is module:
        return None
    return next((name, child) for name, child in module.named_modules() if child is inner)


def shard_adapters(
    name: str, wrapper: nn.Module, base: nn.Module, style: str, group: ProcessGroup, rng: TensorParallelRNG
) -> None:
    """Splits the adapters of the LoRA layer `wrapper` (named `name`) to go with `base`, its base Linear already
    sharded as `style` (see the module docstring)."""
    _check_supported(name, wrapper, style)
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    if style in COLUMN_STYLES:
        spec = base.shard_specs["weight"]
        for key, up in list(wrapper.lora_B.items()):
            layer = ColumnParallelLinear(
                up.in_features, up.out_features, group, bias=up.bias is not None, sections=spec.sections,
                units=spec.units, device="meta", dtype=up.weight.dtype,
            )  # fmt: skip
            for param_name, param_spec in layer.shard_specs.items():
                original = getattr(up, param_name)
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
        shard = shard_tensor(down.weight.detach(), layer.shard_specs["weight"], rank, tp)
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
