"""Distillation on a real multi-node Ray cluster (`ray.cluster_utils.Cluster`), logged to a
real MLflow server: DDP across two nodes. (A training worker killed, or its node lost, and
resumed from its checkpoint: `test_faults.py`.)"""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pytest
import ray
from ray.cluster_utils import Cluster

from distill_support import tiny_config
from draftlab.config import BenchSpec, DrafterSpec, ScalingSpec
from draftlab.decoding.ngram import NgramStore
from draftlab.decoding.tree import load_tree
from draftlab.decoding.tree_search import best_tree
from draftlab.distill.launch import run_distill
from draftlab.distill.tree_select import choose_tree_for_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "object_store_memory": 150 * 1024**2,
            "include_dashboard": False,
        },
    )
    nodes = [c.add_node(num_cpus=1, object_store_memory=100 * 1024**2) for _ in range(2)]
    c.wait_for_nodes()
    ray.init(address=c.address)
    yield c, nodes
    ray.shutdown()
    c.shutdown()


def test_two_node_ddp_logs_and_registers(cluster, mlflow_uri, tmp_module):
    """The whole distillation of a p-eagle drafter (aux-layer features cached with the data)."""
    cfg = tiny_config(
        tmp_module,
        "ddp2",
        mlflow_uri,
        drafter=DrafterSpec(family="p-eagle", k=3, depth=1),
        scaling=ScalingSpec(num_workers=2, cpus_per_worker=1, placement_strategy="STRICT_SPREAD"),
        bench=BenchSpec(limit=2, max_new_tokens=12, chain_depth="tree", fresh_process=True),
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
    losses = [
        m.value
        for m in sorted(client.get_metric_history(run.info.run_id, "loss"), key=lambda m: m.step)
    ]
    assert len(losses) == summary["steps"]
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3  # the loss falls
    for key in (
        "eval/acc_pos1",
        "eval/sim_accept_len",
        "train/tokens_per_s_total",
        "tau",
        "speedup_vs_ar",
        "train/ms_forward_backward",
        "train/step_ms_collate",
    ):
        assert key in run.data.metrics, key
    assert set(summary["train_step_ms"]) == {"collate", "features", "forward_backward", "optimizer"}
    # the bench's fastest method is what tree.json serves
    served = load_tree(str(Path(summary["drafter_dir"]) / "tree.json"))
    bench = summary["bench"]["methods"]
    assert summary["best_method"] == max(
        (m for m in bench if m != "ar"), key=lambda m: bench[m]["speedup_vs_ar"]
    )
    search = json.loads((Path(summary["drafter_dir"]) / "tree-search.json").read_text())
    depth = next(c["depth"] for c in search["candidates"] if c["tree"] == search["chosen"])
    assert (
        summary["bench"]["k"] == depth
    )  # chain_depth=tree: the chain drafts as deep as the searched tree
    chosen_nodes = next(c["nodes"] for c in search["candidates"] if c["tree"] == search["chosen"])
    pooled = (
        f"searched-16@{chosen_nodes}"  # bench.per_round_pool: the same node count, chosen per round
    )
    pool_nodes = len(best_tree(search["acceptance"], 16).paths)  # paths accepted at all, up to 16
    assert (f"draftlab_tree:{pooled}" in bench) == (pool_nodes > chosen_nodes)
    assert served.ngram is None and summary["tree"] in (f"chain-{depth}", "searched", pooled)
    assert (served.per_round is not None) == (summary["best_method"] == f"draftlab_tree:{pooled}")
    if summary["best_method"] == "draftlab_chain":
        assert served.paths == tuple((0,) * d for d in range(1, depth + 1))
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "drafter")}
    assert artifacts == {
        "drafter/config.json",
        "drafter/model.safetensors",
        "drafter/tree.json",
        "drafter/tree-search.json",
        "drafter/training.json",
        "drafter/lookup-store.safetensors",
    }
    store = NgramStore.beside(
        summary["drafter_dir"]
    )  # the target's responses to the training prompts
    assert store is not None and len(store.table) > 100
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {
        "bench.json",
        "config.json",
        "training.json",
        "drafter",
    }
    curve = json.loads((Path(summary["drafter_dir"]) / "training.json").read_text())
    assert [e["step"] for e in curve["evaluations"]][-1] == summary["steps"] and curve[
        "verify_chain_ms"
    ] > 0
    assert curve["timed_in"] == "fresh process"  # the end stage ran in a child of the rank-0 worker
    version = client.get_model_version(summary["registered_model"], summary["model_version"])
    assert version.run_id == run.info.run_id
    assert (
        version.tags["k"] == "3" and version.tags["family"] == "p-eagle" and "tau" in version.tags
    )
    # `draftlab select-tree` redoes the tree choice from the cached held-out split (no generation)
    report = choose_tree_for_run(cfg)
    tree = load_tree(str(Path(summary["drafter_dir"]) / "tree.json"))
    assert max(report["candidates"], key=lambda c: c["predicted_speedup"])["paths"] == [
        list(p) for p in tree.paths
    ]
