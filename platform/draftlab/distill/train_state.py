"""What a worker's training run keeps track of: the trainer state each checkpoint saves,
the metrics window between logged steps, and the latest held-out evaluation
(`distill.worker`'s recipe holds one of each).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from draftlab.distill.objective import Stats

# A training step's phases, timed per step and logged as train/ms_<phase>: get the packed
# batch onto the device (waiting for the prefetching worker, or collating inline with
# `train.prefetch: 0`); read (or compute) the target's features; drafter forward (the group
# mask is built there, on the device), loss and backward; gradient clipping and the optimizer.
PHASES = ("collate", "features", "forward_backward", "optimizer")


@dataclass
class TrainState:
    """The trainer state every checkpoint saves (`state.json`'s "trainer", with the MLflow
    metrics not delivered yet and the grad scaler beside it) and a resumed attempt restores."""

    step: int = 0  # optimisation steps done
    epoch: int = 0  # data position: the next batch is batch `batch` of epoch `epoch`
    batch: int = 0
    elapsed_s: float = 0.0  # training seconds over every attempt, as of the last checkpoint
    tokens: int = 0  # response tokens trained on
    evaluations: list[dict] = field(
        default_factory=list
    )  # the training curve; older checkpoints lack it


@dataclass
class LogWindow:
    """The steps since the last logged one (`train.log_every`): their tokens, summed stats and
    seconds per step phase, from `started` on."""

    stats: Stats
    started: float = field(default_factory=time.perf_counter)
    tokens: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))


@dataclass(frozen=True)
class Evaluation:
    """A held-out evaluation: its step (-1: none yet), totals and metrics."""

    step: int
    stats: Stats
    metrics: dict[str, float]
