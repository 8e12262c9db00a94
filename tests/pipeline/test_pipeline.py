"""`draftlab pipeline` for real on the tiny target: Ray Data generation, Ray Train, Ray Tune,
the MLflow registry on a real tracking server, Ray Serve and an HTTP request with the
official `openai` client; a second run skips every finished stage, and a run after an
interruption continues at the first unfinished one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from draftlab.cli import main
from draftlab.config import TargetSpec
from draftlab.pipeline.runner import float32_note, format_summary, run_pipeline
from mlflow_server import free_port
from ray_support import local_ray, stop_serve

# the first run, in the fixture, takes ~200 s alone on 2 cores
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]
STAGES = ["data", "distill", "sweep", "promote", "compare", "serve", "smoke", "report"]


@pytest.fixture(scope="module")
def ray_local():
    with local_ray(num_cpus=3, object_store_mb=200):
        yield
        stop_serve()


def pipeline_file(tmp: Path, uri: str, port: int) -> Path:
    """The --quick pipeline with every output under `tmp` and the test's MLflow and port."""
    doc = yaml.safe_load((ROOT / "jobs/configs/pipeline-tiny-quick.yaml").read_text())
    doc |= {
        "distill": str(ROOT / "jobs/configs/pipeline-tiny-distill.yaml"),
        "state_dir": str(tmp / "state"),
        "overrides": {
            "storage_path": str(tmp / "ray"),
            "data": {"cache_dir": str(tmp / "data")},
            "tracking": {"tracking_uri": uri},
        },
    }
    doc["serve"] |= {
        "config": str(ROOT / doc["serve"]["config"].removeprefix("../../")),
        "port": port,
    }
    path = tmp / "pipeline.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture(scope="module")
def first(ray_local, mlflow_uri, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline")
    path = pipeline_file(tmp, mlflow_uri, free_port())
    return path, run_pipeline(path, progress=False)


def test_every_stage_runs_for_real(first, mlflow_uri):
    path, s = first
    assert [k for k in s["stages"] if k != "total"] == STAGES
    assert all(s["stages"][k]["status"] == "ran" for k in STAGES)
    client = MlflowClient(tracking_uri=mlflow_uri)
    champ = s["champion"]
    mv = client.get_model_version_by_alias(champ["model"], "champion")
    assert (str(mv.version), mv.run_id) == (champ["version"], champ["run_id"])
    # the sweep's best replaces the baseline only past sweep.tie (5%) faster
    base, best = s["baseline"]["speedup_vs_ar"], s["sweep"]["best"]["speedup_vs_ar"]
    assert champ["source"] == ("sweep" if best > base * 1.05 else "baseline")
    # the distillation and the sweep are nested under the pipeline's parent run
    parent = s["mlflow_run_id"]
    nested = {
        r.data.tags.get("draftlab.kind")
        for r in client.search_runs(
            [client.get_experiment_by_name("draftlab-pipelines").experiment_id],
            f"tags.`mlflow.parentRunId` = '{parent}'",
        )
    }
    assert {"distill", "sweep"} <= nested
    arts = {a.path for a in client.list_artifacts(parent)}
    assert {"bench.json", "profile.json", "summary.json", "sweep", "report"} <= arts
    assert client.get_run(parent).info.status == "FINISHED"
    cmp = s["compare"]
    assert cmp["greedy_identical"] is True  # the champion's greedy output equals the target's
    assert {"speedup_vs_ar", "speedup_vs_hf_generate", "speedup_vs_hf_prompt_lookup"} <= set(cmp)
    report = Path(s["report"]["html"]).read_text()
    assert "prompt lookup" in report.lower() and "data:image/png;base64," in report
    text = format_summary(s)
    assert s["endpoint"]["url"] in text and "curl" in text and "mlflow" in text.lower()


def test_the_endpoint_answers_the_openai_client(first):
    from openai import OpenAI

    _, s = first
    ep = s["endpoint"]
    client = OpenAI(base_url=ep["url"], api_key="none")
    out = client.chat.completions.create(
        model=ep["model"], messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0
    )
    assert out.usage.completion_tokens >= 1
    assert s["smoke"]["usage"]["completion_tokens"] >= 1


def test_a_second_run_skips_every_finished_stage(first):
    path, s = first
    again = run_pipeline(path, progress=False)
    assert {k: v["status"] for k, v in again["stages"].items() if k != "total"} == {
        **{k: "skipped (done before)" for k in STAGES},
        "smoke": "ran",
    }  # smoke always checks the live endpoint
    assert again["champion"] == s["champion"] and again["mlflow_run_id"] == s["mlflow_run_id"]


def test_after_an_interruption_it_continues_at_the_first_unfinished_stage(first):
    path, _ = first
    state = Path(yaml.safe_load(path.read_text())["state_dir"]) / "tiny-quick"
    (state / "stages" / "compare.json").unlink()  # as if killed during the compare stage
    (state / "bench.json").unlink()
    again = run_pipeline(path, progress=False)
    ran = [k for k, v in again["stages"].items() if v["status"] == "ran" and k != "total"]
    # compare produced new measurements, so the report (which shows them) is rebuilt too;
    # the endpoint was taken down while compare ran (it may need the replica's CPUs)
    assert ran == ["compare", "serve", "smoke", "report"]
    assert json.loads((state / "bench.json").read_text())["greedy_identical"] is True


def test_cli_needs_one_config(capsys):
    assert main(["pipeline"]) == 2
    assert "give exactly one of -c PIPELINE.yaml or --quick" in capsys.readouterr().err


def test_report_cli_rebuilds_the_report_from_the_pipeline_dir(first, mlflow_uri, tmp_path, capsys):
    path, s = first
    state = Path(yaml.safe_load(path.read_text())["state_dir"]) / "tiny-quick"
    assert main(["report", str(state), "-o", str(tmp_path), "--tracking-uri", mlflow_uri]) == 0
    assert f"logged to MLflow run {s['mlflow_run_id']}" in capsys.readouterr().out
    html = (tmp_path / "report.html").read_text()
    assert s["champion"]["model"] in html and "hf_prompt_lookup" in html
    assert "| category |" in (tmp_path / "report.md").read_text().lower()
    assert main(["report", str(tmp_path / "nothing-here")]) == 2


@pytest.mark.parametrize(
    "fast_bf16,dtype,noted",
    [(False, "auto", True), (True, "auto", False), (False, "float32", False)],
)
def test_a_target_that_runs_in_float32_on_this_cpu_is_announced(
    monkeypatch, fast_bf16, dtype, noted
):
    # the CPU's bf16 support is the one input a test machine cannot choose: patched
    monkeypatch.setattr("draftlab.models.target.cpu_has_fast_bf16", lambda: fast_bf16)
    note = float32_note(TargetSpec(name="smollm2-135m", device="cpu", dtype=dtype))
    assert (note is not None) == noted
    if noted:
        assert "smollm2-135m runs in float32" in note
