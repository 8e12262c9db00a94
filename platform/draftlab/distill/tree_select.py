"""Pick the verification tree of a trained drafter by predicted speedup on this hardware.

From the drafter's held-out conditional rank acceptance (`ranks.rank_acceptance`), the
best tree for each node budget (`tree_search.best_tree`) has an expected tau; the target's
measured verify time for that tree, plus the drafter's measured drafting time for its
depth, turn tau into a predicted speedup over a decoding step:

    speedup(tree) = tau(tree) * t_decode / (t_verify(tree) + t_draft(depth(tree)))

The best-scoring tree is saved next to the drafter as `tree.json`; the whole table (rates,
costs, candidates) as `tree-search.json`. A drafter directory may be a URI (s3://...): it is
read through its local mirror (`draftlab.storage.local_copy`).
"""

from __future__ import annotations

import json
from pathlib import Path

from draftlab.config import DistillConfig
from draftlab.decoding.tree import Tree, load_tree, split_ngram
from draftlab.decoding.tree_search import best_tree, expected_accepted, searched_budget
from draftlab.distill.ranks import rank_acceptance
from draftlab.models.drafters.network import DrafterNet, load_drafter
from draftlab.models.target import Target, load_target
from draftlab.profiling import draft_ms, verify_ms
from draftlab.storage import is_uri, local_copy, publish


def select_tree(
    drafter: DrafterNet,
    target: Target,
    rows: list[dict],  # held-out samples: input_ids, prompt_len (and optionally hidden)
    k: int,
    budgets: list[int],
    max_ranks: int,
    context: int,
    depth: int | None = None,
    repeats: int = 15,
) -> tuple[Tree, dict]:
    """The tree with the best predicted speedup among the budget optima, and the report.

    `k` depths are measured (the training groups); trees may go `depth` deep. An
    autoregressive drafter trains one group, so its deeper rates repeat the last measured
    depth (flagged in the report as `extrapolated_depths`): an optimistic guess, as its
    acceptance usually decays a little with depth.
    """
    acc, extrapolated = acceptance_to_depth(drafter, target, rows, k, max_ranks, depth)
    trees: dict[tuple, Tree] = {}
    for n in sorted(set(budgets)):
        tree = best_tree(acc, n)
        trees.setdefault(tree.paths, tree)  # budgets past the useful paths give the same tree
    candidates = list(trees.values())
    decode, *verify = verify_ms(target, [None, *candidates], context, repeats)
    drafting = {
        d: draft_ms(drafter, d, context, repeats) for d in sorted({t.depth for t in candidates})
    }
    table = []
    for tree, v in zip(candidates, verify, strict=True):
        tau = 1.0 + expected_accepted(tree, acc)
        table.append(
            {
                "tree": tree.name,
                "nodes": tree.num_nodes,
                "depth": tree.depth,
                "paths": [list(p) for p in tree.paths],
                "expected_tau": tau,
                "verify_ms": v,
                "draft_ms": drafting[tree.depth],
                "predicted_speedup": tau * decode / (v + drafting[tree.depth]),
            }
        )
    best = max(range(len(table)), key=lambda i: table[i]["predicted_speedup"])
    report = {
        "acceptance": acc,
        "extrapolated_depths": extrapolated,
        "context": context,
        "decode_ms": decode,
        "candidates": table,
        "chosen": table[best]["tree"],
    }
    return candidates[best], report


def acceptance_to_depth(
    drafter: DrafterNet, target: Target, rows: list[dict], k: int, max_ranks: int, depth: int | None
) -> tuple[list[list[float]], int]:
    """Held-out rank acceptance per depth (`k` measured, repeated down to `depth`), and how
    many depths were extrapolated."""
    acc = rank_acceptance(drafter, target, rows, k, max_ranks=max_ranks)
    extrapolated = max(0, (depth or k) - len(acc))
    return acc + [list(acc[-1])] * extrapolated, extrapolated


def save_acceptance(
    cfg: DistillConfig, drafter: DrafterNet, target: Target, evalset, out_dir: str | Path
) -> Path:
    """Only the measurement half of the search: `tree-search.json` with the held-out rank
    acceptance (what `searched-<n>` trees are built from), no timing and no `tree.json`.
    A sweep measures its trees' speed instead of predicting it."""
    from draftlab.distill.worker import group_count

    rows = [evalset[i] for i in range(len(evalset))]
    acc, extrapolated = acceptance_to_depth(
        drafter, target, rows, group_count(cfg), cfg.bench.search_ranks, cfg.drafter.k
    )
    path = Path(out_dir) / "tree-search.json"
    path.write_text(
        json.dumps({"acceptance": acc, "extrapolated_depths": extrapolated}, indent=2) + "\n"
    )
    return path


