"""One sweep trial: (training parameters, tree shape) -> speedup measured by the real engine.

Tune calls `run_trial(params, ctx)`. Trials that differ only in the tree share a training,
found by `training_key` under `<storage>/trainings/<name>/`:

    <name>/                  Ray Train run directory (checkpoints: a restarted trial resumes)
      drafter/               the exported drafter, with tree-search.json (held-out rank
                             acceptance: what `searched-<n>` trees are built from)
      fits.jsonl             one line per fit started (which trial trained it)
      done.json              the training summary, written last
      stopped.json           ASHA stopped the training trial: trials sharing it stop too
      evals-<digest>.json    tree -> bench result, per bench setting
      .lock                  held while training or benchmarking the key

The first trial of a key trains it (its training reports reach Tune through
`TuneReportCallback`, so ASHA judges it), then benchmarks *all* of the sweep's trees for the
drafter in one interleaved run on a task with the trial's resources: every tree's speedup is
taken against one `ar` baseline measured side by side, and the other trials of the key read
their row instead of re-measuring. Each trial then logs a nested MLflow run (params, its
tree's metrics, the drafter with its `tree.json`) and reports its final result.
"""

from __future__ import annotations

import hashlib
import json
import platform as std_platform
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import ray
from filelock import FileLock
from ray import tune
from ray.tune.integration.ray_train import TuneReportCallback

from draftlab.bench import bench_loaded
from draftlab.config import BenchConfig, DistillConfig, ScalingSpec, TargetSpec
from draftlab.data.selfdistill import training_view
from draftlab.decoding.tree import Tree, split_ngram, split_per_round
from draftlab.decoding.tree_files import resolve_tree, save_tree
from draftlab.distill.launch import build_trainer
from draftlab.distill.tree_select import save_acceptance
from draftlab.models.drafters.build import load_drafter
from draftlab.models.target import load_target, placed_spec
from draftlab.sweep.space import training_key, trial_config
from draftlab.tracking import Tracker


@dataclass(frozen=True)
class SweepContext:
    """What every trial of one sweep shares (passed with `tune.with_parameters`)."""

    sweep: str
    base: dict  # the base DistillConfig, sweep overrides applied
    trees: list[str]  # the sweep's tree shapes (benchmarked together per drafter)
    trainings: str  # absolute directory of the keyed trainings
    data_path: str  # the cached self-distillation dataset
    tracking_uri: str
    experiment: str
    parent_run_id: str | None
    tags: dict = field(default_factory=dict)
    objective: str = "draftlab"  # SweepConfig.objective: whose speedup ranks the trials


@dataclass(frozen=True)
class Plan:
    """A trial's training: its config, key and directory."""

    cfg: DistillConfig
    key: str
    dir: Path


def plan(params: dict, ctx: SweepContext) -> Plan:
    """The training a trial with Tune `params` needs (the `tree` param is not training)."""
    probe = trial_config(ctx.base, {k: v for k, v in params.items() if k != "tree"})
    key = training_key(probe)
    d = probe.drafter
    name = f"{d.family}-k{d.k}-d{d.depth}-{key}"
    run_dir = Path(ctx.trainings) / name
    cfg = probe.model_copy(
        update={
            "name": name,
            "storage_path": ctx.trainings,
            "output_dir": str(run_dir / "drafter"),
            "bench": probe.bench.model_copy(update={"enabled": False}),  # the trial benchmarks
            "tracking": probe.tracking.model_copy(update={"register_model": False}),
            "scaling": trial_scaling(probe.scaling),
        }
    )
    return Plan(cfg, key, run_dir)


