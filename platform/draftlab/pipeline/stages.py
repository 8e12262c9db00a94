"""The pipeline's stages, each `fn(run) -> outputs` (a JSON-able dict the runner records).

data -> distill -> sweep -> promote -> compare -> serve -> smoke -> report. Every stage
calls the same library function as its own CLI command, on the current Ray cluster.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import ray
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from draftlab.bench import run_bench
from draftlab.config import BenchConfig, ConfigError, ProfileConfig, ServeArgs
from draftlab.data.selfdistill import load_or_generate
from draftlab.distill.launch import registered_name, run_distill
from draftlab.errors import DraftlabError
from draftlab.export import served_draft_length
from draftlab.profiling import run_profile
from draftlab.report import write_report
from draftlab.serve.control import deploy
from draftlab.serve.pair import resolve_pair
from draftlab.sweep.runner import STATE_FILE, champion, resume_sweep, start_sweep
from draftlab.tracking import promote as promote_run
from draftlab.vllm_offline import INSTALL_HINT, require_vllm
from draftlab.vllm_scheduler import require_arctic

if TYPE_CHECKING:
    from draftlab.pipeline.runner import PipelineRun


class StageFailed(DraftlabError):
    """A stage could not produce its outputs; the message says which and why."""


def data(run: PipelineRun) -> dict:
    cfg = run.p.distill
    ds = load_or_generate(cfg.data, cfg.target, progress=run.progress)
    # load_from_disk maps <dataset>/<split>/data-*.arrow
    path = Path(ds["train"].cache_files[0]["filename"]).parent.parent
    return {"data_path": str(path), "train": len(ds["train"]), "eval": len(ds["eval"])}


def distill(run: PipelineRun) -> dict:
    cfg = run.p.distill
    cfg = cfg.model_copy(
        update={"tracking": cfg.tracking.model_copy(update={"parent_run_id": run.parent_id})}
    )
    s = run_distill(cfg, progress=run.progress)
    return {
        "mlflow_run_id": s["mlflow_run_id"],
        "drafter_dir": s["drafter_dir"],
        "steps": s.get("steps"),
        "tau": s.get("tau"),
        "speedup_vs_ar": s.get("speedup_vs_ar"),
        "k": cfg.drafter.k,
        "depth": cfg.drafter.depth,
        "family": cfg.drafter.family,
        "tree": s.get("tree") or cfg.bench.tree,
    }


def sweep(run: PipelineRun) -> dict:
    p = run.p
    base = p.sweep_base(run.parent_id)
    exp_dir = Path(run.storage) / "sweeps" / p.sweep.name
    state = exp_dir / STATE_FILE
    same = (
        state.is_file()
        and (old := json.loads(state.read_text()))["sweep"] == p.sweep.model_dump(mode="json")
        and old["base"] == base
    )
    if same and not (exp_dir / "results" / "summary.json").is_file():  # interrupted: continue it
        summary = resume_sweep(exp_dir, run.progress)
    else:
        summary = start_sweep(p.sweep, base, str(p.source), run.progress)
    best = summary.get("best")
    if not best:
        raise StageFailed(
            f"sweep {p.sweep.name}: no trial finished ({summary['trials_stopped']} stopped or "
            f"failed); see {exp_dir}"
        )
    local = run.dir / "sweep"
    shutil.rmtree(local, ignore_errors=True)
    shutil.copytree(exp_dir / "results", local)
    run.parent.log_artifacts(str(local), "sweep")
    return {
        "experiment_dir": str(exp_dir),
        "mlflow_parent_run_id": summary["mlflow_parent_run_id"],
        "trials_done": summary["trials_done"],
        "wall_s": summary["wall_s"],
        "best": {
            k: best[k]
            for k in ("k", "depth", "family", "tree", "tau", "speedup_vs_ar", "mlflow_run_id")
        },
    }


def candidates(run: PipelineRun) -> list[dict]:
    """The baseline and the sweep's best, each with its measured speedup (same bench settings)."""
    d = run.outputs["distill"]
    out = [
        {
            "source": "baseline",
            **{
                k: d[k]
                for k in ("k", "depth", "family", "tree", "tau", "speedup_vs_ar", "mlflow_run_id")
            },
        }
    ]
    if "sweep" in run.outputs:
        out.append({"source": "sweep", **run.outputs["sweep"]["best"]})
    return out


