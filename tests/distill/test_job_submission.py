"""`draftlab submit` / `draftlab jobs` (Ray's job submission SDK) against a real
`ray start --head`."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from distill_support import tiny_config

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))
DRAFTLAB = str(Path(sys.executable).with_name("draftlab"))


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """A real head node in its own process group, so teardown stops exactly this cluster
    (`ray stop` would stop every Ray instance on the machine)."""
    from mlflow_server import free_ports

    # Every fixed default port gets a free one: another Ray instance on this machine (a
    # developer's, or a test module's) must not collide with this head's agents.
    flags = (
        "dashboard-agent-listen-port",
        "dashboard-agent-grpc-port",
        "metrics-export-port",
        "runtime-env-agent-port",
        "ray-client-server-port",
        "node-manager-port",
        "object-manager-port",
    )
    port, dash, *others = free_ports(2 + len(flags))
    agent_ports = [f"--{flag}={p}" for flag, p in zip(flags, others, strict=True)]
    # As with an activated virtualenv: the job's `python` is this interpreter.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1", "PATH": path}
    log_path = tmp_path_factory.mktemp("head") / "ray-start.log"
    # Its own temp dir: a job's driver finds its cluster through the "current cluster" file
    # there (Ray's job supervisor resolves RAY_ADDRESS "auto"), and in the shared /tmp/ray
    # that file names whichever cluster started last, another test module's under `-n 2`.
    # Short, under /tmp: Ray's socket paths must fit in 107 characters.
    temp_dir = tempfile.mkdtemp(prefix="ray-jobs-", dir="/tmp")
    log = open(log_path, "w")  # noqa: SIM115 (closed at teardown)
    proc = subprocess.Popen(
        [
            RAY,
            "start",
            "--head",
            "--block",
            f"--port={port}",
            "--num-cpus=3",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dash}",
            "--object-store-memory=157286400",
            "--disable-usage-stats",
            f"--temp-dir={temp_dir}",
            *agent_ports,
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        url = f"http://127.0.0.1:{dash}"
        deadline = time.monotonic() + 120
        while True:  # up, or failed to start: say why instead of timing out in the tests
            assert proc.poll() is None, (
                f"ray start exited {proc.returncode}: {log_path.read_text()[-3000:]}"
            )
            try:
                urllib.request.urlopen(f"{url}/api/version", timeout=5).close()
                break
            except urllib.error.HTTPError:  # it answers (401 without Ray's auth token): it is up
                break
            except OSError:
                assert time.monotonic() < deadline, (
                    f"no dashboard after 120 s: {log_path.read_text()[-3000:]}"
                )
                time.sleep(1)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:  # `ray start --block` can sit out its whole shutdown when its agents die with it
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`draftlab ...` as a user runs it against a cluster with Ray's token auth on:
    RAY_AUTH_MODE=token makes the client send ~/.ray/auth_token (written by `ray start --head`)."""
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    return subprocess.run(
        [DRAFTLAB, *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_submit_runs_a_distill_job_and_jobs_logs_shows_its_output(head, tmp_path):
    cfg = tiny_config(tmp_path, "job", f"sqlite:///{tmp_path / 'mlflow.db'}")
    cfg_file = tmp_path / "tiny.yaml"  # outside the repo: staged into <repo>/.submit/ and uploaded
    cfg_file.write_text(yaml.safe_dump(json.loads(cfg.model_dump_json())))
    deadline = time.time() + 90
    while True:  # the dashboard's job agent can take a few seconds to come up
        sub = _cli(
            "submit",
            "distill",
            "--address",
            head,
            "-c",
            str(cfg_file),
            "train.epochs=2",
            "bench.enabled=false",  # the job, its logs and its outputs are under test here
        )
        if sub.returncode == 0 or time.time() > deadline:
            break
        time.sleep(3)
    assert sub.returncode == 0, sub.stdout + sub.stderr
    job_id = re.search(r"submitted distill job (\S+)", sub.stdout).group(1)
    # one follower until the job ends, not a status poll every few seconds (each `draftlab`
    # process costs ~1 s of CPU on 2 cores, which the job itself needs)
    logs = _cli("jobs", "logs", job_id, "--address", head, "--follow", timeout=400).stdout
    status = _cli("jobs", "status", job_id, "--address", head).stdout
    assert "SUCCEEDED" in status, status + logs[-3000:]
    assert '"registered_model": "draftlab-tiny-llama-drafter"' in logs
    assert (tmp_path / "ray" / "job" / "drafter" / "model.safetensors").is_file()
    listed = _cli("jobs", "list", "--address", head).stdout
    assert job_id in listed and "distill" in listed and "SUCCEEDED" in listed


def test_jobs_errors_are_clear(head):
    out = _cli("jobs", "logs", "raysubmit_nope", "--address", head)
    assert (
        out.returncode == 2
        and "job 'raysubmit_nope'" in out.stderr
        and "Traceback" not in out.stderr
    )
    out = _cli("jobs", "list", "--address", "http://127.0.0.1:1")
    assert out.returncode == 2 and "no Ray dashboard at http://127.0.0.1:1" in out.stderr, (
        out.stderr
    )
    out = _cli("submit", "distill", "--address", head, "-c", "missing.yaml")
    assert out.returncode == 2 and "missing.yaml: config file not found" in out.stderr


def test_runtime_env_ships_this_checkout():
    from draftlab.submit import requirements, runtime_env

    env = runtime_env(pip=True, env_vars={"A": "1"})
    assert env["working_dir"] == str(ROOT) and env["py_modules"] == [
        str(ROOT / "platform" / "draftlab")
    ]
    assert ".venv/" in env["excludes"] and ".draftlab/" in env["excludes"]
    assert env["pip"] == requirements() and not any(r.startswith("torch") for r in env["pip"])
    assert any(r.startswith("ray[") for r in env["pip"]) and env["env_vars"] == {"A": "1"}
