"""Faults injected for real into tiny distillation runs: a checkpoint save SIGKILLed part-way,
damaged checkpoints, the MLflow server stopped during training while the node hosting the
training worker is removed from a `ray.cluster_utils.Cluster`, and the server down for
longer than `tracking.max_outage_s`. Recovery times are printed (`pytest -s`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlflow
import psutil
import pytest
import ray
import torch
from ray.cluster_utils import Cluster

from distill_support import committed_checkpoint, tiny_config, wait_for
from draftlab.config import BenchSpec, ScalingSpec, TrackingSpec, TrainConfig
from draftlab.distill.checkpoint import (
    CheckpointError,
    load_checkpoint,
    restore_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from draftlab.distill.launch import run_distill
from draftlab.models.drafters.build import init_drafter
from draftlab.tracking import Tracker, TrackingUnavailable
from mlflow_server import MlflowServer
from ray_support import no_state_api

# 12 training samples -> 6 batches of 2 per epoch (tiny_config's data).
STEPS_PER_EPOCH = 6


# ----------------------------------------------------------------------------- helpers


def _adamw(drafter):
    return torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-3)


def _trained_state(tiny):
    """A tiny drafter and an AdamW that has taken a step (so it has moment tensors)."""
    drafter = init_drafter("parallel", tiny, k=3, depth=1).float().train()
    opt = _adamw(drafter)
    for p in drafter.parameters():
        if p.requires_grad:
            p.grad = torch.full_like(p, 1e-3)
    opt.step()
    return drafter, opt


def _raylet(node) -> int:
    return node.all_processes["raylet"][0].process.pid


def _train_workers(cluster) -> list[psutil.Process]:
    """The Ray Train worker processes of `cluster` (children of its raylets: never another
    Ray's on this machine)."""
    raylets = {_raylet(n) for n in [cluster.head_node, *cluster.worker_nodes]}
    return [
        p
        for p in psutil.process_iter(["pid", "ppid", "cmdline"])
        if p.info["ppid"] in raylets and "RayTrainWorker" in " ".join(p.info["cmdline"] or [])
    ]


def _start(cfg) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run():
        try:
            box["summary"] = run_distill(cfg, progress=False)
        except BaseException as e:  # noqa: BLE001 - inspected by the test
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def _finish(thread: threading.Thread, box: dict, timeout: float = 300) -> dict:
    thread.join(timeout)
    assert not thread.is_alive(), "the run did not finish"
    if "error" in box:
        raise box["error"]
    return box["summary"]


def _history(uri: str, run_id: str) -> dict[str, list[int]]:
    """Every metric of a run -> its sorted logged steps."""
    client = mlflow.MlflowClient(uri)
    keys = client.get_run(run_id).data.metrics
    return {k: sorted(m.step for m in client.get_metric_history(run_id, k)) for k in keys}


# ----------------------------------------------------------------------------- checkpoints

# Runs save_checkpoint in forked children and SIGKILLs each at one point of the save: when
# a file reaches a size, or after a fraction of a full save's duration. The drafter is
# tiny-llama's with a wide decoder (~20 M params: ~230 MB with AdamW's moments), so a save
# takes long enough to be cut inside every file.
SAVER = r"""
import json, os, signal, sys, time
import torch
torch.set_num_threads(1)
from draftlab.distill.checkpoint import save_checkpoint
from draftlab.models.drafters.build import init_drafter
from draftlab.tracking import Tracker, TrackingUnavailable
from draftlab.models.drafters.registry import drafter_class
from draftlab.models.target import load_target

root, plans = sys.argv[1], json.loads(sys.argv[2])
target = load_target("tiny-llama")
small = init_drafter("parallel", target, k=3, depth=2)
wide = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
    "head_dim": 64,
}
cfg = small.cfg.model_copy(update={"decoder": {**small.cfg.decoder, **wide}})
torch.manual_seed(0)
drafter = drafter_class("parallel")(cfg, target).float().train()
params = [p for p in drafter.parameters() if p.requires_grad]
opt = torch.optim.AdamW(params, lr=1e-3)
for p in params:
    p.grad = torch.full_like(p, 1e-3)
opt.step()
state = {"step": 7, "epoch": 0, "batch": 7, "elapsed_s": 1.0, "tokens": 100}

t0 = time.perf_counter()
save_checkpoint(os.path.join(root, "reference"), drafter, opt, state)
ref_s = time.perf_counter() - t0
ref_sizes = {}
for d, _, files in os.walk(os.path.join(root, "reference")):
    for f in files:
        rel = os.path.relpath(os.path.join(d, f), os.path.join(root, "reference"))
        ref_sizes[rel] = os.path.getsize(os.path.join(d, f))

def reached(case, plan):
    if "frac_time" in plan:
        return False
    for d, _, files in os.walk(case):
        for f in files:
            path = os.path.join(d, f)
            if path.endswith(plan["file"]):
                try:
                    want = plan.get("frac_size", 0.0) * ref_sizes[plan["file"]]
                    if os.path.getsize(path) >= want:
                        return True
                except OSError:
                    pass
    return False

cases = []
for plan in plans:
    case = os.path.join(root, plan["name"])
    os.makedirs(case)
    pid = os.fork()
    if pid == 0:
        save_checkpoint(os.path.join(case, "checkpoint"), drafter, opt, state)
        os._exit(0)
    t0, killed = time.perf_counter(), False
    while True:
        elapsed = time.perf_counter() - t0
        if reached(case, plan) or ("frac_time" in plan and elapsed >= plan["frac_time"] * ref_s):
            os.kill(pid, signal.SIGKILL)
            killed = True
            break
        if os.waitpid(pid, os.WNOHANG)[0]:
            pid = None  # finished before the kill point
            break
    if pid:
        os.waitpid(pid, 0)
    cases.append({"name": plan["name"], "killed": killed, "at_s": elapsed})
print(json.dumps({"reference_s": ref_s, "sizes": ref_sizes, "cases": cases}))
"""

KILL_POINTS = [
    {"name": "drafter-config-written", "file": "drafter/config.json"},
    {"name": "drafter-weights-half", "file": "drafter/model.safetensors", "frac_size": 0.5},
    {"name": "optimizer-started", "file": "optimizer.safetensors"},
    {"name": "optimizer-half", "file": "optimizer.safetensors", "frac_size": 0.5},
    {"name": "state-written", "file": "state.json"},  # then: fsyncs and hashes
    {"name": "manifest-written", "file": "MANIFEST.json"},  # just before the rename
    {"name": "time-30pct", "frac_time": 0.3},
    {"name": "time-60pct", "frac_time": 0.6},
    {"name": "time-90pct", "frac_time": 0.9},
]
MID_SAVE = {
    "drafter-config-written",
    "drafter-weights-half",
    "optimizer-started",
    "optimizer-half",
    "state-written",
}


@pytest.mark.slow
def test_checkpoint_save_killed_at_any_point_is_never_loaded(tiny, tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parents[2] / "platform"), os.environ.get("PYTHONPATH", "")]
        ),
    }
    proc = subprocess.run(
        [sys.executable, "-c", SAVER, str(tmp_path), json.dumps(KILL_POINTS)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    print(
        f"\nfull save of {sum(report['sizes'].values()) / 2**20:.0f} MB took "
        f"{report['reference_s']:.2f} s"
    )
    reference = tmp_path / "reference"
    verify_checkpoint(reference)
    _, _, state = load_checkpoint(reference, tiny, _adamw)  # the complete save loads
    assert state["step"] == 7
    ref_manifest = json.loads((reference / "MANIFEST.json").read_text())

    cut = []
    for case in report["cases"]:
        path = tmp_path / case["name"] / "checkpoint"
        print(
            f"  {case['name']:24s} killed={case['killed']} at {case['at_s']:.3f} s: "
            f"{'complete' if path.exists() else 'no checkpoint'}"
        )
        if path.exists():  # published by the rename: then it is the whole checkpoint
            verify_checkpoint(path)
            assert json.loads((path / "MANIFEST.json").read_text()) == ref_manifest
            continue
        cut.append(case["name"])
        with pytest.raises(CheckpointError, match="does not exist"):
            verify_checkpoint(path)
        with pytest.raises(CheckpointError, match="does not exist"):
            load_checkpoint(path, tiny, _adamw)
        # What the killed save left behind is refused too, if anything ever tried to load it
        # (as a non-atomic save would have published it): no manifest yet, or files that do
        # not match it, or a manifest cut mid-write; unless the kill came between the manifest
        # and the rename.
        for partial in (tmp_path / case["name"]).glob(".checkpoint.partial-*"):
            try:
                verify_checkpoint(partial)
            except CheckpointError as e:
                assert any(
                    w in str(e)
                    for w in ("no MANIFEST", "unreadable", "missing", "truncated", "sha256")
                ), e
                with pytest.raises(CheckpointError):
                    load_checkpoint(partial, tiny, _adamw)
            else:
                assert json.loads((partial / "MANIFEST.json").read_text()) == ref_manifest
    assert MID_SAVE <= set(cut), (
        f"these kills landed after the save completed: {MID_SAVE - set(cut)}"
    )


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("truncate:drafter/model.safetensors", "drafter/model.safetensors is truncated"),
        ("flip:optimizer.safetensors", "optimizer.safetensors does not match its sha256"),
        ("delete:state.json", "state.json is missing"),
        ("truncate:MANIFEST.json", "MANIFEST.json is unreadable"),
        ("delete:MANIFEST.json", "no MANIFEST.json"),
    ],
)
def test_damaged_checkpoint_is_refused_naming_the_problem(tiny, tmp_path, damage, message):
    drafter, opt = _trained_state(tiny)
    path = save_checkpoint(tmp_path / "ckpt", drafter, opt, {"step": 4})
    assert not list(tmp_path.glob(".ckpt.partial-*"))  # nothing left behind by a complete save
    with pytest.raises(CheckpointError, match="already exists"):
        save_checkpoint(path, drafter, opt, {"step": 5})  # never overwritten in place
    kind, name = damage.split(":")
    f = path / name
    if kind == "truncate":
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif kind == "flip":
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
    else:
        f.unlink()
    with pytest.raises(CheckpointError, match=message):
        verify_checkpoint(path)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path, tiny, _adamw)


