import json

import pytest
import torch

from draftlab.decoding.tree import Tree, TreeError, available_trees, load_tree


def test_sorted_buffers():
    t = Tree.from_paths([[0, 0], [1], [0], [0, 1], [1, 0], [0, 0, 0]])
    assert t.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert t.parents == [-1, 0, 0, 1, 1, 2, 3]
    assert t.children[0] == [1, 2] and t.children[1] == [3, 4]
    assert t.depths.tolist() == [0, 1, 1, 2, 2, 2, 3]
    m = t.ancestor_mask
    assert m[6].nonzero().flatten().tolist() == [0, 1, 3, 6]  # root, [0], [0,0], self
    assert m[5].nonzero().flatten().tolist() == [0, 2, 5]
    assert not m[1, 2] and m.diagonal().all()


def test_ancestor_rows_list_each_nodes_mask_row_in_path_order():
    t = Tree.from_paths([[0, 0], [1], [0], [0, 1], [1, 0], [0, 0, 0], [2]])
    rows, counts = t.ancestor_rows  # (N+1, depth+1), (N+1,)
    assert rows.shape == (8, 4)
    for i, row in enumerate(t.ancestor_mask):
        assert rows[i, : counts[i]].tolist() == row.nonzero().flatten().tolist()


def test_node_tokens_follow_ranks():
    t = Tree.from_paths([[0], [1], [0, 0], [1, 0], [0, 0, 0]])
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0], [3.0, 0.0, 0.0, 9.0], [7.0, 0.0, 0.0, 0.0]])
    # position 1 ranks: 1, 2; position 2: 3; position 3: 0
    assert t.node_tokens(42, logits).tolist() == [42, 1, 2, 3, 3, 0]


def test_per_round_tree_verifies_the_paths_the_drafter_rates_likeliest():
    t = Tree.from_paths([[0], [1], [0, 0], [1, 0], [0, 0, 0]]).with_per_round(3)
    sure = torch.tensor(
        [[0.0, 9.0, 1.0, 0.0], [9.0, 0.0, 0.0, 0.0], [0.0, 0.0, 9.0, 0.0]]
    )  # one likely path
    shape, nodes = t.round_tree(42, sure)
    assert shape.is_chain and nodes.tolist() == [42, 1, 0, 2]  # [0], [0, 0], [0, 0, 0]: deep
    unsure = torch.tensor([[0.0, 5.2, 5.0, 0.0], [0.0, 0.0, 0.0, 0.5], [0.0, 0.0, 9.0, 0.0]])
    shape, nodes = t.round_tree(42, unsure)  # position 1 a coin toss, position 2 a guess: wide
    assert shape.parents == [-1, 0, 0, 1] and nodes.tolist() == [42, 1, 2, 3]  # [0], [1], [0, 0]
    small = Tree.from_paths([[0], [1]]).with_per_round(
        2
    )  # a budget the tree fits in: the tree itself
    assert small.round_tree(42, sure)[0] is small


def test_per_round_choice_is_prefix_closed_under_ties():
    t = load_tree("wide-16").with_per_round(6)
    shape, nodes = t.round_tree(0, torch.zeros(t.depth, 50))  # every node equally likely
    assert shape.num_nodes == 6 and nodes.numel() == 7
    assert all(0 <= p < i for i, p in enumerate(shape.parents) if i)  # parents precede children


def test_per_round_validation_and_json(tmp_path):
    with pytest.raises(TreeError, match="per_round must be >= 1"):
        load_tree("default").with_per_round(0)
    with pytest.raises(TreeError, match="is a chain"):
        Tree.chain(4).with_per_round(2)
    t = load_tree("wide-16").with_per_round(6).with_ngram()
    f = tmp_path / "t.json"
    f.write_text(t.to_json())
    back = load_tree(str(f))
    assert back.per_round == 6 and back.ngram == t.ngram and back.paths == t.paths
    assert back.truncated(2).per_round == 6
    f.write_text(json.dumps({"paths": [[0], [1]], "per_round": "6"}))
    with pytest.raises(TreeError, match="per_round` must be an integer"):
        load_tree(str(f))


def test_chain():
    c = Tree.chain(3)
    assert c.is_chain and c.depth == 3 and c.num_nodes == 3
    assert load_tree("chain-3") == c.__class__(c.paths, "chain-3")


@pytest.mark.parametrize(
    "paths,msg",
    [
        ([], "non-empty list"),
        ([[0], [0]], "duplicate path"),
        ([[0], [1, 0]], r"has no parent \[1\]"),
        ([[0], []], "non-empty list of ranks"),
        ([[0], [-1]], "non-negative integer"),
        ([[0], ["a"]], "non-negative integer"),
        ("[[0]]", "non-empty list"),
    ],
)
def test_invalid_trees(paths, msg):
    with pytest.raises(TreeError, match=msg):
        Tree.from_paths(paths)


def test_depth_limit():
    with pytest.raises(TreeError, match="depth 3 > k=2"):
        Tree.from_paths([[0], [0, 0], [0, 0, 0]], max_depth=2)
    with pytest.raises(TreeError, match="depth 4 > k=3"):
        load_tree("default", k=3)


def test_presets_and_files(tmp_path):
    for name in available_trees():
        if name != "chain-<k>":
            assert load_tree(name).num_nodes > 0
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"paths": [[0], [1], [0, 0]]}))
    assert load_tree(str(f)).num_nodes == 3
    f.write_text("[[0], [1, 0]")
    with pytest.raises(TreeError, match="not valid JSON"):
        load_tree(str(f))
    f.write_text("[[0], [2, 0]]")
    with pytest.raises(TreeError, match="prefix-closed"):
        load_tree(str(f))
    with pytest.raises(TreeError, match="unknown tree 'nope'"):
        load_tree("nope")


def test_truncated_keeps_prefix_closure():
    t = load_tree("default")
    assert t.truncated(4) is t
    t2 = t.truncated(2)
    assert t2.depth == 2 and all(len(p) <= 2 for p in t2.paths)
    assert set(t2.paths) == {p for p in t.paths if len(p) <= 2}
