"""Online teacher features (`train.feature_stream`): the target's states for each training
batch, computed by a pool of Ray Data actors and streamed to the training worker, with no
disk cache.

    training worker (rank r)                       Ray Data (streaming executor, ordered)
    TrainStream.plans() -- (epoch, index, rows) --> from_items -> map_batches(TeacherFeatures,
                                                                  ActorPoolStrategy(size=n))
    collate(rows) + hidden <-- iter_batches(prefetch_batches=p) <--+

Each rank builds its own stream from its own saved data position, so a restarted worker
resumes where its checkpoint left off, and collates exactly the batches of the cached path
(same rows, same drop-token draws): only where `hidden` comes from differs. Ray Data keeps
the plans' order (`preserve_order`), restarts a killed actor and runs its batch again
(`max_restarts`, `max_task_retries`: Ray Data's defaults for actor pools), so no batch is
lost or repeated. Each actor takes one batch at a time, and the executor stops feeding them
once the features computed and not yet consumed fill `buffer_mb` of the object store
(back-pressure): a stream's memory is bounded.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import datasets
import numpy as np
import ray.data  # loaded with ray.train.torch in a training worker anyway
import torch
from ray.data import ExecutionResources

from draftlab.config import FeatureStreamSpec, TargetSpec
from draftlab.data.generation import target_features
from draftlab.distill.batching import row_ids
from draftlab.distill.loader import Step, TrainStream
from draftlab.models.target import load_target


class TeacherFeatures:
    """A Ray Data actor: the frozen target's features (`Target.features` of `aux_layers`)
    for one planned batch of the training split at a time, computed and stored as the data
    stage caches them (`target_features`: float16)."""

    def __init__(
        self, target: dict, data_path: str, aux_layers: list[int], max_seq_len: int, threads: int
    ):
        torch.set_num_threads(threads)
        self.target = load_target(TargetSpec.model_validate(target))
        self.rows = datasets.load_from_disk(data_path)["train"].select_columns(["input_ids"])
        self.aux, self.max_seq_len = list(aux_layers), max_seq_len

    def __call__(self, plan: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """plan: one row (epoch, index, rows) -> the same with `hidden` (1, B, L, F) float16,
        zero past each row's length as `collate` pads a cached batch, and `computed_at` (the
        wall time it was ready)."""
        seqs = [row_ids(self.rows[int(j)], self.max_seq_len).tolist() for j in plan["rows"][0]]
        feats = target_features(self.target, seqs, len(seqs), self.aux)  # B x (L_b, F)
        hidden = np.zeros(
            (1, len(seqs), max(map(len, seqs)), feats[0].shape[-1]), np.float16
        )  # (1, B, L, F)
        for b, f in enumerate(feats):
            hidden[0, b, : f.shape[0]] = f
        return {
            "epoch": plan["epoch"],
            "index": plan["index"],
            "hidden": hidden,
            "computed_at": np.array([time.time()]),
        }


@dataclass
class FeatureBatch:
    epoch: int
    index: int
    hidden: torch.Tensor  # (B, L, F) float32, as `collate` reads a cache
    computed_at: float  # wall time the actor finished it


def feature_batches(
    plans: list[tuple[int, int, list[int]]],
    spec: FeatureStreamSpec,
    target: TargetSpec,
    data_path: str,
    aux_layers: list[int],
    max_seq_len: int,
) -> Iterator[FeatureBatch]:
    """The features of `plans` ((epoch, index, row ids) of the training split), in order,
    from a Ray Data actor pool of `spec.actors` targets."""
    if not plans:
        return
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.execution_options.resource_limits = ExecutionResources.for_limits(
        object_store_memory=int(spec.buffer_mb * 2**20)
    )  # back-pressure: the actors wait once this much is computed and not consumed
    ctx.enable_progress_bars = False  # a worker's log is no terminal
    items = [{"epoch": e, "index": i, "rows": rows} for e, i, rows in plans]
    device = "cuda" if spec.gpus_per_actor else "cpu"
    ds = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
        TeacherFeatures,
        fn_constructor_kwargs={
            "target": target.model_copy(update={"device": device}).model_dump(),
            "data_path": data_path,
            "aux_layers": list(aux_layers),
            "max_seq_len": max_seq_len,
            "threads": max(1, int(spec.cpus_per_actor)),
        },
        batch_size=1,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=spec.actors, max_tasks_in_flight_per_actor=1),
        num_cpus=spec.cpus_per_actor,
        num_gpus=spec.gpus_per_actor,
    )
    for out in ds.iter_batches(
        batch_size=1, batch_format="numpy", prefetch_batches=spec.prefetch_batches
    ):
        yield FeatureBatch(
            int(out["epoch"][0]),
            int(out["index"][0]),
            torch.from_numpy(np.ascontiguousarray(out["hidden"][0])).float(),
            float(out["computed_at"][0]),
        )


def streamed_steps(
    stream: TrainStream,
    spec: FeatureStreamSpec,
    target: TargetSpec,
    data_path: str,
    aux_layers: list[int],
    device: torch.device,
) -> Iterator[Step]:
    """`stream`'s steps, each batch with the streamed features as its `hidden`, on `device`."""
    plans = list(stream.plans())
    feats = feature_batches(
        [(e, i, rows) for e, i, _, rows in plans],
        spec,
        target,
        data_path,
        aux_layers,
        stream.train.max_seq_len,
    )
    try:
        for (epoch, i, count, rows), f in zip(plans, feats, strict=True):
            if (f.epoch, f.index) != (epoch, i):  # preserve_order broken: never train on it
                raise RuntimeError(
                    f"feature stream out of order: got epoch {f.epoch} batch {f.index}, "
                    f"expected epoch {epoch} batch {i}"
                )
            batch = replace(stream.collate(rows), hidden=f.hidden)
            yield Step(epoch, i, count, batch.to(device))
    finally:
        feats.close()  # stops the dataset's executor when training stops early
