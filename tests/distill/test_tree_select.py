"""Tree selection at the end of training: budget optima scored by measured costs."""

import json

import torch

from draftlab.decoding.tree import load_tree
from draftlab.decoding.tree_files import save_tree
from draftlab.decoding.tree_search import best_tree
from draftlab.distill.tree_select import _lookup_options, select_tree
from draftlab.models.drafters.build import init_drafter


def _rows(tiny, n=3, length=40):
    g = torch.Generator().manual_seed(0)
    return [
        {
            "input_ids": torch.randint(3, tiny.vocab_size, (length,), generator=g).tolist(),
            "prompt_len": 5,
        }
        for _ in range(n)
    ]


def test_picks_the_best_predicted_speedup_and_saves_it(tiny, tmp_path):
    drafter = init_drafter("parallel", tiny, k=3, depth=1, seed=0)
    tree, report = select_tree(
        drafter, tiny, _rows(tiny), k=3, budgets=[1, 2, 4, 8], max_ranks=3, context=32, repeats=2
    )
    table = report["candidates"]
    assert report["chosen"] == tree.name
    assert max(table, key=lambda c: c["predicted_speedup"])["tree"] == tree.name
    assert len(report["acceptance"]) == 3 and all(len(row) == 3 for row in report["acceptance"])
    for c in table:  # every candidate is the budget optimum, scored by its own measured costs
        assert [list(p) for p in best_tree(report["acceptance"], c["nodes"]).paths] == c["paths"]
        assert c["verify_ms"] > 0 and c["draft_ms"] > 0
        # without lookups every replayed round costs the same: tau x t_decode / round cost
        assert (
            abs(
                c["predicted_speedup"]
                - c["tau"] * report["decode_ms"] / (c["verify_ms"] + c["draft_ms"])
            )
            < 1e-9
        )
        assert c["lookup_rounds"] == 0.0 and c["graft_row_ms"] == c["carried_row_ms"] == 0.0
    save_tree(tree, report, tmp_path)
    assert load_tree(str(tmp_path / "tree.json")).paths == tree.paths
    assert json.loads((tmp_path / "tree-search.json").read_text())["chosen"] == tree.name


def test_searching_with_lookups_scores_and_saves_them(tiny):
    from draftlab.config import NgramSpec

    spec = NgramSpec(tokens=3, min_match=1, max_match=1)  # random text repeats single tokens
    drafter = init_drafter("parallel", tiny, k=3, depth=1, seed=0)
    tree, report = select_tree(
        drafter,
        tiny,
        _rows(tiny),
        k=3,
        budgets=[1, 3],
        max_ranks=2,
        context=32,
        repeats=2,
        ngram=spec,
    )
    assert tree.ngram == NgramSpec.model_validate(report["chosen_ngram"])
    per_tree = {}
    for c in report[
        "candidates"
    ]:  # no store: the lookups carrying on the likeliest path vary alone
        assert c["ngram"] == spec.model_dump() | {
            k: c["ngram"][k] for k in ("extend", "extend_from")
        }
        per_tree.setdefault((str(c["paths"]), c["depth"]), []).append(
            (c["ngram"]["extend"], c["ngram"]["extend_from"])
        )
    for (
        _,
        depth,
    ), carry in per_tree.items():  # every prefix, or (deeper trees) the whole path alone
        assert carry == (
            [(0, 1), (2, 1), (2, depth), (4, 1), (4, depth)]
            if depth > 1
            else [(0, 1), (2, 1), (4, 1)]
        )
    deeper = _lookup_options(spec, None, 3)  # a 3-deep tree: every prefix, or its whole path alone
    assert [(o.extend, o.extend_from) for o in deeper] == [(0, 1), (2, 1), (2, 3), (4, 1), (4, 3)]
    assert max(report["candidates"], key=lambda c: c["predicted_speedup"])["paths"] == [
        list(p) for p in tree.paths
    ]
    assert all(
        0.0 < c["lookup_rounds"] <= 1.0 and 0.0 <= c["graft_row_ms"] <= c["carried_row_ms"]
        for c in report["candidates"]
    )


