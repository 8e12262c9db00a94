"""The verdict of a bench with vLLM contenders (`draftlab.verdict`): which served configuration
to deploy and its batch-size schedule, on hand-made reports (no vLLM needed), and the
prompt sources the pipeline measures on (`prompts: mixed`, `datasets:`)."""

from __future__ import annotations

import json

import pytest

from draftlab.config import BenchConfig
from draftlab.data.prompts import load_prompts
from draftlab.serve.vllm_app import VllmServeArgs
from draftlab.verdict import add_load_speedups, schedule, verdict
from draftlab.vllm_scheduler import (
    REQUEST_K,
    builtin_config,
    engine_kwargs,
    request_k,
    with_schedule,
)


@pytest.mark.parametrize(
    ("levels", "drafts", "expected"),
    [
        ([1, 4, 16], [True, True, False], [[1, 4, 3], [5, 1024, 0]]),
        ([1, 4, 16], [True, False, False], [[1, 1, 3], [2, 1024, 0]]),
        ([1, 4, 16], [False, True, True], [[1, 3, 0], [4, 1024, 3]]),
        ([1, 4, 16], [True, False, True], [[1, 1, 3], [2, 15, 0], [16, 1024, 3]]),
        ([1], [True], [[1, 1024, 3]]),
        ([1, 4, 16, 64], [True, True, True, False], [[1, 16, 3], [17, 1024, 0]]),
        ([2, 8], [True, False], [[1, 2, 3], [3, 1024, 0]]),  # the first range always starts at 1
    ],
)
def test_schedule_drafts_between_won_levels_only(levels, drafts, expected):
    assert schedule(levels, drafts, 3) == expected


def _report(
    tps: dict[str, float], load: dict[str, dict[int, float]], lookups: bool = False
) -> dict:
    specs = {
        "vllm_ar": None,
        "vllm_ngram": {"method": "ngram", "num_speculative_tokens": 4},
        "vllm_suffix": {"method": "suffix", "suffix_decoding_max_cached_requests": 0},
        "vllm_draftlab": {
            "method": "eagle3",
            "num_speculative_tokens": 3,
            "parallel_drafting": True,
        },
        "vllm_draftlab_ngram": {
            "method": "eagle3",
            "num_speculative_tokens": 5,
            "parallel_drafting": True,
        },
    }
    ar = tps["vllm_ar"]
    methods = {
        m: {"tokens_per_s": t, "speedup_vs_vllm_ar": t / ar, "by_category": {}}
        for m, t in tps.items()
    }
    table = {m: {str(c): {"tokens_per_s": t} for c, t in rows.items()} for m, rows in load.items()}
    lk = {
        "vllm_draftlab_ngram": {
            "draftlab_lookup": {"spec": {"tokens": 5} if lookups else None, "draft_tokens": 3}
        }
    }
    return {
        "methods": methods,
        "load": add_load_speedups(table),
        "prompts": 13,
        "vllm": {"speculative_config": specs, "lookups": lk},
    }


def test_the_fastest_contender_is_served_and_drafts_only_where_it_won():
    r = _report(
        {"vllm_ar": 10, "vllm_ngram": 13, "vllm_draftlab": 15, "vllm_draftlab@k2": 14},
        {
            "vllm_ar": {1: 10, 4: 30, 16: 60},
            "vllm_draftlab": {1: 15, 4: 33, 16: 50},
            "vllm_ngram": {1: 13, 4: 35, 16: 58},
            "vllm_draftlab@k2": {1: 14, 4: 32, 16: 55},
        },
    )
    v = verdict(r, BenchConfig())
    assert v["served"] == "vllm_draftlab" and v["speedup_vs_vllm_ar"] == 1.5
    assert v["deploy"] == {
        "speculation": "on",
        "method": "drafter",
        "num_speculative_tokens": 3,
        "prompt_lookup": "off",
        "schedule": [[1, 4, 3], [5, 1024, 0]],
    }
    assert [row["drafts"] for row in v["levels"]] == [True, True, False]
    assert "trained drafter" in v["reason"]


def test_a_drafter_measured_at_a_smaller_k_is_deployed_with_that_k():
    r = _report(
        {"vllm_ar": 10, "vllm_draftlab": 12, "vllm_draftlab@k2": 14},
        {
            "vllm_ar": {1: 10, 16: 60},
            "vllm_draftlab@k2": {1: 14, 16: 61},
            "vllm_draftlab": {1: 12, 16: 50},
        },
    )
    v = verdict(r, BenchConfig())
    assert v["deploy"]["num_speculative_tokens"] == 2 and v["deploy"]["schedule"] == [[1, 1024, 2]]


def test_lookups_engine_schedules_the_tokens_it_drafts_a_step():
    """With lookups merged the engine drafts max(k, copy length) a step; vLLM 0.29's parallel
    drafting takes that many or none, so the schedule says that number (not k)."""
    r = _report(
        {"vllm_ar": 10, "vllm_draftlab_ngram": 16},
        {"vllm_ar": {1: 10, 4: 30}, "vllm_draftlab_ngram": {1: 16, 4: 29}},
        lookups=True,
    )
    v = verdict(r, BenchConfig())
    assert v["deploy"]["prompt_lookup"] == "on" and v["deploy"]["num_speculative_tokens"] == 3
    assert v["deploy"]["schedule"] == [[1, 1, 5], [2, 1024, 0]]


