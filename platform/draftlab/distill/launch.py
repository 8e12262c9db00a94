"""Tiers 2 and 3: `build_trainer(cfg, ...)` and `run_distill(cfg)`, the caller shared by
the CLI, `jobs/distill.py` and (later) Tune trials.

    draftlab distill -c jobs/configs/smollm2-135m-parallel-k4.yaml train.epochs=2

Same `name` and `storage_path` = resume from the latest checkpoint (Ray Train does it).
`storage_path` (and `output_dir`) may be a URI such as s3://: the checkpoints go there through
Ray Train, the drafter directory through `draftlab.storage`.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import ray
import ray.train
from ray.train.torch import TorchConfig, TorchTrainer

from draftlab.cluster import ensure_ray, output_dir, storage_uri
from draftlab.config import ConfigError, DistillConfig
from draftlab.data.selfdistill import load_or_generate
from draftlab.distill.drafter_setup import training_samples
from draftlab.distill.payload import WorkerPayload
from draftlab.distill.worker import train_fn_per_worker
from draftlab.storage import is_uri, publish
from draftlab.submit import check_hub_access
from draftlab.tracking import (
    Tracker,
    TrackingUnavailable,
    drafter_model_name,
    parent_tags,
    resolve_tracking_uri,
)


def train_and_publish(config: dict) -> dict:
    """`train_fn_per_worker`; with a URI `output_dir`, the worker writes the drafter directory
    (weights, tree.json, tree-search.json, training.json) into a local staging directory
    and rank 0 publishes it to the URI once it is complete."""
    payload = WorkerPayload.model_validate(config)
    dest = payload.output_dir
    if not is_uri(dest):
        return train_fn_per_worker(config)
    with tempfile.TemporaryDirectory(prefix="draftlab-drafter-") as staging:
        summary = train_fn_per_worker(
            payload.model_copy(update={"output_dir": staging}).model_dump()
        )
        if ray.train.get_context().get_world_rank() == 0:
            publish(staging, dest)
    return summary


def check_feature_actors_fit(cfg: DistillConfig, cluster: dict[str, float]) -> None:
    """A ConfigError naming the fields when the training workers and their feature actors
    (`train.feature_stream`) need more CPUs or GPUs than `cluster` (Ray's resources) has: Ray
    Data only warns that its actors cannot be placed, and the fit would wait for ever."""
    fs, sc = cfg.train.feature_stream, cfg.scaling
    if fs is None:
        return
    need = {
        "CPU": sc.num_workers * (sc.cpus_per_worker + fs.actors * fs.cpus_per_actor),
        "GPU": sc.num_workers * (int(sc.use_gpu) + fs.actors * fs.gpus_per_actor),
    }
    short = [
        f"{n:g} {r}s where the Ray cluster has {cluster.get(r, 0):g}"
        for r, n in need.items()
        if n > cluster.get(r, 0)
    ]
    if short:
        raise ConfigError(
            f"train.feature_stream: {sc.num_workers} training worker(s), each with "
            f"scaling.cpus_per_worker={sc.cpus_per_worker:g}"
            + (" and 1 GPU" if sc.use_gpu else "")
            + f" and train.feature_stream.actors={fs.actors} feature actor(s) of "
            f"cpus_per_actor={fs.cpus_per_actor:g}, gpus_per_actor={fs.gpus_per_actor:g}, need "
            + " and ".join(short)
            + ": lower them or add nodes"
        )


def build_trainer(
    cfg: DistillConfig,
    data_path: str,
    mlflow_run_id: str | None,
    tracking_uri: str | None,
    callbacks: list | None = None,
) -> TorchTrainer:
    """`callbacks`: Ray Train `UserCallback`s (a Tune trial passes `TuneReportCallback`)."""
    if cfg.train.feature_stream is not None:  # asks the cluster: only then is Ray needed here
        check_feature_actors_fit(cfg, ray.cluster_resources())
    sc = cfg.scaling
    return TorchTrainer(
        train_and_publish,
        # a plain dict (Ray Train's contract): the worker validates it back (`train_fn_per_worker`)
        train_loop_config=WorkerPayload(
            cfg=cfg,
            data_path=data_path,
            mlflow_run_id=mlflow_run_id,
            tracking_uri=tracking_uri,
            output_dir=output_dir(cfg),
        ).model_dump(),
        scaling_config=ray.train.ScalingConfig(
            num_workers=sc.num_workers,
            use_gpu=sc.use_gpu,
            resources_per_worker={"CPU": sc.cpus_per_worker, **({"GPU": 1} if sc.use_gpu else {})},
            placement_strategy=sc.placement_strategy,
        ),
        torch_config=TorchConfig(backend="nccl" if sc.use_gpu else "gloo"),
        run_config=ray.train.RunConfig(
            name=cfg.name,  # stable: a rerun with the same name resumes
            storage_path=storage_uri(cfg.storage_path),
            failure_config=ray.train.FailureConfig(max_failures=sc.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=2),
            callbacks=callbacks,
        ),
    )


def registered_name(cfg: DistillConfig) -> str:
    if cfg.tracking.registered_model:
        return cfg.tracking.registered_model
    return drafter_model_name(cfg.target.name)


def run_distill(cfg: DistillConfig, progress: bool = True) -> dict:
    """Generate or reuse the data, train with Ray Train, log to MLflow, register the drafter."""
    check_hub_access(cfg.target, cfg.data)
    ensure_ray()
    t0 = time.perf_counter()
    data = load_or_generate(cfg.data, cfg.target, progress=progress)
    # load_from_disk maps <dataset>/<split>/data-*.arrow: workers reopen the same directory.
    data_path = Path(data["train"].cache_files[0]["filename"]).parent.parent
    data_seconds = time.perf_counter() - t0
    training_samples(data["train"], cfg.train.max_samples)  # a bad size fails here, not in Train

    tracking_uri = resolve_tracking_uri(cfg.tracking.tracking_uri)
    limit = cfg.tracking.max_outage_s
    tracker = Tracker(
        tracking_uri=tracking_uri,
        experiment=cfg.tracking.experiment,
        run_id=None,
        enabled=True,
        max_buffer_seconds=limit,
        max_outage_s=limit,
    )
    run_id = tracker.start_or_resume(
        cfg.name,
        tags={
            "draftlab.kind": "distill",
            "draftlab.target": cfg.target.name,
            "draftlab.family": cfg.drafter.family,
            **parent_tags(cfg.tracking.parent_run_id),
        },
    )
    tracker.log_params(cfg.model_dump())
    tracker.log_params(
        {
            "data.cache_path": str(data_path),
            "data.train_samples": len(data["train"]),
            "data.eval_samples": len(data["eval"]),
        }
    )
    try:
        result = build_trainer(cfg, str(data_path), run_id, tracking_uri).fit()
    except Exception as e:
        tracker.end("FAILED")
        # Ray's error carries the workers' tracebacks (cut to a snippet); an MLflow outage past
        # `tracking.max_outage_s` is worth its own plain message.
        lost = [
            f
            for f in getattr(e, "worker_failures", {}).values()
            if isinstance(f, TrackingUnavailable)
        ]
        if lost:
            raise TrackingUnavailable(f"distillation {cfg.name!r} stopped: {lost[0]}") from e
        raise
    summary = dict(result.return_value or {})
    summary |= {
        "data_seconds": data_seconds,
        "data_path": str(data_path),
        "mlflow_run_id": run_id,
        "drafter_dir": output_dir(cfg),
        "checkpoint": result.checkpoint.path if result.checkpoint else None,
    }
    tracker.log_metrics_now({"data_seconds": data_seconds}, summary.get("steps", 0))
    if cfg.tracking.register_model:
        tags = {
            "k": cfg.drafter.k,
            "depth": cfg.drafter.depth,
            "family": cfg.drafter.family,
            "target": cfg.target.name,
            "tau": summary.get("tau"),
            "speedup_vs_ar": summary.get("speedup_vs_ar"),
        }
        name = registered_name(cfg)
        summary["registered_model"] = name
        summary["model_version"] = tracker.register_model(
            "drafter", name, {k: str(v) for k, v in tags.items()}
        )
    tracker.end("FINISHED")
    return summary


def format_summary(summary: dict) -> str:
    """The run summary as JSON, without the (large) embedded bench report."""
    return json.dumps({k: v for k, v in summary.items() if k != "bench"}, indent=2, default=str)
