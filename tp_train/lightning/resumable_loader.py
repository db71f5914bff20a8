"""A training DataLoader that resumes mid-epoch at the batch where a checkpoint was saved."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, Dataset, DistributedSampler

SEQUENCES_PER_BATCH = "sequences_per_batch"  # a saved state's batch size times its data-parallel ranks


class ResumableDistributedSampler(DistributedSampler):
    """torch's `DistributedSampler` (a permutation seeded with `seed + epoch`, this rank taking every
    `num_replicas`-th index) that can leave out the first `start` indices of this rank's share for one epoch.

    With `step_size` (the sequences of one optimizer step over all ranks), each epoch's order is cut to a whole number
    of steps before it is split, instead of padded to a multiple of the ranks: every step then trains the same
    `step_size` sequences whatever the number of ranks and the batch per rank (`parallel=auto`'s fixed global batch,
    resumable on another layout), the tail of each epoch's order left out.
    """

    def __init__(
        self,
        dataset: Dataset,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        step_size: int | None = None,
    ):
        whole_steps = step_size is not None
        super().__init__(
            dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=whole_steps
        )
        if whole_steps:
            if step_size <= 0 or step_size % num_replicas:
                raise ValueError(f"step_size={step_size} must be a positive multiple of num_replicas={num_replicas}")
            self.total_size = len(dataset) - len(dataset) % step_size  # DistributedSampler's cut, for drop_last
            self.num_samples = self.total_size // num_replicas
        self.start = 0  # indices of this rank's share to leave out; set by ResumableDataLoader

    def __iter__(self) -> Iterator[int]:
        return iter(list(super().__iter__())[self.start :])


class ResumableDataLoader(DataLoader):
    """A DataLoader over a `ResumableDistributedSampler` whose position Lightning saves in checkpoints.

    Args:
        dataset: a map-style dataset.
        batch_size: samples per batch on this data-parallel rank.
        sampler: its sampler; `set_epoch` (called by Lightning each epoch) picks the epoch's order.
        **kwargs: other DataLoader arguments (num_workers, ...).
    """

    def __init__(self, dataset: Dataset, batch_size: int, sampler: ResumableDistributedSampler, **kwargs: Any):
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, **kwargs)
        self._epoch, self._batches = sampler.epoch, 0  # the current epoch and the batches yielded in it
        self._resume_at: dict[str, int] | None = None  # a loaded state, applied by the next iteration

    def __iter__(self) -> Iterator[Any]:
        # A generator: this runs at the first next(), after Lightning has set the sampler's epoch.
        epoch, resume = self.sampler.epoch, self._resume_at
        self._resume_at = None
        skipped = resume["batches"] if resume is not None and resume["epoch"] == epoch else 0
        self.sampler.start = skipped * self.batch_size
        self._epoch, self._batches = epoch, skipped
        for batch in super().__iter__():
            self._batches += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        """The epoch, how many of its batches this rank has been given (= trained, see the module doc), and how many
        sequences each of those batches took over all data-parallel ranks (what `DataPosition` resumes by)."""
        sequences = self.batch_size * self.sampler.num_replicas
        return {"epoch": self._epoch, "batches": self._batches, SEQUENCES_PER_BATCH: sequences}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Makes the next iteration of epoch `state["epoch"]` start after its first `state["batches"]` batches."""
        self._resume_at = {"epoch": int(state["epoch"]), "batches": int(state["batches"])}
        self._epoch, self._batches = self._resume_at["epoch"], self._resume_at["batches"]
