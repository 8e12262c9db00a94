"""draftlab.tracking against a real `mlflow server` (one per module) and the sqlite default."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from mlflow import MlflowClient

from draftlab.config import DataConfig
from draftlab.tracking import (
    MAX_PARAM_VAL_LENGTH,
    ParamConflictError,
    Tracker,
    TrackingUnavailable,
    flatten,
    format_runs_table,
    list_runs,
    looks_secret,
    prepare_params,
    promote,
    resolve_tracking_uri,
)
from mlflow_server import MlflowServer

EXP = "draftlab-test"


@pytest.fixture(scope="module")
def mlflow_server():
    with MlflowServer() as server:  # one start per module (~7 s); stopped and removed after
        yield server


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _steps(client: MlflowClient, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


# ----------------------------------------------------------------------------- no server


def test_import_is_cheap_and_limits_match_mlflow():
    code = "import sys, draftlab.tracking; assert 'mlflow' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    from mlflow.utils import validation

    from draftlab import tracking

    assert tracking.MAX_PARAM_VAL_LENGTH == validation.MAX_PARAM_VAL_LENGTH
    assert tracking.MAX_METRICS_PER_BATCH == validation.MAX_METRICS_PER_BATCH
    assert tracking.MAX_PARAMS_TAGS_PER_BATCH == validation.MAX_PARAMS_TAGS_PER_BATCH


def test_flatten_redact_truncate():
    assert flatten({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": None, "f": {}, "g": []}) == {
        "a.b": "1",
        "a.c.d": "[1, 2]",
        "e": "None",
        "f": "{}",
        "g": "[]",
    }
    mix = DataConfig(source=[{"weight": 2}, {"documents": "self"}], num_prompts=8)
    flat = flatten({"data": mix})
    assert flat["data.source.0.weight"] == "2.0" and flat["data.source.1.documents"] == "self"
    assert flat["data.num_prompts"] == "8" and "data.source" not in flat
    for secret in [
        "key",
        "api_key",
        "wandb.api_key",
        "HF_TOKEN",
        "hf-token",
        "clientSecret",
        "db.password",
        "aws_secret_access_key",
        "Credential",
        "gcp.credentials",
        "token.value",
    ]:
        assert looks_secret(secret), secret
    for fine in [
        "max_new_tokens",
        "tokenizer",
        "monkey",
        "keys",
        "drop_tokens",
        "pad_token",
        "num_heads",
        "secretary_bird",
    ]:
        assert not looks_secret(fine), fine
    out = prepare_params({"hf": {"token": "hf_abc"}, "long": "x" * 10_000, "k": 4})
    assert out["hf.token"] == "***"
    assert len(out["long"]) == MAX_PARAM_VAL_LENGTH and out["long"].endswith("...")
    assert out["k"] == "4"


def test_resolve_tracking_uri_precedence(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://env:5000")
    assert resolve_tracking_uri("http://arg:1") == "http://arg:1"
    assert resolve_tracking_uri() == "http://env:5000"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert resolve_tracking_uri() == f"sqlite:///{tmp_path.resolve()}/.draftlab/mlflow.db"
    assert (tmp_path / ".draftlab").is_dir()


def test_disabled_tracker_is_a_no_op(tmp_path):
    # Port 9 (discard) on loopback: nothing listens, so any contact would fail loudly.
    t = Tracker("http://127.0.0.1:9", EXP, enabled=False, max_buffer_seconds=0)
    assert t.start_or_resume("x", {"a": 1}) == ""
    t.log_params({"a": 1, "token": "s"})
    t.buffer_metrics({"loss": 1.0}, step=0)
    t.flush()
    t.log_metrics_now({"loss": 1.0}, step=1)
    t.log_artifacts(tmp_path, "d")
    t.log_text("x", "x.txt")
    t.log_dict({"a": 1}, "a.json")
    t.set_tags({"a": 1})
    assert t.register_model("drafter", "m", {}) == ""
    assert t.run_url() is None
    t.end("FAILED")
    assert t._client is None and t.pending == 0


def test_flush_never_hangs_on_a_stalled_server():
    """/health answers but log-batch hangs: flush gives up after its budget, not MLflow's
    120 s request timeout times its retries."""
    release = threading.Event()

    class Stalled(BaseHTTPRequestHandler):
        def do_GET(self):  # /health
            self.send_response(200)
            self.end_headers()

        def do_POST(self):  # /api/2.0/mlflow/runs/log-batch
            release.wait(30)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Stalled)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        t = Tracker(url, EXP, run_id="0" * 32, max_buffer_seconds=2)
        t.buffer_metrics({"loss": 1.0}, step=0)

        t0 = time.monotonic()
        with pytest.raises(TrackingUnavailable):
            t.flush()
        assert time.monotonic() - t0 < 6
        assert t.pending == 1
    finally:
        release.set()
        server.shutdown()
        server.server_close()


def test_default_backend_is_sqlite_under_draftlab(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert list_runs() == []  # no database yet, and none is created just to list it
    assert not (tmp_path / ".draftlab" / "mlflow.db").exists()

    t = Tracker(experiment=EXP)
    assert t.tracking_uri == f"sqlite:///{tmp_path.resolve()}/.draftlab/mlflow.db"
    run_id = t.start_or_resume("local", {})
    t.log_metrics_now({"loss": 0.5}, step=3)
    t.log_text("hello", "notes/hello.txt")
    t.end()

    assert (tmp_path / ".draftlab" / "mlflow.db").is_file()
    hits = list((tmp_path / ".draftlab" / "mlartifacts").rglob("hello.txt"))
    assert len(hits) == 1 and hits[0].read_text() == "hello"
    assert t.run_url() is None  # not an http URI
    rows = list_runs()
    assert [r["run_id"] for r in rows] == [run_id]
    assert rows[0]["metrics"] == {"loss": 0.5} and rows[0]["status"] == "FINISHED"


# ----------------------------------------------------------------------------- real server


@pytest.mark.slow
def test_params_flattened_and_redacted(mlflow_server):
    t = Tracker(mlflow_server.url, EXP)
    run_id = t.start_or_resume(_name("params"), {"draftlab.job": "distill"})
    t.log_params(
        {
            "model": {"target": "smollm2-135m", "k": 4},
            "hub": {"token": "hf_secret", "api_key": "sk-1"},
            "tree": [[0], [1]],
        }
    )
    run = MlflowClient(mlflow_server.url).get_run(run_id)
    assert run.data.params == {
        "model.target": "smollm2-135m",
        "model.k": "4",
        "hub.token": "***",
        "hub.api_key": "***",
        "tree": "[[0], [1]]",
    }
    assert run.data.tags["draftlab.job"] == "distill"
    t.end()


@pytest.mark.slow
def test_metrics_appear_only_after_flush(mlflow_server):
    client = MlflowClient(mlflow_server.url)
    t = Tracker(mlflow_server.url, EXP)
    run_id = t.start_or_resume(_name("flush"), {})
    for step in range(5):
        t.buffer_metrics({"loss": 1.0 / (step + 1), "lr": 1e-3}, step)
    assert client.get_metric_history(run_id, "loss") == []
    t.flush()
    assert t.pending == 0
    assert _steps(client, run_id, "loss") == [0, 1, 2, 3, 4]
    assert [
        m.value for m in sorted(client.get_metric_history(run_id, "loss"), key=lambda m: m.step)
    ] == [1.0, 0.5, 1 / 3, 0.25, 0.2]
    t.flush()  # empty buffer: nothing re-sent
    assert _steps(client, run_id, "lr") == [0, 1, 2, 3, 4]

    # More than one log_batch worth (chunks of <= 1000).
    for step in range(5, 605):
        t.buffer_metrics({"a": step, "b": -step}, step)
    t.flush()
    assert _steps(client, run_id, "a") == list(range(5, 605))
    assert _steps(client, run_id, "b") == list(range(5, 605))
    t.end()


@pytest.mark.slow
def test_resume_by_run_name_continues_the_same_run(mlflow_server):
    client = MlflowClient(mlflow_server.url)
    name = _name("resume")
    first = Tracker(mlflow_server.url, EXP)
    run_id = first.start_or_resume(name, {})
    first.log_params({"k": 4, "lr": 1e-3})
    for step in range(3):
        first.buffer_metrics({"loss": 3.0 - step}, step)
    first.flush()  # checkpoint at step 2
    first.buffer_metrics({"loss": 0.0}, 3)  # never checkpointed ...
    first.end("FAILED")  # ... the job dies; step 3 is dropped and will be redone

    again = Tracker(mlflow_server.url, EXP)
    assert again.start_or_resume(name, {"attempt": 2}) == run_id
    assert client.get_run(run_id).info.status == "RUNNING"
    again.log_params({"k": 4, "lr": 1e-3})  # identical: fine on resume
    with pytest.raises(ParamConflictError, match="k: logged '4', now '8'"):
        again.log_params({"k": 8})
    for step in range(3, 6):
        again.buffer_metrics({"loss": 3.0 - step}, step)
    again.flush()
    assert _steps(client, run_id, "loss") == [0, 1, 2, 3, 4, 5]
    again.end()

    # A FINISHED run is not resumed: the same name starts a fresh run.
    fresh = Tracker(mlflow_server.url, EXP)
    assert fresh.start_or_resume(name, {}) != run_id
    fresh.end("KILLED")


@pytest.mark.slow
def test_artifacts_go_through_the_server(mlflow_server, tmp_path):
    client = MlflowClient(mlflow_server.url)
    t = Tracker(mlflow_server.url, EXP)
    run_id = t.start_or_resume(_name("artifacts"), {})
    src = tmp_path / "ckpt"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text('{"k": 4}')
    (src / "sub" / "weights.bin").write_bytes(b"\x00\x01\x02")
    t.log_artifacts(src, "drafter")
    t.log_text("tau 3.1", "reports/summary.txt")
    t.log_dict({"tree": [[0], [1]], "k": 4}, "reports/tree.yaml")  # JSON despite the name

    assert {a.path for a in client.list_artifacts(run_id, "drafter")} == {
        "drafter/config.json",
        "drafter/sub",
    }
    dst = Path(client.download_artifacts(run_id, "", tmp_path / "dl"))
    assert (dst / "drafter" / "sub" / "weights.bin").read_bytes() == b"\x00\x01\x02"
    assert (dst / "reports" / "summary.txt").read_text() == "tau 3.1"
    assert json.loads((dst / "reports" / "tree.yaml").read_text()) == {"tree": [[0], [1]], "k": 4}
    # Proxied artifacts: the bytes live in the server's --artifacts-destination.
    assert list(mlflow_server.artifacts.rglob("weights.bin"))
    t.end()


@pytest.mark.slow
def test_register_model_versions(mlflow_server, tmp_path):
    client = MlflowClient(mlflow_server.url)
    name = _name("draftlab-drafter")
    (tmp_path / "model.txt").write_text("weights")
    versions = []
    for i in range(2):
        t = Tracker(mlflow_server.url, EXP)
        run_id = t.start_or_resume(_name("register"), {})
        t.log_artifacts(tmp_path, "drafter")
        versions.append(t.register_model("drafter", name, {"tau": 3.0 + i, "k": 4}))
        t.end()
        mv = client.get_model_version(name, versions[-1])
        assert mv.tags == {"tau": str(3.0 + i), "k": "4"}
        assert mv.source == f"runs:/{run_id}/drafter" and mv.run_id == run_id
    assert versions == ["1", "2"]


def _distill_like_run(
    url: str, tmp_path: Path, target: str, tau: float, with_drafter: bool = True
) -> str:
    t = Tracker(url, EXP)
    run_id = t.start_or_resume(_name("promo"), {"draftlab.target": target})
    t.log_params({"drafter": {"k": 4, "depth": 1, "family": "parallel"}})
    t.log_metrics_now({"tau": tau, "speedup_vs_ar": tau - 0.2}, 0)
    if with_drafter:
        (tmp_path / "model.safetensors").write_text("weights")
        t.log_artifacts(tmp_path, "drafter")
    t.end()
    return run_id


@pytest.mark.slow
def test_promote_moves_the_champion_and_keeps_the_previous_version(mlflow_server, tmp_path, capsys):
    from draftlab.cli import main

    client = MlflowClient(mlflow_server.url)
    target = _name("tgt")
    first = _distill_like_run(mlflow_server.url, tmp_path, target, 1.5)
    second = _distill_like_run(mlflow_server.url, tmp_path, target, 1.7)
    out = promote(first, tracking_uri=mlflow_server.url)
    assert out == {
        "model": f"draftlab-{target}-drafter",
        "version": "1",
        "alias": "champion",
        "previous": None,
        "run_id": first,
    }
    assert main(["promote", second, "--tracking-uri", mlflow_server.url]) == 0
    assert "version 2" in capsys.readouterr().out
    champion = client.get_model_version_by_alias(out["model"], "champion")
    assert champion.version == "2" and champion.run_id == second
    assert champion.tags["replaced_champion_version"] == "1" and champion.tags["k"] == "4"
    assert champion.tags["tau"] == "1.7" and champion.tags["family"] == "parallel"
    assert (
        client.get_model_version(out["model"], "1").run_id == first
    )  # the previous champion stays
    assert (
        promote(first, tracking_uri=mlflow_server.url)["version"] == "1"
    )  # re-promotion reuses its version


@pytest.mark.slow
def test_promote_bad_runs_are_clear_errors(mlflow_server, tmp_path, capsys):
    from draftlab.cli import main

    assert main(["promote", "0123456789abcdef", "--tracking-uri", mlflow_server.url]) == 2
    assert "not found" in capsys.readouterr().err
    bare = _distill_like_run(mlflow_server.url, tmp_path, _name("tgt"), 1.2, with_drafter=False)
    with pytest.raises(ValueError, match="no 'drafter' artifact"):
        promote(bare, tracking_uri=mlflow_server.url)


@pytest.mark.slow
def test_list_runs_and_table(mlflow_server):
    t = Tracker(mlflow_server.url, EXP)
    name = _name("listed")
    run_id = t.start_or_resume(name, {})
    t.log_metrics_now(
        {"tau": 3.25, "speedup_vs_ar": 1.8, "loss": 0.1, "eval/sim_accept_len": 2.5, "other": 1.0},
        step=10,
    )
    url = t.run_url()
    assert url == f"{mlflow_server.url}/#/experiments/{t.experiment_id}/runs/{run_id}"
    t.end()

    rows = list_runs(mlflow_server.url)
    assert rows[0]["run_id"] == run_id  # newest first
    assert rows[0]["run_name"] == name and rows[0]["experiment"] == EXP
    assert rows[0]["status"] == "FINISHED"
    assert rows[0]["metrics"] == {
        "tau": 3.25,
        "speedup_vs_ar": 1.8,
        "loss": 0.1,
        "eval/sim_accept_len": 2.5,
    }
    starts = [r["start_time"] for r in rows]
    assert starts == sorted(starts, reverse=True)
    assert list_runs(mlflow_server.url, experiment="draftlab-nope") == []
    assert len(list_runs(mlflow_server.url, experiment=EXP, max_results=2)) == 2

    table = format_runs_table(rows)
    assert name in table and run_id[:12] in table and "3.25" in table and "tau" in table


@pytest.mark.slow
def test_flush_survives_a_server_outage(mlflow_server):
    """Runs last: stops the module's server. Nothing buffered is lost, nothing duplicated."""
    client = MlflowClient(mlflow_server.url)
    t = Tracker(mlflow_server.url, EXP, max_buffer_seconds=3)
    run_id = t.start_or_resume(_name("outage"), {})
    t.log_metrics_now({"loss": 1.0}, step=0)
    for step in range(1, 4):
        t.buffer_metrics({"loss": 1.0 / (step + 1)}, step)

    mlflow_server.stop()
    t0 = time.monotonic()
    with pytest.raises(TrackingUnavailable, match="unreachable for 3 s"):
        t.flush()
    elapsed = time.monotonic() - t0
    assert 3 <= elapsed < 10, elapsed  # gave up on time, not after MLflow's minutes of retries
    assert t.pending == 3  # kept for the next flush

    t.buffer_metrics({"loss": 0.1}, 4)
    mlflow_server.start()
    for _ in range(5):  # a busy machine can answer a flush after its 3 s: the buffer stays
        try:  # for the next flush, as the error says
            t.flush()
            break
        except TrackingUnavailable:
            assert t.pending == 4
    assert t.pending == 0
    assert _steps(client, run_id, "loss") == [0, 1, 2, 3, 4]

    # An abandoned request that lands late re-sends identical (key, step, timestamp, value)
    # rows; the SQL store drops them, so late deliveries never duplicate a step.
    history = client.get_metric_history(run_id, "loss")
    client.log_batch(run_id, metrics=history, synchronous=True)
    assert _steps(client, run_id, "loss") == [0, 1, 2, 3, 4]
    t.end()


@pytest.mark.slow
def test_resume_after_drops_already_logged_steps(mlflow_server):
    server_url = mlflow_server.url
    """A crash between flush and checkpoint commit: the re-run steps are not logged twice."""
    first = Tracker(server_url, "draftlab-test-resume-after", run_id=None)
    run_id = first.start_or_resume(_name("resume-after"), tags={})
    for step in range(1, 6):
        first.buffer_metrics({"loss": float(step)}, step)
    first.flush()  # steps 1..5 delivered, but the checkpoint (say at step 3) was the last commit
    again = Tracker(server_url, "draftlab-test-resume-after", run_id=run_id)
    assert again.resume_after("loss") == 5
    for step in range(4, 9):  # the restarted attempt re-runs steps 4..8
        again.buffer_metrics({"loss": 100.0 + step}, step)
    again.flush()
    history = sorted((m.step, m.value) for m in again.client.get_metric_history(run_id, "loss"))
    assert [s for s, _ in history] == list(range(1, 9))
    assert history[3] == (4, 4.0)  # the first record of a step is kept