def test_resume_falls_back_to_an_older_verified_checkpoint_or_fails_clearly(tiny, tmp_path):
    """What the worker does with `ray.train.get_checkpoint()`: Ray's latest, else the newest
    older checkpoint of the run that verifies; never a newer (uncommitted) one."""
    drafter, opt = _trained_state(tiny)
    names = [f"checkpoint_2025-01-01_00-00-0{i}.000000" for i in (1, 2, 3)]
    for name, step in zip(names, (3, 6, 9), strict=True):
        save_checkpoint(tmp_path / name, drafter, opt, {"step": step})
    weights = tmp_path / names[1] / "drafter" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # Ray's latest (step 6): a partial upload
    latest = ray.train.Checkpoint(str(tmp_path / names[1]))

    _, _, state = restore_checkpoint(latest, tiny, _adamw)
    assert state["step"] == 3  # the older one; step 9 (newer than Ray's latest) was never committed

    (tmp_path / names[0] / "state.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no usable checkpoint") as err:
        restore_checkpoint(latest, tiny, _adamw)
    assert names[0] in str(err.value) and names[1] in str(err.value)


# ----------------------------------------------------------------------------- Ray runs


@pytest.fixture(scope="module")
def cluster():
    """Head without CPUs (it hosts the driver and Train's controller), one 2-CPU worker node.
    Nodes added later (the node-loss test) start inside `no_state_api` too."""
    with no_state_api():
        c = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 0,
                "object_store_memory": 150 * 1024**2,
                "include_dashboard": False,
            },
        )
        c.add_node(num_cpus=2, object_store_memory=100 * 1024**2)
        c.wait_for_nodes()
        ray.init(address=c.address)
        yield c
        ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="module")