def choose_tree(
    cfg: DistillConfig, drafter: DrafterNet, target: Target, evalset, out_dir: str | Path
) -> Path:
    """The tree of `cfg.bench.tree` for this drafter, saved into `out_dir` as `tree.json`."""
    spec, ngram = split_ngram(cfg.bench.tree)
    if spec == "searched":
        tree, report = _search(cfg, drafter, target, evalset)
    else:  # a given tree may be deeper than this drafter's k: keep its first k levels
        tree, report = load_tree(spec).truncated(cfg.drafter.k), None
    return save_tree(tree.with_ngram() if ngram else tree, report, out_dir)


def _search(cfg: DistillConfig, drafter: DrafterNet, target: Target, evalset) -> tuple[Tree, dict]:
    """`select_tree` on the held-out split with the `cfg.bench.search_*` settings."""
    from draftlab.distill.worker import group_count

    b = cfg.bench
    rows = [evalset[i] for i in range(len(evalset))]
    return select_tree(
        drafter,
        target,
        rows,
        group_count(cfg),
        b.search_budgets,
        b.search_ranks,
        b.search_context,
        depth=cfg.drafter.k,
    )


def search_and_save(
    cfg: DistillConfig, drafter: DrafterNet, target: Target, evalset, out_dir: str | Path
) -> Path:
    """`_search`, saving `tree.json` and `tree-search.json` into `out_dir`; returns the
    `tree.json` path."""
    return save_tree(*_search(cfg, drafter, target, evalset), out_dir)


def choose_tree_for_run(cfg: DistillConfig, drafter_dir: str | None = None) -> dict:
    """`draftlab select-tree`: redo the end-of-training search for a trained drafter (default:
    the run's drafter directory) on its cached held-out data; returns the search report."""
    from draftlab.data.selfdistill import load_or_generate
    from draftlab.distill.trainer import output_dir

    drafter_dir = drafter_dir or output_dir(cfg)
    local = local_copy(drafter_dir)
    target = load_target(cfg.target)
    evalset = load_or_generate(cfg.data, cfg.target, progress=False)["eval"]
    path = search_and_save(cfg, load_drafter(local, target), target, evalset, local)
    if is_uri(drafter_dir):  # the mirror holds the new files: store them beside the drafter
        publish(local, drafter_dir, ["tree.json", "tree-search.json"])
    return json.loads((path.parent / "tree-search.json").read_text())


def searched_tree_file(drafter_dir: str | Path, budget: int) -> Path:
    """`tree-searched-<n>.json` next to the drafter: the best `budget`-node tree under the
    acceptance rates its `tree-search.json` recorded (written on first use; for a URI drafter,
    into its local mirror)."""
    drafter_dir = local_copy(drafter_dir)
    report_file = drafter_dir / "tree-search.json"
    if not report_file.is_file():
        raise FileNotFoundError(
            f"tree 'searched-{budget}' needs {report_file} (written by `draftlab distill` with bench.tree=searched, "
            f"or by `draftlab select-tree`)"
        )
    path = drafter_dir / f"tree-searched-{budget}.json"
    if not path.is_file():
        acc = json.loads(report_file.read_text())["acceptance"]
        path.write_text(best_tree(acc, budget).to_json() + "\n")
    return path


def save_tree(tree: Tree, report: dict | None, out_dir: str | Path) -> Path:
    """Write `tree.json` (and `tree-search.json` when a search chose it) into `out_dir`."""
    out_dir = Path(out_dir)
    (out_dir / "tree.json").write_text(tree.to_json() + "\n")
    if report is not None:
        (out_dir / "tree-search.json").write_text(json.dumps(report, indent=2) + "\n")
    return out_dir / "tree.json"


def resolve_tree(spec: str | None, drafter_dir: str | Path | None, k: int) -> Tree:
    """The tree a drafter drafting `k` deep verifies with: `chain` (= chain-k), `chain-<n>`,
    a preset (cut to depth k), `searched-<n>` (from the drafter's tree-search.json), a JSON
    file, or None = the drafter directory's `tree.json` when it has one, else chain-k; any of
    them followed by `+ngram` grafts prompt lookups each round."""
    if spec is None:
        saved = local_copy(drafter_dir) / "tree.json" if drafter_dir else None
        spec = str(saved) if saved is not None and saved.is_file() else "chain"
    spec, ngram = split_ngram(spec)
    if ngram:
        return resolve_tree(spec, drafter_dir, k).with_ngram()
    if spec == "chain":
        return Tree.chain(k)
    budget = searched_budget(spec)
    if budget:
        if drafter_dir is None:
            raise ValueError(
                f"tree {spec!r} needs a saved drafter directory (its tree-search.json)"
            )
        found = load_tree(str(searched_tree_file(drafter_dir, budget)), k)
        return Tree.from_paths([list(p) for p in found.paths], spec)
    return load_tree(spec).truncated(k)
