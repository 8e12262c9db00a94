"""The training batch stream: this rank's batches for every remaining epoch, built ahead.

One process collates the batches in order with one drop-token generator, so the stream is
the plain loop's batch for batch (same rows, same draws). With `train.prefetch` > 0 that
process is a torch DataLoader worker that keeps `prefetch` batches ready while the step
runs; on CUDA they come pinned and the copy to the device does not block. `prefetch` = 0
collates in the training process, between steps.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import datasets
import torch
from torch.utils.data import DataLoader, IterableDataset

from draftlab.config import TrainConfig
from draftlab.distill.batching import Batch, collate


def epoch_batches(
    n: int,
    batch_size: int,
    epoch: int,
    seed: int,
    rank: int,
    world: int,
    lengths: list[int] | None = None,
    window: int = 0,
) -> list[list[int]]:
    """This rank's batches for an epoch: a seeded shuffle, equal counts on every rank.

    With `lengths` (one per row) and `window` > 0, each run of `window` batches' rows of the
    shuffle is sorted by length before it is cut into batches, and the batches are then
    shuffled: rows of like length share a batch, so little of a step is padding (the same
    rows and batch count per epoch as without)."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch)).tolist()
    per_rank = n // world
    mine = order[rank * per_rank : (rank + 1) * per_rank]
    grouped = lengths is not None and window > 0
    if grouped and per_rank >= batch_size:
        span = window * batch_size  # a multiple of batch_size: no batch straddles two windows
        full = (
            per_rank - per_rank % batch_size
        )  # the rows past it are left out, as without grouping
        mine = [
            j
            for s in range(0, full, span)
            for j in sorted(mine[s : min(s + span, full)], key=lambda j: lengths[j])
        ]
    batches = [
        mine[i : i + batch_size] for i in range(0, per_rank - batch_size + 1, batch_size)
    ] or ([mine] if mine else [])
    if grouped and len(batches) > 1:  # not short to long within a window
        shuffle = torch.randperm(
            len(batches), generator=torch.Generator().manual_seed(seed * 1000 + epoch + 7919)
        )  # a stream apart from the rows' shuffle
        batches = [batches[i] for i in shuffle.tolist()]
    return batches


def row_lengths(data: datasets.Dataset, max_seq_len: int) -> list[int]:
    """Each row's length as `collate` truncates it: what length-grouped batches sort by."""
    return [min(len(ids), max_seq_len) for ids in data["input_ids"]]


@dataclass
class Step:
    """One batch of the stream and where it sits in its epoch."""

    epoch: int
    index: int  # batch number within the epoch
    count: int  # batches in the epoch (this rank)
    batch: Batch

    def pin_memory(self) -> Step:  # DataLoader(pin_memory=True) calls it
        return replace(self, batch=self.batch.pin_memory())


class TrainStream(IterableDataset):
    """Batches of `data` from (`epoch`, batch `start`) to the end of training, in order."""

    def __init__(
        self,
        data: datasets.Dataset,
        k: int,
        train: TrainConfig,
        rank: int,
        world: int,
        epoch: int,
        start: int,
        generator: torch.Generator,
    ):
        self.data, self.k, self.train, self.rank, self.world = data, k, train, rank, world
        self.epoch, self.start, self.generator = epoch, start, generator
        self.lengths = row_lengths(data, train.max_seq_len) if train.length_window else None

    def plans(self) -> Iterator[tuple[int, int, int, list[int]]]:
        """(epoch, batch index, batches in the epoch, row ids) of every remaining batch, in
        order: what `__iter__` collates, and what a feature stream computes features for."""
        t = self.train
        for epoch in range(self.epoch, t.epochs):
            batches = epoch_batches(
                len(self.data),
                t.batch_size,
                epoch,
                t.seed,
                self.rank,
                self.world,
                self.lengths,
                t.length_window,
            )
            for i in range(self.start if epoch == self.epoch else 0, len(batches)):
                yield epoch, i, len(batches), batches[i]

    def collate(self, row_ids: list[int]) -> Batch:
        """The batch of these rows (drawing the drop-token layout from the stream's generator:
        call in stream order)."""
        t = self.train
        rows = [self.data[j] for j in row_ids]
        return collate(
            rows,
            self.k,
            t.max_seq_len,
            t.drop_tokens,
            self.generator,
            loss_on_prompt=t.loss_on_prompt,
        )

    def __iter__(self) -> Iterator[Step]:
        for epoch, i, count, row_ids in self.plans():
            yield Step(epoch, i, count, self.collate(row_ids))


def _as_is(step: Step) -> Step:
    return step


def batch_stream(stream: TrainStream, device: torch.device, prefetch: int) -> Iterator[Step]:
    """`stream`'s steps with their batches on `device`, built `prefetch` ahead (0: inline)."""
    if prefetch == 0:
        for step in stream:
            yield replace(step, batch=step.batch.to(device))
        return
    # One worker: a single generator draws in order (more workers would each need a
    # shard of the stream and their own draws: other batches than the plain loop's).
    loader = DataLoader(
        stream,
        batch_size=None,
        num_workers=1,
        prefetch_factor=prefetch,
        collate_fn=_as_is,
        pin_memory=device.type == "cuda",
    )
    it = iter(loader)
    try:
        for step in it:
            yield replace(step, batch=step.batch.to(device, non_blocking=True))
    finally:
        del it  # stops the worker process when training stops early