def mlflow_server(tmp_module):
    with MlflowServer(root=tmp_module / "mlflow") as server:
        yield server


DEAD = "http://127.0.0.1:9"  # nothing listens on the discard port: an MLflow that is down


@pytest.mark.slow
def test_tracker_outage_bookkeeping_never_blocks_and_never_duplicates(mlflow_server):
    """The Tracker side of a restart during an outage, without waiting for a real one: a
    worker resumes from the checkpoint of step 8 while MLflow (which already has steps up to
    12: a crash between flush and commit) is down, re-runs steps 9..16, checkpoints, crashes
    again, and resumes once MLflow is back."""
    client = mlflow.MlflowClient(mlflow_server.url)
    first = Tracker(mlflow_server.url, "draftlab-test-bookkeeping")
    run_id = first.start_or_resume("bookkeeping", {})
    for step in range(1, 13):
        first.buffer_metrics({"loss": float(step)}, step)
    first.flush()

    down = Tracker(DEAD, run_id=run_id, max_outage_s=60)
    t0 = time.monotonic()
    down.restore(None)  # the checkpoint of step 8 held no undelivered metrics
    assert down.resume_after("loss") is None  # looked up later: MLflow does not answer
    for step in range(9, 17):  # re-run steps, buffered while the last logged step is unknown
        down.buffer_metrics({"loss": 100.0 + step}, step)
    assert down.try_flush() is False and down.outage_seconds >= 0
    snap = json.loads(json.dumps(down.snapshot()))  # as it rides in state.json
    down.end("FAILED")  # a failing run is not held up by the dead server either
    assert time.monotonic() - t0 < 5
    assert snap["exempt"] == 0 and len(snap["pending"]) == 8 and snap["down_since"]

    back = Tracker(mlflow_server.url, run_id=run_id)
    back.restore(snap)
    assert back.resume_after("loss") == 12  # steps 9..12 re-run: dropped, the first record wins
    for step in range(17, 19):
        back.buffer_metrics({"loss": 100.0 + step}, step)
    assert back.try_flush() and back.outage_seconds == 0
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "loss"))
    assert [s for s, _ in history] == list(range(1, 19))
    assert history[8] == (9, 9.0) and history[12] == (13, 113.0)

    limited = Tracker(DEAD, run_id=run_id, max_outage_s=0.5)
    limited.buffer_metrics({"loss": 1.0}, 19)
    assert limited.try_flush() is False
    time.sleep(0.6)
    with pytest.raises(
        TrackingUnavailable, match=r"MLflow at http://127.0.0.1:9 .* tracking.max_outage_s = 0.5 s"
    ):
        limited.drain()


