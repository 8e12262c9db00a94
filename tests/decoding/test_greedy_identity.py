"""Greedy speculative output must equal target-only greedy output, token for token."""

import dataclasses

import pytest

from draftlab.config import SamplingParams
from draftlab.decoding.engine import Block, SpeculativeDecoder, autoregressive_generate, step_many
from draftlab.decoding.tree import Tree, load_tree
from draftlab.models.drafters.build import init_drafter
from oracle import OracleDrafter

PER_ROUND = dataclasses.replace(
    load_tree("wide-16").with_per_round(6), name="wide-16@6"
)  # a new shape each round
TREES = [
    Tree.chain(1),
    Tree.chain(4),
    load_tree("small-6"),
    load_tree("default"),
    load_tree("wide-16"),
    PER_ROUND,
]
GREEDY = SamplingParams(max_new_tokens=40)


# The fast tier (-m "not slow") runs every tree once and every family twice; the rest of the
# family x tree matrix runs in the full suite.
FAST = {
    ("p-eagle", "default"),
    ("p-eagle", "wide-16@6"),
    ("parallel", "chain-4"),
    ("parallel", "wide-16"),
    ("autoregressive", "chain-1"),
    ("autoregressive", "small-6"),
}
MATRIX = [
    pytest.param(
        family,
        tree,
        id=f"{tree.name}-{family}",
        marks=() if (family, tree.name) in FAST else pytest.mark.slow,
    )
    for family in ("p-eagle", "parallel", "autoregressive")
    for tree in TREES
]


@pytest.mark.parametrize("family,tree", MATRIX)
def test_untrained_drafter_identity(tiny, tiny_prompts, family, tree):
    drafter = init_drafter(family, tiny, k=4, depth=2, seed=1)
    dec = SpeculativeDecoder(tiny, drafter, tree)
    for ids in tiny_prompts:
        ref = autoregressive_generate(tiny, ids, GREEDY)
        out = dec.generate(ids, GREEDY)
        assert out.tokens == ref.tokens and out.text == ref.text
        assert out.finish_reason == ref.finish_reason
        assert out.stats.rounds >= 1 or len(ref.tokens) == 1


@pytest.mark.parametrize(
    "tree,ranks,tau_min",
    [
        (Tree.chain(4), None, 4.0),
        (load_tree("default"), [1, 0, 0, 0], 2.5),  # accepted path [1, 0]: gathered KV rows
        pytest.param(
            load_tree("wide-16"), [0, 1, 0, 0], 3.5, marks=pytest.mark.slow
        ),  # accepted path [0, 1, 0]
        pytest.param(
            load_tree("default"), [0, 0, 1, 0], 3.5, marks=pytest.mark.slow
        ),  # accepted path [0, 0, 1]
        (PER_ROUND, [0, 1, 0, 0], 3.5),  # the oracle's confidence puts [0, 1, 0] in 6 of 16 nodes
    ],
    ids=["chain", "rank1-first", "rank1-second", "rank1-third", "per-round"],
)
def test_oracle_drafter_all_accepted(tiny, tiny_prompts, tree, ranks, tau_min):
    for ids in tiny_prompts:
        ref = autoregressive_generate(tiny, ids, GREEDY)
        out = SpeculativeDecoder(tiny, OracleDrafter(tiny, ids, ranks), tree).generate(ids, GREEDY)
        assert out.tokens == ref.tokens
        if len(ref.tokens) > 12:
            assert out.stats.tau >= tau_min


def test_partial_acceptance_oracle(tiny, tiny_prompts):
    ids = tiny_prompts[1]
    ref = autoregressive_generate(tiny, ids, GREEDY)
    out = SpeculativeDecoder(tiny, OracleDrafter(tiny, ids, wrong_after=2), Tree.chain(4)).generate(
        ids, GREEDY
    )
    assert out.tokens == ref.tokens
    assert out.stats.per_position_acceptance[:2] == [1.0, 1.0]
    assert out.stats.per_position_acceptance[2:] == [0.0, 0.0]
    assert out.stats.tau == pytest.approx(3.0)


