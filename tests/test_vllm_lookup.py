"""`SourceChooser`: which proposal vLLM verifies when a copy and the drafter's draft compete.

Pure Python (no vLLM): the scheduler that calls it runs in `test_vllm_bench.py`."""

from __future__ import annotations

import pytest

from draftlab.vllm_lookup import SourceChooser, _accepted


def test_accepted_counts_the_common_prefix_once_the_text_decides_it():
    text = [5, 6, 7, 8]
    assert _accepted(text, 1, [6, 7, 9]) == 2  # the target wrote 8 where the chain had 9
    assert _accepted(text, 1, [6, 7, 8]) == 3  # all of it
    assert _accepted(text, 1, [9]) == 0
    assert _accepted(text, 2, [7, 8, 1]) is None  # agrees so far; the next token is not written yet
    assert _accepted(text, 4, [1]) is None


def _run(chooser: SourceChooser, text: list[int], start: int, copy_at, draft_at) -> list[str]:
    """Replay `text` from `start`: at each position both sources propose (`copy_at(i)`,
    `draft_at(i)`); the target accepts the chosen chain's agreeing prefix plus one token.
    Returns which source was verified each step."""
    chosen, i = [], start
    while i < len(text) - 1:
        copy, draft = copy_at(i), draft_at(i)
        chain = chooser.choose(text[:i], copy, draft)
        chosen.append("copy" if chain == copy and copy else "drafter")
        i += (_accepted(text, i, chain) or 0) + 1
    return chosen


def test_a_request_whose_copies_miss_switches_to_the_drafter():
    """Free text: the copies are coincidences (never right), the drafter's first token is."""
    text = list(range(100, 200))
    chooser = SourceChooser()
    chosen = _run(chooser, text, 2, copy_at=lambda i: [0, 1, 2, 3, 4], draft_at=lambda i: [text[i], -1])
    assert chosen[0] == "copy"  # a request starts as n-gram drafting would
    assert set(chosen[3:]) == {"drafter"}
    assert chooser.score["drafter"] > 0.9 and chooser.score["copy"] == 0.0


def test_a_request_that_quotes_its_prompt_keeps_the_copies():
    """A quote: every copy is right for 5 tokens, the drafter's draft never."""
    text = list(range(100, 300))
    chooser = SourceChooser()
    chosen = _run(chooser, text, 2, copy_at=lambda i: text[i : i + 5], draft_at=lambda i: [-1, -1])
    assert set(chosen) == {"copy"}
    assert chooser.score["copy"] > 4.0 and chooser.score["drafter"] == 0.0


def test_the_choice_follows_the_text_when_it_changes_kind():
    """Copies right for the first half (a quote), wrong after it (free text): the request
    moves to the drafter within a few steps of the change, and scores proposals it did
    not verify (the drafter's during the quote)."""
    text = list(range(100, 400))
    half = 150
    chooser = SourceChooser()
    chosen = _run(chooser, text, 2,
                  copy_at=lambda i: text[i : i + 5] if i < half else [0] * 5,
                  draft_at=lambda i: [text[i], text[i + 1]] if i >= half else [-1, -1])
    steps_in_quote = sum(1 for _ in range(2, half, 6))
    assert set(chosen[:steps_in_quote]) == {"copy"}
    assert set(chosen[steps_in_quote + 8 :]) == {"drafter"}


@pytest.mark.parametrize("copy", [[], [1, 2]])
def test_no_copy_verifies_the_draft_and_is_not_scored(copy):
    chooser = SourceChooser()
    assert chooser.choose([1, 2, 3], [], [4, 5]) == [4, 5]
    assert chooser._pending == []
    chosen = chooser.choose([1, 2, 3], copy, [4, 5])
    assert chosen == (copy or [4, 5])
    assert len(chooser._pending) == (1 if copy else 0)
