"""Tests for draftlab.distill.group_mask (ParallelSpec group attention mask)."""

from __future__ import annotations

import math

import pytest
import torch

from draftlab.distill.group_mask import GroupLayout, build_group_layout


def brute_force_attend(layout: GroupLayout) -> torch.Tensor:
    """attend[i, j] straight from the definition, with a double loop over node pairs."""
    anchors = layout.anchor.tolist()
    depths = layout.depth.tolist()
    m = len(anchors)
    out = torch.zeros(m, m, dtype=torch.bool)
    for i in range(m):
        a, d = anchors[i], depths[i]
        for j in range(m):
            a2, d2 = anchors[j], depths[j]
            out[i, j] = (d2 == 0 and a2 <= a) or (a2 == a and d2 <= d)
    return out


CASES = [(1, 1), (1, 3), (2, 2), (5, 1), (5, 3), (8, 4), (13, 5), (6, 8)]


@pytest.mark.parametrize("seq_len,k", CASES)
@pytest.mark.parametrize("drop_tokens", [False, True])
def test_attend_matches_brute_force(seq_len, k, drop_tokens):
    gen = torch.Generator().manual_seed(seq_len * 100 + k)
    layout = build_group_layout(seq_len, k, drop_tokens=drop_tokens, generator=gen)
    m = layout.anchor.numel()
    assert layout.attend.shape == (m, m)
    assert layout.attend.dtype == torch.bool
    assert torch.equal(layout.attend, brute_force_attend(layout))


@pytest.mark.parametrize("seq_len", [1, 2, 7, 16])
def test_k1_is_causal(seq_len):
    layout = build_group_layout(seq_len, 1)
    assert torch.equal(layout.anchor, torch.arange(seq_len))
    assert torch.equal(layout.depth, torch.zeros(seq_len, dtype=torch.long))
    causal = torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool))
    assert torch.equal(layout.attend, causal)
    add = layout.additive_mask()
    assert add.shape == (1, 1, seq_len, seq_len)
    assert torch.equal(add[0, 0] == 0, causal)
    assert torch.all(add[0, 0][~causal] == torch.finfo(torch.float32).min)
    add16 = layout.additive_mask(torch.bfloat16)
    assert add16.dtype == torch.bfloat16
    assert torch.all(add16[0, 0][~causal] == torch.finfo(torch.bfloat16).min)


def test_full_layout_nodes_positions_labels():
    seq_len, k = 6, 3
    layout = build_group_layout(seq_len, k)
    # Depth 0: all anchors; depth d >= 1: anchors with a + d + 1 < L, depth-major ordering.
    expected = [(a, 0) for a in range(seq_len)]
    for d in range(1, k):
        expected += [(a, d) for a in range(seq_len) if a + d + 1 < seq_len]
    got = list(zip(layout.anchor.tolist(), layout.depth.tolist(), strict=True))
    assert got == expected
    for dt in (layout.anchor, layout.depth, layout.position_ids, layout.label_index):
        assert dt.dtype == torch.long
    assert torch.equal(layout.position_ids, layout.anchor + layout.depth)
    for a, d, li in zip(
        layout.anchor.tolist(), layout.depth.tolist(), layout.label_index.tolist(), strict=True
    ):
        assert li == (a + d + 1 if a + d + 1 < seq_len else -1)
    # Only the last depth-0 node lacks a label.
    assert (layout.label_index == -1).nonzero().flatten().tolist() == [seq_len - 1]

    ids = torch.tensor([10, 11, 12, 13, 14, 15])
    inp = layout.input_ids(ids, mask_token=99)
    lab = layout.labels(ids, ignore_index=-100)
    for i, (a, d) in enumerate(got):
        assert inp[i].item() == (ids[a].item() if d == 0 else 99)
        assert lab[i].item() == (ids[a + d + 1].item() if a + d + 1 < seq_len else -100)
    # Batched ids work too.
    batch = torch.stack([ids, ids + 100])  # (2, L)
    assert torch.equal(layout.input_ids(batch, 99)[1], layout.input_ids(ids + 100, 99))
    assert torch.equal(layout.labels(batch)[0], lab)
    with pytest.raises(ValueError, match="ids"):
        layout.input_ids(torch.arange(seq_len + 1))


@pytest.mark.parametrize("seq_len,k", [(20, 6), (37, 8), (100, 5), (10, 10), (3, 4)])
@pytest.mark.parametrize("ratio,min_ratio", [(0.7, 0.2), (0.5, 0.3), (1.0, 1.0), (0.9, 0.1)])
def test_drop_tokens_counts_and_chains(seq_len, k, ratio, min_ratio):
    gen = torch.Generator().manual_seed(0)
    layout = build_group_layout(
        seq_len, k, drop_tokens=True, ratio=ratio, min_ratio=min_ratio, generator=gen
    )
    nodes = set(zip(layout.anchor.tolist(), layout.depth.tolist(), strict=True))
    assert len(nodes) == layout.anchor.numel()  # no duplicates
    # Depth-major ordering, anchors sorted within a depth.
    keys = list(zip(layout.depth.tolist(), layout.anchor.tolist(), strict=True))
    assert keys == sorted(keys)

    prev = set(range(seq_len))
    for d in range(k):
        kept = {a for a, dd in nodes if dd == d}
        if d == 0:
            assert kept == set(range(seq_len))
        else:
            eligible = {a for a in prev if a + d + 1 < seq_len}
            target = math.floor(seq_len * max(ratio**d, min_ratio))
            assert len(kept) == min(target, len(eligible))
            assert kept <= eligible
        prev = kept
    # Chain completeness: every (a, d) has (a, 0..d-1).
    for a, d in nodes:
        for dd in range(d):
            assert (a, dd) in nodes
    # With ratio = 1 nothing is dropped beyond the out-of-range anchors.
    if ratio == 1.0:
        assert torch.equal(layout.anchor, build_group_layout(seq_len, k).anchor)