def promote(run: PipelineRun) -> dict:
    """The baseline becomes @champion unless the sweep's best measured more than `sweep.tie`
    faster (`champion`): a 1-minute trial within a short bench's noise of the 4-minute
    baseline does not replace it."""
    base, *sweep = candidates(run)
    challenger = sweep[0] if sweep else base  # no sweep: the baseline against itself
    tie = run.p.sweep.tie if run.p.sweep else 0.0
    best = champion(base, challenger, tie)
    promoted = promote_run(
        best["mlflow_run_id"], registered_name(run.p.distill), tracking_uri=run.tracking_uri
    )
    out = best | promoted | {"model_uri": f"models:/{promoted['model']}@{promoted['alias']}"}
    if best is base and (challenger["speedup_vs_ar"] or 0.0) > (base["speedup_vs_ar"] or 0.0):
        out["reason"] = (
            f"the sweep's best measured {challenger['speedup_vs_ar']:.3f}x ar against the "
            f"baseline's {base['speedup_vs_ar']:.3f}x, within sweep.tie ({tie:.0%}): the "
            "baseline stays"
        )
    return out


def champion_is_current(run: PipelineRun, outputs: dict) -> bool:
    """The registry still gives the alias to the version this stage promoted."""
    try:
        mv = MlflowClient(tracking_uri=run.tracking_uri).get_model_version_by_alias(
            outputs["model"], outputs["alias"]
        )
    except MlflowException:
        return False
    return str(mv.version) == outputs["version"]


def _compare_task(
    bench: dict, profile: dict, model_uri: str, tracking_uri: str, each_k: bool
) -> tuple[dict, dict]:
    """On a worker with the training's resources: the champion as served, side by side."""
    pair = resolve_pair(
        ServeArgs(model_uri=model_uri, tracking_uri=tracking_uri, target=bench["target"])
    )
    cfg = BenchConfig.model_validate(bench | {"drafter": pair.drafter})
    if each_k and "vllm_draftlab" in cfg.methods:  # every k below the one it is served with
        k = served_draft_length(pair.drafter)
        cfg = cfg.model_copy(
            update={"vllm": cfg.vllm.model_copy(update={"draft_lengths": list(range(1, k))})}
        )
    report = run_bench(cfg, progress=False)
    return report, run_profile(ProfileConfig.model_validate(profile))


def compare_engine(c) -> tuple[str, list[str], str | None]:
    """(the engine the compare stage measures in, its vLLM contenders, a note on what was left
    out) for `compare.engine`."""
    if c.engine == "draftlab":
        return "draftlab", [], None
    try:
        require_vllm()
    except ImportError as e:
        if c.engine == "vllm":
            raise ConfigError(f"compare.engine: vllm: {e}") from None
        return (
            "draftlab",
            [],
            f"vLLM is not installed: measured and deployed in draftlab's engine ({INSTALL_HINT})",
        )
    methods, note = list(c.vllm_methods), None
    if "vllm_suffix" in methods:
        try:
            require_arctic()
        except ImportError as e:
            methods.remove("vllm_suffix")
            note = f"vllm_suffix left out: {e}"
    return "vllm", methods, note