def trial_scaling(sc: ScalingSpec) -> ScalingSpec:
    """A trial's training workers: a multi-GPU trial runs on one node (`STRICT_PACK`).

    Trials are ranked by speed under one time budget, so a trial whose all-reduce crossed
    nodes (what PACK or SPREAD allow when a node is partly taken) would lose to an equal
    drafter packed on NVLink; STRICT_PACK waits for a whole node instead. Size
    `scaling.num_workers` to a node's GPUs. CPU and single-GPU trials keep the config's.
    (Not part of `training_key`: placement changes speed, not the trained drafter.)"""
    if sc.use_gpu and sc.num_workers > 1:
        return sc.model_copy(update={"placement_strategy": "STRICT_PACK"})
    return sc


def trial_run_name(ctx: SweepContext, trial_id: str) -> str:
    """The MLflow run of a trial (nested under the sweep's parent run)."""
    return f"{ctx.sweep}-{trial_id}"


def _remote_options(cfg: DistillConfig) -> dict:
    """The trial's resources for its own work: one training worker's worth."""
    # DEFAULT: outside the trial's placement group (which holds no CPU), like Train's workers
    return {
        "num_cpus": cfg.scaling.cpus_per_worker,
        "num_gpus": 1 if cfg.scaling.use_gpu else 0,
        "scheduling_strategy": "DEFAULT",
    }


def _measure_acceptance(cfg_json: dict, data_path: str) -> None:
    cfg = DistillConfig.model_validate(cfg_json)
    target = load_target(cfg.target)
    evalset = training_view(datasets.load_from_disk(data_path)["eval"])
    save_acceptance(cfg, load_drafter(cfg.output_dir, target), target, evalset, cfg.output_dir)


def _bench_trees(cfg_json: dict, trees: list[str], objective: str = "draftlab") -> dict[str, dict]:
    """Every tree of `trees` and `ar`, interleaved prompt by prompt in one bench run; with
    the `vllm` objective, the drafter exported to vLLM at the deepest chain's k and each other
    chain's k measured on that engine (`vllm_draftlab@k<n>`: per-request draft lengths),
    against `vllm_ar`."""
    cfg = DistillConfig.model_validate(cfg_json)
    target = load_target(cfg.target)
    drafter = load_drafter(cfg.output_dir, target)
    resolved = {name: resolve_tree(name, cfg.output_dir, cfg.drafter.k) for name in trees}
    b = cfg.bench
    bcfg = BenchConfig(
        target=cfg.target,
        drafter=cfg.output_dir,
        prompts=b.prompts,
        limit=b.limit,
        max_new_tokens=b.max_new_tokens,
        methods=["ar"],
    )
    if objective == "vllm":
        ks = {name: tree.depth for name, tree in resolved.items()}
        top = max(ks.values())
        vcfg = bcfg.vllm.model_copy(update={"draft_lengths": sorted(set(ks.values()) - {top})})
        report = bench_loaded(
            target,
            drafter,
            bcfg.model_copy(update={"methods": ["ar", "vllm_draftlab"], "k": top, "vllm": vcfg}),
            progress=False,
        )
        runs = {
            name: (report, "vllm_draftlab" if k == top else f"vllm_draftlab@k{k}", "vllm_ar")
            for name, k in ks.items()
        }
    else:
        report = bench_loaded(target, drafter, bcfg, progress=False, trees=resolved)
        runs = {name: (report, f"draftlab_tree:{name}", "ar") for name in resolved}
    out = {}
    for name, (report, method, base) in runs.items():
        m, ar, tree = report["methods"][method], report["methods"][base], resolved[name]
        out[name] = {
            # the objective's speedup: ours vs `ar`, or vLLM's vs `vllm_ar`
            "speedup_vs_ar": m[f"speedup_vs_{base}"],
            "tau": m["tau"],
            "tokens_per_s": m["tokens_per_s"],
            "ar_tokens_per_s": ar["tokens_per_s"],
            "objective": objective,
            "draft_ms": 1000
            * m.get("draft_s", 0.0)
            / max(1, m["forwards"]),  # per round (ours only)
            "verify_ms": 1000 * m.get("verify_s", 0.0) / max(1, m["forwards"]),
            "tree_nodes": tree.num_nodes,
            "tree_depth": tree.depth,
            "paths": [list(p) for p in tree.paths],
            "per_position_acceptance": m.get("per_position_acceptance"),
            "tau_by_category": {c: v["tau"] for c, v in m["by_category"].items()},
            "greedy_identical": report["vllm_greedy_identical"]
            if objective == "vllm"
            else report["greedy_identical"],
            "device": report["device"],
            "prompts": report["prompts"],
            "max_new_tokens": report["max_new_tokens"],
        }
    return out