def test_drop_tokens_reproducible():
    def make(seed):
        return build_group_layout(
            64, 6, drop_tokens=True, generator=torch.Generator().manual_seed(seed)
        )

    a, b, c = make(1234), make(1234), make(4321)
    for name in ("anchor", "depth", "position_ids", "label_index", "attend"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert not torch.equal(a.anchor, c.anchor)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(seq_len=0, k=2), "seq_len"),
        (dict(seq_len=-3, k=2), "seq_len"),
        (dict(seq_len=2.5, k=2), "seq_len"),
        (dict(seq_len=4, k=0), "k"),
        (dict(seq_len=4, k=1.0), "k"),
        (dict(seq_len=4, k=2, min_ratio=0.0), "min_ratio"),
        (dict(seq_len=4, k=2, min_ratio=-0.1), "min_ratio"),
        (dict(seq_len=4, k=2, ratio=0.1, min_ratio=0.2), "ratio"),
        (dict(seq_len=4, k=2, ratio=1.5), "ratio"),
    ],
)
def test_invalid_args(kwargs, name):
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        build_group_layout(**kwargs)


# ---------------------------------------------------------------- end-to-end equivalence


def _tiny_llama():
    from transformers import LlamaConfig, LlamaModel

    cfg = LlamaConfig(
        vocab_size=1,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        bos_token_id=None,  # vocab_size=1: keep special ids out of range checks
        eos_token_id=None,
        pad_token_id=None,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return LlamaModel(cfg).eval()


@pytest.mark.parametrize("drop_tokens", [False, True])
def test_mask_reproduces_inference_time_drafting(drop_tokens):
    seq_len, k, hidden = 9, 4, 32
    model = _tiny_llama()
    gen = torch.Generator().manual_seed(7)
    layout = build_group_layout(seq_len, k, drop_tokens=drop_tokens, ratio=0.6, generator=gen)

    tok_emb = torch.randn(seq_len, hidden, generator=gen)  # (L, H) one embedding per real token
    mask_emb = torch.randn(k, hidden, generator=gen)  # (K, H) row d = "mask d" (row 0 unused)

    is_real = (layout.depth == 0)[:, None]  # (M, 1)
    packed = torch.where(is_real, tok_emb[layout.anchor], mask_emb[layout.depth])  # (M, H)
    with torch.no_grad():
        out = model(
            inputs_embeds=packed[None],  # (1, M, H)
            attention_mask=layout.additive_mask(),  # (1, 1, M, M)
            position_ids=layout.position_ids[None],  # (1, M)
        ).last_hidden_state[0]  # (M, H)

        for i, (a, d) in enumerate(zip(layout.anchor.tolist(), layout.depth.tolist(), strict=True)):
            seq = torch.cat([tok_emb[: a + 1], mask_emb[1 : d + 1]])  # (a + 1 + d, H)
            ref = model(
                inputs_embeds=seq[None],  # (1, a + 1 + d, H)
                position_ids=torch.arange(a + d + 1)[None],  # (1, a + 1 + d)
            ).last_hidden_state[0, -1]  # (H,)
            torch.testing.assert_close(out[i], ref, atol=1e-5, rtol=0, msg=f"node {(a, d)}")


@pytest.mark.parametrize("drop_tokens", [False, True])
def test_first_anchor_keeps_depth_zero_and_drops_earlier_mask_chains(drop_tokens):
    seq_len, k, first = 30, 4, 11
    gen = torch.Generator().manual_seed(3)
    layout = build_group_layout(
        seq_len, k, drop_tokens=drop_tokens, generator=gen, first_anchor=first
    )
    real = layout.depth == 0
    assert torch.equal(layout.anchor[real], torch.arange(seq_len))  # the prompt stays as context
    lowest = int(layout.anchor[~real].min())
    assert lowest == first if not drop_tokens else lowest >= first
    assert torch.equal(layout.attend, brute_force_attend(layout))
    if not drop_tokens:  # the full layout's mask nodes from `first` on, nothing else
        full = build_group_layout(seq_len, k)
        keep = (full.depth == 0) | (full.anchor >= first)
        assert torch.equal(layout.anchor, full.anchor[keep]) and torch.equal(
            layout.depth, full.depth[keep]
        )
    else:  # drop-token counts over the L - first anchors left to the mask depths
        for d in range(1, k):
            got = int((layout.depth == d).sum())
            assert got == min(
                math.floor((seq_len - first) * max(0.7**d, 0.2)), seq_len - first - d - 1
            )
    with pytest.raises(ValueError, match="first_anchor"):
        build_group_layout(seq_len, k, first_anchor=-1)
    assert build_group_layout(5, 3, first_anchor=9).num_nodes == 5  # past the end: depth 0 only