@pytest.mark.slow
def test_node_lost_during_an_mlflow_outage_resumes_on_a_new_node_and_loses_no_metric(
    cluster, mlflow_server, tmp_module
):
    """The MLflow server goes down; during the outage a checkpoint is committed holding
    metrics the server never got, then the node running the training worker is removed
    (raylet, worker and what it had buffered). Train waits for resources, resumes from that
    checkpoint on a new node and checkpoints again, still during the outage; the server comes
    back after ~30 s. The run ends as an uninterrupted one would, every metric logged once."""
    epochs = 50  # 300 steps: still training when the node goes (at step ~60-90)
    cfg = tiny_config(
        tmp_module,
        "outage",
        mlflow_server.url,
        bench=BenchSpec(enabled=False),
        train=TrainConfig(
            epochs=epochs,
            batch_size=2,
            lr=3e-3,
            warmup_steps=2,
            checkpoint_every=30,
            eval_every=40,
            log_every=1,
        ),
        tracking=TrackingSpec(
            tracking_uri=mlflow_server.url, experiment="draftlab-test-outage", max_outage_s=300
        ),
    )
    run_dir = Path(cfg.storage_path) / cfg.name
    client = mlflow.MlflowClient(mlflow_server.url)
    thread, box = _start(cfg)
    before = wait_for(lambda: committed_checkpoint(run_dir), 240, "a committed checkpoint")
    run_id = client.search_runs(
        [client.get_experiment_by_name("draftlab-test-outage").experiment_id]
    )[0].info.run_id
    delivered = max(m.step for m in client.get_metric_history(run_id, "loss"))

    mlflow_server.stop()
    t_down = time.monotonic()

    def held_back():  # a checkpoint committed during the outage, holding undelivered metrics
        s = committed_checkpoint(run_dir)
        if not s or s["step"] <= before["step"]:
            return None
        try:  # (Ray may have deleted it already: num_to_keep=2)
            pending = json.loads((s["dir"] / "state.json").read_text())["trainer"]["tracking"][
                "pending"
            ]
        except (OSError, ValueError):
            return None
        return s | {"pending_steps": sorted({r[3] for r in pending if r[0] == "loss"})}

    ckpt = wait_for(held_back, 60, "a checkpoint committed during the outage")
    held = ckpt["pending_steps"]  # what MLflow had not received: delivered up to just before them
    assert held and held[0] > delivered and held == list(range(held[0], ckpt["step"] + 1))
    (node,) = cluster.worker_nodes
    workers = wait_for(lambda: _train_workers(cluster), 30, "the training worker")
    assert {w.info["ppid"] for w in workers} == {
        _raylet(node)
    }  # the worker runs on the node we remove
    t_lost = time.monotonic()
    cluster.remove_node(node)  # every process of the node: raylet, training worker, ...
    time.sleep(3)  # no CPU left in the cluster: Train waits for resources
    latest = committed_checkpoint(run_dir)  # the last checkpoint committed before the node went
    new = cluster.add_node(num_cpus=2, object_store_memory=100 * 1024**2)
    t_added = time.monotonic()
    after = wait_for(
        lambda: (s := committed_checkpoint(run_dir)) and s["step"] > latest["step"] and s,
        180,
        "a checkpoint on the new node, still during the outage",
    )
    t_resumed = time.monotonic()
    assert not mlflow_server.healthy()
    time.sleep(max(0.0, 22 - (time.monotonic() - t_down)))  # + ~8-14 s of server start-up
    mlflow_server.start()
    t_up = time.monotonic()
    summary = _finish(thread, box)
    print(
        f"\noutage {t_up - t_down:.1f} s; checkpoints at steps {before['step']} (before), "
        f"{ckpt['step']} (during, {len(held)} steps held back); node removed {t_lost - t_down:.1f} "
        f"s into the outage after the checkpoint of step {latest['step']}, a new one added "
        f"{t_added - t_lost:.1f} s later; the next checkpoint (step {after['step']}) "
        f"{t_resumed - t_added:.1f} s after it came; run finished {time.monotonic() - t_up:.1f} s "
        "after the server returned"
    )

    assert t_up - t_down >= 25
    assert (
        summary["resumed_from_step"] == latest["step"] >= ckpt["step"]
    )  # the latest checkpoint, not from scratch
    assert (
        summary["steps"] == epochs * STEPS_PER_EPOCH and summary["epochs_done"] == epochs
    )  # as uninterrupted
    assert summary["worker_nodes"] == [new.node_id]
    history = _history(mlflow_server.url, summary["mlflow_run_id"])
    assert history["loss"] == list(
        range(1, summary["steps"] + 1)
    )  # every step once: none lost, none twice
    for key, steps in history.items():
        assert len(steps) == len(set(steps)), f"{key} logged twice at a step"
    assert client.get_run(summary["mlflow_run_id"]).info.status == "FINISHED"


