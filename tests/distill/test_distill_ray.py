"""Distillation on a real multi-node Ray cluster (`ray.cluster_utils.Cluster`), logged to a
real MLflow server: DDP across two nodes, a killed worker resumed from its checkpoint."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import mlflow
import psutil
import pytest
import ray
from ray.cluster_utils import Cluster

from distill_support import tiny_config
from draftlab.config import BenchSpec, DrafterSpec, ScalingSpec, TrainConfig
from draftlab.decoding.ngram import NgramStore
from draftlab.decoding.tree import load_tree
from draftlab.decoding.tree_search import best_tree
from draftlab.distill.launch import run_distill
from draftlab.distill.tree_select import choose_tree_for_run
from mlflow_server import MlflowServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "object_store_memory": 150 * 1024**2, "include_dashboard": False},
    )
    nodes = [c.add_node(num_cpus=1, object_store_memory=100 * 1024**2) for _ in range(2)]
    c.wait_for_nodes()
    ray.init(address=c.address)
    yield c, nodes
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def mlflow_uri(tmp_module):
    with MlflowServer(root=tmp_module / "mlflow") as server:
        yield server.url


def test_two_node_ddp_logs_and_registers(cluster, mlflow_uri, tmp_module):
    """The whole distillation of a p-eagle drafter (aux-layer features cached with the data)."""
    cfg = tiny_config(
        tmp_module, "ddp2", mlflow_uri,
        drafter=DrafterSpec(family="p-eagle", k=3, depth=1),
        scaling=ScalingSpec(num_workers=2, cpus_per_worker=1, placement_strategy="STRICT_SPREAD"),
        bench=BenchSpec(limit=2, max_new_tokens=12, chain_depth="tree"),
    )
    assert cfg.data.aux_layers == "eagle3"  # the data cache keeps what the family fuses
    summary = run_distill(cfg, progress=False)
    assert summary["world_size"] == 2
    assert len(set(summary["worker_nodes"])) == 2  # STRICT_SPREAD: really two nodes
    assert summary["replica_weights_equal"]  # DDP kept both replicas identical
    client = mlflow.MlflowClient(mlflow_uri)
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["drafter.k"] == "3" and run.data.params["scaling.num_workers"] == "2"
    losses = [m.value for m in sorted(client.get_metric_history(run.info.run_id, "loss"), key=lambda m: m.step)]
    assert len(losses) == summary["steps"]
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3  # the loss falls
    for key in ("eval/acc_pos1", "eval/sim_accept_len", "train/tokens_per_s_total", "tau", "speedup_vs_ar",
                "train/ms_forward_backward", "train/step_ms_collate"):
        assert key in run.data.metrics, key
    assert set(summary["train_step_ms"]) == {"collate", "features", "forward_backward", "optimizer"}
    # the bench's fastest method is what tree.json serves
    served = load_tree(str(Path(summary["drafter_dir"]) / "tree.json"))
    bench = summary["bench"]["methods"]
    assert summary["best_method"] == max((m for m in bench if m != "ar"), key=lambda m: bench[m]["speedup_vs_ar"])
    search = json.loads((Path(summary["drafter_dir"]) / "tree-search.json").read_text())
    depth = next(c["depth"] for c in search["candidates"] if c["tree"] == search["chosen"])
    assert summary["bench"]["k"] == depth  # chain_depth=tree: the chain drafts as deep as the searched tree
    chosen_nodes = next(c["nodes"] for c in search["candidates"] if c["tree"] == search["chosen"])
    pooled = f"searched-16@{chosen_nodes}"  # bench.per_round_pool: the same node count, chosen per round
    pool_nodes = len(best_tree(search["acceptance"], 16).paths)  # paths accepted at all, up to 16
    assert (f"draftlab_tree:{pooled}" in bench) == (pool_nodes > chosen_nodes)
    assert served.ngram is None and summary["tree"] in (f"chain-{depth}", "searched", pooled)
    assert (served.per_round is not None) == (summary["best_method"] == f"draftlab_tree:{pooled}")
    if summary["best_method"] == "draftlab_chain":
        assert served.paths == tuple((0,) * d for d in range(1, depth + 1))
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "drafter")}
    assert artifacts == {"drafter/config.json", "drafter/model.safetensors", "drafter/tree.json", "drafter/tree-search.json",
                         "drafter/training.json", "drafter/lookup-store.safetensors"}
    store = NgramStore.beside(summary["drafter_dir"])  # the target's responses to the training prompts
    assert store is not None and len(store.table) > 100
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"bench.json", "config.json", "training.json", "drafter"}
    curve = json.loads((Path(summary["drafter_dir"]) / "training.json").read_text())
    assert [e["step"] for e in curve["evaluations"]][-1] == summary["steps"] and curve["verify_chain_ms"] > 0
    version = client.get_model_version(summary["registered_model"], summary["model_version"])
    assert version.run_id == run.info.run_id
    assert version.tags["k"] == "3" and version.tags["family"] == "p-eagle" and "tau" in version.tags
    # `draftlab select-tree` redoes the tree choice from the cached held-out split (no generation)
    report = choose_tree_for_run(cfg)
    tree = load_tree(str(Path(summary["drafter_dir"]) / "tree.json"))
    assert max(report["candidates"], key=lambda c: c["predicted_speedup"])["paths"] == [list(p) for p in tree.paths]


def _train_worker_pids() -> list[int]:
    pids = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "RayTrainWorker" in cmd:
            pids.append(p.info["pid"])
    return pids


def test_killed_worker_resumes_from_checkpoint(cluster, mlflow_uri, tmp_module):
    cfg = tiny_config(
        tmp_module, "resume", mlflow_uri,
        train=TrainConfig(epochs=12, batch_size=2, lr=3e-3, warmup_steps=2, checkpoint_every=3, eval_every=100, log_every=1),
    )
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(run_distill(cfg, progress=False)))
    thread.start()
    snapshot = tmp_module / "ray" / "resume" / "checkpoint_manager_snapshot.json"

    def committed() -> bool:  # a checkpoint dir appears before Ray commits it: wait for the commit
        try:
            return json.loads(snapshot.read_text()).get("latest_checkpoint_result") is not None
        except (OSError, ValueError):
            return False

    deadline = time.time() + 240
    while time.time() < deadline and not committed():
        time.sleep(0.2)
    assert committed(), "no checkpoint was committed"
    pids = _train_worker_pids()
    assert pids, "could not find the Ray Train worker process"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)  # a real crash of the training process
    thread.join(timeout=300)
    assert not thread.is_alive()
    # 12 samples in the train split -> 6 batches of 2 per epoch, 12 epochs.
    assert result["resumed_from_step"] > 0  # restarted from a checkpoint, not from scratch
    assert result["steps"] == 72 and result["epochs_done"] == 12
    client = mlflow.MlflowClient(mlflow_uri)
    steps = sorted(m.step for m in client.get_metric_history(result["mlflow_run_id"], "loss"))
    assert steps == list(range(1, 73))  # continuous: no gap, no duplicate