def bench_target(cfg: DistillConfig) -> TargetSpec:
    """The target as the trial's bench task loads it, from the config strings alone: device
    `auto` pinned by the trial's resources (a task that reserved no GPU must not pick one
    up) and dtype `auto` by that device. No CUDA query: the trial process holds no GPU."""
    return placed_spec(
        cfg.target, cfg.scaling.use_gpu, "scaling.use_gpu", "the trial's training and bench tasks"
    )


def _run_task(fn, cfg: DistillConfig, *args):
    pinned = cfg.model_copy(update={"target": bench_target(cfg)})
    return ray.get(
        ray.remote(fn).options(**_remote_options(cfg)).remote(pinned.model_dump(mode="json"), *args)
    )


def bench_digest(cfg: DistillConfig, objective: str = "draftlab") -> str:
    """Bench results are reused only for the same prompts and engine on the same kind of
    hardware and precision: the `bench_target` the bench task runs (never resolved here,
    where no GPU is held), the machine architecture and any non-default target setting
    (e.g. its attention kernel)."""
    b, target = cfg.bench, bench_target(cfg)
    spec = {
        "prompts": b.prompts,
        "limit": b.limit,
        "max_new_tokens": b.max_new_tokens,
        "device": target.device,
        "dtype": f"torch.{target.dtype}",
        "machine": std_platform.machine(),
    }
    if objective != "draftlab":  # older digests stay valid
        spec["objective"] = objective
    extra = target.model_dump(
        mode="json", exclude_defaults=True, exclude={"name", "device", "dtype", "trust_remote_code"}
    )
    if extra:  # only when set: older digests stay valid
        spec["target"] = extra
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]


def ensure_trained(p: Plan, ctx: SweepContext, run_id: str | None, trial_id: str) -> dict:
    """The training summary of `p` (`{"stopped": ...}` if ASHA stopped it); trains, or
    resumes an interrupted training, only when no finished one exists. Caller holds the lock."""
    done, stopped = p.dir / "done.json", p.dir / "stopped.json"
    if done.is_file():
        return json.loads(done.read_text()) | {"trained_here": False}
    if stopped.is_file():
        return {"stopped": json.loads(stopped.read_text())}

    p.dir.mkdir(parents=True, exist_ok=True)
    with (p.dir / "fits.jsonl").open("a") as f:
        f.write(
            json.dumps({"trial": trial_id, "mlflow_run_id": run_id, "time": time.time()}) + "\n"
        )
    result = build_trainer(
        p.cfg, ctx.data_path, run_id, ctx.tracking_uri, callbacks=[TuneReportCallback()]
    ).fit()
    summary = {k: v for k, v in (result.return_value or {}).items() if k != "worker_nodes"}
    _run_task(_measure_acceptance, p.cfg, ctx.data_path)
    summary |= {"key": p.key, "trained_by": trial_id, "mlflow_run_id": run_id}
    _atomic_write(done, summary)
    return summary | {"trained_here": True}


