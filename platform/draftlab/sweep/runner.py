"""The sweep driver: `run_sweep(path)` / `resume_sweep(dir)`, shared by `draftlab sweep`
and `sweeps/run.py` (for `ray job submit`).

    draftlab sweep -c sweeps/smollm2-135m-cpu.yaml [dotted.field=value ...]
    draftlab sweep --resume .draftlab/ray/sweeps/smollm2-135m-cpu

Layout under the base config's `storage_path` (default `.draftlab/ray`):

    sweeps/<name>/            Tune experiment (Tuner.restore resumes it) + sweep.json
    sweeps/<name>/results/    results.csv, plots, best.json (also on the MLflow parent run)
    trainings/<name>/         keyed trainings, shared by sweeps (see sweep/trial.py)
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import ray
from optuna.samplers import TPESampler
from ray import tune
from ray.tune.schedulers import ASHAScheduler
from ray.tune.search.optuna import OptunaSearch
from rich.console import Console
from rich.table import Table

from draftlab.cluster import ensure_ray, storage_uri
from draftlab.config import ConfigError
from draftlab.data.selfdistill import load_or_generate
from draftlab.distill.drafter_setup import training_samples
from draftlab.distill.launch import registered_name
from draftlab.submit import check_hub_access
from draftlab.sweep.report import write_csv, write_plots
from draftlab.sweep.space import SweepConfig, load_sweep, max_concurrency, param_space, trial_config
from draftlab.sweep.trial import SweepContext, plan, run_trial, trial_run_name
from draftlab.tracking import Tracker, parent_tags, promote, resolve_tracking_uri

STATE_FILE = "sweep.json"
TRIAL_MEMORY = 512 * 1024**2  # the coordinating trial process (imports torch, ray, mlflow)
RESULTS = "results"


class SweepCallback(tune.Callback):
    """Marks trainings ASHA stopped (so the trials sharing them stop too) and prints a live
    table: trial, K, depth, tree, status, training step, sim accept length, speedup."""

    def __init__(self, ctx: SweepContext, progress: bool = True, every_s: float = 20.0):
        self.ctx, self.progress, self.every_s = ctx, progress, every_s
        self.rows: dict[str, dict] = {}
        self._printed = 0.0

    def _row(self, trial) -> dict:
        c = trial.config
        return self.rows.setdefault(
            trial.trial_id,
            {
                "K": c.get("drafter.k", self.ctx.base["drafter"].get("k")),
                "depth": c.get("drafter.depth", self.ctx.base["drafter"].get("depth")),
                "tree": c.get("tree"),
                "status": "PENDING",
                "step": "",
                "sim": "",
                "speedup": "",
            },
        )

    def on_trial_start(self, iteration, trials, trial, **info):
        self._row(trial)["status"] = "RUNNING"
        self._show(force=True)

    def on_trial_result(self, iteration, trials, trial, result, **info):
        row = self._row(trial)
        if "status" in result:  # the trial's final report
            row["status"] = result["status"]
            row["speedup"] = f"{result['speedup_vs_ar']:.3f}" if "speedup_vs_ar" in result else ""
        else:  # a training report
            row["status"], row["step"] = "training", result.get("step", "")
            if result.get("done"):  # the scheduler stopped it: the trials sharing it stop too
                self._mark_stopped(trial, result)
                row["status"] = "stopped (ASHA)"
        sim = result.get("eval/sim_accept_len")
        row["sim"] = f"{sim:.3f}" if isinstance(sim, float) else row["sim"]
        self._show(force="status" in result or result.get("done", False))

    def _mark_stopped(self, trial, result: dict) -> None:
        """Its process is killed next: record why, for the trials sharing its training and
        on its MLflow run (which would otherwise stay RUNNING)."""
        p = plan(trial.config, self.ctx)
        (p.dir / "stopped.json").write_text(
            json.dumps(
                {
                    "trial": trial.trial_id,
                    "step": result.get("step"),
                    "eval/sim_accept_len": result.get("eval/sim_accept_len"),
                    "time": time.time(),
                }
            )
            + "\n"
        )
        c = self.ctx
        run_id = Tracker(c.tracking_uri, c.experiment).find_unfinished(
            trial_run_name(c, trial.trial_id)
        )
        if run_id:
            run = Tracker(c.tracking_uri, c.experiment, run_id=run_id)
            run.set_tags(
                {
                    "draftlab.status": "stopped (ASHA)",
                    "draftlab.stopped_at_step": result.get("step"),
                }
            )
            run.end("KILLED")

    def on_trial_complete(self, iteration, trials, trial, **info):
        row = self._row(trial)
        if row["status"] in ("RUNNING", "training"):
            row["status"] = "finished"
        self._show(force=True)

    def on_trial_error(self, iteration, trials, trial, **info):
        self._row(trial)["status"] = "ERROR"
        self._show(force=True)

    def _show(self, force: bool = False) -> None:
        if not self.progress or (not force and time.monotonic() - self._printed < self.every_s):
            return

        table = Table(title=f"sweep {self.ctx.sweep}", show_lines=False)
        for col in ("trial", "K", "depth", "tree", "status", "step", "sim accept", "speedup"):
            table.add_column(col)
        for tid, r in self.rows.items():
            table.add_row(
                tid,
                *(str(r[c]) for c in ("K", "depth", "tree", "status", "step", "sim", "speedup")),
            )
        Console(stderr=True).print(table)
        self._printed = time.monotonic()


def _paths(base: dict, name: str) -> tuple[Path, Path]:
    storage = storage_uri(base.get("storage_path", ".draftlab/ray"))
    if "://" in storage:  # Path() would fold it into a local `s3:/...` directory
        raise ConfigError(
            f"storage_path {storage!r}: a sweep coordinates its trials through file locks and "
            f"files under storage_path, so it needs a local or shared (NFS) directory, not a URI"
        )
    root = Path(storage)
    return root / "sweeps" / name, root / "trainings"


def search_setup(sweep: SweepConfig, concurrency: int):
    """(search algorithm or None for Tune's grid/random variant generator, num_samples)."""
    if sweep.search.algorithm == "grid":
        return None, sweep.search.num_samples or 1
    num_samples = sweep.search.num_samples or max(
        8, 2 * concurrency
    )  # unset: two waves of the cluster, at least 8
    if sweep.search.algorithm == "random":
        return None, num_samples

    return OptunaSearch(
        metric="speedup_vs_ar", mode="max", sampler=TPESampler(seed=sweep.search.seed)
    ), num_samples


def _tuner_parts(sweep: SweepConfig, base: dict, ctx: SweepContext, progress: bool):
    cfg = trial_config(base, {})
    sc = cfg.scaling
    concurrency = sweep.search.max_concurrent_trials or max_concurrency(
        ray.cluster_resources(),
        sc.cpus_per_worker * sc.num_workers,
        float(sc.num_workers) if sc.use_gpu else 0.0,
    )
    scheduler = None
    if sweep.asha:
        a = sweep.asha
        scheduler = ASHAScheduler(
            time_attr="training_iteration",
            metric=a.metric,
            mode="max",
            max_t=a.max_t,
            grace_period=a.grace_period,
            reduction_factor=a.reduction_factor,
        )
    search_alg, num_samples = search_setup(sweep, concurrency)
    tune_config = tune.TuneConfig(
        num_samples=num_samples,
        max_concurrent_trials=concurrency,
        scheduler=scheduler,
        search_alg=search_alg,
    )
    # The trial process only coordinates: its training workers and bench task reserve the
    # CPUs/GPUs (a CPU held here would starve a training that needs the whole node), so it
    # asks for memory only, and `max_concurrent_trials` bounds how many run at once.
    trainable = tune.with_resources(
        tune.with_parameters(run_trial, ctx=ctx), {"CPU": 0, "memory": TRIAL_MEMORY}
    )
    return trainable, tune_config, [SweepCallback(ctx, progress)], concurrency


def run_sweep(path: str | Path, overrides: dict | None = None, progress: bool = True) -> dict:
    """Run the sweep of `path`; returns the summary (also `results/summary.json`)."""
    return start_sweep(*load_sweep(path, overrides), str(path), progress)


def start_sweep(sweep: SweepConfig, base: dict, source: str, progress: bool = True) -> dict:
    """Run an already loaded sweep (`load_sweep`, or built by `draftlab pipeline`)."""
    exp_dir, trainings = _paths(base, sweep.name)
    cfg = trial_config(base, {})
    check_hub_access(cfg.target, cfg.data)
    ensure_ray()
    data = load_or_generate(cfg.data, cfg.target, progress=progress)  # cached: never per trial
    data_path = str(Path(data["train"].cache_files[0]["filename"]).parent.parent)
    dim = sweep.space.get("train.max_samples")  # a data-size axis: within the cached split
    largest = max(dim if isinstance(dim, list) else next(iter(dim.values()))) if dim else None
    for n in (cfg.train.max_samples, largest):
        training_samples(data["train"], n)
    state = {
        "sweep": sweep.model_dump(mode="json"),
        "base": base,
        "source": source,
        "data_path": data_path,
    }
    return _run(sweep, base, state, exp_dir, trainings, progress, restore=False)


def resume_sweep(exp_dir: str | Path, progress: bool = True) -> dict:
    """Continue an interrupted sweep from its Tune experiment directory: finished trials
    are kept, unfinished ones resume (their trainings from the latest checkpoint)."""
    exp_dir = Path(exp_dir).expanduser().resolve()
    state_file = exp_dir / STATE_FILE
    if not state_file.is_file():
        raise ConfigError(
            f"--resume {exp_dir}: no {STATE_FILE} here; pass the directory `draftlab sweep` "
            "printed (<storage_path>/sweeps/<name>)"
        )
    state = json.loads(state_file.read_text())
    sweep = SweepConfig.model_validate(state["sweep"])

    check_hub_access(
        trial_config(state["base"], {}).target
    )  # the data is cached: only trials load the target
    ensure_ray()
    _, trainings = _paths(state["base"], sweep.name)
    return _run(sweep, state["base"], state, exp_dir, trainings, progress, restore=True)


def _run(
    sweep: SweepConfig,
    base: dict,
    state: dict,
    exp_dir: Path,
    trainings: Path,
    progress: bool,
    restore: bool,
) -> dict:
    cfg = trial_config(base, {})
    uri = resolve_tracking_uri(cfg.tracking.tracking_uri)
    # a new sweep gets a new parent run; --resume continues the one its sweep.json names
    parent = Tracker(
        tracking_uri=uri,
        experiment=sweep.experiment,
        run_id=state.get("parent_run_id") if restore else None,
    )
    parent_id = parent.start_or_resume(
        f"sweep-{sweep.name}",
        resume=restore,
        tags={
            "draftlab.kind": "sweep",
            "draftlab.sweep": sweep.name,
            "draftlab.target": cfg.target.name,
            **parent_tags(cfg.tracking.parent_run_id),
        },
    )
    if not restore:
        parent.log_params({"sweep": sweep.model_dump(mode="json"), "base_config": state["source"]})
    ctx = SweepContext(
        sweep=sweep.name,
        base=base,
        trees=sweep.trees,
        trainings=str(trainings),
        data_path=state["data_path"],
        tracking_uri=uri,
        experiment=sweep.experiment,
        parent_run_id=parent_id,
        objective=sweep.objective,
    )
    trainable, tune_config, callbacks, concurrency = _tuner_parts(sweep, base, ctx, progress)
    exp_dir.mkdir(parents=True, exist_ok=True)
    (exp_dir / STATE_FILE).write_text(
        json.dumps(state | {"parent_run_id": parent_id}, indent=2) + "\n"
    )
    if progress:
        print(
            f"sweep {sweep.name}: {exp_dir} (resume: draftlab sweep --resume {exp_dir}); "
            f"{concurrency} trial(s) at a time; MLflow parent run {parent_id}",
            flush=True,
        )
    t0 = time.perf_counter()
    try:
        if restore:
            tuner = tune.Tuner.restore(
                str(exp_dir), trainable=trainable, resume_unfinished=True, resume_errored=True
            )
        else:
            tuner = tune.Tuner(
                trainable,
                param_space=param_space(sweep),
                tune_config=tune_config,
                run_config=tune.RunConfig(
                    name=sweep.name,
                    storage_path=str(exp_dir.parent),
                    callbacks=callbacks,
                    verbose=0,
                    failure_config=tune.FailureConfig(max_failures=sweep.max_failures),
                ),
            )
        grid = tuner.fit()
    except BaseException:
        parent.end("FAILED")
        raise
    summary = summarise(grid, sweep, exp_dir / RESULTS)
    summary |= {
        "wall_s": time.perf_counter() - t0,
        "experiment_dir": str(exp_dir),
        "mlflow_parent_run_id": parent_id,
    }
    parent.log_artifacts(str(exp_dir / RESULTS), RESULTS)
    best = summary.get("best")
    if best:
        parent.log_metrics_now(
            {
                "best_speedup_vs_ar": best["speedup_vs_ar"],
                "best_tau": best["tau"],
                "trials_done": summary["trials_done"],
                "trials_stopped": summary["trials_stopped"],
                "sweep_wall_s": summary["wall_s"],
            },
            0,
        )
        parent.set_tags({"draftlab.best_run_id": best["mlflow_run_id"]})
        if sweep.promote:
            summary["champion"] = promote(
                best["mlflow_run_id"], registered_name(cfg), tracking_uri=uri
            )
    (exp_dir / RESULTS / "summary.json").write_text(
        json.dumps(summary, indent=2, default=str) + "\n"
    )
    parent.log_dict(summary, f"{RESULTS}/summary.json")
    parent.end("FINISHED" if best else "FAILED")
    return summary


ROW_KEYS = (
    "family",
    "k",
    "depth",
    "tree",
    "tree_nodes",
    "tau",
    "speedup_vs_ar",
    "tokens_per_s",
    "ar_tokens_per_s",
    "draft_ms",
    "verify_ms",
    "drafter_parameters",
    "train_steps",
    "eval/sim_accept_len",
    "tau_by_category",
    "trained_here",
    "training_key",
    "mlflow_run_id",
    "greedy_identical",
)


def _unfinished(error, metrics: dict) -> str:
    """Why a trial has no final row: ASHA judges reported steps, so one that never reported
    was interrupted (Ctrl-C, a lost node) before its first."""
    if error:
        return "error"
    return "stopped (ASHA)" if metrics.get("step") is not None else "interrupted"


def summarise(grid, sweep: SweepConfig, out_dir: Path) -> dict:
    """Rows of the finished trials, the results files and the best trial."""
    rows, other = [], []
    for r in grid:
        m = r.metrics or {}
        trial = m.get("trial_id") or (Path(r.path).name if r.path else "?")
        if m.get("status") == "done":
            params = {k: (r.config or {}).get(k) for k in sweep.space}  # its point in the space
            rows.append({"trial": trial, **{k: m.get(k) for k in ROW_KEYS}, "params": params})
        else:
            other.append(
                {
                    "trial": trial,
                    "status": m.get("status") or _unfinished(r.error, m),
                    "config": r.config,
                    "error": str(r.error) if r.error else None,
                    "step": m.get("step"),
                    "eval/sim_accept_len": m.get("eval/sim_accept_len"),
                }
            )
    out_dir.mkdir(parents=True, exist_ok=True)
    summary: dict = {
        "sweep": sweep.name,
        "trials": len(rows) + len(other),
        "trials_done": len(rows),
        "trials_stopped": len(other),
        "rows": rows,
        "not_finished": other,
    }
    if not rows:
        return summary
    write_csv(rows, out_dir / "results.csv")
    write_plots(rows, out_dir)
    best = fastest(rows, sweep.tie)
    summary["best"] = best
    summary["best_by_tree"] = {
        t: max(r["speedup_vs_ar"] for r in rows if r["tree"] == t)
        for t in dict.fromkeys(r["tree"] for r in rows)
    }
    (out_dir / "best.json").write_text(json.dumps(best, indent=2) + "\n")
    return summary


def fastest(rows: list[dict], tie: float) -> dict:
    """The row of the highest `speedup_vs_ar`, or, among the rows measured within `tie` (a
    fraction) of it, the one of the highest `tau` (SweepConfig.tie)."""
    top = max(r["speedup_vs_ar"] or 0.0 for r in rows)
    near = [r for r in rows if (r["speedup_vs_ar"] or 0.0) >= top * (1 - tie)]
    return max(near, key=lambda r: (r.get("tau") or 0.0, r["speedup_vs_ar"] or 0.0))


def champion(incumbent: dict, challenger: dict, tie: float) -> dict:
    """The challenger where it measured more than `tie` (a fraction) faster than the incumbent
    (or the incumbent has no measurement), else the incumbent. No tau decides here: the taus
    of different trees and drafter depths do not rank their speeds (a wider tree verifies more
    tokens a round at a higher cost; vLLM serves a deeper drafter's chain at its own cost)."""
    new, old = challenger["speedup_vs_ar"], incumbent["speedup_vs_ar"]
    if new is None:
        return incumbent
    return challenger if old is None or new > old * (1 + tie) else incumbent


def format_table(summary: dict) -> str:
    """The results as a fixed-width table (best first)."""
    cols = (
        "trial",
        "family",
        "k",
        "depth",
        "tree",
        "tree_nodes",
        "tau",
        "speedup_vs_ar",
        "trained_here",
    )
    lines = ["  ".join(f"{c:>13}" for c in cols)]
    for r in sorted(summary.get("rows", []), key=lambda r: -r["speedup_vs_ar"]):
        cells = [f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols]
        lines.append("  ".join(f"{c:>13}" for c in cells))
    for o in summary.get("not_finished", []):
        lines.append(f"{o['trial']:>13}  {o['status']}  {o['config']}")
    return "\n".join(lines)
