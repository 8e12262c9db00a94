"""Smoke test on the real preset (SmolLM2-135M-Instruct from the PyPI GGUF, cached)."""

import pytest
import torch

from draftlab.config import SamplingParams
from draftlab.data.prompts import load_prompts
from draftlab.decoding.cache import keep_rows
from draftlab.decoding.engine import SpeculativeDecoder, autoregressive_generate
from draftlab.decoding.tree import Tree, load_tree
from draftlab.models.drafters.build import init_drafter
from draftlab.models.target import load_target
from oracle import OracleDrafter

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def target():
    return load_target("smollm2-135m")


def test_smollm2_greedy_speculative_identical(target):
    assert target.vocab_size == 49152 and target.model.config.num_hidden_layers == 30
    ids = target.encode_prompt("What is the capital of France?")
    params = SamplingParams(max_new_tokens=24)
    ref = autoregressive_generate(target, ids, params)
    assert "Paris" in ref.text  # a real pretrained instruct model, not random weights
    drafter = init_drafter("parallel", target, k=4, depth=1)
    for tree in (Tree.chain(4), load_tree("default")):
        out = SpeculativeDecoder(target, drafter, tree).generate(ids, params)
        assert out.tokens == ref.tokens, tree.name


def test_smollm2_verify_rows_equal_decoding_bitwise(target):
    """Every row of a 4-row verify block equals the decoding step at its position, bit for
    bit, on the real bf16 target with a packaged prompt, for blocks starting at each of 48
    positions (with the kernel's work split across threads, some of these rows differed).

    In float32 (CPUs without AMX/AVX512-BF16, where `dtype: auto` picks it) MKL's sgemm
    rounds a row differently for 1-3 rows than for 4+ (measured on an AVX2 EPYC), so there
    rows match decoding to float32 precision and pick the same token, not bit for bit."""
    exact = target.dtype == torch.bfloat16
    prompt = next(p for p in load_prompts() if p.category == "writing")
    ids = target.encode_prompt(prompt.messages)
    cache = target.new_cache()
    logits, _ = target.forward(torch.tensor(ids), torch.arange(len(ids)), cache)
    tokens, decoded = [int(logits[-1].argmax())], []  # decoded[i]: the step that fed tokens[i]
    for i in range(52):
        step, _ = target.forward(torch.tensor(tokens[-1:]), torch.tensor([len(ids) + i]), cache)
        decoded.append(step[0])
        tokens.append(int(step[0].argmax()))
    cache = target.new_cache()
    target.forward(torch.tensor(ids), torch.arange(len(ids)), cache)
    for s in range(48):
        ctx = len(ids) + s
        block, _ = target.forward(
            torch.tensor(tokens[s : s + 4]),
            torch.arange(ctx, ctx + 4),
            cache,
            rows=[ctx + i + 1 for i in range(4)],
        )
        for i in range(4):
            if exact:
                assert torch.equal(block[i], decoded[s + i]), f"block at {ctx}, row {i}"
            else:
                torch.testing.assert_close(
                    block[i], decoded[s + i], rtol=0, atol=1e-3, msg=f"block at {ctx}, row {i}"
                )
                assert int(block[i].argmax()) == int(decoded[s + i].argmax()), (
                    f"block at {ctx}, row {i}"
                )
        keep_rows(cache, ctx, [0])  # keep the first row: the cache advances one token


@pytest.mark.parametrize(
    "tree", [Tree.chain(4), load_tree("default").with_ngram()], ids=["chain-4", "default+ngram"]
)
def test_smollm2_accepted_drafts_identical(target, tree):
    """Accepted rows (and the KV rows they leave in the cache) in bf16 on the real target:
    an oracle drafter right for two tokens per round, then wrong."""
    ids = target.encode_prompt("Write a short story about a lighthouse keeper and a storm.")
    params = SamplingParams(max_new_tokens=40)  # >= 13 rounds
    ref = autoregressive_generate(target, ids, params)
    out = SpeculativeDecoder(target, OracleDrafter(target, ids, wrong_after=2), tree).generate(
        ids, params
    )
    assert out.tokens == ref.tokens
    assert out.stats.tau > 2.0  # drafts were accepted, not only rejected
