"""`draftlab.report.write_report`: HTML + Markdown from a sweep dir, a pipeline dir or an
MLflow run, with a real bench and profile report of the tiny target."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from draftlab.config import BenchConfig, ProfileConfig
from draftlab.report import RUN_ARTIFACTS, SWEEP_PLOTS, write_report
from draftlab.sweep.report import write_csv, write_plots
from draftlab.sweep.runner import ROW_KEYS

IMG = "data:image/png;base64,"


@pytest.fixture(scope="module")
def bench(tiny):
    from draftlab.bench import bench_loaded
    from draftlab.models.drafters.build import init_drafter

    cfg = BenchConfig(
        target={"name": "tiny-llama"},
        limit=2,
        max_new_tokens=8,
        methods=["ar", "hf_generate", "hf_prompt_lookup", "draftlab_tree"],
    )
    return bench_loaded(tiny, init_drafter("parallel", tiny, k=4, depth=1), cfg, progress=False)


@pytest.fixture(scope="module")
def profile():
    from draftlab.profiling import run_profile

    return run_profile(
        ProfileConfig(
            target={"name": "tiny-llama"},
            context=16,
            new_tokens=[1, 2, 4, 8],
            depths=[1, 2],
            ks=[1, 2, 4],
            repeats=1,
        )
    )


def _row(trial: str, k: int, depth: int, tree: str, nodes: int, speedup: float, **extra) -> dict:
    row = (
        {key: None for key in ROW_KEYS}
        | {
            "family": "parallel",
            "k": k,
            "depth": depth,
            "tree": tree,
            "tree_nodes": nodes,
            "tau": 1 + speedup / 2,
            "speedup_vs_ar": speedup,
            "tokens_per_s": 100 * speedup,
            "ar_tokens_per_s": 100.0,
            "draft_ms": 1.5,
            "verify_ms": 4.0,
            "drafter_parameters": 1_000_000 * (k + depth),
            "train_steps": 50,
            "eval/sim_accept_len": 1.8,
            "tau_by_category": {"writing": 1.4, "roleplay": 1.7, "math": 1.2},
            "trained_here": True,
            "training_key": f"k{k}-d{depth}",
            "mlflow_run_id": "0" * 32,
            "greedy_identical": True,
        }
        | extra
    )
    return {"trial": trial, **row}


def _sweep_summary(parent_run_id: str | None = None) -> dict:
    rows = [
        _row("t-slow", 2, 1, "chain-2", 3, 1.05),
        _row("t-best", 4, 2, "default", 9, 1.42),
        _row("t-mid", 4, 1, "searched-6", 7, 1.21),
    ]
    return {
        "sweep": "tiny-sweep",
        "trials": 4,
        "trials_done": 3,
        "trials_stopped": 1,
        "rows": rows,
        "not_finished": [
            {"trial": "t-asha", "status": "stopped (ASHA)", "config": {}, "error": None, "step": 8}
        ],
        "best": rows[1],
        "wall_s": 12.5,
        "mlflow_parent_run_id": parent_run_id,
    }


def _sweep_results(results: Path, parent_run_id: str | None = None, plots: bool = True) -> dict:
    summary = _sweep_summary(parent_run_id)
    results.mkdir(parents=True)
    (results / "summary.json").write_text(json.dumps(summary))
    if plots:
        write_plots(summary["rows"], results)
        write_csv(summary["rows"], results / "results.csv")
    return summary


def _pipeline(
    root: Path, bench: dict, profile: dict, run_id: str | None = None, name: str = "tiny-pipe"
) -> Path:
    _sweep_results(root / "sweep")
    (root / "summary.json").write_text(
        json.dumps(
            {
                "name": name,
                "mlflow_run_id": run_id,
                "endpoint": {"url": "http://127.0.0.1:8000/v1", "model": "tiny-pipe"},
                "champion": {
                    "k": 4,
                    "depth": 2,
                    "tree": "default",
                    "tau": 1.71,
                    "speedup_vs_ar": 1.42,
                    "model": "draftlab-tiny-llama-drafter",
                    "version": "3",
                    "run_id": "0" * 32,
                },
                "stages": {
                    "sweep": {"status": "done", "wall_s": 12.5},
                    "bench": {"status": "done", "wall_s": 3.0},
                },
            }
        )
    )
    (root / "bench.json").write_text(json.dumps(bench))
    (root / "profile.json").write_text(json.dumps(profile))
    return root


def _section(html: str, title: str) -> str:
    """The HTML from heading `title` to the next h2."""
    start = html.index(f"<h2>{title}</h2>")
    end = html.find("<h2>", start + 4)
    return html[start : end if end > 0 else None]


def test_pipeline_report_has_every_section(tmp_path, bench, profile):
    src = _pipeline(tmp_path / "pipe", bench, profile)
    out = write_report(str(src), log=False)
    assert out == {
        "html": str(src / "report" / "report.html"),
        "markdown": str(src / "report" / "report.md"),
        "logged_to": None,
    }
    page = Path(out["html"]).read_text()
    for title in (
        "Champion",
        "Pipeline stages",
        "Endpoint",
        "Sweep trials",
        "Per-category tau and speedup",
        "Comparison with HF generate and HF prompt lookup",
        "Per-position acceptance",
        "Cost profile",
    ):
        assert f"<h2>{title}</h2>" in page, title
    assert "is missing" not in page
    # self-contained: 4 sweep plots + the cost profile inline, nothing fetched
    assert page.count(IMG) == 5
    assert not re.search(r"""(src|href)=["'](?!data:)""", page) and "<script" not in page
    # trials best speedup first
    trials = _section(page, "Sweep trials")
    assert trials.index("t-best") < trials.index("t-mid") < trials.index("t-slow")
    assert "t-asha" in trials
    comparison = _section(page, "Comparison with HF generate and HF prompt lookup")
    for method in ("hf_generate", "hf_prompt_lookup", "draftlab_tree"):
        assert f"<td>{method}</td>" in comparison
    assert "<td>reference</td>" in comparison and "<td>not checked</td>" in comparison
    assert bench["device"] in page and "1.42" in _section(page, "Champion")
    assert "t_target ms" in _section(page, "Cost profile") and "k=4" in _section(
        page, "Cost profile"
    )

    md = Path(out["markdown"]).read_text()
    header = next(line for line in md.splitlines() if line.startswith("| category |"))
    assert (
        "| ar tokens/s | hf_generate tau | hf_generate speedup |" in header
        and "sweep best tau" in header
    )
    methods = bench["methods"]
    for cat, ar in methods["ar"]["by_category"].items():
        row = next(line for line in md.splitlines() if line.startswith(f"| {cat} |"))
        tree = methods["draftlab_tree"]["by_category"][cat]
        assert f"{tree['tokens_per_s'] / ar['tokens_per_s']:.2f}x" in row
    assert "| math |" in md  # only in the sweep's tau_by_category
    for name in (*SWEEP_PLOTS, "cost_profile.png"):
        assert f"](plots/{name})" in md and (src / "report" / "plots" / name).is_file()


