"""Replaying held-out text round by round: the rounds the real engine runs, lookups included."""

import pytest
import torch

from draftlab.config import NgramSpec, SamplingParams, TargetSpec, TrainConfig
from draftlab.decoding.engine import SpeculativeDecoder, autoregressive_generate
from draftlab.decoding.ngram import NgramStore
from draftlab.decoding.tree import Tree
from draftlab.distill.batching import collate
from draftlab.distill.objective import DistillModule, loss_and_backward, teacher_states
from draftlab.distill.ranks import acceptance_rates, rank_tables
from draftlab.distill.replay import Replay, RoundCost, extrapolate, replay
from draftlab.models.drafters.build import init_drafter
from draftlab.models.target import load_target

GREEDY = SamplingParams(max_new_tokens=48)
LOOKUP = NgramSpec(
    tokens=2, min_match=1, max_match=2, grow_to=8
)  # copies grow: state across rounds
CARRIED = LOOKUP.model_copy(update={"extend": 2})  # and lookups carry on the likeliest path
WHOLE = CARRIED.model_copy(
    update={"extend_from": 3}
)  # its whole path alone (k=3; 2-deep trees: theirs)


@pytest.fixture(scope="module")
def texts(tiny_prompts):
    """The tiny target in float32 (in bf16, teacher-forced and incremental logits differ
    enough to swap near-tied ranks), its greedy responses, and a drafter overfit on them so
    that its drafts are accepted at every depth some of the time."""
    tiny = load_target(TargetSpec(name="tiny-llama", dtype="float32"))
    rows = []
    for ids in tiny_prompts:
        out = autoregressive_generate(tiny, ids, GREEDY).tokens
        rows.append({"input_ids": ids + out, "prompt_len": len(ids)})
    drafter = init_drafter("parallel", tiny, k=3, depth=1, seed=0)
    batch = collate(rows, 3, 512, False, None)
    hidden = teacher_states(tiny, batch)
    module, opt = DistillModule(drafter), torch.optim.Adam(drafter.parameters(), lr=1e-2)
    for _ in range(60):
        loss_and_backward(module, drafter, batch, hidden, TrainConfig(), 3)
        opt.step()
        opt.zero_grad()
    return tiny, drafter.eval(), rows


@pytest.mark.parametrize(
    "ngram, with_store",
    [(None, False), (LOOKUP, False), (LOOKUP, True), (CARRIED, True), (WHOLE, True)],
    ids=[
        "tree",
        "tree+lookup",
        "tree+lookup+store",
        "tree+lookup+store+carried",
        "tree+lookup+store+carried-whole",
    ],
)
@pytest.mark.parametrize(
    "paths", [[[0]], [[0], [0, 0], [0, 0, 0]], [[0], [1], [0, 0], [1, 0]]], ids=str
)
def test_replay_runs_the_rounds_the_engine_runs(tiny_prompts, texts, paths, ngram, with_store):
    tiny, drafter, rows = texts
    tree = Tree.from_paths(paths)
    served = tree.with_ngram(ngram) if ngram else tree
    # a store of other text than the replayed: its drafts are mostly wrong, and cost rows
    store = (
        NgramStore.build([row["input_ids"][::-1] for row in rows], NgramSpec())
        if with_store
        else None
    )
    dec = SpeculativeDecoder(tiny, drafter, served, store)
    rounds = tokens = 0
    for ids, row in zip(tiny_prompts, rows, strict=True):
        out = dec.generate(ids, GREEDY)
        assert ids + out.tokens == row["input_ids"]  # greedy identity: the replayed text
        rounds, tokens = (
            rounds + out.stats.rounds,
            tokens + len(out.tokens) - 1,
        )  # the first: prefill
    run = replay(rank_tables(drafter, tiny, rows, 3), rows, tree, RoundCost(1.0, 2.0), ngram, store)
    assert (run.rounds, run.tokens) == (rounds, tokens)
    assert run.tau > 1.0  # drafts were accepted: the check compares real walks
    assert (run.lookup_rounds > 0) == (ngram is not None)


def test_round_costs_and_shared_branch_rows():
    """Prompt 1 2 3 4 1, response 2 3 4 5 6; the tree's ranks by hand."""
    ids = [1, 2, 3, 4, 1, 2, 3, 4, 5, 6]
    table = torch.full((len(ids) - 1, 2), 3)  # rank 3: not in the tree
    table[4] = torch.tensor([0, 3])  # after root x_5 = 2 the tree accepts 3, not 4
    rows = [{"input_ids": ids, "prompt_len": 5}]
    tree, cost = (
        Tree.from_paths([[0], [0, 0]]),
        RoundCost(draft_ms=1.0, verify_ms=10.0, graft_row_ms=2.0),
    )
    plain = replay([table], rows, tree, cost)
    assert (plain.rounds, plain.tokens, plain.lookup_rounds) == (3, 4, 0)  # 3 4 | 5 | 6
    assert plain.ms == 3 * 11.0 and plain.tau == 4 / 3
    run = replay([table], rows, tree, cost, NgramSpec(tokens=3, min_match=1, max_match=2))
    # round 1: "1 2" was followed by 3 4 1: two match, one beyond the tree's, so 3 4 5 are
    # committed and the branch adds 2 rows (its 3 is the tree's node); round 2: no match
    assert (run.rounds, run.tokens, run.lookup_rounds) == (2, 4, 1)
    assert run.ms == 11.0 + 2 * 2.0 + 11.0
    assert run.speedup(11.0) == pytest.approx(4 * 11.0 / run.ms)
    cost = RoundCost(draft_ms=1.0, verify_ms=10.0, graft_row_ms=2.0, carried_row_ms=3.0)
    carried = replay(
        [table], rows, tree, cost, NgramSpec(tokens=3, min_match=1, max_match=2, extend=2)
    )
    # round 1 also carries on x's prefixes 3 and 3 4 (ranks 0, then 3): "2 3" was followed by
    # 4 1 (one more accepted, as the copy has), "3 4" by 1 2 (its prefix is not the drafter's
    # likeliest); both pay their 2 rows, off the leading chain. Round 2: nothing follows "5 6"
    # or "6"
    assert (carried.rounds, carried.tokens) == (2, 4)
    assert carried.ms == run.ms + 4 * 3.0  # carried-on rows at their own (tree-row) price
    whole = replay(
        [table],
        rows,
        tree,
        cost,
        NgramSpec(tokens=3, min_match=1, max_match=2, extend=2, extend_from=2),
    )
    assert (whole.rounds, whole.tokens) == (
        2,
        4,
    )  # "3 4" alone is carried on: the same tokens, half the rows
    assert whole.ms == run.ms + 2 * 3.0
    assert Replay().tau == 1.0


def test_extrapolated_depths_follow_the_rates():
    table = torch.tensor([[0], [1], [0], [-1]])  # 4 anchors, 1 measured depth
    wide = extrapolate([table] * 400, [[1.0, 0.0], [0.5, 0.25]])
    assert all(w.shape == (4, 2) and w[:, 0].tolist() == [0, 1, 0, -1] for w in wide)
    assert all(
        w[3:, 1].tolist() == [-1] and w[2:, 1].tolist() == [-1, -1] for w in wide
    )  # past the end
    drawn = torch.cat([w[:2, 1] for w in wide])  # (800,)
    share = [(drawn == r).float().mean().item() for r in (0, 1, 2)]
    assert share == pytest.approx([0.5, 0.25, 0.25], abs=0.06)
    assert extrapolate([table], [[1.0, 0.0]])[0] is table
    assert acceptance_rates(wide, 2)[1] == pytest.approx([0.5, 0.25], abs=0.06)
