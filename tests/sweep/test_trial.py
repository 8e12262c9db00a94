"""The pieces of a sweep trial without Tune: training plans and keys, tree resolution, the
multi-tree bench, and the CLI's errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from draftlab.bench import bench_loaded
from draftlab.cli import main
from draftlab.config import BenchConfig
from draftlab.decoding.tree import Tree, load_tree
from draftlab.decoding.tree_files import resolve_tree
from draftlab.decoding.tree_search import best_tree
from draftlab.sweep.trial import SweepContext, plan

ROOT = Path(__file__).resolve().parents[2]
BASE = yaml.safe_load((ROOT / "jobs/configs/smollm2-135m-parallel-k4.yaml").read_text())


def _ctx(tmp_path) -> SweepContext:
    return SweepContext(
        sweep="s",
        base=BASE,
        trees=["chain"],
        trainings=str(tmp_path / "trainings"),
        data_path="unused",
        tracking_uri="sqlite:///unused.db",
        experiment="e",
        parent_run_id=None,
    )


def test_trials_differing_only_in_tree_share_one_training(tmp_path):
    ctx = _ctx(tmp_path)
    a = plan({"drafter.k": 3, "tree": "chain"}, ctx)
    b = plan({"drafter.k": 3, "tree": "searched-8"}, ctx)
    c = plan({"drafter.k": 3, "train.lr": 3e-4, "tree": "chain"}, ctx)
    assert a.key == b.key and a.dir == b.dir
    assert c.key != a.key and c.dir != a.dir
    assert a.dir.parent == tmp_path / "trainings" and a.dir.name.startswith("p-eagle-k3-d1-")
    assert a.cfg.output_dir == str(a.dir / "drafter") and a.cfg.storage_path == ctx.trainings
    assert (
        not a.cfg.bench.enabled and not a.cfg.tracking.register_model
    )  # the trial benches and promotes


def test_resolve_tree_chain_presets_and_searched(tmp_path):
    assert resolve_tree("chain", tmp_path, 3).paths == Tree.chain(3).paths
    assert resolve_tree(None, tmp_path, 3).paths == Tree.chain(3).paths  # no tree.json: the chain
    assert (
        resolve_tree(None, tmp_path, 2, fallback="small-6").name == "small-6-d2"
    )  # the bench's fallback, cut
    (tmp_path / "tree.json").write_text("[[0], [1], [0, 0]]")
    assert resolve_tree(None, tmp_path, 3).paths == load_tree(str(tmp_path / "tree.json")).paths
    assert resolve_tree("small-6", tmp_path, 2).depth == 2  # a preset is cut to the drafter's K
    assert resolve_tree("small-6", tmp_path, 5).paths == load_tree("small-6").paths
    assert (
        resolve_tree("small-6+ngram", tmp_path, 2, cut=False).paths == load_tree("small-6").paths
    )  # for an init: drafter
    acc = [[0.6, 0.2, 0.1], [0.5, 0.1, 0.05], [0.4, 0.1, 0.0]]
    (tmp_path / "tree-search.json").write_text(json.dumps({"acceptance": acc}))
    searched = resolve_tree("searched-4", tmp_path, 3)
    assert searched.paths == best_tree(acc, 4).paths and searched.name == "searched-4"
    with pytest.raises(FileNotFoundError, match="tree-search.json"):
        resolve_tree("searched-4", tmp_path / "nowhere", 3)


def test_bench_measures_named_trees_side_by_side(tiny, tmp_path):
    from draftlab.models.drafters.build import init_drafter

    drafter = init_drafter("parallel", tiny, k=3, depth=1)
    cfg = BenchConfig(
        target={"name": "tiny-llama"},
        drafter="init:parallel",
        limit=2,
        max_new_tokens=8,
        methods=["ar"],
    )
    trees = {"chain": Tree.chain(3), "small-6": load_tree("small-6").truncated(3)}
    report = bench_loaded(tiny, drafter, cfg, progress=False, trees=trees)
    assert set(report["methods"]) == {"ar", "draftlab_tree:chain", "draftlab_tree:small-6"}
    assert report["greedy_identical"]
    for name in trees:
        m = report["methods"][f"draftlab_tree:{name}"]
        assert m["forwards"] > 0 and m["speedup_vs_ar"] > 0


@pytest.mark.parametrize(
    ("args", "msg"),
    [
        (["sweep"], "exactly one of -c"),
        (["sweep", "-c", "x.yaml", "--resume", "d"], "exactly one of -c"),
        (["sweep", "--resume", "{tmp}", "k=1"], "overrides are not allowed"),
        (["sweep", "--resume", "{tmp}"], "no sweep.json"),
        (["sweep", "-c", "{tmp}/missing.yaml"], "missing.yaml"),
    ],
)
def test_sweep_cli_errors_are_clear(args, msg, tmp_path, capsys):
    assert main([a.replace("{tmp}", str(tmp_path)) for a in args]) == 2
    assert msg in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_vllm_objective_ranks_by_the_speedup_vllm_measures(tmp_path):
    """`objective: vllm`: each chain's k is measured in vLLM against `vllm_ar`, all on one
    engine of the deepest k (real vLLM on CPU, a tiny head_dim-64 target); the row's speedup
    is vLLM's."""
    pytest.importorskip("vllm")
    from draftlab.config import DistillConfig
    from draftlab.models.drafters.build import init_drafter
    from draftlab.models.target import load_target
    from draftlab.sweep.trial import _bench_trees

    target = load_target("tiny-llama-vllm")
    init_drafter("p-eagle", target, k=3, depth=1).save(tmp_path / "d")
    cfg = DistillConfig.model_validate(
        {
            "target": {"name": "tiny-llama-vllm", "dtype": "float32"},
            "drafter": {"family": "p-eagle", "k": 3},
            "output_dir": str(tmp_path / "d"),
            "bench": {"limit": 2, "max_new_tokens": 8},
        }
    )
    rows = _bench_trees(cfg.model_dump(mode="json"), ["chain-2", "chain-3"], "vllm")
    for k, out in ((2, rows["chain-2"]), (3, rows["chain-3"])):
        assert (
            out["objective"] == "vllm"
            and out["tree_depth"] == k
            and out["greedy_identical"] is True
        )
        assert out["speedup_vs_ar"] > 0 and out["tau"] >= 1.0
        assert (
            len(out["per_position_acceptance"]) == k
        )  # chain-2: the first 2 of the engine's 3 slots