def test_sweep_dir_without_plots_redraws_them_and_names_missing_inputs(tmp_path):
    exp = tmp_path / "sweeps" / "tiny-sweep"
    _sweep_results(exp / "results", plots=False)
    out = write_report(str(exp), str(tmp_path / "out"), log=False)
    page = Path(out["html"]).read_text()
    assert page.count(IMG) == 4
    assert all((tmp_path / "out" / "plots" / name).stat().st_size > 1000 for name in SWEEP_PLOTS)
    assert "The bench report (bench.json) is missing" in page
    assert "The cost profile (profile.json) is missing" in page
    assert "<h2>Comparison with HF generate and HF prompt lookup</h2>" not in page
    assert "<h2>Cost profile</h2>" not in page
    categories = _section(page, "Per-category tau and speedup")  # from the best trial alone
    assert "only the sweep&#x27;s best trial tau" in categories and "sweep best tau" in categories


def test_bench_only_dir_like_a_distillation_run(tmp_path, bench):
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    out = write_report(str(tmp_path), log=False)
    page = Path(out["html"]).read_text()
    assert "The sweep summary (results/summary.json) is missing" in page
    assert "No champion" in page and "<h2>Per-position acceptance</h2>" in page
    md = Path(out["markdown"]).read_text()
    assert "| category | ar tokens/s |" in md and "sweep best tau" not in md


def test_html_escapes_every_text(tmp_path, bench, profile):
    src = _pipeline(tmp_path / "pipe", bench, profile, name="<script>alert('x')</script>")
    page = Path(write_report(str(src), log=False)["html"]).read_text()
    assert "<script" not in page and "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in page


def test_bad_sources_are_clear_errors(tmp_path):
    with pytest.raises(
        ValueError, match="'no/such/dir' is neither a directory nor an MLflow run id"
    ):
        write_report("no/such/dir", log=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        ValueError, match=f"{re.escape(str(tmp_path / 'empty'))}' holds no report input"
    ):
        write_report(str(tmp_path / "empty"), log=False)
    uri = f"sqlite:///{tmp_path / 'none.db'}"
    with pytest.raises(ValueError, match=f"'{'a' * 32}': no such MLflow run"):
        write_report("a" * 32, tracking_uri=uri)
    assert not (tmp_path / "none.db").exists()  # looking did not create a store
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "bench.json").write_text("{not json")
    with pytest.raises(ValueError, match="bench.json: not valid JSON"):
        write_report(str(tmp_path / "bad"), log=False)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