def ensure_evaluated(p: Plan, ctx: SweepContext, tree: str) -> dict:
    """`tree`'s bench result for this drafter; benches every sweep tree not yet measured
    (plus `tree`) in one run when `tree` is missing. Caller holds the lock."""
    path = p.dir / f"evals-{bench_digest(p.cfg, ctx.objective)}.json"
    evals = json.loads(path.read_text()) if path.is_file() else {}
    if tree not in evals:
        missing = [t for t in dict.fromkeys([*ctx.trees, tree]) if t not in evals]
        evals |= _run_task(_bench_trees, p.cfg, missing, ctx.objective)
        _atomic_write(path, evals)
    return evals[tree]


def _atomic_write(path: Path, obj) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    tmp.replace(path)


def run_trial(params: dict, ctx: SweepContext) -> None:
    """The Tune function trainable."""
    trial = tune.get_context()
    trial_id = trial.get_trial_id()
    p = plan(params, ctx)
    d = p.cfg.drafter
    tree = params.get("tree", "chain")
    base = {"k": d.k, "depth": d.depth, "family": d.family, "tree": tree, "training_key": p.key}
    tracker = Tracker(
        tracking_uri=ctx.tracking_uri, experiment=ctx.experiment, run_id=None, enabled=True
    )
    tags = {
        **ctx.tags,
        "draftlab.kind": "sweep-trial",
        "draftlab.sweep": ctx.sweep,
        "draftlab.target": p.cfg.target.name,
        "draftlab.family": d.family,
        "draftlab.training_key": p.key,
        "draftlab.trial_id": trial_id,
        "draftlab.tree": tree,
    }
    if ctx.parent_run_id:
        tags["mlflow.parentRunId"] = ctx.parent_run_id
    run_id = tracker.start_or_resume(trial_run_name(ctx, trial_id), tags=tags)
    tracker.log_params(p.cfg.model_dump(mode="json") | {"tree": tree, "training_key": p.key})
    p.dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(p.dir / ".lock")):
        summary = ensure_trained(p, ctx, run_id, trial_id)
        if "stopped" in summary:
            stop = summary["stopped"]
            tracker.set_tags(
                {"draftlab.status": "stopped", "draftlab.stopped_by": stop.get("trial")}
            )
            tracker.end("KILLED")
            tune.report(
                {
                    **base,
                    "status": "stopped",
                    "eval/sim_accept_len": stop.get("eval/sim_accept_len", 0.0),
                    "mlflow_run_id": run_id,
                }
            )
            return
        result = ensure_evaluated(p, ctx, tree)
    metrics = {
        k: v for k, v in result.items() if isinstance(v, int | float) and not isinstance(v, bool)
    }
    training = {
        "drafter_parameters": summary["drafter_parameters"],
        "train_steps": summary["steps"],
        "eval/sim_accept_len": summary["eval_sim_accept_len"],
    }
    # the training trial's run already holds the training metrics (logged by its worker)
    tracker.log_metrics_now(
        metrics if summary["trained_here"] else metrics | training, summary["steps"]
    )
    metrics |= training
    tracker.log_dict(result, "bench.json")

    with (
        tempfile.TemporaryDirectory() as tmp
    ):  # the drafter as served by this trial: its own tree.json
        staged = Path(tmp) / "drafter"
        shutil.copytree(p.cfg.output_dir, staged)
        served = Tree.from_paths(result["paths"], tree).with_per_round(
            split_per_round(split_ngram(tree)[0])[1]
        )
        save_tree(served.with_ngram() if split_ngram(tree)[1] else served, None, staged)
        tracker.log_artifacts(str(staged), "drafter")
    tracker.set_tags(
        {
            "draftlab.status": "done",
            "draftlab.trained_here": str(summary["trained_here"]),
            "draftlab.hardware": result["device"],
        }
    )
    tracker.end("FINISHED")
    tune.report(
        {
            **base,
            **metrics,
            "status": "done",
            "tau_by_category": result["tau_by_category"],
            "greedy_identical": result["greedy_identical"],
            "trained_here": summary["trained_here"],
            "drafter_dir": p.cfg.output_dir,
            "mlflow_run_id": run_id,
        }
    )