GPU_BASE = yaml.safe_load(
    (ROOT / "jobs/configs/llama3-8b-parallel-k5-2x8gpu.yaml").read_text()
)  # device: cuda


def test_bench_digest_of_a_cuda_trial_needs_no_gpu(tmp_path):
    """The trial process reserves no GPU: a `device: cuda` trial's bench digest comes from the
    config strings (this machine has no CUDA at all), and still changes with whatever changes
    bench results, while a CPU trial keeps the digest its older evals files are named by."""
    import hashlib
    import platform

    import torch

    from draftlab.sweep.trial import bench_digest, bench_target

    assert not torch.cuda.is_available()
    ctx = SweepContext(
        sweep="s",
        base=GPU_BASE,
        trees=["chain"],
        trainings=str(tmp_path),
        data_path="unused",
        tracking_uri="sqlite:///unused.db",
        experiment="e",
        parent_run_id=None,
    )
    cfg = plan({"tree": "chain"}, ctx).cfg
    digest = bench_digest(cfg)
    assert bench_target(cfg).device == "cuda" and bench_target(cfg).dtype == "bfloat16"
    assert bench_digest(cfg) == digest
    changed = [
        {"bench": cfg.bench.model_copy(update={"max_new_tokens": 64})},
        {"bench": cfg.bench.model_copy(update={"prompts": "heldout"})},
        {"bench": cfg.bench.model_copy(update={"limit": 3})},
        {"target": cfg.target.model_copy(update={"dtype": "float16"})},
        {"target": cfg.target.model_copy(update={"attention": "row-exact"})},
        {
            "target": cfg.target.model_copy(update={"device": "auto"}),
            "scaling": cfg.scaling.model_copy(update={"use_gpu": False}),
        },
    ]
    digests = {bench_digest(cfg.model_copy(update=u)) for u in changed} | {
        bench_digest(cfg, "vllm"),
        digest,
    }
    assert len(digests) == len(changed) + 2
    cpu = cfg.model_copy(update=changed[-1])
    old = {
        "prompts": None,
        "limit": None,
        "max_new_tokens": 256,
        "device": "cpu",
        "dtype": "torch.bfloat16",
        "machine": platform.machine(),
    }
    assert (
        bench_digest(cpu)
        == hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()[:10]
    )


def test_multi_gpu_trials_train_on_one_node(tmp_path):
    """A trial of several GPU workers is built STRICT_PACK (one node, whatever the base
    config's placement); CPU and single-GPU trials keep the configured placement."""
    from draftlab.distill.launch import build_trainer

    def built(base: dict, params: dict) -> str:
        ctx = SweepContext(
            sweep="s",
            base=base,
            trees=["chain"],
            trainings=str(tmp_path),
            data_path="unused",
            tracking_uri="sqlite:///unused.db",
            experiment="e",
            parent_run_id=None,
        )
        p = plan({**params, "tree": "chain"}, ctx)
        return build_trainer(
            p.cfg, "unused", None, "sqlite:///unused.db"
        ).scaling_config.placement_strategy

    assert GPU_BASE["scaling"]["placement_strategy"] == "SPREAD"
    assert built(GPU_BASE, {"scaling.num_workers": 8}) == "STRICT_PACK"
    assert built(GPU_BASE, {"scaling.num_workers": 1}) == "SPREAD"
    cpu = json.loads(json.dumps(BASE))
    cpu["scaling"] = {**cpu.get("scaling", {}), "num_workers": 2, "placement_strategy": "SPREAD"}
    assert built(cpu, {}) == "SPREAD"
