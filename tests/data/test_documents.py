"""Document-grounded magpie prompts (`source.documents`), the chats magpie writes
(`turns: chat`) and mixes of prompt sources (`data.source` as a list): configs, corpora, the
per-turn openings and the interleaving.
The tiny target writes random characters, so the tests check where texts come from and
how they are laid out, not what they say."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from draftlab.config import DataConfig, DistillConfig, PromptSourceConfig, SamplingParams
from draftlab.config.data import DOCUMENT_SEEDS, FOLLOW_UP_SEEDS
from draftlab.data.documents import cut_to_tokens, document_stream
from draftlab.data.selfdistill import interleave
from draftlab.data.sources import collect_prompts, ground, prompt_text, reject_reason
from draftlab.decoding.engine import autoregressive_generate

KW = dict(progress=False, magpie_batch_size=3, magpie_max_rounds=40)


def grounded(**kw) -> PromptSourceConfig:
    return PromptSourceConfig(
        **{"min_chars": 4, "max_prompt_tokens": 8, "document_tokens": 48} | kw
    )


# --- configs -------------------------------------------------------------------------------


def test_a_mix_splits_its_total_by_weight():
    data = DataConfig(source=[{"weight": 3}, {"documents": "self"}, {"weight": 0.5}], num_prompts=9)
    assert data.mix_counts() == [6, 2, 1] and data.total_prompts == 9
    assert [s.num_prompts for s in data.sources] == [6, 2, 1]
    assert data.sources[1].magpie_seeds == list(DOCUMENT_SEEDS)  # documents: their own seeds
    assert DataConfig().sources == [DataConfig().source]


@pytest.mark.parametrize(
    "data, message",
    [
        ({"source": [{}]}, "set data.num_prompts"),
        ({"source": [{"num_prompts": 4}], "num_prompts": 4}, "its share of data.num_prompts"),
        ({"num_prompts": 4}, "a mix's total"),
        ({"source": {"weight": 2}}, r"weight\n +Extra inputs"),
        ({"source": []}, "an empty list"),
        ({"source": [{"weight": 99}, {}], "num_prompts": 10}, r"source\[1\]: its weight"),
        ({"source": {"kind": "dataset", "documents": "self"}}, "set kind: magpie"),
        ({"source": {"document_tokens": 64}}, "documents is not"),
        ({"source": {"kind": "dataset", "turns": "chat"}}, "set conversations"),
        ({"source": {"answer_tokens": 64}}, "answer_tokens is for the chats magpie writes"),
        ({"source": {"follow_up_seeds": ["Why"]}}, "follow_up_seeds is for the chats"),
    ],
)
def test_bad_mixes_and_document_settings_are_refused_by_name(data, message):
    with pytest.raises(ValidationError, match=message):
        DataConfig.model_validate(data)


def test_document_prompts_must_leave_room_for_their_response():
    base = dict(name="d", target={"name": "tiny-llama"})
    data = {"source": {"documents": "self", "document_tokens": 256}, "max_new_tokens": 128}
    with pytest.raises(ValidationError, match=r"data.source: .* exceed train.max_seq_len = 384"):
        DistillConfig.model_validate(base | {"data": data})
    DistillConfig.model_validate(base | {"data": data, "train": {"max_seq_len": 640}})
    mix = {  # a mix entry's own answer length counts
        "source": [{}, {"documents": "self", "document_tokens": 128, "max_new_tokens": 256}],
        "num_prompts": 4,
        "max_new_tokens": 64,
    }
    with pytest.raises(ValidationError, match=r"data.source\[1\].max_new_tokens\) exceed"):
        DistillConfig.model_validate(base | {"data": mix})
    chats = {"source": {"turns": "chat", "answer_tokens": 160}, "max_new_tokens": 128}
    with pytest.raises(ValidationError, match=r"written chats of up to 432 tokens .*answer_tokens"):
        DistillConfig.model_validate(base | {"data": chats})


# --- documents -----------------------------------------------------------------------------


def test_corpus_documents_are_passages_within_the_token_limit(tiny, tmp_path):
    cfg = grounded(documents="python-docs")
    docs = document_stream(cfg, tiny)(0, 30)
    assert len(set(docs)) == 30 and document_stream(cfg, tiny)(10, 5) == docs[10:15]
    sizes = [len(tiny.tokenizer(d, add_special_tokens=False)["input_ids"]) for d in docs]
    assert all(12 <= n <= 48 + 2 for n in sizes), sizes  # a cut may re-tokenise its edge
    assert document_stream(cfg.model_copy(update={"seed": 1}), tiny)(0, 30) != docs
    assert cut_to_tokens("one two\n\nthree four five six", tiny.tokenizer, 1000) == (
        "one two\n\nthree four five six"
    )
    cut = cut_to_tokens("one two three. " + "four five six seven " * 20, tiny.tokenizer, 18)
    assert cut == "one two three."  # at the sentence end that fits (no paragraph or line end)


def test_a_users_corpus_is_read_from_its_column(tiny, tmp_path):
    path = tmp_path / "docs.jsonl"
    rows = [
        {"body": f"Minutes {i}: the committee met and agreed the budget. " * 4} for i in range(3)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = grounded(documents=str(path), document_field="body", document_tokens=400)
    assert sorted(document_stream(cfg, tiny)(0, 3)) == sorted(r["body"].strip() for r in rows)
    with pytest.raises(ValueError, match=r"no column 'text' .* available columns: \['body'\]"):
        document_stream(cfg.model_copy(update={"document_field": None}), tiny)


def test_the_target_writes_its_own_documents_seeded_by_index(tiny):
    cfg = grounded(documents="self", seed=2)
    docs = document_stream(cfg, tiny, batch_size=3)
    first = docs(0, 3)
    assert len(first) == 3 and all(first) and docs(0, 3) == first
    assert docs(3, 3) != first  # the next round: other seeds


def test_turn_i_opens_with_seed_i_grounded_in_document_i(tiny):
    seeds = ["Summarize", "Context:\n{document}\n\nQuestion:"]
    cfg = grounded(documents="python-docs", magpie_seeds=seeds, num_prompts=7)
    got = collect_prompts(cfg, tiny, **KW)
    docs = document_stream(cfg, tiny)(0, got.consumed)
    assert got.consumed == 7  # the tiny target's turns pass the filters
    for i, prompt in enumerate(got.prompts):
        opening = ground(seeds[i % 2], docs[i])
        assert prompt.startswith(opening), (i, prompt[:80])
        assert reject_reason(prompt, cfg, tiny.tokenizer) is None
    assert ground(seeds[1], "x") == "Context:\nx\n\nQuestion:"
    assert ground("Translate", "x") == "Translate\n\nx\n\n"
    # a longer list resumes where this one stopped, inside a round of 3
    longer = collect_prompts(cfg.model_copy(update={"num_prompts": 11}), tiny, **KW, start=got)
    assert longer == collect_prompts(cfg.model_copy(update={"num_prompts": 11}), tiny, **KW)


def test_plain_magpie_turns_of_one_round_open_with_different_seeds(tiny):
    seeds = ["Write a", "Explain", "Solve"]
    cfg = PromptSourceConfig(
        kind="magpie", num_prompts=12, min_chars=4, max_prompt_tokens=24, magpie_seeds=seeds
    )
    got = collect_prompts(cfg, tiny, progress=False, magpie_batch_size=12, magpie_max_rounds=1)
    used = [next(s for s in seeds if p.startswith(s)) for p in got.prompts]
    assert len(set(used)) >= 2, used  # a round used to open all its turns alike


# --- written chats ------------------------------------------------------------------------


def test_chats_default_to_the_follow_up_seeds_and_count_all_turns_in_the_limit():
    chat = PromptSourceConfig(turns="chat", max_prompt_tokens=32)
    assert chat.follow_up_seeds == list(FOLLOW_UP_SEEDS) and chat.writes_chats
    assert chat.prompt_token_limit == 32 + 128 + 32 + 16  # first turn, answer, second turn
    assert PromptSourceConfig(max_prompt_tokens=32).prompt_token_limit == 32
    # plain magpie sources keep their dumps (and so their cache keys)
    assert "follow_up_seeds" not in PromptSourceConfig().model_dump()


def test_the_target_writes_two_turn_chats_on_its_own_greedy_answers(tiny):
    follow = ["Now", "Why"]
    cfg = PromptSourceConfig(
        turns="chat",
        num_prompts=5,
        min_chars=4,
        max_prompt_tokens=16,
        answer_tokens=6,
        follow_up_seeds=follow,
        magpie_seeds=["Solve"],
    )
    got = collect_prompts(cfg, tiny, **KW)
    assert len(got.prompts) == 5  # (the junk filter drops some of the tiny target's turns)
    openings = set()
    for chat in got.prompts:
        assert [m["role"] for m in chat] == ["user", "assistant", "user"]
        first, answer, second = (m["content"] for m in chat)
        assert first.startswith("Solve")
        openings.add(next(f for f in follow if second.startswith(f)))
        greedy = autoregressive_generate(
            tiny, tiny.encode_prompt(first), SamplingParams(max_new_tokens=6)
        ).tokens
        assert answer == tiny.tokenizer.decode(greedy, skip_special_tokens=True).strip()
        assert reject_reason(prompt_text(chat), cfg, tiny.tokenizer) is None
    assert openings == set(follow)  # second turns open with the follow-up seeds in turn
    assert collect_prompts(cfg, tiny, **KW) == got  # seeded
    # a longer list resumes where this one stopped, inside a round of 3
    longer = cfg.model_copy(update={"num_prompts": 8})
    assert collect_prompts(longer, tiny, **KW, start=got) == collect_prompts(longer, tiny, **KW)


# --- interleaving --------------------------------------------------------------------------


def test_interleave_spreads_each_list_over_the_whole_and_keeps_order():
    a, b = [f"a{i}" for i in range(6)], ["b0", "b1", "b2"]

    def merged(lists):
        return [lists[k][j] for k, j in interleave(lists)]

    assert merged([a, b]) == ["a0", "b0", "a1", "a2", "b1", "a3", "a4", "b2", "a5"]
    assert merged([a]) == a and merged([["x", "y"], ["y", "z"]]) == ["x", "y", "z"]
    assert interleave([["x", "y"], ["y", "z"]]) == [(0, 0), (1, 0), (1, 1)]  # "y" placed first
