"""Acceptance walks on hand-set logits (no model)."""

import torch

from draftlab.decoding.acceptance import greedy_tokens, greedy_walk, process_logits, sampled_walk
from draftlab.decoding.tree import Tree

V = 5


def onehot_logits(tokens):
    out = torch.full((len(tokens), V), -10.0)
    out[torch.arange(len(tokens)), torch.tensor(tokens)] = 10.0
    return out


def test_greedy_tokens_pick_the_first_of_tied_maxima_as_argmax_does():
    # bf16 logits tie often; a decode step and a verify row must break ties alike.
    logits = torch.randn(13, 49152).bfloat16().float()
    top = logits.max() + 1
    for r, (i, j) in enumerate([(5, 40000), (0, 1), (49150, 49151)] * 4 + [(7, 7)]):
        logits[r, i] = logits[r, j] = top
    assert greedy_tokens(logits).tolist() == logits.argmax(-1).tolist()
    assert greedy_tokens(logits)[:3].tolist() == [5, 0, 49150]
    assert int(greedy_tokens(logits[1])) == 0  # one row, as a decode step calls it


def test_greedy_chain_partial_accept():
    t = Tree.chain(3)
    nodes = [9, 1, 2, 3]  # root + drafts
    target = onehot_logits([1, 2, 4, 0])  # argmax after root=1 ok, after 1=2 ok, after 2=4 != 3
    assert greedy_walk(t, nodes, target) == ([1, 2], 4)


def test_greedy_tree_takes_matching_sibling():
    t = Tree.from_paths([[0], [1], [1, 0]])  # nodes: 1=[0], 2=[1], 3=[1,0]
    nodes = [9, 3, 1, 2]
    target = onehot_logits([1, 0, 2, 4])  # root wants 1 -> node 2; node 2 wants 2 -> node 3; then 4
    assert greedy_walk(t, nodes, target) == ([2, 3], 4)


def test_all_rejected_gives_target_token():
    t = Tree.chain(2)
    assert greedy_walk(t, [9, 3, 3], onehot_logits([0, 0, 0])) == ([], 0)


def test_top_p_keeps_nucleus():
    p = process_logits(torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])), 1.0, 0.8)
    torch.testing.assert_close(p, torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8)
    p = process_logits(torch.log(torch.tensor([0.9, 0.1])), 1.0, 0.5)
    torch.testing.assert_close(p, torch.tensor([1.0, 0.0]))


def test_sampled_point_mass_certain_accept_and_reject():
    t = Tree.from_paths([[0], [1]])
    probs = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0]] + [[0.2] * V] * 2)
    # Target puts all mass on token 1 = second sibling: first sibling (token 3) must be
    # rejected (p=0) and the second accepted (p renormalised = 1).
    acc, bonus = sampled_walk(t, [9, 3, 1], probs, None, torch.Generator().manual_seed(0))
    assert acc == [2]
    probs0 = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0]] + [[0.2] * V] * 2)
    acc, bonus = sampled_walk(t, [9, 3, 1], probs0, None, torch.Generator().manual_seed(0))
    assert acc == [] and bonus == 4  # residual after zeroing both siblings is token 4


def test_sampled_chain_residual_excludes_overdrafted_token():
    t = Tree.chain(1)
    p = torch.tensor([[0.5, 0.5, 0, 0, 0]] + [[0.2] * V])
    q = torch.tensor([[0.0, 1.0, 0, 0, 0]])  # drafted token 1 with q=1: accept w.p. 0.5
    outcomes = [sampled_walk(t, [9, 1], p, q, torch.Generator().manual_seed(s)) for s in range(400)]
    rejected = [b for a, b in outcomes if not a]
    assert rejected and all(b == 0 for b in rejected)  # residual max(p-q,0) = token 0 only
    assert 0.4 < sum(1 for a, _ in outcomes if a) / 400 < 0.6


def test_top_p_too_small_for_float32_keeps_the_top_token():
    from draftlab.decoding.acceptance import process_logits

    logits = torch.tensor([[0.5, 3.0, 1.0, -2.0]])
    for top_p in (5e-324, 1e-300, 1e-9):
        probs = process_logits(logits, 1.0, top_p)
        assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0]])), top_p