def compare(run: PipelineRun) -> dict:
    cfg, c, champ = run.p.distill, run.p.cfg.compare, run.outputs["promote"]
    engine, contenders, note = compare_engine(c)
    if note and run.progress:
        print(f"compare: {note}", flush=True)
    methods = ["ar", *contenders] if engine == "vllm" else c.methods
    vllm = run.p.compare_vllm(champ["model_uri"], run.tracking_uri) if engine == "vllm" else c.vllm
    bench = BenchConfig(
        target=cfg.target,
        drafter=None,
        prompts=run.p.cfg.prompts,
        limit=c.limit,
        max_new_tokens=c.max_new_tokens,
        methods=methods,
        vllm=vllm,
        concurrency=c.concurrency if engine == "vllm" else [],
        load_requests=c.load_requests,
    ).model_dump(mode="json")
    profile = ProfileConfig(
        target=cfg.target,
        new_tokens=[1, 2, 4, 8, 16],
        depths=[champ["depth"]],
        ks=[champ["k"]],
        repeats=c.profile_repeats,
    ).model_dump(mode="json")
    sc = cfg.scaling
    task = ray.remote(_compare_task).options(
        num_cpus=sc.cpus_per_worker, num_gpus=1 if sc.use_gpu else 0
    )
    report, prof = ray.get(
        task.remote(bench, profile, champ["model_uri"], run.tracking_uri, c.each_k)
    )
    for name, obj in (("bench.json", report), ("profile.json", prof)):
        (run.dir / name).write_text(json.dumps(obj, indent=2) + "\n")
        run.parent.log_dict(obj, name)
    m = report["methods"]
    common = {
        "engine": engine,
        "note": note,
        "device": report["device"],
        "prompts": report["prompts"],
        "prompt_set": run.p.cfg.prompts,
        "greedy_identical": report["greedy_identical"],
    }
    if engine == "vllm":
        v = report["verdict"]
        v["deploy"]["target.dtype"] = report["vllm"][
            "dtype"
        ]  # served as measured (float32 on CPUs without bf16)
        return common | {
            "method": v["served"],
            "tau": m[v["served"]]["tau"],
            "tokens_per_s": m[v["served"]]["tokens_per_s"],
            "speedup_vs_vllm_ar": v["speedup_vs_vllm_ar"],
            "speedup_vs_ar": m[v["served"]]["speedup_vs_ar"],
            "verdict": v,
            "greedy_identical": report["vllm_greedy_identical"],
            "greedy_mismatches": report["vllm_greedy_mismatches"],
        }
    spec = (
        "draftlab_tree"
        if "draftlab_tree" in m
        else next((k for k in m if k.startswith("draftlab_")), None)
    )
    if spec is None:
        raise ConfigError(
            "compare.methods must include draftlab_tree or draftlab_chain (the champion)"
        )
    ratio = {
        f"speedup_vs_{b}": m[spec]["tokens_per_s"] / m[b]["tokens_per_s"]
        for b in ("ar", "hf_generate", "hf_prompt_lookup")
        if b in m and m[b]["tokens_per_s"]
    }
    return common | {
        "method": spec,
        "tau": m[spec]["tau"],
        "tokens_per_s": m[spec]["tokens_per_s"],
        **ratio,
    }


def serve_spec(run: PipelineRun) -> dict:
    """The Serve spec the serve stage deploys: the champion in our engine, or the compare
    stage's vLLM verdict (which may be a built-in method, or target-only)."""
    cmp = run.outputs.get("compare") or {}
    deploy = cmp["verdict"]["deploy"] if cmp.get("engine") == "vllm" else None
    return run.p.serve_spec(run.outputs["promote"]["model_uri"], run.tracking_uri, deploy)


def serve(run: PipelineRun) -> dict:
    return deploy(serve_spec(run), blocking=False, progress=run.progress) | {
        "version": run.outputs["promote"]["version"]
    }


def serving(run: PipelineRun, outputs: dict) -> bool:
    """The application is up (a fresh cluster has lost it: deploy again)."""
    from ray import serve  # noqa: PLC0415 -- at the top, the serve stage above would shadow it

    try:
        app = serve.status().applications.get(outputs["app"])
    except Exception:  # noqa: BLE001 - no Serve on this cluster
        return False
    return app is not None and str(app.status).endswith("RUNNING")


def smoke(run: PipelineRun) -> dict:
    ep, s = run.outputs["serve"], run.p.cfg.smoke
    body = {
        "model": ep["model"],
        "messages": [{"role": "user", "content": s.prompt}],
        "max_tokens": s.max_tokens,
        "temperature": 0,
    }
    keys = serve_spec(run)["args"].accepted_keys()
    headers = {"Authorization": f"Bearer {keys[0]}"} if keys else {}
    t0 = time.perf_counter()
    try:
        r = httpx.post(
            f"{ep['url']}/chat/completions", json=body, headers=headers, timeout=s.timeout_s
        )
    except httpx.HTTPError as e:
        raise StageFailed(f"smoke request to {ep['url']} failed: {e}") from None
    if r.status_code != 200:
        raise StageFailed(f"smoke request to {ep['url']}: HTTP {r.status_code}: {r.text[:300]}")
    out = r.json()
    text = out["choices"][0]["message"]["content"]
    if not out["usage"]["completion_tokens"]:
        raise StageFailed(f"smoke request to {ep['url']} returned no tokens")
    return {"latency_s": round(time.perf_counter() - t0, 3), "text": text, "usage": out["usage"]}


def report(run: PipelineRun) -> dict:
    run.write_summary()
    return write_report(str(run.dir), tracking_uri=run.tracking_uri, log=True)
