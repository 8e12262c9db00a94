"""Distillation on a real multi-node Ray cluster (`ray.cluster_utils.Cluster`), logged to a
real MLflow server: DDP across two nodes, with the target's features cached or streamed from
Ray Data actors (`train.feature_stream`). (A training worker killed, or its node lost, and
resumed from its checkpoint: `test_faults.py`.)"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from pathlib import Path

import datasets
import mlflow
import pytest
import ray
import torch
from ray.cluster_utils import Cluster

from distill_support import tiny_config
from draftlab.config import BenchSpec, DrafterSpec, FeatureStreamSpec, ScalingSpec
from draftlab.data.generation import target_features
from draftlab.data.selfdistill import load_or_generate, training_view
from draftlab.decoding.ngram import NgramStore
from draftlab.decoding.tree import load_tree
from draftlab.decoding.tree_search import best_tree
from draftlab.distill.feature_stream import feature_batches
from draftlab.distill.launch import run_distill
from draftlab.distill.loader import epoch_batches
from draftlab.distill.tree_select import choose_tree_for_run
from draftlab.models.drafters.p_eagle import resolve_aux_layers
from draftlab.models.target import load_target
from ray_support import no_state_api

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    with no_state_api():  # Train's placement-group cleaner must not ask another test's dashboard
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


TWO_NODES = ScalingSpec(num_workers=2, cpus_per_worker=1, placement_strategy="STRICT_SPREAD")


@pytest.fixture(scope="module")
def ddp2(cluster, mlflow_uri, tmp_module):
    """The whole distillation of a p-eagle drafter on two nodes (aux-layer features cached
    with the data): (config, summary)."""
    cfg = tiny_config(
        tmp_module,
        "ddp2",
        mlflow_uri,
        drafter=DrafterSpec(family="p-eagle", k=3, depth=1),
        scaling=TWO_NODES,
        bench=BenchSpec(limit=2, max_new_tokens=12, chain_depth="tree", fresh_process=True),
    )
    return cfg, run_distill(cfg, progress=False)


def loss_history(client: mlflow.MlflowClient, run_id: str) -> list[float]:
    return [
        m.value for m in sorted(client.get_metric_history(run_id, "loss"), key=lambda m: m.step)
    ]


def test_two_node_ddp_logs_and_registers(ddp2, mlflow_uri):
    cfg, summary = ddp2
    assert cfg.data.aux_layers == "eagle3"  # the data cache keeps what the family fuses
    assert summary["world_size"] == 2
    assert len(set(summary["worker_nodes"])) == 2  # STRICT_SPREAD: really two nodes
    assert summary["replica_weights_equal"]  # DDP kept both replicas identical
    client = mlflow.MlflowClient(mlflow_uri)
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["drafter.k"] == "3" and run.data.params["scaling.num_workers"] == "2"
    losses = loss_history(client, run.info.run_id)
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


def _map_workers() -> list[dict]:
    """Ray Data's live actors (GCS actor table: this cluster has no dashboard)."""
    return [
        a
        for a in ray._private.state.actors().values()
        if a["State"] == "ALIVE" and "MapWorker" in a["ActorClassName"]
    ]


def _kill_feature_actor() -> str:
    """SIGKILL the process of the live Ray Data actor computing features; its actor id."""
    (actor,) = _map_workers()  # the data stage's generation actors are gone by now
    os.kill(actor["Pid"], signal.SIGKILL)
    return actor["ActorID"]


def test_feature_stream_loses_no_batch_to_a_killed_actor(cluster, mlflow_uri, tmp_module):
    """Features streamed from a Ray Data actor on the cluster: every planned batch once, in
    order, each the features of its own rows (as the data stage computes them: the same
    function, one thread, bit for bit); the actor killed mid-stream is restarted and its
    batch computed again; a slow consumer holds it back."""
    cfg = tiny_config(
        tmp_module, "stream-unit", mlflow_uri, drafter=DrafterSpec(family="p-eagle", k=3)
    )
    data = load_or_generate(cfg.data, cfg.target, progress=False)
    data_path = Path(data["train"].cache_files[0]["filename"]).parent.parent
    train = training_view(data["train"])
    target = load_target(cfg.target)
    aux = resolve_aux_layers(cfg.data.aux_layers, target.num_layers)
    plans = [
        (epoch, i, rows)
        for epoch in range(2)
        for i, rows in enumerate(epoch_batches(len(train), 2, epoch, 0, 0, 1))
    ]
    spec = FeatureStreamSpec(actors=1, cpus_per_actor=0.5, prefetch_batches=2, buffer_mb=0.1)
    got, consumed, killed = [], [], None
    for f in feature_batches(plans, spec, cfg.target, str(data_path), aux, 64):
        got.append(f)
        consumed.append(time.time())
        if len(got) == 3:
            killed = _kill_feature_actor()
        time.sleep(0.2)  # a slow training step
    assert killed is not None
    restarted = ray._private.state.actors()[killed]
    assert restarted["NumRestarts"] >= 1  # Ray Data's actor came back, the same actor
    assert [(f.epoch, f.index) for f in got] == [(e, i) for e, i, _ in plans]  # once, in order
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the actor (cpus_per_actor 0.5 -> 1 thread)
    try:
        for f, (_, _, rows) in zip(got, plans, strict=True):
            seqs = [list(train[j]["input_ids"][:64]) for j in rows]
            want = target_features(target, seqs, len(seqs), aux)  # B x (L_b, F)
            for b, w in enumerate(want):
                assert torch.equal(f.hidden[b, : len(w)], torch.from_numpy(w).float())
                assert not f.hidden[b, len(w) :].any()  # zero padding, as collate pads a cache
    finally:
        torch.set_num_threads(threads)
    # back-pressure: batches ready but not consumed yet, at each consumption, within what
    # the consumer prefetches, the actor holds and `buffer_mb` of float16 features fit
    ahead = [sum(f.computed_at <= t for f in got) - n for n, t in enumerate(consumed, 1)]
    fits = math.ceil(spec.buffer_mb * 2**20 / min(2 * f.hidden.numel() for f in got))
    assert fits < len(plans) // 2  # the bound binds
    assert max(ahead) <= spec.prefetch_batches + spec.actors + fits, (ahead, fits)


def test_streamed_features_train_as_the_cache(ddp2, mlflow_uri, tmp_module):
    """Two nodes, each training worker streaming the target's features from its own feature
    actor (no feature cache): the same steps and losses as the cached run."""
    cfg, cached = ddp2
    streamed = tiny_config(
        tmp_module,
        "ddp2-stream",
        mlflow_uri,
        drafter=cfg.drafter,
        train=cfg.train.model_copy(
            update={"feature_stream": FeatureStreamSpec(cpus_per_actor=0.5)}
        ),
        scaling=TWO_NODES,
        bench=BenchSpec(enabled=False),
    )
    assert not streamed.data.store_features  # nothing cached on disk
    summary = run_distill(streamed, progress=False)
    data = Path(summary["data_path"])
    assert "hidden" not in datasets.load_from_disk(str(data))["train"].column_names
    assert summary["world_size"] == 2 and len(set(summary["worker_nodes"])) == 2
    assert summary["steps"] == cached["steps"]
    client = mlflow.MlflowClient(mlflow_uri)
    want = loss_history(client, cached["mlflow_run_id"])
    got = loss_history(client, summary["mlflow_run_id"])
    assert len(got) == len(want) == summary["steps"]
    assert got == pytest.approx(want, rel=1e-3)
    assert summary["eval_accuracy"] == pytest.approx(cached["eval_accuracy"], abs=1e-6)
