"""Trees saved beside a drafter, and tree specs resolved against them.

A drafter directory may hold `tree.json` (the tree it is served with, chosen by distill or a
sweep), `tree-search.json` (its held-out rank acceptance, from which `searched-<n>` trees
are built) and the `tree-searched-<n>.json` files built from it on first use. Every reader
of a tree spec (bench, serving, sweeps) resolves it here, with `resolve_tree`.
"""

from __future__ import annotations

import json
from pathlib import Path

from draftlab.decoding.tree import Tree, load_tree, split_ngram, split_per_round
from draftlab.decoding.tree_search import best_tree, searched_budget
from draftlab.storage import local_copy


def save_tree(tree: Tree, report: dict | None, out_dir: str | Path) -> Path:
    """Write `tree.json` (and `tree-search.json` when a search chose it) into `out_dir`."""
    out_dir = Path(out_dir)
    (out_dir / "tree.json").write_text(tree.to_json() + "\n")
    if report is not None:
        (out_dir / "tree-search.json").write_text(json.dumps(report, indent=2) + "\n")
    return out_dir / "tree.json"


def searched_tree_file(drafter_dir: str | Path, budget: int) -> Path:
    """`tree-searched-<n>.json` next to the drafter: the best `budget`-node tree under the
    acceptance rates its `tree-search.json` recorded (written on first use; for a URI drafter,
    into its local mirror)."""
    drafter_dir = local_copy(drafter_dir)
    report_file = drafter_dir / "tree-search.json"
    if not report_file.is_file():
        raise FileNotFoundError(
            f"tree 'searched-{budget}' needs {report_file} (written by `draftlab distill` with "
            "bench.tree=searched, or by `draftlab select-tree`)"
        )
    path = drafter_dir / f"tree-searched-{budget}.json"
    if not path.is_file():
        acc = json.loads(report_file.read_text())["acceptance"]
        path.write_text(best_tree(acc, budget).to_json() + "\n")
    return path


def resolve_tree(
    spec: str | None,
    drafter_dir: str | Path | None,
    k: int,
    fallback: str = "chain",
    cut: bool = True,
) -> Tree:
    """The tree a drafter drafting `k` deep verifies with.

    `spec`: `chain` (= chain-k), `chain-<n>`, a preset, `searched-<n>` (the best n-node tree
    under the drafter's `tree-search.json`), a JSON file of rank paths, or None = the drafter
    directory's `tree.json` when it has one, else `fallback`. Any of them followed by `@n`
    verifies n of its nodes per round, then `+ngram` grafts prompt lookups each round.

    Trees deeper than `k` are cut to it; `cut=False` keeps them whole (for a drafter not
    built yet, then made deep enough: `draftlab bench` with `init:<family>`). The fallback
    is `chain` when serving and sweeping (what the drafter was trained to draft); the bench
    passes `default`, the packaged tree, so that its tree method differs from its chain.
    """
    if spec is None:
        saved = local_copy(drafter_dir) / "tree.json" if drafter_dir else None
        spec = str(saved) if saved is not None and saved.is_file() else fallback
    spec, ngram = split_ngram(spec)
    if ngram:
        return resolve_tree(spec, drafter_dir, k, fallback, cut).with_ngram()
    spec, per_round = split_per_round(spec)
    if per_round is not None:
        return resolve_tree(spec, drafter_dir, k, fallback, cut).with_per_round(per_round)
    if spec == "chain":
        return Tree.chain(k)
    budget = searched_budget(spec)
    if budget:
        if drafter_dir is None:
            raise ValueError(
                f"tree {spec!r} needs a saved drafter directory (its tree-search.json)"
            )
        found = load_tree(str(searched_tree_file(drafter_dir, budget)), k if cut else None)
        return Tree.from_paths([list(p) for p in found.paths], spec)
    tree = load_tree(spec)
    return tree.truncated(k) if cut else tree
