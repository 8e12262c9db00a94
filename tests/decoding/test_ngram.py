"""Prompt-lookup drafts grafted onto the drafter's tree: the index, the graft, and greedy
identity when the grafted nodes are the ones the target accepts."""

import pytest

from draftlab.config import NgramSpec, SamplingParams
from draftlab.decoding.engine import SpeculativeDecoder, autoregressive_generate
from draftlab.decoding.ngram import NgramIndex, graft
from draftlab.decoding.tree import RoundTree, Tree, load_tree
from draftlab.models.drafters.build import init_drafter
from oracle import OracleDrafter

GREEDY = SamplingParams(max_new_tokens=40)


def test_index_proposes_what_followed_the_latest_longest_match():
    spec = NgramSpec(tokens=3, min_match=1, max_match=3)
    #          0  1  2  3  4  5  6  7  8  9
    toks = [7, 1, 2, 3, 9, 1, 2, 4, 5, 2]
    idx = NgramIndex(spec, toks)
    assert idx.propose() == [4, 5, 2]  # "2" last followed at 6 (latest), not at 2
    idx.extend([3])  # suffix "2 3" matches at 2..3 (length 2 beats the 1-gram "3")
    assert idx.propose() == [9, 1, 2]
    idx.extend([8])  # "8" never seen before: no 1..3-gram match
    assert idx.propose() == []


def test_index_min_match_and_incremental_equals_fresh():
    spec = NgramSpec(tokens=4, min_match=2, max_match=2)
    toks = [1, 2, 3, 4, 1, 2]
    assert NgramIndex(spec, toks).propose() == [3, 4, 1, 2]
    assert NgramIndex(spec, [5, 6, 1, 3, 1]).propose() == []  # only 1-gram matches
    grown = NgramIndex(spec, toks[:2])
    for t in toks[2:]:
        grown.extend([t])
    assert (
        grown.propose() == NgramIndex(spec, toks).propose()
        and grown._next == NgramIndex(spec, toks)._next
    )


def test_ngram_spec_validates():
    with pytest.raises(ValueError, match="min_match"):
        NgramSpec(min_match=3, max_match=2)


def test_graft_shares_prefixes_and_adds_the_rest():
    tree = load_tree("small-6")  # [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    nodes = [100, 10, 11, 20, 21, 22, 30]  # root, then one token per node
    assert tree.parents == [-1, 0, 0, 1, 1, 2, 3]
    same, ids = graft(tree, nodes, [10, 20, 30])  # the top-1 chain itself: nothing new
    assert same is tree and ids == nodes
    grown, ids = graft(tree, nodes, [10, 21, 40, 41])  # follows [0], [0, 1], then two new nodes
    assert isinstance(grown, RoundTree)
    # the branch leads (root, [0], [0, 1], 40, 41), then the static tree's other nodes
    assert ids == [100, 10, 21, 40, 41, 11, 20, 22, 30]
    assert grown.parents == [-1, 0, 1, 2, 3, 0, 1, 5, 6]
    assert grown.depths.tolist() == [0, 1, 2, 3, 4, 1, 2, 2, 3]
    assert grown.children[0] == [1, 5] and grown.children[1] == [2, 6] and grown.children[3] == [4]
    anc, counts = grown.ancestor_rows
    assert anc[4, : counts[4]].tolist() == [0, 1, 2, 3, 4] and anc[8, : counts[8]].tolist() == [
        0,
        1,
        6,
        8,
    ]
    fresh, ids = graft(Tree.chain(2), [100, 10, 20], [55])  # a new root child beside the chain
    assert fresh.parents == [-1, 0, 0, 2] and not fresh.is_chain and ids == [100, 55, 10, 20]
    longer, _ = graft(Tree.chain(2), [100, 10, 20], [10, 20, 30])  # agrees, then goes deeper
    assert longer.is_chain and longer.depth == 3


class TruthLookup:
    """Stands in for the session's `NgramIndex`: proposes the target's true greedy
    continuation, right for `right` tokens and then wrong, so grafted nodes are what the
    target accepts (the random tiny target rarely repeats itself, so real lookups seldom hit)."""

    def __init__(self, truth: list[int], prompt_len: int, right: int, vocab: int):
        self.truth, self.seen, self.right, self.vocab = truth, -prompt_len - 1, right, vocab

    def extend(self, new: list[int]) -> None:
        self.seen += len(new)

    def propose(self) -> list[int]:
        span = self.truth[self.seen + 1 : self.seen + 7]
        return span[: self.right] + [(t + 1) % self.vocab for t in span[self.right :]]