def test_searching_with_a_store_tries_its_branch_lengths(tiny):
    from draftlab.config import NgramSpec
    from draftlab.decoding.ngram import NgramStore

    rows = _rows(tiny)
    spec = NgramSpec(tokens=3)
    store = NgramStore.build(
        [r["input_ids"] for r in rows], spec
    )  # the replayed text: always right
    drafter = init_drafter("parallel", tiny, k=3, depth=1, seed=0)
    tree, report = select_tree(
        drafter,
        tiny,
        rows,
        k=3,
        budgets=[1, 2],
        max_ranks=2,
        context=32,
        repeats=2,
        ngram=spec,
        store=store,
    )
    per_tree = {}
    for c in report["candidates"]:
        per_tree.setdefault(str(c["paths"]), []).append(c)
    for (
        cands
    ) in per_tree.values():  # each tree with the text alone, then 2 and 3 tokens from the store
        starts = sorted({1, cands[0]["depth"]})
        carry = [(0, 1)] + [(e, s) for e in (2, 4) for s in starts]
        assert [
            (c["ngram"]["store_tokens"], c["ngram"]["extend"], c["ngram"]["extend_from"])
            for c in cands
        ] == [(t, e, s) for t in (0, 2, 3) for e, s in carry]
        n = len(carry)
        assert cands[0]["tau"] < cands[n]["tau"] < cands[2 * n]["tau"]  # a right store is accepted
    best = max(report["candidates"], key=lambda c: c["predicted_speedup"])
    assert (
        tree.ngram
        == NgramSpec.model_validate(best["ngram"])
        == NgramSpec.model_validate(report["chosen_ngram"])
    )
    assert report["lookup_store_grams"] == len(store.table)


def test_autoregressive_depths_beyond_training_are_extrapolated(tiny):
    drafter = init_drafter("autoregressive", tiny, k=3, depth=1, seed=0)
    tree, report = select_tree(
        drafter, tiny, _rows(tiny), k=1, budgets=[4], max_ranks=2, context=32, depth=3, repeats=2
    )
    assert report["extrapolated_depths"] == 2
    assert report["acceptance"][1] == report["acceptance"][0] == report["acceptance"][2]
    assert tree.depth <= 3


def test_bench_tree_with_ngram_suffix_saves_a_grafting_tree(tiny, tmp_path):
    """`bench.tree: searched+ngram` / `chain-2+ngram`: the chosen tree.json grafts lookups."""
    from draftlab.config import DistillConfig
    from draftlab.distill.tree_select import choose_tree

    drafter = init_drafter("parallel", tiny, k=3, depth=1, seed=0)
    rows = _rows(tiny)
    for spec, paths in (("chain-2+ngram", ((0,), (0, 0))), ("searched+ngram", None)):
        cfg = DistillConfig.model_validate(
            {
                "name": "t",
                "target": {"name": "tiny-llama"},
                "drafter": {"k": 3},
                "bench": {
                    "tree": spec,
                    "search_budgets": [1, 2],
                    "search_ranks": 2,
                    "search_context": 32,
                },
            }
        )
        out = tmp_path / spec
        out.mkdir()
        tree = load_tree(str(choose_tree(cfg, drafter, tiny, rows, out)))
        assert tree.ngram is not None and (paths is None or tree.paths == paths)
        assert (out / "tree-search.json").is_file() == (paths is None)


def test_per_round_variant_pools_the_searched_trees_rates(tmp_path):
    from draftlab.config import BenchSpec, DistillConfig, NgramSpec
    from draftlab.decoding.tree import Tree
    from draftlab.distill.tree_select import per_round_tree

    acc = [[0.6, 0.3, 0.2, 0.1], [0.5, 0.2, 0.1, 0.1], [0.4, 0.1, 0.1, 0.1], [0.3, 0.1, 0.1, 0.1]]
    static = best_tree(acc, 4).with_ngram(NgramSpec(store_tokens=5))
    cfg = DistillConfig(bench=BenchSpec(tree="searched+ngram", per_round_pool=8))
    assert per_round_tree(cfg, static, tmp_path) is None  # no search beside the drafter
    (tmp_path / "tree-search.json").write_text(json.dumps({"acceptance": acc}))
    pooled = per_round_tree(cfg, static, tmp_path)
    assert (
        pooled.name == "searched-8@4+ngram"
        and pooled.per_round == 4
        and pooled.ngram == static.ngram
    )
    assert pooled.paths == best_tree(acc, 8).paths
    assert (
        per_round_tree(
            cfg.model_copy(update={"bench": BenchSpec(per_round_pool=None)}), static, tmp_path
        )
        is None
    )
    assert (
        per_round_tree(cfg, Tree.from_paths([list(p) for p in best_tree(acc, 8).paths]), tmp_path)
        is None
    )  # no node to add
