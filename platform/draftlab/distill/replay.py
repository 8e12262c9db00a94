"""Replay held-out responses round by round: what a tree (with grafted lookups) accepts and costs.

The positional model of `decoding.tree_search` scores a tree by its drafter paths alone. A
tree served with prompt lookups (`+ngram`) also verifies a copied span in the rounds where
the lookup proposes one: a rank-2 node then buys little where the lookup already supplies
the second candidate, and every lookup row costs verify time. Both depend on the text, so
this module walks each held-out response as greedy decoding would:

    root x_p (the first one: the response's first token, which the prefill produces)
    tree:   accepted depth = longest prefix of the drafter's ranks of x_{p+1}, x_{p+2}, ...
            (`ranks.rank_tables`, anchor p-1) that is a path of the tree
    lookup: accepted depth = leading tokens of `NgramIndex.propose()` on x_0..x_p (the
            drafter's `NgramStore` where the text has no match) that equal x_{p+1}, x_{p+2}, ...
    carried on (`ngram.extend`): for each prefix of the drafter's likeliest path from
            `ngram.extend_from` deep (and, from 1, the `ngram.extend_firsts` likeliest
            other first-position candidates), the tokens of
            `NgramIndex.propose_after(prefix)`; accepted where that prefix is x's (its ranks
            all 0, or a first-position candidate's rank) as far as they equal x's next tokens
    commit max(tree, lookup, carried on) + 1 tokens (the bonus), and pay draft + verify of
    this round

A round's verify cost is the static tree's, plus its share of a grafted branch's cost for
each row the branch adds: branch rows on the accepted path the tree also has are shared.
The data are the target's greedy responses (`data.temperature: 0`), so x is the text
greedy speculative decoding commits. Where the drafter's likeliest path is not x's, the replay
knows its ranks, not its tokens: the rows of the lookups after x's own prefixes stand in for
the rows the engine pays after the drafted ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftlab.config import NgramSpec
from draftlab.decoding.ngram import NgramIndex, NgramStore, carried_depths
from draftlab.decoding.tree import Tree


@dataclass(frozen=True)
class RoundCost:
    """Measured ms of one round's parts (`profiling.verify_ms` / `draft_ms`)."""

    draft_ms: float
    verify_ms: float  # the static tree
    graft_row_ms: float = 0.0  # each row a grafted lookup branch adds (the block's leading chain)
    carried_row_ms: float = 0.0  # each row a carried-on lookup adds (tree rows, off that chain)


@dataclass
class Replay:
    tokens: int = 0  # committed by speculative rounds
    rounds: int = 0
    lookup_rounds: int = 0  # rounds where the lookup proposed a branch
    ms: float = 0.0  # summed round costs

    @property
    def tau(self) -> float:
        return self.tokens / self.rounds if self.rounds else 1.0

    def speedup(self, decode_ms: float) -> float:
        """Predicted speedup over decoding one token per `decode_ms`."""
        return self.tokens * decode_ms / self.ms if self.ms else 1.0


def _tree_depth(ranks: list[int], paths: set[tuple[int, ...]]) -> int:
    """How deep the tree follows the target: the longest accepted rank prefix."""
    d = 0
    while d < len(ranks) and ranks[d] >= 0 and tuple(ranks[: d + 1]) in paths:
        d += 1
    return d


def _matched(branch: list[int], truth: list[int]) -> int:
    return next(
        (i for i, (b, t) in enumerate(zip(branch, truth, strict=False)) if b != t),
        min(len(branch), len(truth)),
    )


def _carried_on(
    lookup: NgramIndex, truth: list[int], ranks: list[int], firsts: set[int]
) -> tuple[int, int]:
    """(accepted depth, rows) of the lookups carrying on the likeliest path's prefixes
    (`carried_depths`) and the other first-position candidates carried on (`firsts`: their
    ranks)."""
    depth, rows = 0, 0
    for d in carried_depths(lookup.spec, len(ranks)):
        after = lookup.propose_after(truth[:d])
        rows += len(after) * (
            1 + len(firsts) if d == 1 else 1
        )  # x_1's lookup stands in for every first's
        if after and (all(r == 0 for r in ranks[:d]) or (d == 1 and ranks[0] in firsts)):
            depth = max(depth, d + _matched(after, truth[d:]))
    return depth, rows


def replay(
    tables: list[torch.Tensor],  # per row (L-1, >= tree depth) ranks, `ranks.rank_tables`
    rows: list[dict],  # the same held-out samples: input_ids, prompt_len
    tree: Tree,
    cost: RoundCost,
    ngram: NgramSpec | None = None,
    store: NgramStore | None = None,
) -> Replay:
    """Walk every row's response with `tree` (grafting `ngram` lookups, in the text and
    then in `store`, when given)."""
    paths = set(tree.paths)
    others = sorted(
        p[0] for p in paths if len(p) == 1 and p[0] != 0
    )  # the tree's other firsts' ranks
    firsts = (
        set(others[: ngram.extend_firsts])
        if ngram is not None and ngram.extend_from == 1
        else set()
    )
    out = Replay()
    for table, row in zip(tables, rows, strict=True):
        ids, p = list(row["input_ids"])[: table.shape[0] + 1], int(row["prompt_len"])
        ranks = table[:, : tree.depth].tolist()  # (L-1, depth)
        lookup = NgramIndex(ngram, ids[: p + 1], store) if ngram is not None else None
        while p < len(ids) - 1:
            truth = ids[p + 1 :]
            by_tree = _tree_depth(ranks[p - 1], paths)
            branch = lookup.propose() if lookup is not None else []
            by_lookup = _matched(branch, truth)
            by_path, path_rows = (
                _carried_on(lookup, truth, ranks[p - 1], firsts) if lookup is not None else (0, 0)
            )
            step = min(max(by_tree, by_lookup, by_path) + 1, len(truth))
            out.ms += cost.draft_ms + cost.verify_ms + path_rows * cost.carried_row_ms
            if branch:
                out.lookup_rounds += 1
                out.ms += (len(branch) - min(by_tree, by_lookup)) * cost.graft_row_ms
            out.tokens += step
            out.rounds += 1
            if lookup is not None:
                lookup.extend(truth[:step])
            p += step
    return out


def extrapolate(
    tables: list[torch.Tensor], acc: list[list[float]], seed: int = 0
) -> list[torch.Tensor]:
    """`tables` widened to len(acc) depths: an extrapolated depth's rank is drawn from its
    rates acc[d] (a miss, rank len(acc[d]), with the rest), where the sequence has a node."""
    k, depth = tables[0].shape[1] if tables else len(acc), len(acc)
    if depth <= k:
        return tables
    gen = torch.Generator().manual_seed(seed)
    out = []
    for table in tables:
        n = table.shape[0]
        extra = torch.full((n, depth - k), -1, dtype=torch.long)
        for d in range(k, depth):
            probs = torch.tensor([*acc[d], max(0.0, 1.0 - sum(acc[d]))])
            drawn = torch.multinomial(probs, n, replacement=True, generator=gen)  # (n,)
            exists = (
                torch.arange(n) + d + 2 <= n
            )  # node (a, d) predicts x_{a+d+2}; x ends at index n
            extra[:, d - k] = torch.where(exists, drawn, -1)
        out.append(torch.cat([table, extra], dim=1))
    return out
