"""`draftlab bench` / `draftlab profile` through the real CLI entry point on a tiny target."""

import json
import subprocess
import sys

import pytest

from draftlab.cli import main

METHODS = {"ar", "hf_generate", "hf_prompt_lookup", "draftlab_chain", "draftlab_tree"}


def check_contract(report: dict, prompts: int, max_new: int) -> None:
    assert isinstance(report["target"], str)
    assert report["drafter"] is None or isinstance(report["drafter"], str)
    assert isinstance(report["device"], str)
    assert report["prompts"] == prompts and report["max_new_tokens"] == max_new
    assert isinstance(report["greedy_identical"], bool)
    assert set(report["methods"]) == METHODS
    for name, m in report["methods"].items():
        for key in ("tokens_per_s", "tau", "speedup_vs_ar"):
            assert isinstance(m[key], float), (name, key)
        assert m["tokens_per_s"] > 0 and m["tau"] >= 1.0
        # agreement with `ar`'s greedy output; None when sampling
        for key in ("greedy_match_rate", "greedy_token_match_rate"):
            assert m[key] is None or 0.0 <= m[key] <= 1.0, (name, key)
        assert m["by_category"], name
        for cat in m["by_category"].values():
            assert isinstance(cat["tokens_per_s"], float) and isinstance(cat["tau"], float)
    ar = report["methods"]["ar"]["tokens_per_s"]
    for name, m in report["methods"].items():  # every speedup is the method's speed over `ar`'s
        assert m["speedup_vs_ar"] == pytest.approx(m["tokens_per_s"] / ar), name
    assert report["methods"]["ar"]["speedup_vs_ar"] == 1.0
    assert report["methods"]["ar"]["tau"] == 1.0