@pytest.mark.slow
def test_mlflow_outage_past_max_outage_s_fails_the_run_clearly(cluster, mlflow_server, tmp_module):
    """Runs last: leaves the module's server stopped."""
    cfg = tiny_config(
        tmp_module,
        "outage-limit",
        mlflow_server.url,
        bench=BenchSpec(enabled=False),
        train=TrainConfig(
            epochs=10_000,
            time_budget_minutes=4,
            batch_size=2,
            lr=3e-3,
            warmup_steps=2,
            checkpoint_every=50,
            eval_every=40,
            log_every=1,
        ),
        tracking=TrackingSpec(
            tracking_uri=mlflow_server.url, experiment="draftlab-test-outage-limit", max_outage_s=10
        ),
        scaling=ScalingSpec(num_workers=1, max_failures=1),  # the restart resumes the outage clock
    )
    thread, box = _start(cfg)
    wait_for(
        lambda: committed_checkpoint(Path(cfg.storage_path) / cfg.name),
        240,
        "a committed checkpoint",
    )
    mlflow_server.stop()
    t_down = time.monotonic()
    thread.join(150)  # its 4-minute budget would train on well past this
    failed_after = time.monotonic() - t_down
    print(
        f"\nserver down; the run failed {failed_after:.1f} s later (limit 10 s, 1 worker restart "
        "allowed)"
    )
    assert not thread.is_alive(), "the run still trains long after the outage limit"
    err = box.get("error")
    print(f"{type(err).__name__}: {err}")
    assert isinstance(err, TrackingUnavailable), repr(err)[-2000:]
    assert f"MLflow at {mlflow_server.url}" in str(err) and "tracking.max_outage_s = 10 s" in str(
        err
    )
