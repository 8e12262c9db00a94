"""Tree search against brute force on hand-set acceptance rates."""

import itertools

import pytest

from draftlab.decoding.tree import Tree, TreeError
from draftlab.decoding.tree_search import best_tree, expected_accepted

ACC = [[0.6, 0.2, 0.1], [0.5, 0.25, 0.05], [0.45, 0.2, 0.1]]


def brute_force(acc, budget):
    nodes = [
        p
        for d in range(1, len(acc) + 1)
        for p in itertools.product(*(range(len(acc[j])) for j in range(d)))
    ]
    best = 0.0
    for subset in itertools.combinations(nodes, budget):
        s = set(subset)
        if all(len(p) == 1 or p[:-1] in s for p in subset):
            best = max(best, expected_accepted(Tree.from_paths([list(p) for p in subset]), acc))
    return best


@pytest.mark.parametrize("budget", [1, 2, 3, 4, 5])
def test_matches_brute_force_optimum(budget):
    tree = best_tree(ACC, budget)
    assert tree.num_nodes == budget
    assert expected_accepted(tree, ACC) == pytest.approx(brute_force(ACC, budget))


def test_known_small_trees():
    assert best_tree(ACC, 1).paths == ((0,),)
    assert best_tree(ACC, 2).paths == ((0,), (0, 0))  # 0.30 beats rank 1 at depth 1 (0.20)
    assert best_tree(ACC, 3).paths == ((0,), (1,), (0, 0))  # 0.20 beats (0,0,0) = 0.135
    # a chain-shaped optimum when the first rank dominates
    assert best_tree([[0.9, 0.01], [0.9, 0.01], [0.9, 0.01]], 3).paths == ((0,), (0, 0), (0, 0, 0))


@pytest.mark.parametrize("budget", [1, 4, 8, 16, 32, 64])
def test_trees_always_validate(budget):
    acc = [[0.7, 0.15, 0.05, 0.02]] * 5
    tree = best_tree(acc, budget)
    again = Tree.from_paths(
        [list(p) for p in tree.paths], max_depth=5
    )  # prefix-closed, no duplicates
    assert again.paths == tree.paths and tree.num_nodes == budget
    assert tree.depth <= 5


def test_zero_value_paths_are_not_added_and_bad_rates_fail():
    assert best_tree([[0.5, 0.0], [0.0]], 8).paths == ((0,),)
    with pytest.raises(TreeError, match="depth 2, rank 0 is 1.5"):
        best_tree([[0.5], [1.5]], 3)
    with pytest.raises(TreeError, match="budget"):
        best_tree(ACC, 0)
