"""Activation memory: the bytes a training step keeps alive for backward, per rank."""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tp_train.tools.memory import MIB


def saved_activation_bytes(model: nn.Module, forward) -> tuple[int, object]:
    """(bytes of the distinct non-parameter storages autograd saved while `forward()` ran, its result)."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters and tensor.device.type != "meta":
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = forward()
    return sum(storages.values()), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    import tp_train
    from models import GPT, GPTConfig

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    tp, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=512, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.hidden, dropout=0.1
    )
    reference = GPT(config)
    idx = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    rows = []
    for sp, ac in ((False, False), (True, False), (False, True), (True, True)):
        model = tp_train.parallelize(copy.deepcopy(reference), sequence_parallel=sp, activation_checkpointing=ac)
        nbytes, logits = saved_activation_bytes(model, lambda model=model: model(idx))
        F.cross_entropy(logits.flatten(0, 1), idx.flatten()).backward()  # the recomputation runs too
        rows.append((sp, ac, nbytes))
    plain, _ = saved_activation_bytes(reference, lambda: reference(idx))
    if rank == 0:
        print(
            f"GPT {args.layers}x{args.hidden}, {args.heads} heads, batch {args.batch} x seq {args.seq}, fp32, tp={tp}"
        )
        print(f"{'model':<28}{'saved for backward':>20}{'vs unsharded':>14}{'vs plain tp':>13}")
        print(f"{'unsharded (one process)':<28}{plain / MIB:>17.2f} MB{1:>14.2f}")
        base = rows[0][2]
        for sp, ac, nbytes in rows:
            name = f"tp={tp}" + (" + SP" if sp else "") + (" + AC" if ac else "")
            print(f"{name:<28}{nbytes / MIB:>17.2f} MB{nbytes / plain:>14.2f}{nbytes / base:>13.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