def test_a_built_in_method_that_wins_is_said_plainly_and_deployed():
    r = _report({"vllm_ar": 10, "vllm_suffix": 16, "vllm_draftlab": 12}, {})
    v = verdict(r, BenchConfig(vllm={"suffix_cached_requests": 0}))
    assert (
        v["served"] == "vllm_suffix"
        and "untrained" in v["reason"]
        and "faster than the trained drafter" in v["reason"]
    )
    assert (
        v["deploy"]["method"] == "suffix" and "schedule" not in v["deploy"]
    )  # no load levels measured


def test_suffix_is_deployed_with_a_schedule_that_stops_drafting_where_it_lost_under_load():
    """vLLM's suffix proposer takes no schedule; draftlab's scheduler applies it
    (`with_schedule`)."""
    r = _report(
        {"vllm_ar": 10, "vllm_suffix": 12},
        {"vllm_ar": {1: 10, 16: 60}, "vllm_suffix": {1: 12, 16: 55}},
    )
    v = verdict(r, BenchConfig())
    assert v["served"] == "vllm_suffix" and v["deploy"]["schedule"] == [[1, 1, 24], [2, 1024, 0]]
    assert [row["drafts"] for row in v["levels"]] == [True, False]


def test_target_only_winning_deploys_no_speculation():
    r = _report({"vllm_ar": 10, "vllm_ngram": 9}, {"vllm_ar": {1: 10}, "vllm_ngram": {1: 9}})
    v = verdict(r, BenchConfig())
    assert (
        v["served"] == "vllm_ar"
        and v["deploy"] == {"speculation": "off"}
        and "no speculation" in v["reason"]
    )


def test_engine_settings_for_per_request_draft_lengths():
    ngram = builtin_config("ngram", None, 1, 3)
    assert ngram == {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
    }
    with pytest.raises(ValueError, match="unknown vLLM drafting method 'medusa'"):
        builtin_config("medusa", 2)
    kw = engine_kwargs(None, ngram, 4)
    assert (
        kw["scheduler_cls"].endswith("DraftlabScheduler")
        and "draft_sample_method" not in kw["speculative_config"]
    )
    assert with_schedule(kw, [[1, 2, 4], [3, 64, 0]])["speculative_config"][
        "num_speculative_tokens_per_batch_size"
    ] == [(1, 2, 4), (3, 64, 0)]
    assert with_schedule({}, [[1, 2, 4]]) == {}  # target only: nothing to schedule
    assert request_k(None) is None and request_k({}) is None and request_k({REQUEST_K: "2"}) == 2
    with pytest.raises(ValueError, match="draftlab_k must be >= 0"):
        request_k({REQUEST_K: -1})


def test_mixed_prompts_take_one_of_each_kind_in_turn():
    mixed = load_prompts("mixed")
    assert len(mixed) == len(load_prompts("default")) + len(load_prompts("heldout"))
    kinds = {p.category for p in mixed}
    assert {
        p.category for p in load_prompts("mixed", len(kinds))
    } == kinds  # the first N: every kind once


def test_prompts_from_a_datasets_source(tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": "hi"}], "category": "chat"},
        {"turns": ["what is 2 + 2?", "and 3 + 3?"], "category": "math"},
        {"prompt": "Translate: bonjour"},
    ]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = load_prompts(f"datasets:{tmp_path / 't.jsonl'}")
    assert [(p.text, p.category) for p in got] == [
        ("hi", "chat"),
        ("what is 2 + 2?", "math"),
        ("Translate: bonjour", "default"),
    ]
    assert len(load_prompts(f"datasets:{tmp_path / 't.jsonl'}", limit=2)) == 2
    with pytest.raises(ValueError, match="cannot load it with datasets"):
        load_prompts(f"datasets:{tmp_path / 'missing.parquet'}")


def test_suffix_capped_at_k_is_deployed_with_that_k_and_its_schedule():
    """`vllm_suffix@k8` (its drafts capped at 8 per request on the suffix engine) beat the
    uncapped suffix drafting: suffix is deployed drafting at most 8 tokens, where it won."""
    r = _report(
        {"vllm_ar": 10, "vllm_suffix": 12, "vllm_suffix@k8": 13},
        {
            "vllm_ar": {1: 10, 16: 60},
            "vllm_suffix": {1: 12, 16: 55},
            "vllm_suffix@k8": {1: 13, 16: 58},
        },
    )
    v = verdict(r, BenchConfig())
    assert v["served"] == "vllm_suffix@k8"
    assert v["deploy"]["method"] == "suffix" and v["deploy"]["num_speculative_tokens"] == 8
    assert v["deploy"]["schedule"] == [[1, 1, 8], [2, 1024, 0]]
    VllmServeArgs.model_validate(
        {"target": {"name": "smollm2-135m"}, "model_uri": "models:/m@champion"} | v["deploy"]
    )