@pytest.mark.parametrize("right", [6, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("tree", [Tree.chain(3), load_tree("default")], ids=lambda t: t.name)
def test_greedy_identity_when_grafted_drafts_are_accepted(tiny, tiny_prompts, tree, right):
    """Every drafter draft is wrong (`wrong_after=0`), so all acceptance comes from the
    grafted branch (the block's leading chain, beside the static tree's nodes)."""
    for ids in tiny_prompts:
        ref = autoregressive_generate(tiny, ids, GREEDY)
        dec = SpeculativeDecoder(tiny, OracleDrafter(tiny, ids, wrong_after=0), tree.with_ngram())
        session = dec.start(ids, GREEDY)
        session.lookup = TruthLookup(ref.tokens, len(ids), right, tiny.vocab_size)
        session.lookup.extend(ids + [session.root])
        while not session.done:
            session.step()
        out = session.result()
        assert out.tokens == ref.tokens and out.finish_reason == ref.finish_reason
        if len(ref.tokens) > 20:
            assert out.stats.tau >= (5.0 if right == 6 else 2.5)


@pytest.mark.parametrize(
    "family,tree",
    [  # the fast tier runs the diagonal
        ("p-eagle", load_tree("small-6")),
        ("parallel", Tree.chain(4)),
        pytest.param("p-eagle", Tree.chain(4), marks=pytest.mark.slow),
        pytest.param("parallel", load_tree("small-6"), marks=pytest.mark.slow),
    ],
    ids=lambda v: getattr(v, "name", v),
)
def test_untrained_drafter_with_real_lookups_identity(tiny, tiny_prompts, family, tree):
    spec = NgramSpec(tokens=4, min_match=1, max_match=2)
    dec = SpeculativeDecoder(
        tiny, init_drafter(family, tiny, k=4, depth=1, seed=2), tree.with_ngram(spec)
    )
    grafted = 0
    for ids in tiny_prompts:
        out = dec.generate(ids, GREEDY)
        assert out.tokens == autoregressive_generate(tiny, ids, GREEDY).tokens
        grafted += out.stats.drafted - out.stats.rounds * tree.num_nodes
    assert grafted > 0, "1-gram lookups must graft nodes onto some rounds"


def test_ngram_tree_specs_round_trip(tmp_path):
    """`+ngram` rides on every tree spec and survives tree.json, truncation and resolution."""
    from draftlab.decoding.tree_files import resolve_tree, save_tree
    from draftlab.sweep.space import SweepConfig

    tree = load_tree("default+ngram")
    assert (
        tree.ngram == NgramSpec()
        and tree.name == "default+ngram"
        and tree.paths == load_tree("default").paths
    )
    assert load_tree("chain-3+ngram").ngram and load_tree("chain-3+ngram").is_chain
    assert resolve_tree("chain+ngram", None, 2) == Tree.chain(2).with_ngram()
    custom = Tree.chain(2).with_ngram(NgramSpec(tokens=7, min_match=1, max_match=3))
    save_tree(custom.truncated(1), None, tmp_path)
    back = resolve_tree(None, tmp_path, 4)  # the drafter dir's tree.json
    assert back.ngram == custom.ngram and back.paths == ((0,),)
    (tmp_path / "bad.json").write_text('{"paths": [[0]], "ngram": {"tokens": 0}}')
    with pytest.raises(ValueError, match="bad `ngram`"):
        load_tree(str(tmp_path / "bad.json"))
    base = {"name": "s", "base": "x.yaml"}
    assert SweepConfig(**base, trees=["chain+ngram", "searched-4+ngram"]).trees[0] == "chain+ngram"
    with pytest.raises(ValueError, match="unknown tree 'nope\\+ngram'"):
        SweepConfig(**base, trees=["nope+ngram"])
    with pytest.raises(ValueError, match="chains only"):
        SweepConfig(**base, trees=["chain+ngram"], objective="vllm")
