"""The router's load-balancing loss over the global batch (Switch Transformer's auxiliary loss, as Hugging Face's
MoE families define it), where each rank routes only its own tokens.

For E experts, top-k routing and all routed rows (every token of every MoE layer, over every rank of `group`):
loss = E * sum_e f_e * P_e, f_e the top-k assignments to expert e per row (summing to k), P_e the mean router
probability of expert e. f_e is a count (no gradient) and P_e a mean; both are summed over `group` first, so the
loss is the same whatever the batch's split over data- and context-parallel ranks, and so at any ep, tp and dp.
Under sequence parallelism each tensor-parallel rank routes its own shard of the sequence: its rows are summed over
the tensor-parallel group too (`sequence_group`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from tp_train.parallel.agreement import before_collective
from tp_train.parallel.widening import widened


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor],
    num_experts: int,
    top_k: int,
    group: ProcessGroup | None = None,
    sequence_group: ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss over all of `group`'s rows, on every rank of it (see the module docstring), and the expert loads.

    Args:
        router_logits: this rank's (rows, E) router logits, one tensor per MoE layer.
        num_experts: E.
        top_k: experts per token.
        group: the ranks whose tokens differ (data x context parallel); None or one rank: this rank's alone.
        sequence_group: the tensor-parallel ranks when each routed its own shard of the sequence (sequence
            parallelism), whose gradients of a replicated router are summed, not averaged; None: they routed alike.

    Returns:
        The loss's value over the whole group. Its gradient on this rank is `group size` times that of this rank's
        own rows' share, so that averaging the gradients over the group (DDP's convention, as for the loss the
        model's rows give) yields the gradient of the loss over all rows. And (layers, E): the top-k assignments
        each layer routed to each expert, over the whole group (no gradient)."""
    probs = [F.softmax(widened(logits), dim=-1) for logits in router_logits]
    loads = torch.stack(
        [torch.bincount(p.topk(top_k, dim=-1).indices.reshape(-1), minlength=num_experts).to(p.dtype) for p in probs]
    )  # (layers, E) assignments per expert
    prob_sums = torch.stack([p.sum(dim=0) for p in probs]).sum(dim=0)  # (E,) this rank's share of sum_rows p
    rows = torch.tensor([float(sum(p.shape[0] for p in probs))], device=loads.device, dtype=loads.dtype)
    world_size = 1 if group is None else dist.get_world_size(group)
    totals = torch.cat([loads.reshape(-1), rows, prob_sums.detach()])
    for over in (group, sequence_group):
        if over is not None and dist.get_world_size(over) > 1:
            before_collective()
            dist.all_reduce(totals, group=over)
    layers = len(probs)
    loads = totals[: layers * num_experts].view(layers, num_experts)
    rows, all_prob_sums = totals[layers * num_experts], totals[layers * num_experts + 1 :]
    fraction = loads.sum(dim=0) / rows  # f_e: assignments to expert e per row (summing to k over the experts)
    own = num_experts * torch.sum(fraction * prob_sums / rows)  # this rank's rows' share of the loss
    value = num_experts * torch.sum(fraction * all_prob_sums / rows)
    return value + world_size * (own - own.detach()), loads
