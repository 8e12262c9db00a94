"""Training batches against a hand-checked example of the ParallelSpec layout."""

import torch

from draftlab.config import TrainConfig
from draftlab.distill.batching import collate
from draftlab.distill.objective import Stats


def test_hand_checked_example_k3():
    # x = [10, 11, 12, 13, 14, 15], prompt = first 3 tokens. Entries e_i = (x_{i+1}, h_i):
    # e_0=(11,h0) e_1=(12,h1) e_2=(13,h2) e_3=(14,h3) e_4=(15,h4); L' = 5, K = 3.
    b = collate(
        [{"input_ids": [10, 11, 12, 13, 14, 15], "prompt_len": 3}],
        k=3,
        max_seq_len=64,
        drop_tokens=False,
        generator=None,
    )
    depth = b.depth[0].tolist()
    anchor = b.node_anchor[0].tolist()
    assert depth == [0] * 5 + [1] * 3 + [2] * 2  # depth d keeps anchors with a + d + 1 < 5
    assert anchor == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1]
    assert b.node_token[0].tolist() == [11, 12, 13, 14, 15, 0, 0, 0, 0, 0]
    assert b.mask_idx[0].tolist() == [-1] * 5 + [0] * 3 + [1] * 2
    assert b.position_ids[0].tolist() == [1, 2, 3, 4, 5, 2, 3, 4, 3, 4]  # a + d + 1
    # node (a, d) learns x_{a+d+2} with the teacher state h_{a+d+1}
    assert b.teacher_idx[0].tolist()[:8] == [1, 2, 3, 4, 0, 2, 3, 4]
    assert b.label[0].tolist()[:4] == [12, 13, 14, 15]
    assert b.label[0].tolist()[5:] == [13, 14, 15, 14, 15]
    # loss only where the label is a response token (index >= 3) and a label exists
    assert b.loss_mask[0].tolist() == [False, True, True, True, False, True, True, True, True, True]
    allowed = b.attention_mask()[0, 0]
    # mask 2 of anchor 1 (node 9) sees real entries 0..1, its own mask 1 (node 6) and itself
    assert allowed[9].nonzero().flatten().tolist() == [0, 1, 6, 9]
    assert b.response_tokens == 3
    # loss_on_prompt: every node with a label carries loss (node 4 has none)
    b = collate(
        [{"input_ids": [10, 11, 12, 13, 14, 15], "prompt_len": 3}],
        k=3,
        max_seq_len=64,
        drop_tokens=False,
        generator=None,
        loss_on_prompt=True,
    )
    assert b.loss_mask[0].tolist() == [True, True, True, True, False, True, True, True, True, True]


def test_padding_rows_are_isolated_and_hidden_is_batched():
    h1, h2 = torch.randn(5, 8), torch.randn(8, 8)
    rows = [
        {"input_ids": [1, 2, 3, 4, 5], "prompt_len": 2, "hidden": h1.half()},
        {"input_ids": list(range(1, 9)), "prompt_len": 2, "hidden": h2.half()},
    ]
    b = collate(rows, k=2, max_seq_len=64, drop_tokens=False, generator=None)
    assert b.hidden.shape == (2, 8, 8)
    torch.testing.assert_close(b.hidden[0, :5], h1.half().float())
    m0 = int(b.depth.shape[1])
    n0 = 4 + 2  # sample 0: 4 entries at depth 0, 2 at depth 1
    pad = b.attention_mask()[0, 0, n0:, :]
    assert pad.sum(-1).tolist() == [1] * (m0 - n0)  # padding nodes attend only to themselves
    assert not b.loss_mask[0, n0:].any()


def test_drop_tokens_subsamples_deep_groups():
    g = torch.Generator().manual_seed(0)
    b = collate(
        [{"input_ids": list(range(101)), "prompt_len": 1}],
        k=4,
        max_seq_len=512,
        drop_tokens=True,
        generator=g,
    )
    counts = [int((b.depth[0] == d).sum()) for d in range(4)]
    assert counts == [100, 70, 48, 34]  # floor(100 * max(0.7^d, 0.2))


def test_sim_accept_len():
    s = Stats(3, nodes=[10, 10, 10], agree=[8, 5, 10])
    assert s.accuracy == [0.8, 0.5, 1.0]
    assert abs(s.sim_accept_len - (1 + 0.8 + 0.4 + 0.4)) < 1e-9
    assert TrainConfig().kl_weight == 1.0
