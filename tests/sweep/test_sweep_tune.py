"""Real Ray Tune sweeps on a tiny target: Ray Train inside Tune trials, the engine's bench,
ASHA, MLflow parent/child runs and the champion alias on a real tracking server, resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest
import ray
import yaml

from distill_support import tiny_config
from draftlab.config import TrainConfig
from draftlab.sweep.runner import resume_sweep, run_sweep
from ray_support import local_ray

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # 4 trials: ~150 s alone on 2 cores
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ray_local():
    with local_ray(object_store_mb=200):
        yield


def write_sweep(tmp: Path, uri: str, name: str, train: TrainConfig | None = None, **doc) -> Path:
    """A tiny base distill config and a sweep over it (2 trainings x 2 trees by default)."""
    tmp.mkdir(parents=True, exist_ok=True)
    base = tiny_config(tmp, f"{name}-base", uri, **({"train": train} if train else {}))
    (tmp / "base.yaml").write_text(yaml.safe_dump(base.model_dump(mode="json")))
    sweep = {
        "name": name,
        "base": "base.yaml",
        "space": {"drafter.k": [2, 3]},
        "trees": ["chain", "searched-3"],
        "search": {"max_concurrent_trials": 1},
        **doc,
    }
    (tmp / "sweep.yaml").write_text(yaml.safe_dump(sweep))
    return tmp / "sweep.yaml"


def fits(tmp: Path) -> dict[str, int]:
    """Training directory -> how many fits were started in it."""
    return {
        p.parent.name: len(p.read_text().splitlines())
        for p in (tmp / "ray" / "trainings").glob("*/fits.jsonl")
    }


def test_sweep_trains_once_per_config_stops_a_bad_training_and_promotes_the_fastest(
    ray_local, mlflow_uri, tmp_path
):
    """One sweep (2 trainings x 2 trees, ASHA on): the good training serves both its trees
    from one fit; lr 1e-9 never learns, so at the first rung (2 reports, step 16) its simulated
    acceptance is below the good trial's and ASHA stops it (and its second tree) before its 24
    steps; the faster tree of the good training (within 5%, the one of more tau) is
    promoted."""
    train = TrainConfig(
        epochs=4,
        batch_size=2,
        lr=3e-3,
        warmup_steps=2,
        checkpoint_every=8,
        eval_every=8,
        log_every=1,
    )
    path = write_sweep(
        tmp_path,
        mlflow_uri,
        "two-by-two",
        train=train,
        space={"train.lr": [3e-3, 1e-9]},
        asha={"grace_period": 2, "reduction_factor": 2, "metric": "eval/sim_accept_len"},
    )
    summary = run_sweep(path, progress=False)

    assert summary["trials_done"] == 2
    stopped = summary["not_finished"]
    assert len(stopped) == 2 and all(o["config"]["train.lr"] == 1e-9 for o in stopped)
    assert sorted(fits(tmp_path).values()) == [
        1,
        1,
    ]  # each config trained once: no tree retrained it
    bad = next(
        d for d in (tmp_path / "ray" / "trainings").iterdir() if (d / "stopped.json").exists()
    )
    assert json.loads((bad / "stopped.json").read_text())["step"] < 24  # stopped early
    assert not (bad / "done.json").exists()
    stopped_run = json.loads((bad / "fits.jsonl").read_text().splitlines()[0])["mlflow_run_id"]
    client = mlflow.MlflowClient(mlflow_uri)
    run = client.get_run(stopped_run)
    assert run.info.status == "KILLED" and run.data.tags["draftlab.status"] == "stopped (ASHA)"

    rows = summary["rows"]
    assert {r["tree"] for r in rows} == {"chain", "searched-3"}
    assert all(r["train_steps"] == 24 for r in rows)
    assert sum(r["trained_here"] for r in rows) == 1
    assert all(r["greedy_identical"] for r in rows)
    assert all(r["params"] == {"train.lr": 3e-3} for r in rows)  # each row's point in the space
    first, second = rows  # the trees of one drafter share its training and its ar baseline
    assert (
        first["training_key"] == second["training_key"]
        and first["ar_tokens_per_s"] == second["ar_tokens_per_s"]
    )
    best, top = summary["best"], max(r["speedup_vs_ar"] for r in rows)
    near = [r for r in rows if r["speedup_vs_ar"] >= top * 0.95]  # sweep.tie: 5%
    assert best in near and best["tau"] == max(r["tau"] for r in near)

    parent = client.get_run(summary["mlflow_parent_run_id"])
    assert parent.info.status == "FINISHED" and parent.data.tags["draftlab.kind"] == "sweep"
    assert parent.data.metrics["best_speedup_vs_ar"] == pytest.approx(best["speedup_vs_ar"])
    results = {a.path for a in client.list_artifacts(parent.info.run_id, "results")}
    assert {
        "results/results.csv",
        "results/pareto.png",
        "results/speedup_vs_k.png",
        "results/speedup_vs_tree_budget.png",
        "results/tau_by_category.png",
        "results/best.json",
    } <= results
    children = client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    finished = [c for c in children if c.info.status == "FINISHED"]
    assert {c.info.run_id for c in finished} == {r["mlflow_run_id"] for r in rows}
    for child in finished:
        assert {"train.lr", "tree", "training_key"} <= set(child.data.params)
        assert "speedup_vs_ar" in child.data.metrics
        tree = json.loads(
            Path(
                mlflow.artifacts.download_artifacts(
                    run_id=child.info.run_id,
                    artifact_path="drafter/tree.json",
                    tracking_uri=mlflow_uri,
                )
            ).read_text()
        )
        row = next(r for r in rows if r["mlflow_run_id"] == child.info.run_id)
        assert len(tree) == row["tree_nodes"]  # the served tree is the trial's own

    champion = client.get_model_version_by_alias(summary["champion"]["model"], "champion")
    assert champion.run_id == best["mlflow_run_id"]
    assert champion.tags["tree"] == best["tree"] and champion.tags["k"] == str(best["k"])


def test_interrupted_sweep_resumes_without_retraining(ray_local, mlflow_uri, tmp_path):
    """One training served with two trees; the driver, a job of the module's Ray instance,
    is killed once the training is done, before the trials' benches finish (its trials go with
    it): the resumed sweep benches both trees on the finished training without fitting it
    again."""
    path = write_sweep(tmp_path, mlflow_uri, "resume", promote=False, space={"drafter.k": [2]})
    trainings = tmp_path / "ray" / "trainings"
    # the module's instance, not a fresh one with a dashboard: ~10 s less on 2 cores
    env = os.environ | {"RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    driver = subprocess.Popen(
        [sys.executable, str(ROOT / "sweeps" / "run.py"), "-c", str(path), "--quiet"],
        cwd=tmp_path,
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "driver.log", "wb"),
    )  # noqa: SIM115
    try:
        deadline = time.monotonic() + 300
        while not list(trainings.glob("*/done.json")):
            assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the sweep never finished its training"
            time.sleep(0.2)
    finally:
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait()
    sweep_dir = tmp_path / "ray" / "sweeps" / "resume"
    assert not (sweep_dir / "results" / "results.csv").exists()  # killed before the sweep's end

    summary = resume_sweep(sweep_dir, progress=False)

    assert summary["trials_done"] == 2
    assert {r["tree"] for r in summary["rows"]} == {"chain", "searched-3"}
    assert list(fits(tmp_path).values()) == [1]  # the finished training was reused, not retrained
    assert not any(r["trained_here"] for r in summary["rows"])
    parent = mlflow.MlflowClient(mlflow_uri).get_run(summary["mlflow_parent_run_id"])
    assert parent.info.status == "FINISHED" and parent.info.run_name == "sweep-resume"
