"""Row-exact attention: a verified block reproduces token-by-token decoding bit for bit.

The model is a random GQA Llama (4 query heads on 2 KV heads of dim 64) in bfloat16. With a
30-token context, plain SDPA over a block, or key counts padded to anything but whole
16-key blocks, gives rows that differ in the last bits from decoding (the tests fail with
`attention.BLOCK = 1`): that is what row-exact attention must remove.
"""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draftlab.decoding.ngram import graft
from draftlab.decoding.tree import load_tree
from draftlab.models import attention
from draftlab.models.target import (
    Target,
    cpu_has_amx_bf16,
    cpu_has_fast_bf16,
    rows_invariant_linears,
)

PREFIX = torch.arange(30) % 23 + 3


def _prefilled(target):
    cache = target.new_cache()
    target.forward(PREFIX, torch.arange(len(PREFIX)), cache)
    return cache


def _stepwise(target, path: list[int]) -> torch.Tensor:
    """Logits (len(path), V) of feeding `path` one token per forward after the prefix."""
    cache, ctx = _prefilled(target), len(PREFIX)
    rows = [target.forward(torch.tensor([tok]), torch.tensor([ctx + i]), cache)[0] for i, tok in enumerate(path)]
    return torch.cat(rows)


@pytest.fixture(scope="module")
def tiny_bf16(tiny):
    if not cpu_has_fast_bf16():
        pytest.skip("bit-exact bf16 rows rely on oneDNN's AMX or AVX512-BF16 matmuls")
    cfg = LlamaConfig(
        vocab_size=tiny.vocab_size, hidden_size=256, intermediate_size=1536, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    attention.install(model)
    if not cpu_has_amx_bf16():  # as load_target does
        rows_invariant_linears(model)
    return Target("gqa-bf16", model, tiny.tokenizer, "random")


@pytest.mark.parametrize("path", [[4, 9, 33, 12, 6], [7, 1, 2, 40, 5, 5, 8, 19, 3, 11, 6, 2, 9, 30]])
def test_chain_block_equals_token_by_token_bitwise(tiny_bf16, path):
    ctx = len(PREFIX)
    cache = _prefilled(tiny_bf16)
    rows = [ctx + i + 1 for i in range(len(path))]
    block, _ = tiny_bf16.forward(torch.tensor(path), torch.arange(ctx, ctx + len(path)), cache, rows=rows)
    assert torch.equal(block, _stepwise(tiny_bf16, path))


@pytest.mark.parametrize("grafted", [False, True], ids=["static", "grafted"])
def test_tree_rows_see_only_their_ancestors_bitwise(tiny_bf16, grafted):
    """Rows of a tree block equal decoding their root-to-node paths. A grafted tree's branch
    leads the block as a chain: those rows read the cache in place (`RowPlan.prefix`), the
    others gather their keys; a static (len, lex)-ordered tree leads with the root and [0]."""
    tree = load_tree("small-6")
    tokens = [4, 9, 33, 12, 6, 21, 14][: tree.num_nodes + 1]
    if grafted:
        tree, tokens = graft(tree, tokens, [9, 6, 40, 41])
    ctx = len(PREFIX)
    cache = _prefilled(tiny_bf16)
    seen = [row.nonzero()[:, 0] for row in tree.ancestor_mask]
    plan = attention.RowPlan.tree(ctx, torch.nn.utils.rnn.pad_sequence(seen, batch_first=True), torch.tensor([len(s) for s in seen]))
    assert plan.prefix == (5 if grafted else 2)
    explicit = attention.RowPlan.build([torch.cat([torch.arange(ctx), ctx + s]) for s in seen])
    assert torch.equal(plan.mask, explicit.mask)
    assert torch.equal(plan.index[plan.mask[:, 0, 0]], explicit.index[explicit.mask[:, 0, 0]])
    positions = ctx + tree.depths
    block, _ = tiny_bf16.forward(torch.tensor(tokens), positions, cache, rows=plan)
    for node, s in enumerate(seen):  # each node's row equals decoding its root-to-node path
        path = [tokens[i] for i in s.tolist()]
        assert torch.equal(block[node], _stepwise(tiny_bf16, path)[-1]), f"node {node}"


def test_rows_must_match_queries(tiny):
    cache = _prefilled(tiny)
    with pytest.raises(ValueError, match="2 rows for 3 queries"):
        tiny.forward(torch.tensor([1, 2, 3]), torch.arange(10, 13), cache, rows=[11, 12])


def test_single_rows_equal_batched_rows_bitwise():
    """The reason for `rows_invariant_linears`: without AMX, a bf16 GEMV (one row) rounds a
    few outputs of a 1536-wide reduction differently from the 2+ row kernel."""
    if not cpu_has_fast_bf16():
        pytest.skip("bf16 matmuls are slow here: targets run in float32")
    torch.manual_seed(0)
    lin = torch.nn.Linear(1536, 576, bias=False).to(torch.bfloat16)
    rows_invariant_linears(lin)
    x = torch.randn(17, 1536, dtype=torch.bfloat16)
    for m in (2, 5, 9, 17):
        block = lin(x[:m])
        for i in range(m):
            assert torch.equal(block[i], lin(x[i : i + 1])[0]) and torch.equal(block[i], lin(x[i]))
