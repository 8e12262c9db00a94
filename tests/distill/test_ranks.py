"""Per-depth rank acceptance: the conditioning rule by hand, agreement with evaluation, and
with the engine's own acceptance."""

import pytest
import torch

from draftlab.config import SamplingParams, TargetSpec, TrainConfig
from draftlab.decoding.engine import SpeculativeDecoder, autoregressive_generate
from draftlab.decoding.tree import Tree
from draftlab.distill.batching import collate
from draftlab.distill.objective import DistillModule, loss_and_backward, teacher_states
from draftlab.distill.ranks import acceptance_rates, conditional_rates, rank_tables
from draftlab.models.drafters.build import init_drafter
from draftlab.models.target import load_target


def test_conditional_rates_by_hand():
    # anchors x depths; -1 = no node at that depth (the sequence ended), R = 2
    table = torch.tensor(
        [
            [0, 0, 1],
            [1, 0, -1],
            [0, 2, 0],  # rank 2 >= R at depth 2: never reaches depth 3
            [3, 0, 0],  # rank 3 at depth 1: reaches nothing deeper
            [-1, -1, -1],
        ]
    )
    hits, reach = conditional_rates(table, max_ranks=2)
    assert reach.tolist() == [4, 3, 1]
    assert hits.tolist() == [[2, 1], [2, 0], [0, 1]]


def test_depth1_rank0_equals_evaluated_agreement():
    tiny = load_target(TargetSpec(name="tiny-llama", dtype="float32"))
    g = torch.Generator().manual_seed(0)
    rows = [
        {
            "input_ids": torch.randint(3, tiny.vocab_size, (40,), generator=g).tolist(),
            "prompt_len": 5,
        }
        for _ in range(4)
    ]
    drafter = init_drafter("parallel", tiny, k=3, depth=1, seed=0)
    batch = collate(rows, 3, 512, False, None)
    hidden = teacher_states(tiny, batch)
    module, cfg = DistillModule(drafter), TrainConfig()
    opt = torch.optim.Adam(drafter.parameters(), lr=1e-2)
    for _ in range(40):  # overfit a little so that agreement is far from 0
        loss_and_backward(module, drafter, batch, hidden, cfg, 3)
        opt.step()
        opt.zero_grad()
    stats = loss_and_backward(module, drafter, batch, hidden, cfg, 3, backward=False)
    assert stats.accuracy[0] > 0.3
    acc = acceptance_rates(rank_tables(drafter, tiny, rows, k=3, batch_size=2), max_ranks=3)
    assert len(acc) == 3 and all(len(row) == 3 for row in acc)
    assert all(0.0 <= a <= 1.0 for row in acc for a in row) and all(
        sum(row) <= 1.0 + 1e-9 for row in acc
    )
    assert abs(acc[0][0] - stats.accuracy[0]) < 1e-9


@pytest.mark.parametrize("family", ["parallel", "p-eagle"])
def test_the_engines_acceptance_is_the_rank_tables_on_the_same_text(family):
    """The tree search trusts `rank_tables`; the engine is what users run. Replaying a chain-1
    greedy decode through the table (accepted iff the target's token ranks first, then the
    next anchor is one or two tokens on) must give the engine's own round-by-round outcome."""
    target = load_target(
        TargetSpec(name="tiny-llama-v8", dtype="float32")
    )  # 8 tokens: partial acceptance
    drafter = init_drafter(family, target, k=1, depth=1, seed=3)
    prompt, new = [0, 3, 5, 1, 6, 2], 40
    text = (
        prompt
        + autoregressive_generate(target, prompt, SamplingParams(max_new_tokens=new + 4)).tokens
    )
    assert len(text) == len(prompt) + new + 4  # no EOS in this vocabulary
    table = rank_tables(drafter, target, [{"input_ids": text, "prompt_len": len(prompt)}], k=1)[0][
        :, 0
    ]  # (L-1,)

    session = SpeculativeDecoder(target, drafter, Tree.chain(1)).start(
        prompt, SamplingParams(max_new_tokens=new)
    )
    engine, expected, anchor = (
        [],
        [],
        len(prompt) - 1,
    )  # anchor: x_0..x_{a+1} committed (the prompt + its first token)
    while not session.done:
        before = session.stats.accepted
        session.step()
        engine.append(session.stats.accepted - before)
        expected.append(
            int(table[anchor] == 0)
        )  # the target's next token ranks first: the draft is accepted
        anchor += 1 + expected[-1]
    assert 0 < sum(engine) < len(engine), engine  # both outcomes occur
    assert engine == expected
    assert session.tokens == text[len(prompt) :][:new]