def _new_run(uri: str, name: str) -> str:
    from draftlab.tracking import Tracker

    return Tracker(uri, "draftlab-report-test").start_or_resume(name, resume=False)


def _report_artifacts(uri: str, run_id: str) -> set[str]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    return {
        a.path for path in ("report", "report/plots") for a in client.list_artifacts(run_id, path)
    }


def test_logs_to_the_sweep_parent_run(tmp_path, store):
    parent = _new_run(store, "sweep-tiny")
    exp = tmp_path / "sweeps" / "tiny-sweep"
    _sweep_results(exp / "results", parent_run_id=parent)
    out = write_report(str(exp), tracking_uri=store)
    assert out["logged_to"] == parent
    logged = _report_artifacts(store, parent)
    assert {"report/report.html", "report/report.md", "report/plots/pareto.png"} <= logged


def test_unknown_run_of_a_directory_logs_nothing(tmp_path, bench, profile, store):
    src = _pipeline(tmp_path / "pipe", bench, profile, run_id="f" * 32)
    out = write_report(str(src), tracking_uri=store)
    assert out["logged_to"] is None and Path(out["html"]).is_file()


def test_run_id_source_downloads_the_pipeline_run(tmp_path, bench, profile, store, monkeypatch):
    from draftlab.tracking import Tracker

    run_id = _new_run(store, "pipeline-tiny")
    src = _pipeline(tmp_path / "pipe", bench, profile, run_id=run_id)
    (src / "drafter").mkdir()
    (src / "drafter" / "weights.bin").write_bytes(
        b"\0" * 64
    )  # not needed by a report: not downloaded
    Tracker(store, run_id=run_id).log_artifacts(src)
    shutil.rmtree(src)
    got = Tracker(store, run_id=run_id).download_artifacts(tmp_path / "dl", RUN_ARTIFACTS)
    assert got == ["bench.json", "profile.json", "summary.json", "sweep"]
    monkeypatch.chdir(tmp_path)
    out = write_report(run_id, tracking_uri=store)
    report_dir = tmp_path / ".draftlab" / "reports" / run_id
    assert Path(out["html"]).resolve() == (report_dir / "report.html").resolve()
    page = (report_dir / "report.html").read_text()
    assert (
        page.count(IMG) == 5
        and "is missing" not in page
        and "draftlab report: pipeline tiny-pipe" in page
    )
    assert out["logged_to"] == run_id and "report/report.html" in _report_artifacts(store, run_id)


def test_unreachable_tracking_server_fails_fast(tmp_path):
    from draftlab.tracking import TrackingUnavailable

    exp = tmp_path / "sweeps" / "s"
    _sweep_results(exp / "results", parent_run_id="b" * 32)
    with pytest.raises(TrackingUnavailable, match="does not answer"):
        write_report(str(exp), tracking_uri="http://127.0.0.1:9")
    assert (exp / "report" / "report.html").is_file()  # written before logging was tried


def test_training_curve_of_a_drafter_dir(tmp_path, tiny):
    """`training.json` (written by every distillation, costs measured by the real profiler)
    becomes the report's training-curve table and plot."""
    from draftlab.config import DistillConfig
    from draftlab.distill.finalize import training_curve
    from draftlab.models.drafters.build import init_drafter

    cfg = DistillConfig.model_validate(
        {
            "name": "t",
            "target": {"name": "tiny-llama"},
            "drafter": {"k": 3},
            "bench": {"search_context": 16},
        }
    )
    evals = [
        {
            "step": 50 * i,
            "minutes": 1.5 * i,
            "tokens": 4000 * i,
            "sim_accept_len": 1.0 + 0.2 * i,
            "accuracy": [0.1 * i, 0.05 * i, 0.02 * i],
        }
        for i in (1, 2, 3)
    ]
    curve = training_curve(cfg, init_drafter("p-eagle", tiny, k=3, depth=1, seed=0), tiny, evals)
    rows = curve["evaluations"]
    assert curve["decode_ms"] > 0 and curve["verify_chain_ms"] > 0 and curve["draft_ms"] > 0
    for r in rows:
        assert r["predicted_speedup"] == pytest.approx(
            r["sim_accept_len"]
            * curve["decode_ms"]
            / (curve["verify_chain_ms"] + curve["draft_ms"])
        )
    assert rows[0]["predicted_speedup"] < rows[-1]["predicted_speedup"]
    (tmp_path / "training.json").write_text(json.dumps(curve))
    out = write_report(str(tmp_path), log=False)
    page = Path(out["html"]).read_text()
    assert (
        "Training curve: what more training buys" in page
        and "draftlab report: training curve" in page
    )
    assert (Path(out["html"]).parent / "plots" / "training_curve.png").is_file()
    md = Path(out["markdown"]).read_text()
    assert "| 150 | 4.5" in md and "| 12,000 | 1.600 |" in md
