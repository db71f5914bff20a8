"""The auto-planner's locality oracle: rank r's share of a column layer's output must move only rank r's share of its
row layer's input; `LocalityProbes._split` finds the first split for which that holds. Mixed into the planner."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch

from tp_train.parallel.norm import hold_statistic
from tp_train.parallel.reductions import held_reductions
from tp_train.parallel.sharding import ShardSpec
from tp_train.plan.deciding.coverage import generic
from tp_train.plan.deciding.head_shapes import observed_counts
from tp_train.plan.deciding.pairs import LEAK_TOLERANCE, SPLITS, Pair, first_mask, last_dim, rank_mask, share_mask
from tp_train.plan.probe import (
    caches_kept,
    channels_first,
    channels_last,
    forward_without_cache,
    hooks_removed,
    split_sizes,
    tensor_caches,
)
from tp_train.plan.styles import column_layout, head_counts


class _Stop(Exception):
    """Ends a probe forward once the row layer's input is captured."""


class LocalityProbes:
    """Probe forwards that perturb shares of a column's output and watch the row's input (see the module docstring)."""

    def _split(
        self, column: str, row: str, frozen: frozenset = frozenset(), background: frozenset = frozenset()
    ) -> str | None:
        """The first split of `column`'s output (`SPLITS`, or [q; k; v] of the sizes the row's view shows) whose
        shares feed only the same shares of `row`'s input (`_local`), or None. `background`: other columns of the row
        whose outputs are moved alike in every probe forward, so that one multiplying `column`'s output and zero in
        the probe (xLSTM's feed-forward gate, its weight initialised to zeros: silu(0) = 0) does not hide where
        `column`'s shares go."""
        width, row_width = last_dim(self.calls[column].output), last_dim(self.calls[row].input)
        if row_width % self.shares:
            return None
        key = ("split", generic(column), generic(row), width, row_width, tuple(sorted(map(generic, frozen))))
        key += tuple(sorted(map(generic, background)))
        if key not in self._cache:
            candidates = [(style, (width // sections,) * sections) for style, sections in SPLITS]
            # Unnamed, `fused_qkv_colwise` takes [q; k; v] from the head counts of the column's parent or the model's
            # config; thirds they do not give (LFM2's conv in_proj, [B; C; x], in a grouped-query model) are named.
            thirds = candidates[-1][1]
            parent = self.modules.get(column.rpartition(".")[0])
            counts = head_counts(parent, getattr(self.model, "config", None))
            if column_layout("fused_qkv_colwise", width, counts)[0] != thirds:
                candidates[-1] = (f"fused_qkv_colwise({','.join(map(str, thirds))})", thirds)
            sizes = split_sizes(self.calls[column].output, self.calls[row].input)
            if sizes and len(set(sizes)) > 1 and len(sizes) == 3:  # [q; k; v] of unequal sizes (grouped-query)
                candidates.append((f"fused_qkv_colwise({','.join(map(str, sizes))})", sizes))
            fits = [
                (style, sizes)
                for style, sizes in candidates
                if sum(sizes) == width and not any(n % self.shares for n in sizes)
            ]
            local = (style for style, sizes in fits if self._local(column, row, sizes, frozen, background=background))
            self._cache[key] = next(local, None) or self._replicated_kv_heads(column, row, frozen, background)
        return self._cache[key]

    def _replicated_kv_heads(self, column: str, row: str, frozen: frozenset, background: frozenset) -> str | None:
        """`colwise(KxD)` for a kv projection of K heads of width D, fewer than the ranks, as its attention's own
        reshape shows them (`tp_train.plan.deciding.head_shapes`): each head held whole by tp / K ranks, the ranks
        holding it those whose query heads read it; when perturbing each head moves only those ranks' shares of `row`'s
        input."""
        if self._observed is None:
            self._observed = observed_counts(self.model, self.linears, self.inputs)
        counts = self._observed.get(column)
        if counts is None or counts.kv_heads >= self.shares or self.shares % counts.kv_heads:
            return None
        if last_dim(self.calls[column].output) != counts.kv_heads * counts.head_dim:
            return None
        spec = ShardSpec(dim=0, sections=(counts.kv_heads * counts.head_dim,), units=(counts.kv_heads,))
        local = self._local(column, row, spec, frozen, background=background)
        return f"colwise({counts.kv_heads}x{counts.head_dim})" if local else None

    def _local(
        self,
        column: str,
        row: str,
        sections: tuple[int, ...] | ShardSpec,
        frozen: frozenset = frozenset(),
        row_sections: tuple[int, ...] | None = None,
        background: frozenset = frozenset(),
    ) -> bool:
        """Whether perturbing rank r's share of `column`'s output (split as `sections`) at every call moves only rank
        r's share of `row`'s input (of each of `row_sections`) at every call, `frozen` outputs held, replicas (kv heads)
        perturbed together; a layer run on two inputs (Pegasus-X's q_proj) is checked at each of its calls."""
        spec = sections if isinstance(sections, ShardSpec) else ShardSpec(dim=0, sections=sections)
        copies = max(spec.replicas(self.shares))
        base = self._row_inputs(row, {}, frozen, background=background) if background else self._row_inputs(row, {})
        for share in range(0, self.shares, copies):
            mask = functools.partial(rank_mask, spec=spec, shares=self.shares, share=share)
            moved = self._row_inputs(row, {column: mask}, frozen, background=background)
            if not self._moves_only(range(share, share + copies), base, moved, row_sections):
                return False
        return True

    def _moves_only(self, share, base: list[torch.Tensor], moved: list[torch.Tensor], row_sections=None) -> bool:
        """Whether a row layer's inputs at its calls, `base` before and `moved` after a perturbation, moved inside
        rank `share`'s share of their features (of each of `row_sections`, default one; `share` may be a range of
        ranks) only, and somewhere at all."""
        shares = share if isinstance(share, range) else (share,)
        effects = []  # how far each input moved inside the share's features, and outside them
        for before, after in zip(base, moved, strict=True):
            delta = (after - before).abs()
            masks = [share_mask(delta, row_sections or (delta.shape[-1],), self.shares, each) for each in shares]
            inside = functools.reduce(torch.logical_or, masks)
            effects.append((delta.masked_fill(~inside, 0).max().item(), delta.masked_fill(inside, 0).max().item()))
        return max(effect for effect, _ in effects) > 0 and not any(leak > LEAK_TOLERANCE * e for e, leak in effects)

    def _parameter_local(self, row: str, owner: str, param: torch.Tensor, dim: int) -> bool:
        """Whether perturbing rank r's share of `param` (of module `owner`) along `dim` moves only rank r's share of
        `row`'s input, for every r: its heads along that dim (a per-head table). The owner's tensor caches
        (`tp_train.plan.probe`) are emptied around each probe, so it computes from the perturbed values."""
        base = self._row_inputs(row, {})
        generator = torch.Generator(device=param.device).manual_seed(0)
        caches = tensor_caches(self.modules[owner])
        original = param.detach().clone()
        try:
            with caches_kept(self.modules[owner]):
                for share in range(self.shares):
                    noise = torch.randn(param.shape, generator=generator, device=param.device, dtype=param.dtype)
                    mask = share_mask(param.movedim(dim, -1), (param.shape[dim],), self.shares, share)
                    with torch.no_grad():
                        param.copy_(original + noise * (original.abs().mean() + 1e-3) * mask.movedim(-1, dim))
                    for cache in caches:
                        cache.clear()
                    if not self._moves_only(share, base, self._row_inputs(row, {}, fresh=True)):
                        return False
            return True
        finally:
            with torch.no_grad():
                param.copy_(original)

    def _table_local(self, table: str, row: str, columns: frozenset) -> bool:
        """Whether embedding `table`'s columns split evenly across ranks (its heads, one column each in T5's
        relative position bias) feed only the same rank's share of `row`'s input, the row's `columns` held: a table
        handed on to later layers also reaches them through the residual stream, which their columns read whole."""
        width = last_dim(self.calls[table].output)
        return width % self.shares == 0 and self._local(table, row, (width,), columns)

    def _mixes_tokens(self, pair: Pair) -> bool:
        """Whether perturbing the columns' outputs at one position (at every call) moves the row input (at a call)
        at more positions than one call perturbed: index 0 along each dimension but the features in turn (tokens are
        the second-to-last in most models, the first in time-major ones, LED's and FSMT's (T, B, C)). A batch
        dimension never mixes. Found once per block shape."""
        key = ("tokens", generic(pair.row), tuple(generic(name) for name in pair.columns))
        if key in self._cache:
            return self._cache[key]
        self._cache[key] = False
        base = self._row_inputs(pair.row, {})
        outputs = [output for column in pair.columns for output in self.calls[column].outputs if output is not None]
        for dim in range(max(output.dim() for output in outputs) - 1):
            mask = functools.partial(first_mask, dim=dim)  # a cross-attention's keys may be longer than its queries
            perturbed = max(int(mask(output).any(-1).sum()) for output in outputs)
            if not perturbed:
                continue
            moved = self._row_inputs(pair.row, dict.fromkeys(pair.columns, mask))
            pairs = zip(base, moved, strict=True)
            if max(int(((after - before).abs().amax(-1) > 0).sum()) for before, after in pairs) > perturbed:
                self._cache[key] = True
                break
        return self._cache[key]

    def _row_inputs(
        self,
        row: str,
        masks: dict[str, Callable],
        frozen: frozenset = frozenset(),
        fresh: bool = False,
        background: frozenset = frozenset(),
    ) -> list[torch.Tensor]:
        """`row`'s input at each call in a probe forward perturbing what `masks` marks, `frozen` outputs held and
        `background` (and `row`'s own, ALBERT's shared layer) moved alike; `fresh` runs again after a parameter was
        perturbed."""
        if not masks and not fresh and not background and row in self._bases:
            return self._bases[row]
        frozen = frozen | {row} if masks or background else frozen
        captured = []
        generator = torch.Generator(device=self.calls[row].input.device).manual_seed(0)
        still = torch.Generator(device=self.calls[row].input.device).manual_seed(1)  # the background's, alike each time

        def perturb(module, args, output, mask, generator=generator):
            output = channels_last(module, output)  # as traced: a 1x1 conv's channels last
            scale = output.detach().abs().mean() + 1e-3
            noise = torch.randn(output.shape, generator=generator, device=output.device, dtype=output.dtype)
            return channels_first(module, output + noise * scale * mask(output))

        def capture(module, args):
            captured.append(channels_last(module, args[0]).detach().clone().float())
            if len(captured) == self.calls[row].calls:
                raise _Stop

        def held(name):
            outputs = iter(self.calls[name].outputs)
            return lambda module, args, output: channels_first(module, next(outputs).detach())

        def hold(name, module, args, output):  # a norm's statistic as traced
            return hold_statistic(module, args[0], output, self.calls[name].input)

        hooks = [(name, functools.partial(perturb, mask=mask)) for name, mask in masks.items()]
        hooks += [(n, functools.partial(perturb, mask=torch.ones_like, generator=still)) for n in sorted(background)]
        hooks += [(name, held(name)) for name in frozen]
        handles = [self.modules[row].register_forward_pre_hook(capture)]
        handles += [self.modules[name].register_forward_hook(hook) for name, hook in hooks]
        # Norms and reductions hold their traced statistics in every probe forward, the unperturbed one too: a
        # forward without autograd may differ from the traced one by round-off (SeamlessM4T's conformer convolutions,
        # 6e-8), and a norm held in perturbed forwards only then moved every feature downstream of it.
        for name in self.reducers:
            handles += held_reductions(self.modules[name], self.calls[name].input)
        handles += [self.modules[name].register_forward_hook(functools.partial(hold, name)) for name in self.norms]
        with contextlib.suppress(_Stop), hooks_removed(handles), torch.no_grad():
            forward_without_cache(self.model, self.inputs)
        if not masks and not fresh and not background:
            self._bases[row] = captured
        return captured
