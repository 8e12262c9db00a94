"""The lookup store: a corpus's most frequent continuations, consulted where the text has no
match."""

import pytest
import torch
from safetensors.torch import save_file

from draftlab.config import NgramSpec, SamplingParams
from draftlab.decoding.engine import SpeculativeDecoder, autoregressive_generate
from draftlab.decoding.ngram import STORE_FILE, NgramIndex, NgramStore
from draftlab.decoding.tree import Tree
from draftlab.models.drafters.build import init_drafter
from oracle import OracleDrafter

GREEDY = SamplingParams(max_new_tokens=40)


def test_store_keeps_the_most_frequent_continuation_cut_at_each_sequence_end(tmp_path):
    spec = NgramSpec(tokens=3, min_match=1, max_match=2)
    store = NgramStore.build([[1, 2, 3, 4], [1, 2, 3, 9], [5, 2, 7], [1, 2, 3, 4]], spec)
    assert store.table[(1, 2)] == [3, 4]  # twice, against 3 9 once; cut where the sequence ends
    assert store.table[(2,)] == [3, 4] and store.table[(5, 2)] == [7]
    assert (7,) not in store.table and (4,) not in store.table  # nothing follows a last token
    assert NgramStore.build([[1, 5], [1, 6]], spec).table[(1,)] == [5]  # a tie: the first seen
    assert store.propose([8, 5, 2]) == [7]  # the longest suffix first: (5, 2), not (2,)
    assert store.propose([8, 2]) == [3, 4] and store.propose([8]) == []
    store.save(tmp_path / STORE_FILE)
    loaded = NgramStore.beside(tmp_path)
    assert loaded.table == store.table
    assert (loaded.spec.tokens, loaded.spec.min_match, loaded.spec.max_match) == (3, 1, 2)
    assert NgramStore.beside(tmp_path / "elsewhere") is None and NgramStore.beside(None) is None
    save_file({"x": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not an n-gram lookup store"):
        NgramStore.load(tmp_path / "other.safetensors")


def test_the_text_comes_first_then_the_store_capped_at_store_tokens():
    store = NgramStore.build([[7, 8, 9, 10]], NgramSpec(min_match=1, max_match=2))
    spec = NgramSpec(tokens=4, min_match=1, max_match=2, store_tokens=2)
    index = NgramIndex(spec, [1, 2, 3, 1], store)
    assert index.propose() == [2, 3, 1]  # 1 was followed by 2 3 1 in the text itself
    index.extend([7])
    assert index.propose() == [8, 9]  # no match in the text: the store's, cut to 2 tokens
    off = NgramIndex(spec.model_copy(update={"store_tokens": 0}), [1, 2, 3, 1, 7], store)
    assert off.propose() == []


def test_the_drafted_path_is_carried_on_by_the_text_then_the_store_capped_at_extend():
    store = NgramStore.build([[5, 6, 40, 41, 42, 43]], NgramSpec(min_match=2, max_match=2))
    spec = NgramSpec(tokens=4, min_match=2, max_match=3, store_tokens=0, extend=3)
    index = NgramIndex(spec, [1, 2, 3, 4, 9, 8, 1, 2], store)
    assert index.propose_after([3, 4]) == [
        9,
        8,
        1,
    ]  # "2 3 4" (two drafted) was followed by 9 8 1 in the text
    assert index.propose_after([7]) == []  # "2 7": neither the text nor the store has it
    assert index.propose_after([5, 6]) == [
        40,
        41,
        42,
    ]  # only the store has "5 6": its continuation, capped
    assert index.propose() == [
        3,
        4,
        9,
        8,
    ]  # the copy at the root is unchanged, and store_tokens=0 holds there
    assert index.copy_len == 4
    off = NgramIndex(spec.model_copy(update={"extend": 0}), [1, 2, 3, 4, 9, 8, 1, 2], store)
    assert off.propose_after([3, 4]) == []


def test_carried_on_prefixes_from_extend_from_and_other_firsts_only_from_depth_one():
    spec = NgramSpec(tokens=4, min_match=2, max_match=3, store_tokens=0, extend=2, extend_firsts=1)
    text = [1, 2, 3, 4, 9, 1, 2, 5, 7, 1, 2, 6, 8, 1, 2]
    every = NgramIndex(spec, text).carried([3, 4], firsts=[3, 5, 6])
    assert every == [
        [3, 4, 9],
        [3, 4, 9, 1],
        [5, 7, 1],
    ]  # "2 3", "2 3 4" and the likeliest other first, 5
    whole = NgramIndex(spec.model_copy(update={"extend_from": 2}), text).carried(
        [3, 4], firsts=[3, 5, 6]
    )
    assert whole == [[3, 4, 9, 1]]  # the whole path alone, no other first
    deeper = NgramIndex(spec.model_copy(update={"extend_from": 5}), text).carried(
        [3, 4], firsts=[3, 5, 6]
    )
    assert deeper == whole  # a tree shallower than extend_from carries its whole path
    first = NgramIndex(spec.model_copy(update={"extend_from": 2}), text).carried(
        [3], firsts=[3, 5, 6]
    )
    assert first == [
        [3, 4, 9]
    ]  # a 1-deep path: itself, still no other first (as the replay counts)


@pytest.mark.parametrize(
    "tree",
    [pytest.param(Tree.chain(1), marks=pytest.mark.slow), Tree.from_paths([[0], [1], [0, 0]])],
    ids=lambda t: t.name,
)
def test_store_drafts_keep_greedy_identity_and_get_accepted(tiny, tiny_prompts, tree):
    """A store of the target's own answers proposes right drafts: accepted rows, same text."""
    refs = [autoregressive_generate(tiny, ids, GREEDY).tokens for ids in tiny_prompts]
    store = NgramStore.build(refs, NgramSpec())
    drafter = init_drafter("parallel", tiny, k=3, depth=1, seed=2)
    tau = {}
    for n in (0, 3):
        dec = SpeculativeDecoder(tiny, drafter, tree.with_ngram(NgramSpec(store_tokens=n)), store)
        outs = [dec.generate(ids, GREEDY) for ids in tiny_prompts]
        assert [o.tokens for o in outs] == refs
        tau[n] = sum(len(o.tokens) for o in outs) / sum(o.stats.rounds + 1 for o in outs)
    assert tau[3] > tau[0] + 0.3


def test_copies_grow_after_whole_ones_are_committed_and_reset_on_a_miss():
    spec = NgramSpec(tokens=2, min_match=1, max_match=1, grow_to=6)
    text = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1]
    index = NgramIndex(spec, text)
    assert index.propose() == [2, 3]
    index.extend([2, 3, 4])  # the whole copy and the bonus token
    assert index.copy_len == 4 and index.propose() == [5, 6, 7, 8]
    index.extend([5, 6, 7, 8, 9])
    assert index.copy_len == 6 and index.propose() == [10, 11, 1, 2, 3, 4]  # capped at grow_to
    index.extend([10, 99])  # cut short
    assert index.copy_len == 2
    index.extend([5])  # no proposal since: the length stays
    assert index.copy_len == 2
    for grow_to in (2, 1):  # at most `tokens`: fixed copies
        fixed = NgramIndex(spec.model_copy(update={"grow_to": grow_to}), text)
        fixed.extend(fixed.propose() + [4])
        assert fixed.copy_len == 2 and fixed.propose() == [5, 6]


def test_extended_paths_keep_greedy_identity_and_get_accepted_past_the_drafters_depth(
    tiny, tiny_prompts
):
    """An oracle drafter's likeliest path is the target's, and the store of the target's own
    answers carries it on: rounds accept past the tree's depth, and the text is unchanged."""
    refs = [autoregressive_generate(tiny, ids, GREEDY).tokens for ids in tiny_prompts]
    store = NgramStore.build(refs, NgramSpec())
    tree = Tree.from_paths([[0], [1], [0, 0]])
    tau, deepest = {}, {}
    for n in (0, 3):
        served = tree.with_ngram(NgramSpec(store_tokens=0, extend=n))
        outs = [
            SpeculativeDecoder(tiny, OracleDrafter(tiny, ids), served, store).generate(ids, GREEDY)
            for ids in tiny_prompts
        ]
        assert [o.tokens for o in outs] == refs
        tau[n] = sum(len(o.tokens) for o in outs) / sum(o.stats.rounds + 1 for o in outs)
        deepest[n] = max(len(o.stats.accepted_at) for o in outs)
    assert deepest[0] <= 2 < deepest[3] and tau[3] > tau[0] + 0.3