def test_bench_writes_contract_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    # float32: in bf16 this random tiny target has exact logit ties, which HF's SDPA and our
    # row kernel round apart (HF `generate` vs `ar`); in float32 every method agrees
    rc = main(
        [
            "bench",
            "--target",
            "tiny-llama",
            "--dtype",
            "float32",
            "--drafter",
            "init:parallel",
            "--limit",
            "3",
            "--max-new-tokens",
            "24",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    check_contract(report, prompts=3, max_new=24)
    assert report["greedy_identical"] is True
    assert report["hf_generate_matches_ar"] is True
    assert report["greedy_mismatches"] == []  # nothing left `ar`'s output, HF `generate` included
    for name, m in report["methods"].items():  # CPU: row-exact attention, every output identical
        assert m["greedy_match_rate"] == 1.0 and m["greedy_token_match_rate"] == 1.0, name
    assert set(report["methods"]["ar"]["by_category"]) == {"writing", "roleplay", "reasoning"}
    assert report["drafter_head_coverage"]["all"] == 1.0  # an untrimmed head scores every token
    out = capsys.readouterr().out
    assert (
        "draftlab_tree" in out and "drafter head scores 100.0% of the target's output tokens" in out
    )


def test_head_coverage_is_the_share_of_the_targets_tokens_a_trimmed_head_can_score(tiny):
    import torch

    from draftlab.bench import Run, head_coverage
    from draftlab.models.drafters.build import init_drafter

    trimmed = init_drafter("parallel", tiny, k=2, depth=1, vocab_size=4)
    trimmed.set_vocab(torch.tensor([3, 5, 7, 9]))
    runs = [
        ("math", Run([3, 4, 5, 6], 1.0, 4)),
        ("chat", Run([9, 9], 1.0, 2)),
        ("math", Run([1], 1.0, 1)),
    ]
    assert head_coverage(trimmed, runs) == {
        "all": 4 / 7,
        "by_category": {"math": 2 / 5, "chat": 1.0},
    }
    full = init_drafter("parallel", tiny, k=2, depth=1)
    assert head_coverage(full, runs) == {"all": 1.0, "by_category": {"math": 1.0, "chat": 1.0}}


def test_greedy_match_rate_counts_prompts_and_tokens_before_the_first_difference():
    """On CUDA (fused attention) a floating-point near-tie may flip a greedy token: the
    bench reports how much of `ar`'s output each method still reproduces."""
    from draftlab.decoding.agreement import greedy_match

    ar = [[1, 2, 3, 4], [5, 6], [7, 8, 9, 10]]
    spec = [[1, 2, 9, 4], [5, 6], [7, 8]]  # flips at 2; identical; stops early (EOS) at 2
    rates = {"greedy_match_rate": 1 / 3, "greedy_token_match_rate": 6 / 10}
    assert greedy_match(ar, spec) == rates
    assert greedy_match(ar, ar) == {"greedy_match_rate": 1.0, "greedy_token_match_rate": 1.0}


def test_bench_sampled_has_no_greedy_match_rate(tmp_path):
    out = tmp_path / "bench.json"
    args = "--limit 1 --warmup 0 --max-new-tokens 6 --temperature 0.8 --methods ar,draftlab_chain"
    assert main(["bench", "--target", "tiny-llama", *args.split(), "--json", str(out)]) == 0
    for m in json.loads(out.read_text())["methods"].values():
        assert m["greedy_match_rate"] is None and m["greedy_token_match_rate"] is None


def test_bench_spec_bench_prompts_and_saved_drafter(tmp_path, tiny):
    from draftlab.models.drafters.build import init_drafter

    init_drafter("autoregressive", tiny, k=3, depth=1).save(tmp_path / "drafter")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"question_id": 1, "category": "math", "turns": ["2+2?", "and 3+3?"]})
        + "\n"
        + json.dumps({"prompt": "plain prompt"})
        + "\n"
        + json.dumps(
            {
                "category": "chat",
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "hello"},
                    {"role": "user", "content": "again?"},
                ],
            }
        )
        + "\n"
    )
    out = tmp_path / "b.json"
    rc = main(
        [
            "bench",
            "--target",
            "tiny-llama",
            "--drafter",
            str(tmp_path / "drafter"),
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "12",
            "--k",
            "3",
            "--tree",
            "small-6",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    check_contract(report, prompts=3, max_new=12)
    assert set(report["methods"]["draftlab_chain"]["by_category"]) == {"math", "default", "chat"}


def test_bench_defaults_to_the_drafters_k_and_tree(tmp_path, tiny):
    from draftlab.decoding.tree import Tree
    from draftlab.models.drafters.build import init_drafter

    saved = init_drafter("parallel", tiny, k=3, depth=1).save(tmp_path / "drafter")
    (saved / "tree.json").write_text(Tree.from_paths([[0], [1], [0, 0]]).to_json())
    out = tmp_path / "b.json"
    rc = main(
        [
            "bench",
            "--target",
            "tiny-llama",
            "--drafter",
            str(saved),
            "--limit",
            "1",
            "--max-new-tokens",
            "8",
            "--methods",
            "draftlab_chain,draftlab_tree",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["k"] == 3  # not the init default of 4: this drafter has 2 masks
    assert report["tree"] == str(saved / "tree.json") and report["tree_nodes"] == 3


def test_bench_searched_tree_comes_from_the_drafters_measured_acceptance(tmp_path, tiny):
    from draftlab.decoding.tree import load_tree
    from draftlab.decoding.tree_search import best_tree
    from draftlab.models.drafters.build import init_drafter

    saved = init_drafter("parallel", tiny, k=3, depth=1).save(tmp_path / "drafter")
    acc = [[0.6, 0.2], [0.5, 0.1], [0.3, 0.1]]
    (saved / "tree-search.json").write_text(json.dumps({"acceptance": acc}))
    out = tmp_path / "b.json"
    rc = main(
        [
            "bench",
            "--target",
            "tiny-llama",
            "--drafter",
            str(saved),
            "--limit",
            "1",
            "--max-new-tokens",
            "8",
            "--tree",
            "searched-4",
            "--methods",
            "draftlab_tree",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["tree"] == "searched-4" and report["tree_nodes"] == 4  # named as serving names it
    assert (
        load_tree(str(saved / "tree-searched-4.json")).paths == best_tree(acc, 4).paths
    )  # built beside the drafter


def test_bench_compares_more_trees_side_by_side(tmp_path, tiny):
    from draftlab.models.drafters.build import init_drafter

    saved = init_drafter("parallel", tiny, k=3, depth=1).save(tmp_path / "drafter")
    (saved / "tree-search.json").write_text(
        json.dumps({"acceptance": [[0.6, 0.2], [0.5, 0.1], [0.3, 0.1]]})
    )
    out = tmp_path / "b.json"
    rc = main(
        [
            "bench",
            "--target",
            "tiny-llama",
            "--drafter",
            str(saved),
            "--limit",
            "2",
            "--max-new-tokens",
            "12",
            "--methods",
            "ar",
            "--trees",
            "searched-4@2+ngram,small-6@3",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    assert list(report["methods"]) == [
        "ar",
        "draftlab_tree:searched-4@2+ngram",
        "draftlab_tree:small-6@3",
    ]
    assert report["greedy_identical"] is True
    ar = report["methods"]["ar"]["tokens_per_s"]
    for m in report["methods"].values():
        assert m["greedy_match_rate"] == 1.0
        assert m["speedup_vs_ar"] == pytest.approx(m["tokens_per_s"] / ar)


def test_bench_compares_other_drafters_with_their_own_trees_side_by_side(tmp_path, tiny):
    """`--versus`: each other drafter runs with its own tree.json (and store) against the same
    `ar`, interleaved; greedy output is checked for every drafter."""
    from draftlab.decoding.tree import Tree
    from draftlab.models.drafters.build import init_drafter

    main_dir = init_drafter("parallel", tiny, k=3, depth=1).save(tmp_path / "a" / "drafter")
    other = init_drafter("parallel", tiny, k=2, depth=2, seed=1).save(tmp_path / "b" / "drafter")
    (other / "tree.json").write_text(Tree.from_paths([[0], [1], [0, 0], [0, 1]]).to_json())
    out = tmp_path / "b.json"
    rc = main(
        [
            "bench",
            "--target",
            "tiny-llama",
            "--dtype",
            "float32",
            "--drafter",
            str(main_dir),
            "--limit",
            "2",
            "--max-new-tokens",
            "12",
            "--methods",
            "ar,draftlab_tree",
            "--versus",
            str(other),
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    assert list(report["methods"]) == ["ar", "draftlab_tree", f"draftlab_tree@{other}"]
    assert report["versus"] == {
        str(other): {
            "tree": str(other / "tree.json"),
            "tree_nodes": 4,
            "k": 2,
            "drafter_parameters": report["versus"][str(other)]["drafter_parameters"],
        }
    }
    assert (
        report["versus"][str(other)]["drafter_parameters"] > report["drafter_parameters"]
    )  # two layers, not one
    assert report["greedy_identical"] is True
    ar = report["methods"]["ar"]["tokens_per_s"]
    versus = report["methods"][f"draftlab_tree@{other}"]
    assert versus["greedy_match_rate"] == 1.0 and len(versus["per_position_acceptance"]) == 2
    assert versus["speedup_vs_ar"] == pytest.approx(versus["tokens_per_s"] / ar)


def test_bench_searched_tree_without_a_search_is_a_clear_error(tmp_path, tiny, capsys):
    from draftlab.models.drafters.build import init_drafter

    saved = init_drafter("parallel", tiny, k=3, depth=1).save(tmp_path / "drafter")
    rc = main(
        [
            "bench",
            "--target",
            "tiny-llama",
            "--drafter",
            str(saved),
            "--limit",
            "1",
            "--tree",
            "searched-4",
        ]
    )
    assert rc == 2
    assert "tree-search.json" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--tree", "nope"], "unknown tree 'nope'"),
        (["--trees", "default@0"], "per_round must be >= 1"),
        (["--drafter", "init:medusa"], "unknown drafter family 'medusa'"),
        (["--k", "0"], "k: Input should be greater than or equal to 1"),
        (["--prompts", "/no/such.jsonl"], "prompt file not found"),
        (["--methods", "ar,fast"], "methods.1"),
        (["--versus", "init:parallel"], "versus takes saved drafters"),
        (["--versus", "/no/such/drafter"], "/no/such/drafter"),
        (["--target", "/no/such/dir"], "not an HF model directory"),
    ],
)
def test_bench_bad_input_is_a_clear_error(args, msg, capsys):
    rc = main(["bench", "--target", "tiny-llama", "--limit", "1", "--max-new-tokens", "4", *args])
    assert rc == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


def test_bad_prompt_file_names_line(tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok"}\n{"text": "no prompt field"}\n')
    assert main(["bench", "--target", "tiny-llama", "--prompts", str(f)]) == 2
    assert f"{f}:2: needs a 'prompt', chat 'messages'" in capsys.readouterr().err
    f.write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": '
        '"yo"}]}\n'
    )
    assert main(["bench", "--target", "tiny-llama", "--prompts", str(f)]) == 2
    assert f"{f}:1: the last message must be a user turn" in capsys.readouterr().err
    f.write_text('{"messages": [{"role": "robot", "content": "hi"}]}\n')
    assert main(["bench", "--target", "tiny-llama", "--prompts", str(f)]) == 2
    assert f"{f}:1: messages[0] must be" in capsys.readouterr().err


@pytest.mark.slow  # times every row count and context
def test_profile_json(tmp_path):
    out = tmp_path / "profile.json"
    # Through the installed console script, as a user runs it.
    exe = [sys.executable, "-m", "draftlab.cli"]
    proc = subprocess.run(
        [
            *exe,
            "profile",
            "--target",
            "tiny-llama",
            "--context",
            "32",
            "--repeats",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert set(report["target_forward_ms"]) == {"1", "2", "4", "8", "16", "32", "64"}
    assert set(report["drafter_ms"]) == {"p-eagle", "parallel", "autoregressive"}
    assert set(report["drafter_ms"]["parallel"]) == {"1", "2", "3", "4"}
    assert set(report["drafter_ms"]["autoregressive"]["4"]) == {str(k) for k in range(1, 9)}
    assert all(v > 0 for v in report["target_forward_ms"].values())


def test_profile_times_the_rows_and_trees_it_is_given(tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert (
        main(
            [
                "profile",
                "--target",
                "tiny-llama",
                "--context",
                "32",
                "--repeats",
                "1",
                "--new-tokens",
                "1,4",
                "--trees",
                "small-6,chain-2",
                "--depths",
                "1",
                "--ks",
                "2",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert set(report["target_forward_ms"]) == {"1", "4"}
    assert report["drafter_ms"]["parallel"] == {
        "1": pytest.approx(report["drafter_ms"]["parallel"]["1"])
    }
    assert set(report["drafter_ms"]["parallel"]["1"]) == {"2"}
    trees = report["tree_verify"]
    assert [trees[t]["rows"] for t in ("small-6", "chain-2")] == [7, 3]  # root + nodes
    assert all(t["ms"] > 0 and t["steps"] > 0 for t in trees.values())
    capsys.readouterr()
    with pytest.raises(SystemExit) as bad:
        main(["profile", "--target", "tiny-llama", "--new-tokens", "1,x"])
    assert (
        bad.value.code == 2
        and "--new-tokens: expected a comma list of integers, got '1,x'" in capsys.readouterr().err
    )
    assert (
        main(
            [
                "profile",
                "--target",
                "tiny-llama",
                "--trees",
                "no-such-tree",
                "--new-tokens",
                "1",
                "--ks",
                "1",
                "--depths",
                "1",
                "--repeats",
                "1",
            ]
        )
        == 2
    )
    assert "no-such-tree" in capsys.readouterr().err


def test_distill_cli_rejects_bad_config_and_overrides(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("drafter: {family: parallel, depth: 0}\n")
    assert main(["distill", "-c", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "drafter.depth" in err and "Traceback" not in err
    good = tmp_path / "good.yaml"
    good.write_text("name: x\n")
    assert main(["distill", "-c", str(good), "train.lr"]) == 2
    assert "must look like key.path=value" in capsys.readouterr().err
    assert main(["distill", "-c", str(tmp_path / "missing.yaml")]) == 2
    assert "config file not found" in capsys.readouterr().err


def test_runs_lists_nothing_on_a_fresh_store(tmp_path, capsys):
    assert main(["runs", "--tracking-uri", f"sqlite:///{tmp_path / 'none.db'}"]) == 0
    assert "run" in capsys.readouterr().out.lower()


def test_near_tie_reports_the_targets_own_logits_at_a_mismatch(tiny, tiny_prompts):
    """Where two greedy outputs differ, the bench reports the target's logits for both tokens
    (our engine, same prefix) and its top-2 gap: a near-tie shows engines' numerics decided."""
    import torch

    from draftlab.config import SamplingParams
    from draftlab.decoding.agreement import near_tie
    from draftlab.decoding.engine import autoregressive_generate

    prompt = tiny_prompts[0]
    a = autoregressive_generate(tiny, prompt, SamplingParams(max_new_tokens=8)).tokens
    b = a[:3] + [(a[3] + 1) % tiny.vocab_size] + a[4:]
    tie = near_tie(tiny, prompt, a, b, 3)
    ids = torch.tensor(prompt + a[:3])
    logits, _ = tiny.forward(ids, torch.arange(ids.numel()), tiny.new_cache())
    assert tie["tokens"] == [a[3], b[3]]
    assert tie["logits"][0] == pytest.approx(float(logits[-1, a[3]]))
    assert tie["margin"] == pytest.approx(
        float(logits[-1, a[3]] - logits[-1, b[3]])
    )  # a is the greedy token
    assert tie["top2_gap"] >= 0 and tie["margin"] >= tie["top2_gap"]
    assert near_tie(tiny, prompt, a, a[:3], 3) == {"tokens": [a[3], None]}


def test_greedy_mismatches_name_method_prompt_position_and_margins(tiny, tiny_prompts):
    """Our engine's methods (and HF's) are checked against `ar` as vLLM's are against
    `vllm_ar`: each differing output gives its prompt, first differing position and the
    target's margins there; identical outputs give nothing."""
    from draftlab.bench import Run, greedy_mismatches
    from draftlab.config import SamplingParams
    from draftlab.decoding.agreement import describe_mismatches
    from draftlab.decoding.engine import autoregressive_generate

    prompts = tiny_prompts[:2]
    outs = [
        autoregressive_generate(tiny, p, SamplingParams(max_new_tokens=8)).tokens for p in prompts
    ]
    flipped = outs[1][:5] + [(outs[1][5] + 1) % tiny.vocab_size]
    runs = {
        "ar": [("a", Run(o, 1.0, 8)) for o in outs],
        "same": [("a", Run(o, 1.0, 8)) for o in outs],
        "other": [("a", Run(outs[0], 1.0, 8)), ("a", Run(flipped, 1.0, 8))],
    }
    encoded = [(None, p) for p in prompts]
    found = greedy_mismatches(tiny, encoded, runs, "ar", ["same", "other"])
    assert [(m["method"], m["prompt"], m["position"]) for m in found] == [("other", 1, 5)]
    assert (
        found[0]["tokens"] == [outs[1][5], flipped[5]]
        and found[0]["margin"] >= found[0]["top2_gap"] >= 0
    )
    assert describe_mismatches(found).startswith(
        "1 outputs differ, widest top-2 gap at a difference "
    )
    assert describe_mismatches([]) == "none"
    # two passes (runs hold both, in order): a difference in either pass is found once, with
    # the prompt's own index
    twice = {m: rs + rs for m, rs in runs.items()} | {"late": runs["same"] + runs["other"]}
    found = greedy_mismatches(tiny, encoded, twice, "ar", ["same", "other", "late"])
    assert [(m["method"], m["prompt"], m["position"]) for m in found] == [
        ("other", 1, 5),
        ("late", 1, 5),
    ]


def test_each_prompt_starts_one_method_further_and_each_kind_has_its_passes():
    """`_interleave` rotates the methods' order prompt by prompt over the whole run (none
    always first or always after the same one); `_summary` gives each kind's passes."""
    from tqdm import tqdm

    from draftlab.bench import Run, _interleave, _summary
    from draftlab.data.prompts import Prompt

    calls: list[tuple[str, int]] = []

    def runner(name: str, seconds: float):
        def run(ids):
            calls.append((name, ids[0]))
            return Run([1, 2], seconds, 1)

        return run

    runners = {m: runner(m, s) for m, s in (("ar", 1.0), ("fast", 0.5), ("slow", 2.0))}
    encoded = [(Prompt(str(i), "t", kind), [i]) for i, kind in enumerate(["a", "b", "a", "b"])]
    with tqdm(disable=True) as bar:
        runs = _interleave(runners, encoded, 1, 2, bar)
    timed = calls[3:]  # after the warm-up: the first prompt by every method
    assert calls[:3] == [("ar", 0), ("fast", 0), ("slow", 0)]
    orders = [[m for m, _ in timed[i : i + 3]] for i in range(0, len(timed), 3)]
    first, second, third = ["ar", "fast", "slow"], ["fast", "slow", "ar"], ["slow", "ar", "fast"]
    # the second pass carries on the rotation
    assert orders == [first, second, third, first, second, third, first, second]
    assert [ids for _, ids in timed[::3]] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert all(len(rs) == 8 for rs in runs.values())
    summary = _summary(runs, greedy=False, vllm=False, passes=2)
    for kind in ("a", "b"):
        c = summary["fast"]["by_category"][kind]
        assert c["tokens_per_s_by_pass"] == [4.0, 4.0]  # 2 prompts x 2 tokens in 2 x 0.5 s
        assert c["speedup_vs_ar_by_pass"] == [2.0, 2.0]
        assert summary["slow"]["by_category"][kind]["speedup_vs_ar_by_pass"] == [0.5, 0.5]


def test_packaged_prompt_sets_by_name():
    from draftlab.data.prompts import available_prompt_sets, load_prompts

    assert {"default", "heldout"} <= set(available_prompt_sets())
    held = load_prompts("heldout")
    kinds = {p.category for p in held}
    assert (
        kinds == {"summarization", "rag", "translation", "math", "qa", "chat"} and len(held) == 18
    )
    assert (
        max(len(p.text) for p in held if p.category in ("summarization", "rag")) > 2800
    )  # long contexts
    chats = [p for p in held if p.category == "chat"]
    assert all(len(p.messages) >= 3 and p.messages[-1]["role"] == "user" for p in chats)


def test_bench_grafts_drafts_from_the_drafters_lookup_store(tmp_path, tiny):
    """A store of the target's own answer beside the drafter: `*_ngram` methods draft from it
    where the text has no match (more accepted tokens, the same text); 0 store tokens = off."""
    from draftlab.config import NgramSpec, SamplingParams
    from draftlab.data.prompts import load_prompts
    from draftlab.decoding.engine import autoregressive_generate
    from draftlab.decoding.ngram import STORE_FILE, NgramStore
    from draftlab.models.drafters.build import init_drafter

    saved = init_drafter("parallel", tiny, k=3, depth=1).save(tmp_path / "drafter")
    prompt = load_prompts(None, 1)[0]
    answer = autoregressive_generate(
        tiny, tiny.encode_prompt(prompt.messages), SamplingParams(max_new_tokens=24)
    ).tokens
    NgramStore.build([answer], NgramSpec()).save(saved / STORE_FILE)
    tau = {}
    for n in ("0", "3"):
        out = tmp_path / f"b{n}.json"
        rc = main(
            [
                "bench",
                "--target",
                "tiny-llama",
                "--drafter",
                str(saved),
                "--limit",
                "1",
                "--max-new-tokens",
                "24",
                "--k",
                "1",
                "--methods",
                "draftlab_chain_ngram",
                "--ngram-store-tokens",
                n,
                "--json",
                str(out),
            ]
        )
        assert rc == 0
        report = json.loads(out.read_text())
        assert report["greedy_identical"]
        tau[n] = report["methods"]["draftlab_chain_ngram"]["tau"]
    assert tau["3"] > tau["0"] + 0.5


def bench_config(monkeypatch, args: list[str]):
    """The config `draftlab bench ARGS` would run (the bench itself is not run)."""
    import draftlab.bench

    got = {}

    def capture(cfg, progress=True):
        got["cfg"] = cfg
        raise SystemExit(0)

    monkeypatch.setattr(draftlab.bench, "run_bench", capture)
    with pytest.raises(SystemExit):
        main(["bench", "--target", "tiny-llama", *args])
    return got["cfg"]


@pytest.mark.parametrize("flags,eager", [([], True), (["--vllm-compile"], False)])
def test_vllm_engines_run_eager_unless_asked_to_compile_as_served(flags, eager, monkeypatch):
    """The flag reaches the engines' settings (a compiled engine's start-up compiles for
    minutes, so the bench itself is not run: the config it would get is captured)."""
    cfg = bench_config(monkeypatch, ["--methods", "vllm_ar", *flags])
    assert cfg.vllm.enforce_eager is eager
    assert cfg.vllm.side_by_side is True and cfg.passes == 1  # the defaults


def test_bench_passes_and_one_engine_at_a_time_reach_the_config(monkeypatch):
    cfg = bench_config(
        monkeypatch, ["--methods", "vllm_ar", "--passes", "3", "--vllm-one-at-a-time"]
    )
    assert cfg.passes == 3 and cfg.vllm.side_by_side is False
