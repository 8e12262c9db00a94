"""Tree search: the static tree that maximises the expected accepted length for a node budget.

Positional acceptance model (Medusa, Sequoia): `acc[d][r]` is the probability that the
target accepts the drafter's rank-r token at depth d+1 given that the path to its parent
was accepted. A node's rank path (r_1..r_d) is then accepted with probability
prod_j acc[j-1][r_j], and the expected number of accepted drafts of a tree is the sum of
that over its nodes. Every factor is <= 1, so a child is never worth more than its parent:
the budget-n optimum is simply the n most valuable paths, which best-first growth from the
root finds (and which is prefix-closed by construction).
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Sequence

from draftlab.decoding.tree import Tree, TreeError

Acceptance = Sequence[Sequence[float]]  # (depth, ranks) conditional acceptance rates


def searched_budget(spec: str | None) -> int | None:
    """n for a `searched-<n>` tree spec (the best n-node tree of a drafter), else None."""
    match = re.fullmatch(r"searched-([1-9][0-9]*)", spec or "")
    return int(match.group(1)) if match else None


def _check(acc: Acceptance) -> None:
    if not acc or not all(len(row) for row in acc):
        raise TreeError("acceptance rates: need at least one depth with at least one rank")
    for d, row in enumerate(acc):
        for r, a in enumerate(row):
            if not 0.0 <= a <= 1.0:
                raise TreeError(
                    f"acceptance rate at depth {d + 1}, rank {r} is {a}; expected a probability in "
                    "[0, 1]"
                )


def path_value(path: Sequence[int], acc: Acceptance) -> float:
    """Probability that the whole rank path is accepted (0 beyond the measured depths/ranks)."""
    value = 1.0
    for d, r in enumerate(path):
        if d >= len(acc) or r >= len(acc[d]):
            return 0.0
        value *= acc[d][r]
    return value


def expected_accepted(tree: Tree, acc: Acceptance) -> float:
    """E[accepted drafts per round] of `tree` under `acc` (tau = 1 + this)."""
    return sum(path_value(p, acc) for p in tree.paths)


def best_tree(acc: Acceptance, budget: int, name: str | None = None) -> Tree:
    """The `budget`-node tree (fewer if fewer paths have non-zero value) maximising
    `expected_accepted`; depth <= len(acc), ranks < len(acc[d])."""
    _check(acc)
    if budget < 1:
        raise TreeError(f"tree budget must be >= 1 node, got {budget}")
    # Max-heap on value; ties go to shallower, then lexicographically smaller paths.
    frontier = [(-acc[0][r], 1, (r,)) for r in range(len(acc[0]))]
    heapq.heapify(frontier)
    chosen: list[tuple[int, ...]] = []
    while frontier and len(chosen) < budget:
        neg, _, path = heapq.heappop(frontier)
        if -neg <= 0.0:
            break
        chosen.append(path)
        depth = len(path)
        if depth < len(acc):
            for r, a in enumerate(acc[depth]):
                heapq.heappush(frontier, (neg * a, depth + 1, (*path, r)))
    return Tree.from_paths(
        [list(p) for p in chosen], name or f"searched-{budget}", max_depth=len(acc)
    )


def static_equivalent(tree: Tree, acc: Acceptance) -> Tree:
    """A `per_round` tree as the best static tree of its node count under `acc` (how deep
    and how accepted it is on average); any other tree as it is."""
    return best_tree(acc, tree.per_round) if tree.per_round else tree
