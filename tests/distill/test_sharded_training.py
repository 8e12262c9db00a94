"""Two Ray Train workers on CPU (gloo): held-out evaluation sharded across the ranks (every
rank gets the single-worker totals), and FSDP2 training end to end on the first rows of the
training split (`train.max_samples`): steps, a checkpoint written and resumed (sharded
optimizer state included), evaluation, the drafter exported and loadable."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import ray
import ray.train
import torch
from ray.train.torch import TorchConfig, TorchTrainer
from safetensors.torch import load_file

from distill_support import tiny_config
from draftlab.config import BenchSpec, ConfigError, DistillConfig, ScalingSpec, TrainConfig
from draftlab.distill.evaluation import evaluate
from draftlab.distill.launch import run_distill
from draftlab.distill.objective import DistillModule
from draftlab.models.drafters.build import init_drafter, load_drafter
from draftlab.models.target import load_target
from ray_support import local_ray

pytestmark = pytest.mark.slow
K = 3


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    with local_ray(num_cpus=4):
        yield


def _rows() -> list[dict]:
    """5 held-out rows: 3 batches of 2, so with 2 ranks one rank has a batch less."""
    g = torch.Generator().manual_seed(3)
    return [
        {"input_ids": torch.randint(3, 100, (n,), generator=g).tolist(), "prompt_len": 3}
        for n in (9, 14, 6, 11, 8)
    ]


def test_evaluation_is_sharded_and_every_rank_gets_the_single_worker_totals(tmp_path):
    cfg = DistillConfig(train=TrainConfig(batch_size=2))

    def per_worker(config: dict) -> dict:  # nested: Ray ships it by value
        """Each rank: the same seeded drafter, wrapped for DDP, then for FSDP; evaluate; the
        totals every rank computed and the batch sizes its forwards saw."""
        import torch.distributed as dist

        from draftlab.distill.sharding import wrap_model

        target = load_target("tiny-llama")
        mine = {}
        for strategy in ("ddp", "fsdp"):
            drafter = init_drafter("parallel", target, k=K, depth=2, seed=0).float().train()
            model = wrap_model(DistillModule(drafter), strategy, 2)
            sizes: list[int] = []
            model.register_forward_hook(
                lambda m, args, out, sizes=sizes: sizes.append(int(args[0].input_ids.shape[0]))
            )
            s = evaluate(
                model,
                target,
                datasets.Dataset.from_list(config["rows"]),
                DistillConfig.model_validate(config["cfg"]),
                K,
            )
            mine[strategy] = {"nodes": s.nodes, "agree": s.agree, "kl": s.kl, "sizes": sizes}
        everyone = [None, None]
        dist.all_gather_object(everyone, mine)
        return {"ranks": everyone}

    trainer = TorchTrainer(
        per_worker,
        train_loop_config={"rows": _rows(), "cfg": cfg.model_dump()},
        scaling_config=ray.train.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        torch_config=TorchConfig(backend="gloo"),
        run_config=ray.train.RunConfig(name="sharded-eval", storage_path=str(tmp_path)),
    )
    ranks = trainer.fit().return_value["ranks"]
    target = load_target("tiny-llama")
    drafter = init_drafter("parallel", target, k=K, depth=2, seed=0).float().train()
    ref = evaluate(
        DistillModule(drafter), target, datasets.Dataset.from_list(_rows()), cfg, K
    )  # 1 worker, no process group
    assert sum(ref.nodes) > 0
    for strategy in ("ddp", "fsdp"):
        for rank, got in enumerate(r[strategy] for r in ranks):
            assert got["nodes"] == ref.nodes and got["agree"] == ref.agree, (strategy, rank)
            assert got["kl"] == pytest.approx(ref.kl, rel=1e-9), (strategy, rank)
        # batches 0 and 2 on rank 0; batch 1 on rank 1, which re-runs batch 0 (discarded) so
        # that both ranks take part in the same number of FSDP all-gathers
        assert [r[strategy]["sizes"] for r in ranks] == [[2, 1], [2, 2]], strategy


def test_fsdp_trains_checkpoints_resumes_evaluates_and_exports(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    sections = dict(
        scaling=ScalingSpec(num_workers=2, cpus_per_worker=1, strategy="fsdp", max_failures=0),
        bench=BenchSpec(enabled=False),
    )
    # the first 8 of the 12 training rows (train.max_samples) over 2 ranks: 2 batches of 2 per
    # rank and epoch (all 12: 3)
    train = dict(
        batch_size=2,
        lr=3e-3,
        warmup_steps=2,
        checkpoint_every=2,
        eval_every=2,
        log_every=1,
        max_samples=8,
    )
    first = run_distill(
        tiny_config(tmp_path, "fsdp", uri, train=TrainConfig(epochs=2, **train), **sections),
        progress=False,
    )
    assert (first["strategy"], first["world_size"], first["steps"], first["resumed_from_step"]) == (
        "fsdp",
        2,
        4,
        0,
    )
    assert len(first["eval_accuracy"]) == K and first["eval_sim_accept_len"] >= 1.0
    curve = json.loads((Path(first["drafter_dir"]) / "training.json").read_text())
    assert [e["step"] for e in curve["evaluations"]] == [2, 4]

    # the exported drafter is the full (gathered) one: what the last checkpoint holds
    exported = load_file(str(Path(first["drafter_dir"]) / "model.safetensors"))
    saved = load_file(str(Path(first["checkpoint"]) / "drafter" / "model.safetensors"))
    assert exported.keys() == saved.keys() and all(
        torch.equal(exported[n], saved[n]) for n in saved
    )
    drafter = load_drafter(first["drafter_dir"], load_target("tiny-llama"))
    assert {n: tuple(p.shape) for n, p in drafter.state_dict().items()} == {
        n: tuple(t.shape) for n, t in saved.items()
    }

    # same name, one more epoch: resumes from step 6 with the optimizer state it had
    second = run_distill(
        tiny_config(tmp_path, "fsdp", uri, train=TrainConfig(epochs=3, **train), **sections),
        progress=False,
    )
    assert (second["resumed_from_step"], second["steps"], second["epochs_done"]) == (4, 6, 3)
    opt = load_file(str(Path(second["checkpoint"]) / "optimizer.safetensors"))
    steps = {key: float(t) for key, t in opt.items() if key.endswith("/step")}
    assert steps and set(steps.values()) == {6.0}  # AdamW counted on from the restored state
    assert all(key.split("/")[0] in saved for key in opt)  # keyed by the drafter's parameter names


def test_max_samples_past_the_training_split_fails_before_training(tmp_path):
    cfg = tiny_config(
        tmp_path,
        "too-many",
        f"sqlite:///{tmp_path / 'mlflow.db'}",
        train=TrainConfig(epochs=1, batch_size=2, max_samples=13),
    )
    with pytest.raises(ConfigError, match="train.max_samples = 13, but the training split has 12"):
        run_distill(cfg, progress=False)
