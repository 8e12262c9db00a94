"""A sweep trial crashes for real (its trial actor process SIGKILLed mid-training): Tune's
`FailureConfig(max_failures)` retries it and the retry resumes the training from its latest
checkpoint instead of training from scratch. Recovery times are printed (`pytest -s`)."""

from __future__ import annotations

import json
import signal
import threading
import time

import mlflow
import psutil
import pytest
import ray
import yaml

from distill_support import committed_checkpoint, tiny_config, wait_for
from draftlab.config import TrainConfig
from draftlab.sweep.runner import run_sweep
from ray_support import local_ray

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def raylet():
    """A local Ray instance; yields its raylet's pid (the parent of every worker process, so
    the test only ever kills processes of its own Ray)."""
    with local_ray(object_store_mb=200):
        yield ray._private.worker._global_node.all_processes["raylet"][0].process.pid


def test_crashed_trial_is_retried_and_resumes_its_training(raylet, mlflow_uri, tmp_path):
    epochs = 10  # 12 training samples, batches of 2: 60 steps
    base = tiny_config(
        tmp_path,
        "crash-base",
        mlflow_uri,
        train=TrainConfig(
            epochs=epochs,
            batch_size=2,
            lr=3e-3,
            warmup_steps=2,
            checkpoint_every=6,
            eval_every=12,
            log_every=1,
        ),
    )
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base.model_dump(mode="json")))
    (tmp_path / "sweep.yaml").write_text(
        yaml.safe_dump(
            {
                "name": "crash",
                "base": "base.yaml",
                "space": {"drafter.k": [3]},
                "trees": ["chain"],
                "search": {"max_concurrent_trials": 1},
                "promote": False,
                "max_failures": 1,
            }
        )
    )
    box: dict = {}

    def sweep():
        try:
            box["summary"] = run_sweep(tmp_path / "sweep.yaml", progress=False)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            box["error"] = e

    thread = threading.Thread(target=sweep, daemon=True)
    thread.start()
    trainings = tmp_path / "ray" / "trainings"
    run_dir = wait_for(
        lambda: next((d for d in trainings.glob("*") if committed_checkpoint(d)), None),
        300,
        "the trial's training to commit a checkpoint",
    )
    trial_actors = [
        p for p in psutil.Process(raylet).children() if "ImplicitFunc" in " ".join(p.cmdline())
    ]
    assert len(trial_actors) == 1, [p.cmdline() for p in psutil.Process(raylet).children()]
    trial_actors[0].send_signal(
        signal.SIGKILL
    )  # the trial process dies; its Train run goes with it
    t_kill = time.monotonic()
    time.sleep(1)
    killed_at = committed_checkpoint(run_dir)["step"]
    wait_for(
        lambda: len((run_dir / "fits.jsonl").read_text().splitlines()) == 2,
        120,
        "Tune to retry the trial",
    )
    t_retry = time.monotonic()
    wait_for(
        lambda: (committed_checkpoint(run_dir) or {"step": 0})["step"] > killed_at,
        120,
        "a checkpoint of the retried training",
    )
    t_resumed = time.monotonic()
    thread.join(300)
    assert not thread.is_alive(), "the sweep did not finish"
    if "error" in box:
        raise box["error"]
    summary = box["summary"]
    print(
        f"\ntrial killed after the checkpoint of step {killed_at}; Tune retried it "
        f"{t_retry - t_kill:.1f} s later; its next checkpoint {t_resumed - t_kill:.1f} s after the "
        f"kill; sweep done {time.monotonic() - t_kill:.1f} s after the kill"
    )

    assert summary["trials_done"] == 1 and not summary["not_finished"]
    fits = [json.loads(line) for line in (run_dir / "fits.jsonl").read_text().splitlines()]
    assert len(fits) == 2 and fits[0]["trial"] == fits[1]["trial"]  # the same trial, retried once
    assert (
        fits[0]["mlflow_run_id"] == fits[1]["mlflow_run_id"]
    )  # ... logging into the same MLflow run
    done = json.loads((run_dir / "done.json").read_text())
    assert (
        done["resumed_from_step"] == killed_at > 0
    )  # from its latest checkpoint, not from scratch
    assert done["steps"] == epochs * 6
    client = mlflow.MlflowClient(mlflow_uri)
    steps = sorted(m.step for m in client.get_metric_history(fits[0]["mlflow_run_id"], "loss"))
    assert steps == list(
        range(1, epochs * 6 + 1)
    )  # continuous across the crash: no gap, no duplicate
    run = client.get_run(fits[0]["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["draftlab.status"] == "done"