@pytest.mark.parametrize("tree", [Tree.chain(4), load_tree("default")], ids=lambda t: t.name)
def test_eos_inside_accepted_draft(tiny, tiny_prompts, tree):
    ids = tiny_prompts[0]
    free = autoregressive_generate(tiny, ids, GREEDY).tokens
    # Declare the token at output position 6 an EOS token: it falls inside the second round
    # of an all-accepting k=4 drafter (1 prefill token, then 5 per round).
    eos = free[6]
    assert eos not in free[:6]
    target = dataclasses.replace(tiny, eos_token_ids=frozenset([eos]))
    ref = autoregressive_generate(target, ids, GREEDY)
    out = SpeculativeDecoder(target, OracleDrafter(target, ids), tree).generate(ids, GREEDY)
    assert ref.tokens == free[:7] and ref.finish_reason == "stop"
    assert out.tokens == ref.tokens and out.finish_reason == "stop"


@pytest.mark.parametrize("max_new", [1, 2, 4, 8, 13])
def test_max_new_tokens_cuts_a_draft(tiny, tiny_prompts, max_new):
    ids = tiny_prompts[3]
    params = SamplingParams(max_new_tokens=max_new)
    ref = autoregressive_generate(tiny, ids, params)
    out = SpeculativeDecoder(tiny, OracleDrafter(tiny, ids), Tree.chain(4)).generate(ids, params)
    assert out.tokens == ref.tokens and len(out.tokens) == max_new
    assert out.finish_reason == "length"


def test_stop_string(tiny, tiny_prompts):
    ids = tiny_prompts[0]
    free = autoregressive_generate(tiny, ids, GREEDY)
    stop = free.text[8:10]
    params = SamplingParams(max_new_tokens=40, stop=[stop])
    ref = autoregressive_generate(tiny, ids, params)
    out = SpeculativeDecoder(tiny, OracleDrafter(tiny, ids), Tree.chain(4)).generate(ids, params)
    assert out.tokens == ref.tokens and out.text == ref.text == free.text[: free.text.find(stop)]
    assert out.finish_reason == "stop"


@pytest.mark.parametrize(
    "tree",
    [pytest.param(Tree.chain(4), marks=pytest.mark.slow), load_tree("default")],
    ids=lambda t: t.name,
)
def test_interleaved_sessions_with_plain_steps(tiny, tiny_prompts, tree):
    """A server's view: every prompt's session advanced round-robin, speculating on some
    rounds and decoding plainly on others; each output still equals target-only decoding."""
    dec = SpeculativeDecoder(tiny, init_drafter("parallel", tiny, k=4, depth=1, seed=3), tree)
    sessions = [dec.start(ids, GREEDY) for ids in tiny_prompts]
    turn = 0
    while not all(s.done for s in sessions):
        for i, s in enumerate(sessions):
            s.step(speculate=(turn + i) % 3 != 0)
        turn += 1
    for ids, s in zip(tiny_prompts, sessions, strict=True):
        ref = autoregressive_generate(tiny, ids, GREEDY)
        assert s.result().tokens == ref.tokens and s.result().finish_reason == ref.finish_reason
        assert 0 < s.stats.rounds  # plain steps count as rounds that drafted nothing


@pytest.mark.parametrize(
    "tree",
    [pytest.param(Tree.chain(4), marks=pytest.mark.slow), load_tree("default")],
    ids=lambda t: t.name,
)
def test_batched_rounds_equal_target_only(tiny, tiny_prompts, tree):
    """`step_many`: several sessions verified in one target forward (rows of different
    lengths and trees side by side, some rounds plain) still give target-only output."""
    dec = SpeculativeDecoder(tiny, init_drafter("parallel", tiny, k=4, depth=1, seed=4), tree)
    prompts = tiny_prompts + [tiny_prompts[0] * 3]  # a longer context beside short ones
    sessions = [
        dec.start(ids, SamplingParams(max_new_tokens=30 + 7 * i)) for i, ids in enumerate(prompts)
    ]
    turn = 0
    while not all(s.done for s in sessions):
        step_many(sessions, [(turn + i) % 4 != 0 for i in range(len(sessions))])
        turn += 1
    for i, (ids, s) in enumerate(zip(prompts, sessions, strict=True)):
        ref = autoregressive_generate(tiny, ids, SamplingParams(max_new_tokens=30 + 7 * i))
        assert s.result().tokens == ref.tokens


def test_block_fields_are_named_at_construction():
    """A `Block` has seven fields, three often None: positional construction is refused."""
    fields = dict(
        ids=None,
        positions=None,
        rows=[1],
        tree=None,
        draft_logits=None,
        sampled_drafts=None,
        draft_s=0.0,
    )
    assert Block(**fields).rows == [1]
    with pytest.raises(TypeError):
        Block(*fields.values())
