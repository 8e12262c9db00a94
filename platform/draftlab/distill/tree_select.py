"""Pick the verification tree of a trained drafter by predicted speedup on this hardware.

From the drafter's held-out conditional rank acceptance (`ranks.acceptance_rates`), the
best tree for each node budget (`tree_search.best_tree`) is a candidate. Each candidate
then replays the held-out responses round by round (`replay.py`), with the prompt lookups
it will be served with when the spec says `+ngram`, paying the target's measured verify
time for its rows and the drafter's measured drafting time for its depth:

    speedup(tree) = tokens * t_decode / sum over rounds (t_verify(round) + t_draft(depth))

The best-scoring tree is saved next to the drafter as `tree.json`; the whole table (rates,
costs, candidates) as `tree-search.json`. A drafter directory may be a URI (s3://...): it is
read through its local mirror (`draftlab.storage.local_copy`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from draftlab.cluster import output_dir
from draftlab.config import DistillConfig, NgramSpec
from draftlab.data.selfdistill import load_or_generate
from draftlab.decoding.ngram import NgramStore, graft
from draftlab.decoding.tree import Topology, Tree, load_tree, split_ngram
from draftlab.decoding.tree_files import save_tree
from draftlab.decoding.tree_search import best_tree, expected_accepted
from draftlab.distill.ranks import acceptance_rates, rank_tables
from draftlab.distill.replay import RoundCost, extrapolate, replay
from draftlab.models.drafters.build import load_drafter
from draftlab.models.drafters.network import DrafterNet
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
    ngram: NgramSpec | None = None,
    store: NgramStore | None = None,
) -> tuple[Tree, dict]:
    """The tree with the best predicted speedup among the budget optima, and the report.

    `k` depths are measured (the training groups); trees may go `depth` deep. An
    autoregressive drafter trains one group, so its deeper rates repeat the last measured
    depth (flagged in the report as `extrapolated_depths`) and the replay draws its ranks
    there from those rates: an optimistic guess, as its acceptance usually decays a little
    with depth. With `ngram`, every candidate is scored with grafted prompt lookups (from
    the text, then from `store`) and the chosen tree carries them.
    """
    tables, acc, extrapolated = _held_out_acceptance(
        drafter, target, rows, k, max_ranks, depth or k
    )
    tables = extrapolate(tables, acc)
    trees: dict[tuple, Tree] = {}
    for n in sorted(set(budgets)):
        tree = best_tree(acc, n)
        trees.setdefault(tree.paths, tree)  # budgets past the useful paths give the same tree
    candidates = list(trees.values())
    grafted = [_with_branch(t, ngram.tokens) for t in candidates] if ngram else []
    twice = [
        _with_branch(t, ngram.tokens, token=2) for t in grafted
    ]  # the first branch now tree rows
    decode, *verify = verify_ms(target, [None, *candidates, *grafted, *twice], context, repeats)
    n = len(candidates)
    plain, with_branch, with_two = (
        verify[:n],
        verify[n : 2 * n] or verify[:n],
        verify[2 * n :] or verify[:n],
    )
    drafting = {
        d: draft_ms(drafter, d, context, repeats) for d in sorted({t.depth for t in candidates})
    }
    table, chosen = [], []
    for tree, v, vb, vb2 in zip(candidates, plain, with_branch, with_two, strict=True):
        row_ms = max(0.0, vb - v) / ngram.tokens if ngram else 0.0
        tree_row_ms = (
            max(row_ms, (vb2 - vb) / ngram.tokens) if ngram else 0.0
        )  # rows off the leading chain
        for spec in _lookup_options(ngram, store, tree.depth):
            cost = RoundCost(drafting[tree.depth], v, row_ms, tree_row_ms)
            run = replay(tables, rows, tree, cost, spec, store)
            chosen.append(tree.with_ngram(spec) if spec else tree)
            table.append(
                {
                    "tree": tree.name,
                    "nodes": tree.num_nodes,
                    "depth": tree.depth,
                    "paths": [list(p) for p in tree.paths],
                    "ngram": spec.model_dump() if spec else None,
                    "expected_tau": 1.0 + expected_accepted(tree, acc),  # the positional model's
                    "tau": run.tau,  # replayed, with the lookups when `ngram`
                    "lookup_rounds": run.lookup_rounds / run.rounds if run.rounds else 0.0,
                    "verify_ms": v,
                    "graft_row_ms": row_ms,
                    "carried_row_ms": tree_row_ms,
                    "draft_ms": drafting[tree.depth],
                    "predicted_speedup": run.speedup(decode),
                }
            )
    best = max(range(len(table)), key=lambda i: table[i]["predicted_speedup"])
    report = {
        "acceptance": acc,
        "extrapolated_depths": extrapolated,
        "context": context,
        "decode_ms": decode,
        "lookup_store_grams": len(store.table) if ngram and store else None,
        "candidates": table,
        "chosen": table[best]["tree"],
        "chosen_ngram": table[best]["ngram"],
    }
    return chosen[best], report


STORE_TOKENS = (0, 2, 3, 5)  # store branch lengths the search tries (0: the text's lookups only)
EXTEND = (0, 2, 4)  # lengths of the lookups carrying on the likeliest path the search tries


def _lookup_options(
    ngram: NgramSpec | None, store: NgramStore | None, depth: int
) -> list[NgramSpec | None]:
    """The lookup settings a `depth`-deep tree is replayed with: none, or `ngram` with each
    length of the lookups carrying on the likeliest path (every prefix of it, or its whole
    `depth` alone), and (with a store) each store branch length up to `ngram.tokens`."""
    if ngram is None:
        return [None]
    lengths = (
        sorted({min(t, ngram.tokens) for t in STORE_TOKENS})
        if store is not None
        else [ngram.store_tokens]
    )
    carry = [(0, 1)] + [(e, start) for e in EXTEND if e for start in sorted({1, depth})]
    return [
        ngram.model_copy(update={"store_tokens": t, "extend": e, "extend_from": start})
        for t in lengths
        for e, start in carry
    ]


def _with_branch(tree: Topology, tokens: int, token: int = 1) -> Topology:
    """`tree` with a `tokens`-long lookup branch of `token`s that shares no node (the tree's
    are 0 and earlier branches' other tokens): a round's worst case."""
    nodes = [0] * (tree.num_nodes + 1)
    return graft(tree, nodes, [token] * tokens)[0]


def _held_out_acceptance(
    drafter: DrafterNet, target: Target, rows: list[dict], k: int, max_ranks: int, depth: int
) -> tuple[list[torch.Tensor], list[list[float]], int]:
    """The drafter's per-row rank tables on held-out `rows` (`k` measured depths), their
    conditional acceptance rates taken down to `depth`, and how many depths were added."""
    tables = rank_tables(drafter, target, rows, k)
    acc, extrapolated = _to_depth(acceptance_rates(tables, max_ranks), depth)
    return tables, acc, extrapolated


def _to_depth(acc: list[list[float]], depth: int) -> tuple[list[list[float]], int]:
    """`acc` with its last measured depth repeated down to `depth`, and how many were added."""
    extrapolated = max(0, depth - len(acc))
    return acc + [list(acc[-1])] * extrapolated, extrapolated


def save_acceptance(
    cfg: DistillConfig, drafter: DrafterNet, target: Target, evalset, out_dir: str | Path
) -> Path:
    """Only the measurement half of the search: `tree-search.json` with the held-out rank
    acceptance (what `searched-<n>` trees are built from), no timing and no `tree.json`.
    A sweep measures its trees' speed instead of predicting it."""
    rows = [evalset[i] for i in range(len(evalset))]
    _, acc, extrapolated = _held_out_acceptance(
        drafter, target, rows, drafter.groups, cfg.bench.search_ranks, cfg.drafter.k
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
    if spec == "searched":  # `searched+ngram`: scored with the lookups, saved with them
        return search_and_save(cfg, drafter, target, evalset, out_dir)
    # a given tree may be deeper than this drafter's k: keep its first k levels
    tree = load_tree(spec).truncated(cfg.drafter.k)
    return save_tree(tree.with_ngram() if ngram else tree, None, out_dir)


def _search(
    cfg: DistillConfig, drafter: DrafterNet, target: Target, evalset, store: NgramStore | None
) -> tuple[Tree, dict]:
    """`select_tree` on the held-out split with the `cfg.bench.search_*` settings, scoring
    the prompt lookups too (with the drafter's `store`) when `cfg.bench.tree` ends in `+ngram`."""
    b = cfg.bench
    rows = [evalset[i] for i in range(len(evalset))]
    return select_tree(
        drafter,
        target,
        rows,
        drafter.groups,
        b.search_budgets,
        b.search_ranks,
        b.search_context,
        depth=cfg.drafter.k,
        ngram=NgramSpec() if split_ngram(cfg.bench.tree)[1] else None,
        store=store,
    )


def search_and_save(
    cfg: DistillConfig, drafter: DrafterNet, target: Target, evalset, out_dir: str | Path
) -> Path:
    """`_search` (with the lookup store saved in `out_dir`, if any), saving `tree.json` and
    `tree-search.json` into `out_dir`; returns the `tree.json` path."""
    return save_tree(*_search(cfg, drafter, target, evalset, NgramStore.beside(out_dir)), out_dir)


def choose_tree_for_run(cfg: DistillConfig, drafter_dir: str | None = None) -> dict:
    """`draftlab select-tree`: redo the end-of-training search for a trained drafter (default:
    the run's drafter directory) on its cached held-out data; returns the search report."""
    drafter_dir = drafter_dir or output_dir(cfg)
    local = local_copy(drafter_dir)
    target = load_target(cfg.target)
    drafter = load_drafter(local, target)  # before the data: a wrong directory fails at once
    evalset = load_or_generate(cfg.data, cfg.target, progress=False)["eval"]
    path = search_and_save(cfg, drafter, target, evalset, local)
    if is_uri(drafter_dir):  # the mirror holds the new files: store them beside the drafter
        publish(local, drafter_dir, ["tree.json", "tree-search.json"])
    return json.loads((path.parent / "tree-search.json").read_text())


def per_round_tree(cfg: DistillConfig, tree: Tree, out_dir: str | Path) -> Tree | None:
    """`tree`'s node count verified per round out of the best `cfg.bench.per_round_pool`-node
    tree under the acceptance in `out_dir`'s `tree-search.json`, with `tree`'s lookups
    (`searched-<pool>@<n>`); None when off, without a search, or when the pool adds no node."""
    pool, report = cfg.bench.per_round_pool, Path(out_dir) / "tree-search.json"
    if pool is None or not report.is_file():
        return None
    paths = best_tree(json.loads(report.read_text())["acceptance"], pool).paths
    if len(paths) <= tree.num_nodes:
        return None
    pooled = Tree.from_paths([list(p) for p in paths], f"searched-{pool}@{tree.num_nodes}")
    pooled = pooled.with_per_round(tree.num_nodes)
    return pooled.with_ngram(tree.ngram) if tree.ngram else pooled
