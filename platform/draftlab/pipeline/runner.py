"""`draftlab pipeline`: run the stages in order under one MLflow parent run, skipping those
whose outputs exist for the same inputs, and print the summary.

    draftlab pipeline -c jobs/configs/pipeline-smollm2-135m-cpu.yaml
    draftlab pipeline --quick

State under `<state_dir>/<name>/` (default `.draftlab/pipelines/<name>/`):

    state.json            the MLflow parent run (a re-run continues it)
    stages/<stage>.json   inputs' fingerprint, outputs and wall time of each finished stage
    bench.json            champion vs ar / HF generate / HF prompt lookup (compare stage)
    profile.json          this hardware's verify and drafting costs
    sweep/                the sweep's results (table, plots, summary)
    summary.json, report/ the final summary and the HTML/markdown report

A stage re-runs when its fingerprint (its config plus the outputs it consumes) changes or
its outputs are gone; the work inside a stage resumes too (cached data shards, Ray Train
checkpoints, `Tuner.restore` of an interrupted sweep). The smoke request always runs: it
checks the live endpoint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import ray
import torch
from ray import serve
from ray._private.worker import get_dashboard_url
from rich.console import Console

from draftlab.cluster import storage_uri
from draftlab.config import TargetSpec
from draftlab.errors import DraftlabError
from draftlab.models.target import resolve_device, resolve_dtype
from draftlab.pipeline import stages
from draftlab.pipeline.compose import Pipeline, load_pipeline
from draftlab.serve.control import example_curl
from draftlab.storage import exists
from draftlab.submit import check_hub_access
from draftlab.tracking import Tracker, resolve_tracking_uri


def fingerprint(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _atomic_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    tmp.replace(path)


@dataclass
class Stage:
    name: str
    fn: Callable[[PipelineRun], dict]
    inputs: Callable[[PipelineRun], object]  # what the stage's result depends on
    valid: Callable[[PipelineRun, dict], bool] = lambda run, out: (
        True
    )  # are its recorded outputs still there?
    always: bool = False


def _exists(key: str) -> Callable[[PipelineRun, dict], bool]:
    return lambda run, out: exists(out[key])  # a local path or a URI (s3://...)


def _sweep_inputs(run: PipelineRun):
    return {
        "sweep": run.p.sweep.model_dump(mode="json"),
        "base": run.p.sweep_base(run.parent_id),
        "data": run.outputs["data"]["data_path"],
    }


STAGES = [
    Stage(
        "data",
        stages.data,
        lambda r: [r.p.distill.data.model_dump(mode="json"), r.p.distill.target.model_dump()],
        _exists("data_path"),
    ),
    Stage(
        "distill",
        stages.distill,
        lambda r: [r.p.distill.model_dump(mode="json"), r.outputs["data"]["data_path"]],
        _exists("drafter_dir"),
    ),
    Stage("sweep", stages.sweep, _sweep_inputs, _exists("experiment_dir")),
    Stage("promote", stages.promote, stages.candidates, stages.champion_is_current),
    Stage(
        "compare",
        stages.compare,
        lambda r: [r.p.cfg.compare.model_dump(), r.p.cfg.prompts, r.outputs["promote"]["version"]],
        lambda r, o: (r.dir / "bench.json").is_file(),
    ),
    Stage(
        "serve",
        stages.serve,
        lambda r: [
            stages.serve_spec(r)["args"].model_dump(mode="json"),
            r.outputs["promote"]["version"],
        ],
        stages.serving,
    ),
    Stage("smoke", stages.smoke, lambda r: None, always=True),
    Stage(
        "report",
        stages.report,
        lambda r: [r.outputs["promote"], r.outputs["compare"], r.outputs.get("sweep")],
        _exists("html"),
    ),
]


BEFORE_SERVE = ("data", "distill", "sweep", "promote", "compare")


@dataclass
class PipelineRun:
    """One execution of a pipeline: where its state lives and what each stage produced."""

    p: Pipeline
    dir: Path
    tracking_uri: str
    parent: object  # draftlab.tracking.Tracker of the parent run
    cluster: dict
    progress: bool = True
    outputs: dict[str, dict] = field(default_factory=dict)
    status: dict[str, dict] = field(default_factory=dict)  # stage -> {status, wall_s}

    @property
    def parent_id(self) -> str:
        return self.parent.run_id

    @property
    def storage(self) -> str:
        return storage_uri(self.p.distill.storage_path)

    def run_stage(self, i: int, stage: Stage) -> None:
        console = Console(stderr=True)
        record = self.dir / "stages" / f"{stage.name}.json"
        fp = fingerprint(stage.inputs(self))
        if not stage.always and record.is_file():
            rec = json.loads(record.read_text())
            if rec["fingerprint"] == fp and stage.valid(self, rec["outputs"]):
                self.outputs[stage.name] = rec["outputs"]
                self.status[stage.name] = {
                    "status": "skipped (done before)",
                    "wall_s": rec["wall_s"],
                }
                if self.progress:
                    console.print(
                        f"[bold]\\[{i}/{len(self.stages)}] {stage.name}[/]: done before, skipped "
                        f"({rec['wall_s']:.0f} s then)"
                    )
                return
        if self.progress:
            console.rule(f"[bold]\\[{i}/{len(self.stages)}] {stage.name}")
        if stage.name in BEFORE_SERVE:
            self._take_down_endpoint(console)
        t0 = time.perf_counter()
        out = stage.fn(self)
        wall = time.perf_counter() - t0
        _atomic_json(
            record, {"fingerprint": fp, "outputs": out, "wall_s": wall, "finished_at": time.time()}
        )
        self.outputs[stage.name] = out
        self.status[stage.name] = {"status": "ran", "wall_s": wall}
        self.parent.log_metrics_now({f"stage_s/{stage.name}": wall}, 0)
        if self.progress:
            console.print(
                f"[bold green]\\[{i}/{len(self.stages)}] {stage.name}[/]: done in {wall:.0f} s"
            )

    def _take_down_endpoint(self, console) -> None:
        """An earlier run's endpoint holds CPUs/GPUs a re-running stage may need (on a small
        machine: all of them); the serve stage deploys it again, with the new champion."""
        record = self.dir / "stages" / "serve.json"
        if not record.is_file():
            return
        app = json.loads(record.read_text())["outputs"]["app"]

        if stages.serving(self, {"app": app}):
            if self.progress:
                console.print(
                    f"taking down the endpoint {app!r} of the earlier run (redeployed at the serve "
                    "stage)"
                )
            serve.delete(app)
        record.unlink()

    @property
    def stages(self) -> list[Stage]:
        return [s for s in STAGES if s.name != "sweep" or self.p.sweep is not None]

    def summary(self) -> dict:
        o = self.outputs
        return {
            "name": self.p.cfg.name,
            "config": str(self.p.source),
            "mlflow_run_id": self.parent_id,
            "tracking_uri": self.tracking_uri,
            "experiment": self.p.cfg.experiment,
            "cluster": self.cluster,
            "stages": self.status,
            "champion": o.get("promote"),
            "compare": o.get("compare"),
            "endpoint": o.get("serve"),
            "smoke": o.get("smoke"),
            "sweep": o.get("sweep"),
            "baseline": o.get("distill"),
            "data": o.get("data"),
            "report": o.get("report"),
        }

    def write_summary(self) -> dict:
        s = self.summary()
        _atomic_json(self.dir / "summary.json", s)
        self.parent.log_dict(s, "summary.json")
        return s


# Worker processes of the pipeline's Ray job draw no progress bars: forwarded to this console
# each bar redraw is a line (a "Loading weights" bar per model load, MLflow's per download).
QUIET_WORKERS = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
}


def _ray_to_log(log_file: Path) -> None:
    """The driver's "ray" logger writes INFO and up to `log_file` (connection notices, the
    dashboard banner) and only warnings and errors to the console."""
    log = logging.getLogger("ray")
    log.handlers.clear()
    to_file = logging.FileHandler(log_file)
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s -- %(message)s"))
    to_console = logging.StreamHandler()
    to_console.setLevel(logging.WARNING)
    log.addHandler(to_file)
    log.addHandler(to_console)
    log.setLevel(logging.INFO)
    log.propagate = False


def connect_cluster(log_file: Path, progress: bool = True) -> dict:
    """This process's Ray: the instance already initialised, RAY_ADDRESS, a cluster running
    on this machine, else a new local head (`ray start --head`), which outlives the pipeline
    so the endpoint stays up (`ray stop` ends it). Ray's own start-up output (the `ray start`
    banner, connection notices) goes to `log_file`, and the job's workers draw no progress
    bars: the console keeps the stages, their progress (the trainer prints a line per
    evaluation) and the summary."""

    def init(address: str) -> None:
        ray.init(
            address=address,
            log_to_driver=True,
            configure_logging=False,
            runtime_env={"env_vars": QUIET_WORKERS},
        )
        _ray_to_log(log_file)  # after init: configure_logging=False clears the "ray" logger

    log_file.parent.mkdir(parents=True, exist_ok=True)
    started = False
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        try:
            init(address or "auto")
        except ConnectionError:
            if address:
                raise
            if progress:
                print(
                    "no Ray cluster on this machine: starting one (`ray start --head`, output in "
                    f"{log_file}; `ray stop` ends it)",
                    flush=True,
                )
            ray_bin = Path(sys.executable).with_name("ray")
            with log_file.open("a") as out:
                code = subprocess.run(
                    [
                        str(ray_bin),
                        "start",
                        "--head",
                        f"--num-cpus={os.cpu_count()}",
                        "--include-dashboard=true",
                        "--dashboard-host=127.0.0.1",
                        "--disable-usage-stats",
                    ],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                ).returncode
            if code:
                raise DraftlabError(
                    f"`ray start --head` failed (exit {code}): its output is in {log_file}"
                ) from None
            init("auto")
            started = True
    url = get_dashboard_url()
    return {
        "address": ray.get_runtime_context().gcs_address,
        "dashboard": f"http://{url}" if url and "://" not in url else url,
        "started_here": started,
        "log": str(log_file),
    }


def float32_note(target: TargetSpec) -> str | None:
    """A warning for CPUs where `dtype: auto` runs the target in float32 (no AMX or AVX512-BF16):
    the embedded budgets were measured with a bf16 target, and every stage that generates or
    benches takes several times longer there; None elsewhere."""
    device = resolve_device(target.device)
    if (
        target.dtype != "auto"
        or device.type != "cpu"
        or resolve_dtype("auto", device) != torch.float32
    ):
        return None
    return (
        f"note: this CPU has neither AMX nor AVX512-BF16, so {target.name} runs in float32: the "
        "stages that generate data and bench take several times longer than the budgets here were "
        "measured at with a bf16 target (docs/benchmarks.md#the-pipeline-end-to-end)"
    )


def run_pipeline(path: str | Path, overrides: dict | None = None, progress: bool = True) -> dict:
    """Run (or continue) the pipeline of `path`; returns the summary."""
    p = load_pipeline(path, overrides)
    check_hub_access(p.distill.target, p.distill.data)
    note = float32_note(p.distill.target)
    if note and progress:
        print(note, flush=True)
    run_dir = Path(p.cfg.state_dir).expanduser().resolve() / p.cfg.name
    uri = resolve_tracking_uri(p.distill.tracking.tracking_uri)
    state_file = run_dir / "state.json"
    state = json.loads(state_file.read_text()) if state_file.is_file() else {}
    parent = Tracker(
        tracking_uri=uri, experiment=p.cfg.experiment, run_id=state.get("mlflow_run_id")
    )
    parent.start_or_resume(
        f"pipeline-{p.cfg.name}",
        tags={
            "draftlab.kind": "pipeline",
            "draftlab.pipeline": p.cfg.name,
            "draftlab.target": p.distill.target.name,
        },
    )
    _atomic_json(state_file, {"mlflow_run_id": parent.run_id, "config": str(p.source)})
    parent.log_params({"pipeline": p.cfg.model_dump(mode="json")})
    run = PipelineRun(
        p, run_dir, uri, parent, connect_cluster(run_dir / "ray.log", progress), progress
    )
    t0 = time.perf_counter()
    try:
        for i, stage in enumerate(run.stages, 1):
            run.run_stage(i, stage)
    except BaseException as e:
        failed = next((s.name for s in run.stages if s.name not in run.status), "?")
        run.status[failed] = {"status": f"failed: {type(e).__name__}: {e}"[:300], "wall_s": None}
        run.write_summary()
        parent.end("KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED")
        raise
    run.status["total"] = {"status": "ran", "wall_s": time.perf_counter() - t0}
    summary = run.write_summary()
    parent.log_metrics_now({"pipeline_wall_s": time.perf_counter() - t0}, 0)
    parent.end("FINISHED")
    return summary


def _verdict_lines(cmp: dict) -> list[str]:
    """What the compare stage chose to deploy (vLLM), per load level."""
    v = cmp.get("verdict")
    if not v:
        return []
    levels = ", ".join(
        f"{r['concurrency']}: {r['tokens_per_s']:.1f} vs {r['vllm_ar_tokens_per_s']:.1f} tok/s"
        f" ({'drafts' if r['drafts'] else 'no drafting'})"
        for r in v["levels"]
    )
    return [f"deployed: {v['served']} {v['deploy']}", f"  {v['reason']}"] + (
        [f"  under load (in flight: served vs vllm_ar): {levels}"] if levels else []
    )


def format_summary(s: dict) -> str:
    """The final summary: stages, champion, figures, endpoint, where to look."""
    lines = [f"pipeline {s['name']}: stages"]
    for name, st in s["stages"].items():
        wall = f"{st['wall_s']:.0f} s" if isinstance(st.get("wall_s"), float) else "-"
        lines.append(f"  {name:<8} {wall:>7}  {st['status']}")
    c, cmp, ep = s["champion"], s["compare"], s["endpoint"]
    lines += [
        f"champion: {c['model']} version {c['version']} @{c['alias']} (from the {c['source']}): "
        f"{c['family']} drafter K={c['k']} depth={c['depth']} tree={c['tree']}",
        *([f"  {c['reason']}"] if c.get("reason") else []),
        f"  measured in {cmp.get('engine', 'draftlab')} on {cmp['prompts']} prompts "
        f"({cmp['device']}): {cmp['method']} tau {cmp['tau']:.2f}, "
        + ", ".join(
            f"{k.replace('_', ' ')} {v:.2f}x"
            for k, v in cmp.items()
            if k.startswith("speedup_vs_") and v
        )
        + f", greedy output identical to the target's: {cmp['greedy_identical']}",
        *_verdict_lines(cmp),
        f"endpoint: {ep['url']} (model {ep['model']!r})",
        "  " + example_curl(ep["url"].removesuffix("/v1"), ep["model"], False),
        f"  python: from openai import OpenAI; c = OpenAI(base_url={ep['url']!r}, api_key='none'); "
        f"print(c.chat.completions.create(model={ep['model']!r}, messages=[{{'role': 'user', "
        "'content': 'Hi'}]).choices[0].message.content)",
        f"smoke request: {s['smoke']['latency_s']} s -> {s['smoke']['text'][:80]!r}",
        f"MLflow: run {s['mlflow_run_id']} in experiment {s['experiment']}; UI: "
        + (
            f"mlflow ui --backend-store-uri {s['tracking_uri']}"
            if s["tracking_uri"].startswith("sqlite")
            else s["tracking_uri"]
        ),
        f"Ray dashboard: {s['cluster']['dashboard'] or 'not running (install ray[default])'}"
        + (
            "; the cluster started here keeps serving: `ray stop` ends it"
            if s["cluster"]["started_here"]
            else ""
        )
        + (f"; Ray's start-up output: {s['cluster']['log']}" if s["cluster"].get("log") else ""),
    ]
    if s.get("report"):
        lines.append(f"report: {s['report']['html']}")
    return "\n".join(lines)
