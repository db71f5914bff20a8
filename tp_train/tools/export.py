"""Export a tensor-parallel checkpoint to a Hugging Face `save_pretrained` directory."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from tp_train.checkpoint.checks import check_files
from tp_train.checkpoint.dcp import (
    ADAPTER_CONFIG_KEY,
    BASE_WEIGHTS_KEY,
    HUGGING_FACE_CONFIG_KEY,
    LAYOUT_KEY,
    checkpoint_extra,
)
from tp_train.checkpoint.safe_load import SafeFileSystemReader
from tp_train.plan.deciding.match import match_plan
from tp_train.plan.deciding.resolve import resolve_plan
from tp_train.plan.styles import LINEAR_STYLES
from tp_train.tools.tokenizer import load_tokenizer, run_tokenizer

SECTION = "/section"  # tp_train.checkpoint's key suffix for the sections of a packed tensor


def export_hugging_face(
    checkpoint: str | Path,
    out_dir: str | Path,
    config=None,
    plan: dict[str, str] | None = None,
    trust_checkpoint: bool = False,
    adapters_only: bool = False,
) -> Path:
    """Writes the model in `checkpoint` as a Hugging Face `save_pretrained` directory at `out_dir`.

    Args:
        checkpoint: a checkpoint directory written by `TensorParallelStrategy` or `tp_train.checkpoint.dcp.save`.
        out_dir: the directory to write (`config.json` and safetensors weights).
        config: the model's Hugging Face config, or a directory holding its `config.json`. Default: the config
            `CausalLMModule` stored in the checkpoint.
        plan: the plan the model was sharded with, if it was not the model's own, with names relative to the
            Hugging Face model (it tells which Conv1D weights were stored in the parallel layer's layout).
        trust_checkpoint: read a checkpoint that holds more than data (pickled objects) as torch would; by default
            it is refused in one line before any of it is unpickled (`tp_train.checkpoint.safe_load`).
        adapters_only: for a run that trained peft adapters: write them as a peft adapter directory
            (`PeftModel.from_pretrained(base, out_dir)`) instead of the merged model.

    Returns:
        `out_dir`.
    """
    from transformers import AutoModelForCausalLM

    checkpoint = Path(checkpoint)
    stored = _stored_tensors(checkpoint, trust_checkpoint)
    extra = checkpoint_extra(checkpoint, trust_checkpoint)
    config = _config(checkpoint, config, extra)
    if ADAPTER_CONFIG_KEY in extra:
        _write_adapted(checkpoint, out_dir, stored, extra, config, trust_checkpoint, adapters_only)
    elif adapters_only:
        raise ValueError(
            f"checkpoint {checkpoint} holds no adapters (its run trained the whole model); drop --adapters-only"
        )
    else:
        with torch.device("meta"):  # shapes only; the weights come from the checkpoint
            model = AutoModelForCausalLM.from_config(config)
        state = _load_state(checkpoint, stored, list(model.state_dict()), trust_checkpoint)
        for name in _transposed_weights(model, plan):
            state[name] = state[name].t().contiguous()
        model.load_state_dict(state, assign=True)
        model.tie_weights()
        model.save_pretrained(out_dir)
    tokenizer = run_tokenizer(checkpoint, extra)
    if tokenizer is not None:  # so that AutoTokenizer.from_pretrained(out_dir) works too
        load_tokenizer(tokenizer).save_pretrained(out_dir)
    return Path(out_dir)


def export_lightning(checkpoint: str | Path, out_file: str | Path, trust_checkpoint: bool = False) -> Path:
    """Writes the sharded checkpoint directory `checkpoint` as one Lightning checkpoint file at `out_file` (what
    `save_distributed_checkpoint=False` writes, without the optimizer state): `MyModule.load_from_checkpoint(out_file)`
    then reads it in a plain process. Read in one process, no ranks needed; the LightningModule's own state names
    and layouts come from the layout record every checkpoint since this command holds."""
    checkpoint = Path(checkpoint)
    stored = _stored_tensors(checkpoint, trust_checkpoint)
    extra = checkpoint_extra(checkpoint, trust_checkpoint)
    layout = extra.pop(LAYOUT_KEY, None)
    if layout is None:
        raise ValueError(
            f"checkpoint {checkpoint} records no layout of its sharded tensors (saved by an older tp_train); resume "
            f"it once with save_distributed_checkpoint=false (trainer.strategy.save_distributed_checkpoint=false) to "
            f"write a file"
        )
    tensors = {key: torch.empty(meta.size, dtype=meta.properties.dtype) for key, meta in stored.items()}
    dcp.load(tensors, storage_reader=SafeFileSystemReader(checkpoint, trust_checkpoint), no_dist=True)
    dims = {name: dim for name, (dim, _) in layout.items()}
    state = _assemble(tensors, "model.", dims)
    for name, (_, transposed) in layout.items():
        if transposed and name in state:
            state[name] = state[name].t().contiguous()
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    torch.save({**extra, "state_dict": state}, out_file)
    return out_file


def _load_state(checkpoint: Path, stored: dict, names: list[str], trust_checkpoint: bool) -> dict[str, torch.Tensor]:
    """{name: full tensor} of the checkpoint's tensors for the model state `names`, read in one process."""
    prefix = _prefix(stored, names, checkpoint)
    wanted = {key: meta for key, meta in stored.items() if key.startswith(prefix)}
    tensors = {key: torch.empty(meta.size, dtype=meta.properties.dtype) for key, meta in wanted.items()}
    dcp.load(tensors, storage_reader=SafeFileSystemReader(checkpoint, trust_checkpoint), no_dist=True)
    return _assemble(tensors, prefix)


def _write_adapted(checkpoint, out_dir, stored, extra, config, trust_checkpoint: bool, adapters_only: bool) -> None:
    """A run that trained peft adapters: its base model (from the pretrained weights it names, else from the
    checkpoint, which then holds the base too) with the adapters loaded, merged or as a peft adapter directory."""
    from peft import PeftConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = extra.get(BASE_WEIGHTS_KEY)
    if base is not None:
        model = AutoModelForCausalLM.from_pretrained(base, local_files_only=True, use_safetensors=True)
    else:
        model = AutoModelForCausalLM.from_config(config)
    model = get_peft_model(model, PeftConfig.from_peft_type(**extra[ADAPTER_CONFIG_KEY]))
    names = [name for name, param in model.named_parameters() if param.requires_grad or base is None]
    state = _load_state(checkpoint, stored, names, trust_checkpoint)
    missing = sorted(set(names) - set(state))
    if missing:
        raise ValueError(
            f"checkpoint {checkpoint} holds no '{missing[0]}' (and {len(missing) - 1} more) of its adapters"
        )
    model.load_state_dict(state, strict=False)
    if adapters_only:
        model.save_pretrained(out_dir)
    else:
        model.merge_and_unload().save_pretrained(out_dir)


def _config(checkpoint: Path, config, extra: dict):
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(config, PretrainedConfig):
        return config
    if config is not None:
        return AutoConfig.from_pretrained(config, local_files_only=True)
    if HUGGING_FACE_CONFIG_KEY not in extra:
        raise ValueError(
            f"checkpoint {checkpoint} stores no Hugging Face config (it was not saved from a CausalLMModule around a "
            f"Hugging Face model); pass config= a directory with its config.json (--config DIR)"
        )
    values = dict(extra[HUGGING_FACE_CONFIG_KEY])
    return AutoConfig.for_model(values.pop("model_type"), **values)


def _stored_tensors(checkpoint: Path, trust_checkpoint: bool) -> dict[str, TensorStorageMetadata]:
    """The checkpoint's model tensors: {DCP key: its metadata}, without the optimizers' state."""
    metadata = check_files(checkpoint, trust_checkpoint).state_dict_metadata  # there, whole, data: else one line
    return {
        key: meta
        for key, meta in metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }


def _prefix(stored: dict, names: list[str], checkpoint: Path) -> str:
    """What precedes the Hugging Face model's state names in the checkpoint's keys ("model." for the model
    itself, "model.model." for a CausalLMModule's `model`)."""
    bases = {key.split(SECTION)[0] for key in stored}
    for base in sorted(bases, key=len):
        if base.endswith(names[0]):
            prefix = base[: -len(names[0])]
            if prefix.endswith(".") and all(prefix + name in bases for name in names):
                return prefix
    raise ValueError(
        f"checkpoint {checkpoint} does not hold this model: no key ends with its '{names[0]}' and the rest; "
        f"its keys look like {sorted(bases)[:3]}"
    )


def _assemble(
    tensors: dict[str, torch.Tensor], prefix: str, dims: dict[str, int] | None = None
) -> dict[str, torch.Tensor]:
    """{model state name: full tensor}, the sections of a packed tensor concatenated along their dim (`dims`, by
    name; the output dim, 0, by default)."""
    sections: dict[str, list[tuple[int, torch.Tensor]]] = {}
    state = {}
    for key, tensor in tensors.items():
        name = key[len(prefix) :]
        if SECTION in name:
            name, index = name.split(SECTION)
            sections.setdefault(name, []).append((int(index), tensor))
        else:
            state[name] = tensor
    for name, pieces in sections.items():
        ordered = [tensor for _, tensor in sorted(pieces, key=lambda piece: piece[0])]
        state[name] = torch.cat(ordered, dim=(dims or {}).get(name, 0))
    return state


def _transposed_weights(model: nn.Module, plan: dict[str, str] | None) -> list[str]:
    """State names of the Conv1D weights the plan shards: stored in the parallel layer's (out, in) layout."""
    resolved, _ = resolve_plan(model, plan)
    return [
        f"{entry.name}.weight"
        for entry in match_plan(model, resolved, 1)
        if entry.style in LINEAR_STYLES and not isinstance(entry.module, nn.Linear)
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tp-train-export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a checkpoint directory (e.g. outputs/<run>/checkpoints/last.ckpt)")
    parser.add_argument("out_dir", help="the save_pretrained directory to write (with --lightning: the file)")
    parser.add_argument(
        "--lightning", action="store_true",
        help="write one Lightning checkpoint file instead, which MyModule.load_from_checkpoint reads in one process",
    )  # fmt: skip
    parser.add_argument("--config", help="a directory with the model's config.json (default: from the checkpoint)")
    parser.add_argument(
        "--adapters-only", action="store_true",
        help="a run that trained peft adapters: write them as a peft adapter directory, not the merged model",
    )  # fmt: skip
    parser.add_argument(
        "--trust-checkpoint", action="store_true",
        help="read a checkpoint holding pickled objects (which could run code); only your own",
    )  # fmt: skip
    args = parser.parse_args(argv)
    try:
        if args.lightning:
            print(f"exported to {export_lightning(args.checkpoint, args.out_dir, args.trust_checkpoint)}")
            return
        out = export_hugging_face(
            args.checkpoint, args.out_dir, config=args.config, trust_checkpoint=args.trust_checkpoint,
            adapters_only=args.adapters_only,
        )  # fmt: skip
    except (ValueError, OSError) as error:  # a user error (CheckpointError among them): one line, status 2
        print(f"error: {str(error).splitlines()[0] if str(error) else type(error).__name__}", file=sys.stderr)
        sys.exit(2)
    print(f"exported to {out}")


if __name__ == "__main__":
    main()
