"""The bench report's model (`draftlab.bench_report`): a real report of the tiny target passes
through it unchanged, keys and their order included; an undocumented key is refused at any
depth; and the bench's method names come from one list (`bench.Methods`)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from draftlab.bench_report import BenchReport, LoadLevel, MethodSummary, Verdict, VllmInfo
from draftlab.config import BenchConfig, VllmBenchSpec
from draftlab.verdict import add_load_speedups, verdict

# The report's keys as `bench._bench` wrote them before it had a model (`verdict`: vLLM only).
KEYS = [
    "target",
    "drafter",
    "device",
    "prompts",
    "max_new_tokens",
    "greedy_identical",
    "greedy_checked",
    "temperature",
    "k",
    "tree",
    "tree_nodes",
    "drafter_parameters",
    "drafter_head_coverage",
    "versus",
    "hf_generate_matches_ar",
    "greedy_mismatches",
    "vllm_greedy_identical",
    "vllm_greedy_checked",
    "vllm_greedy_mismatches",
    "vllm_ar_matches_ar",
    "order",
    "vllm",
    "torch",
    "methods",
    "load",
]
PLAIN = [
    "tokens_per_s",
    "tau",
    "tokens",
    "seconds",
    "forwards",
    "by_category",
    "greedy_match_rate",
    "greedy_token_match_rate",
    "speedup_vs_ar",
]  # a method without drafts
DRAFTED = [
    "tokens_per_s",
    "tau",
    "tokens",
    "seconds",
    "forwards",
    "per_position_acceptance",
    "by_category",
    "draft_s",
    "verify_s",
    "greedy_match_rate",
    "greedy_token_match_rate",
    "speedup_vs_ar",
]


@pytest.fixture(scope="module")
def report(tiny, tmp_path_factory) -> dict:
    from draftlab.bench import bench_loaded
    from draftlab.decoding.tree import load_tree
    from draftlab.models.drafters.build import init_drafter

    out = tmp_path_factory.mktemp("bench") / "bench.json"
    cfg = BenchConfig(
        target={"name": "tiny-llama"},
        limit=2,
        max_new_tokens=8,
        json_out=str(out),
        methods=["ar", "hf_generate", "draftlab_chain", "draftlab_tree_ngram"],
    )
    report = bench_loaded(
        tiny,
        init_drafter("parallel", tiny, k=4, depth=1),
        cfg,
        progress=False,
        trees={"small": load_tree("small-6")},
    )
    assert out.read_text() == json.dumps(report, indent=2) + "\n"
    return report


def test_the_report_keeps_its_keys_in_order(report):
    assert list(report) == KEYS == [f for f in BenchReport.model_fields if f != "verdict"]
    assert list(report["methods"]) == [
        "ar",
        "hf_generate",
        "draftlab_chain",
        "draftlab_tree_ngram",
        "draftlab_tree:small",
    ]
    for name, summary in report["methods"].items():
        assert list(summary) == (DRAFTED if name.startswith("draftlab_") else PLAIN), name
        for cat in summary["by_category"].values():
            assert list(cat) == [
                "tokens_per_s",
                "tau",
                *(["per_position_acceptance"] if "draft_s" in summary else []),
                "speedup_vs_ar",
            ]
    assert report["greedy_identical"] is True and report["greedy_checked"] is True
    assert (
        report["tree"] == "default"
        and report["k"] == 4
        and report["vllm"] is None
        and report["load"] is None
    )
    assert report["order"] == {  # one group, ours; no vLLM warm-up batch
        "groups": [list(report["methods"])],
        "passes": 1,
        "warmup_requests": 1,
    }


def test_the_report_round_trips_through_its_model(report):
    model = BenchReport.model_validate(report)
    assert model.methods["draftlab_chain"].per_position_acceptance
    assert model.model_dump() == report
    assert json.dumps(model.model_dump()) == json.dumps(report)  # the same keys in the same order


@pytest.mark.parametrize("where", ["top", "method", "category", "coverage"])
def test_an_undocumented_key_is_refused_at_any_depth(report, where):
    bad = json.loads(json.dumps(report))
    node = {
        "top": bad,
        "method": bad["methods"]["ar"],
        "category": next(iter(bad["methods"]["ar"]["by_category"].values())),
        "coverage": bad["drafter_head_coverage"],
    }[where]
    node["new_figure"] = 1.0
    with pytest.raises(ValidationError, match="new_figure"):
        BenchReport.model_validate(bad)


def test_a_missing_key_is_refused(report):
    with pytest.raises(ValidationError, match="torch"):
        BenchReport.model_validate({k: v for k, v in report.items() if k != "torch"})


def test_vllm_info_carries_the_bench_specs_fields_in_order():
    """`_decode` spreads `cfg.vllm.model_dump()` between `dtype` and `startup_s`."""
    spec = list(VllmBenchSpec.model_fields)
    fields = list(VllmInfo.model_fields)
    assert fields[3 : 3 + len(spec)] == spec
    for name in spec:
        assert (
            VllmInfo.model_fields[name].annotation == VllmBenchSpec.model_fields[name].annotation
        ), name
    info = {
        "version": "0.0",
        "target_dir": "d",
        "dtype": "float32",
        **VllmBenchSpec().model_dump(),
        "startup_s": {"vllm_ar": 1.0},
        "kv_cache_bytes": {"vllm_ar": 2**20},
        "engines": {"vllm_ar": ["vllm_ar"]},
        "speculative_config": {"vllm_ar": None},
        "lookups": {},
    }
    assert VllmInfo.model_validate(info).model_dump() == info


def test_load_levels_and_the_verdict_fit_their_models():
    """Hand-made vLLM figures (no vLLM needed) through `add_load_speedups` and `verdict`."""
    level = {"tau": 1.0, "requests": 4, "seconds": 1.0}
    load = add_load_speedups(
        {
            m: {str(c): {"tokens_per_s": t * c, **level} for c in (1, 4)}
            for m, t in (("vllm_ar", 10.0), ("vllm_draftlab", 12.0))
        }
    )
    for rows in load.values():
        for row in rows.values():
            assert LoadLevel.model_validate(row).model_dump() == row
    methods = {
        m: {"tokens_per_s": t, "speedup_vs_vllm_ar": t / 10.0}
        for m, t in (("vllm_ar", 10.0), ("vllm_draftlab", 12.0))
    }
    report = {
        "methods": methods,
        "load": load,
        "prompts": 3,
        "vllm": {
            "speculative_config": {"vllm_ar": None, "vllm_draftlab": {"num_speculative_tokens": 3}},
            "lookups": {},
        },
    }
    v = verdict(report, BenchConfig())
    assert Verdict.model_validate(v).model_dump() == v and v["served"] == "vllm_draftlab"


def test_optional_figures_are_left_out_not_null():
    s = MethodSummary(
        tokens_per_s=1.0,
        tau=1.0,
        tokens=3,
        seconds=3.0,
        forwards=2,
        by_category={},
        greedy_match_rate=None,
        greedy_token_match_rate=None,
        speedup_vs_ar=1.0,
    )
    assert list(s.model_dump()) == PLAIN  # greedy rates stay (None when sampling); the rest go


def test_one_list_of_method_names():
    from draftlab.bench import Contender, _methods
    from draftlab.decoding.tree import Tree

    chain = Tree.chain(2)
    cfg = BenchConfig(
        methods=["draftlab_tree", "ar", "hf_generate", "vllm_ngram", "draftlab_chain_ngram"]
    )
    m = _methods(cfg, {"a": chain}, {"other": Contender(drafter=None, tree=chain, store=None)})
    assert m.interleaved == [
        "ar",
        "draftlab_tree",
        "hf_generate",
        "draftlab_chain_ngram",
        "draftlab_tree:a",
        "draftlab_tree@other",
    ]
    assert m.mine == ["draftlab_tree", "draftlab_chain_ngram", "draftlab_tree:a"]
    assert m.speculative == [
        "draftlab_tree",
        "draftlab_chain_ngram",
        "draftlab_tree:a",
        "draftlab_tree@other",
    ]
    assert _methods(BenchConfig(methods=["ar", "hf_generate"]), {}, {}).mine == []
