"""Smoke test on the real preset (SmolLM2-135M-Instruct from the PyPI GGUF, cached)."""

import pytest

from draftlab.config import SamplingParams
from draftlab.decoding.engine import SpeculativeDecoder, autoregressive_generate
from draftlab.decoding.tree import Tree, load_tree
from draftlab.models.drafters import init_drafter
from draftlab.models.target import load_target

pytestmark = pytest.mark.slow


def test_smollm2_greedy_speculative_identical():
    target = load_target("smollm2-135m")
    assert target.vocab_size == 49152 and target.model.config.num_hidden_layers == 30
    ids = target.encode_prompt("What is the capital of France?")
    params = SamplingParams(max_new_tokens=24)
    ref = autoregressive_generate(target, ids, params)
    assert "Paris" in ref.text  # a real pretrained instruct model, not random weights
    drafter = init_drafter("parallel", target, k=4, depth=1)
    for tree in (Tree.chain(4), load_tree("default")):
        out = SpeculativeDecoder(target, drafter, tree).generate(ids, params)
        assert out.tokens == ref.tokens, tree.name
