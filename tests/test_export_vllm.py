"""`draftlab export --format vllm`: vLLM (CPU wheel, real engine) runs our P-EAGLE drafter
with the math our engine runs.

A tiny target (head_dim 64: vLLM's CPU attention has no smaller kernel) and a p-eagle
drafter trained here for a few seconds to agree with it, so drafts are accepted at several
positions. Both engines run float32 so that their numerics agree to the last bits that a
greedy argmax can see; one vLLM engine with and one without the drafter for the module.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from draftlab.config import SamplingParams, TargetSpec, TrainConfig
from draftlab.decoding.engine import SpeculativeDecoder, autoregressive_generate
from draftlab.decoding.tree import Tree
from draftlab.distill.batching import collate
from draftlab.distill.objective import DistillModule, loss_and_backward, teacher_states
from draftlab.export import export_vllm, vllm_speculative_config, vllm_target_dir
from draftlab.models.drafters.build import init_drafter, load_drafter
from draftlab.models.target import load_target

pytest.importorskip("vllm")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

K = 3
NEW = 40
TEXTS = [
    "Hello world",
    "The quick brown fox",
    "1 + 1 =",
    "Write a poem about the sea.",
    "abc",
    "Tell me a story",
]


@pytest.fixture(scope="module")
def target():
    return load_target(TargetSpec(name="tiny-llama-vllm", dtype="float32"))


@pytest.fixture(scope="module")
def prompts(target):
    return [target.encode_prompt(t) for t in TEXTS]


@pytest.fixture(scope="module")
def drafter_dir(target, prompts, tmp_path_factory):
    """A p-eagle drafter fitted to the target's own greedy continuations (a few seconds)."""
    rows = []
    for ids in prompts + [target.encode_prompt(t + "!") for t in TEXTS]:
        out = autoregressive_generate(target, ids, SamplingParams(max_new_tokens=NEW)).tokens
        rows.append({"input_ids": ids + out, "prompt_len": len(ids)})
    drafter = init_drafter("p-eagle", target, k=K, depth=1, seed=0, vocab_size=64)
    drafter.set_vocab(torch.arange(64))
    drafter.train()
    batch = collate(rows, K, 512, False, None)
    feats = teacher_states(target, batch, drafter.cfg.aux_layers)
    module, cfg = DistillModule(drafter), TrainConfig(lr=3e-3)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(150):
        loss_and_backward(module, drafter, batch, feats, cfg, K)
        opt.step()
        opt.zero_grad()
    path = tmp_path_factory.mktemp("drafter") / "p-eagle"
    drafter.eval().save(path)
    return path


@pytest.fixture(scope="module")
def exported(drafter_dir, target, tmp_path_factory):
    return export_vllm(drafter_dir, tmp_path_factory.mktemp("export") / "vllm", target)


@pytest.fixture(scope="module")
def vllm_runs(target, prompts, exported):
    """vLLM's greedy runs without and with the exported drafter (one engine at a time)."""
    from draftlab.vllm_offline import VllmEngine

    model = vllm_target_dir(target)
    out = {}
    for name, spec in (("ar", None), ("draftlab", vllm_speculative_config(exported, K))):
        # memory 0.3: in-process, vLLM's KV budget is this share of RAM minus what pytest holds
        with VllmEngine(
            model,
            dtype=torch.float32,
            max_model_len=512,
            speculative_config=spec,
            in_process=True,
            memory_fraction=0.3,
        ) as llm:
            out[name] = [llm.generate(ids, NEW) for ids in prompts]
    return out


def test_export_layout(exported, drafter_dir, target):
    cfg = json.loads((exported / "config.json").read_text())
    ours = load_drafter(drafter_dir, target)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == ours.cfg.aux_layers
    assert cfg["ptd_token_id"] == ours.cfg.mask_token_id and cfg["draft_vocab_size"] == 64
    w = load_file(str(exported / "model.safetensors"))
    # d2t maps draft ids to target ids; the head rows are the target's rows of those ids.
    ids = torch.arange(64) + w["d2t"]
    assert torch.equal(ids, ours.vocab_ids)
    torch.testing.assert_close(w["lm_head.weight"], target.lm_head.weight[ids].float())
    assert w["layers.0.self_attn.q_proj.weight"].shape[1] == 2 * target.hidden_size
    assert not any("embed_tokens" in k for k in w)  # vLLM shares the target's embedding


def test_vllm_greedy_with_drafter_equals_without(vllm_runs):
    for ar, spec in zip(vllm_runs["ar"], vllm_runs["draftlab"], strict=True):
        assert spec.tokens == ar.tokens
    assert sum(r.spec.accepted for r in vllm_runs["draftlab"]) > 0, (
        "the fitted drafter should get drafts accepted"
    )


def test_vllm_acceptance_matches_our_engine(vllm_runs, target, drafter_dir, prompts):
    """Same drafter, same greedy text: vLLM accepts at each draft position what ours does."""
    drafter = load_drafter(drafter_dir, target)
    dec = SpeculativeDecoder(target, drafter, Tree.chain(K))
    ours_rounds, ours_at, theirs_rounds, theirs_at = 0, [0] * K, 0, [0] * K
    for ids, theirs in zip(prompts, vllm_runs["draftlab"], strict=True):
        out = dec.generate(ids, SamplingParams(max_new_tokens=NEW))
        assert out.tokens == theirs.tokens
        ours_rounds += out.stats.rounds
        ours_at = [a + b for a, b in zip(ours_at, out.stats.accepted_at + [0] * K, strict=False)]
        theirs_rounds += theirs.spec.drafts
        theirs_at = [
            a + b for a, b in zip(theirs_at, theirs.spec.accepted_per_position, strict=False)
        ]
    ours = [a / ours_rounds for a in ours_at]
    theirs = [a / theirs_rounds for a in theirs_at]
    print(
        f"\nper-position acceptance: ours {ours} ({ours_rounds} rounds), vLLM {theirs} "
        f"({theirs_rounds} rounds)"
    )
    assert ours[0] > 0.2  # a test that can fail: the drafter is accepted, by both
    for a, b in zip(ours, theirs, strict=True):
        assert a == pytest.approx(b, abs=0.02)


def test_export_refuses_other_families(tmp_path, target):
    init_drafter("parallel", target, k=2).save(tmp_path / "par")
    with pytest.raises(ValueError, match=r"'parallel' drafter; vLLM runs \['p-eagle'\]"):
        export_vllm(tmp_path / "par", tmp_path / "out", target)
    with pytest.raises(FileNotFoundError, match="not a drafter directory"):
        export_vllm(tmp_path / "missing", tmp_path / "out", target)


def test_export_cli(drafter_dir, tmp_path, capsys):
    from draftlab.cli import main

    assert main(["export", str(drafter_dir), str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert (
        '"parallel_drafting": true' in out and f'"num_speculative_tokens": {K}' in out
    )  # no tree.json: its K
    assert (tmp_path / "out" / "model.safetensors").is_file()
    shutil.copytree(drafter_dir, tmp_path / "served")
    (tmp_path / "served" / "tree.json").write_text(json.dumps([[0], [1], [2]]))
    assert main(["export", str(tmp_path / "served"), str(tmp_path / "out3")]) == 0
    assert (
        '"num_speculative_tokens": 1' in capsys.readouterr().out
    )  # as deep as the tree it is served with
    assert main(["export", str(tmp_path / "nothing"), str(tmp_path / "out2")]) == 2
    assert "not a drafter directory" in capsys.readouterr().err
