"""Static verification trees as Medusa-style rank paths, and their buffers.

A parallel drafter gives one distribution per future position, not conditioned on the path,
so a tree node is a *rank path*: `[0, 1]` = top-1 token at position 1, then top-2 at
position 2. A chain of k drafts is `[[0], [0, 0], ..., [0]*k]`.

Buffers are built once per tree. Node 0 is the root (the last committed token); nodes 1..N
follow the paths sorted by (depth, lexicographic), so parents precede children.

A tree may verify only `per_round` of its paths each round, those the drafter rates likeliest
that round (EAGLE-2's dynamic trees, here over rank paths): deep where the drafter is sure,
wide where it is not, at the cost of `per_round` nodes (`Tree.round_tree`).

A tree may also graft prompt-lookup drafts onto itself each round (`ngram`, spec suffix
`+ngram`, e.g. `chain-3+ngram`; see `ngram.py`): it travels with the tree through sweeps,
`tree.json`, the compare stage and serving. `@n` after a tree's name verifies n of its nodes
per round (`per_round`, e.g. `wide-16@6+ngram`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from draftlab.config import NgramSpec

NGRAM = "+ngram"  # spec suffix: graft prompt-lookup drafts onto the tree each round
PER_ROUND = "@"  # spec suffix `@n`: verify n of the tree's nodes per round
PRESET_DIR = Path(__file__).parent / "trees"


class TreeError(ValueError):
    """A tree definition is malformed; the message says which path and why."""


class Topology:
    """Buffers every verification tree derives from its `parents` (node 0 = the root, and
    every parent precedes its children): what the walks in `acceptance.py` and the verify
    forward's row plan need. Subclasses provide `parents: list[int]`."""

    parents: list[int]  # (N+1,), the root's is -1

    @property
    def num_nodes(self) -> int:
        """Drafted nodes (the verify forward has num_nodes + 1 rows with the root)."""
        return len(self.parents) - 1

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    @cached_property
    def children(self) -> list[list[int]]:
        """children[i] in node order (for a rank-path tree, rank order: siblings are tried
        in this order when sampling)."""
        kids: list[list[int]] = [[] for _ in self.parents]
        for i, p in enumerate(self.parents[1:], start=1):
            kids[p].append(i)
        return kids

    @cached_property
    def depths(self) -> torch.Tensor:
        """(N+1,) depth of each node; the root is 0. Position id = context length + depth."""
        out = [0] * len(self.parents)
        for i, p in enumerate(self.parents[1:], start=1):
            out[i] = out[p] + 1
        return torch.tensor(out)

    @cached_property
    def depth(self) -> int:
        return int(self.depths.max())

    @cached_property
    def ancestors(self) -> list[list[int]]:
        """(N+1) x (depth_i + 1): each node's ancestors from the root, then itself (parents
        precede children, so path order). Plain lists: a grafted round tree builds its row
        buffers from them every round (~14 nodes)."""
        seen: list[list[int]] = []
        for i, p in enumerate(self.parents):
            seen.append([*(seen[p] if p >= 0 else []), i])
        return seen

    @cached_property
    def ancestor_counts(self) -> list[int]:
        """(N+1,) how many block rows each node sees (its ancestors and itself), as host ints."""
        return [len(a) for a in self.ancestors]

    @cached_property
    def ancestor_mask(self) -> torch.Tensor:
        """(N+1, N+1) bool: row i may attend to column j iff j is i or an ancestor of i."""
        n = len(self.parents)
        m = torch.zeros(n, n, dtype=torch.bool)
        for i, path in enumerate(self.ancestors):
            m[i, path] = True
        return m

    @cached_property
    def ancestor_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Block rows each node sees, its ancestors then itself: ((N+1, depth+1) zero-padded
        offsets, (N+1,) counts) - the input of `attention.RowPlan.tree`."""
        width = max(len(s) for s in self.ancestors)
        return (
            torch.tensor([s + [0] * (width - len(s)) for s in self.ancestors]),
            torch.tensor([len(s) for s in self.ancestors]),
        )


@dataclass(frozen=True)
class RoundTree(Topology):
    """A verification tree built for one round: a `per_round` tree's chosen nodes, or a tree
    with a grafted lookup branch (`ngram.graft`)."""

    parents: list[int]  # (N+1,), the root's is -1


@dataclass(frozen=True)
class Tree(Topology):
    paths: tuple[tuple[int, ...], ...]  # sorted by (len, lex); excludes the root
    name: str = "custom"
    ngram: NgramSpec | None = None  # graft prompt-lookup drafts each round (ngram.py)
    per_round: int | None = None  # verify this many of `paths` per round, the drafter's likeliest

    @classmethod
    def from_paths(cls, paths, name: str = "custom", max_depth: int | None = None) -> Tree:
        """Validate: non-empty int paths, no duplicates, prefix-closed, depth <= max_depth."""
        if not isinstance(paths, list | tuple) or not paths:
            raise TreeError(
                f"tree {name!r}: expected a non-empty list of rank paths like [[0], [1], [0, 0]]"
            )
        clean: list[tuple[int, ...]] = []
        for p in paths:
            if not isinstance(p, list | tuple) or not p:
                raise TreeError(f"tree {name!r}: path {p!r} must be a non-empty list of ranks")
            if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in p):
                raise TreeError(
                    f"tree {name!r}: path {list(p)} must hold non-negative integer ranks"
                )
            clean.append(tuple(p))
        seen = set()
        for p in clean:
            if p in seen:
                raise TreeError(f"tree {name!r}: duplicate path {list(p)}")
            seen.add(p)
        for p in clean:
            if len(p) > 1 and p[:-1] not in seen:
                raise TreeError(
                    f"tree {name!r}: path {list(p)} has no parent {list(p[:-1])} (trees must be "
                    "prefix-closed)"
                )
        if max_depth is not None and max(len(p) for p in clean) > max_depth:
            deepest = max(clean, key=len)
            raise TreeError(
                f"tree {name!r}: path {list(deepest)} has depth {len(deepest)} > k={max_depth}"
            )
        return cls(tuple(sorted(clean, key=lambda p: (len(p), p))), name)

    @classmethod
    def chain(cls, k: int) -> Tree:
        return cls.from_paths([[0] * d for d in range(1, k + 1)], name=f"chain-{k}")

    @property
    def max_rank(self) -> int:
        return max(max(p) for p in self.paths)

    @property
    def is_chain(self) -> bool:
        """Top-1 drafts only (a chain's drafts may be sampled from the drafter)."""
        return all(all(r == 0 for r in p) for p in self.paths)

    # -- buffers (built once, cached) --------------------------------------------------
    @cached_property
    def parents(self) -> list[int]:
        """parents[i] for node i in 0..N (root's parent is -1)."""
        index = {p: i + 1 for i, p in enumerate(self.paths)}
        return [-1] + [index.get(p[:-1], 0) for p in self.paths]

    @cached_property
    def ranks(self) -> torch.Tensor:
        """(N,) rank at the node's own position (index into that position's top-k list)."""
        return torch.tensor([p[-1] for p in self.paths])

    def node_tokens(self, root: int, draft_logits: torch.Tensor) -> torch.Tensor:
        """(N+1,) verify-input ids: root, then each node's ranked token from (k, V) logits."""
        topk = draft_logits[: self.depth].topk(self.max_rank + 1, dim=-1).indices  # (depth, R)
        nodes = topk[self.depths[1:] - 1, self.ranks]  # (N,)
        return torch.cat([torch.tensor([root], device=nodes.device), nodes])

    @cached_property
    def _path_sums(self) -> torch.Tensor:
        """(N, N) float: row i sums over node i's path (itself and its ancestors, not the root)."""
        return self.ancestor_mask[1:, 1:].float()

    def round_tree(self, root: int, draft_logits: torch.Tensor) -> tuple[Topology, torch.Tensor]:
        """This round's tree and its (n+1,) verify-input ids (`node_tokens`): the whole tree,
        or for a `per_round` tree the `per_round` nodes whose paths the drafter rates likeliest.
        A path's score is the sum of its nodes' log-probabilities; a child never outscores
        its parent, so the choice is prefix-closed. It reads the drafter alone, before
        verification, so the walks' guarantees hold as for a static tree."""
        nodes = self.node_tokens(root, draft_logits)
        if self.per_round is None or self.per_round >= self.num_nodes:
            return self, nodes
        pos = (self.depths[1:] - 1).to(nodes.device)  # (N,) each node's draft position
        logp = draft_logits[: self.depth].float().log_softmax(-1)[pos, nodes[1:]]  # (N,)
        score = self._path_sums.to(logp.device) @ logp - 1e-4 * pos  # ties: the parent first
        keep = tuple(
            (score.topk(self.per_round).indices.sort().values + 1).tolist()
        )  # node ids, parents first
        shape = self._round_shapes.get(keep)
        if shape is None:  # a few shapes recur: build each (and its row buffers) once
            index = {0: 0} | {old: i + 1 for i, old in enumerate(keep)}
            shape = self._round_shapes[keep] = RoundTree(
                [-1] + [index[self.parents[old]] for old in keep]
            )
        return shape, nodes[[0, *keep]]

    @cached_property
    def _round_shapes(self) -> dict[tuple[int, ...], RoundTree]:
        """`round_tree`'s topologies by the node ids they keep."""
        return {}

    def truncated(self, max_depth: int) -> Tree:
        """The same tree without nodes deeper than `max_depth` (still prefix-closed)."""
        if self.depth <= max_depth:
            return self
        cut = Tree.from_paths(
            [list(p) for p in self.paths if len(p) <= max_depth], f"{self.name}-d{max_depth}"
        )
        return dataclasses.replace(cut, ngram=self.ngram, per_round=self.per_round)

    def with_ngram(self, spec: NgramSpec | None = None) -> Tree:
        """This tree, grafting prompt-lookup drafts (`spec`, default settings) each round."""
        base = self.name.removesuffix(NGRAM)
        return dataclasses.replace(self, name=base + NGRAM, ngram=spec or NgramSpec())

    def with_per_round(self, per_round: int | None) -> Tree:
        """This tree verifying `per_round` of its nodes each round (None: all of them)."""
        if per_round is not None and per_round < 1:
            raise TreeError(f"tree {self.name!r}: per_round must be >= 1 (got {per_round})")
        if per_round is not None and self.is_chain:
            raise TreeError(
                f"tree {self.name!r} is a chain: per_round would only cut its depth (use "
                f"chain-{per_round})"
            )
        return dataclasses.replace(self, per_round=per_round)

    def to_json(self) -> str:
        paths = [list(p) for p in self.paths]
        extra = {"ngram": self.ngram.model_dump()} if self.ngram else {}
        if self.per_round is not None:
            extra["per_round"] = self.per_round
        return json.dumps({"paths": paths, **extra} if extra else paths)


def available_trees() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json")) + ["chain-<k>"]


def split_ngram(spec: str) -> tuple[str, bool]:
    """`default+ngram` -> (`default`, True); `default` -> (`default`, False)."""
    return (spec.removesuffix(NGRAM), True) if spec.endswith(NGRAM) else (spec, False)


def split_per_round(spec: str) -> tuple[str, int | None]:
    """`wide-16@6` -> (`wide-16`, 6); `wide-16` -> (`wide-16`, None)."""
    base, sep, n = spec.rpartition(PER_ROUND)
    return (base, int(n)) if sep and n.isdigit() else (spec, None)


def load_tree(spec: str, k: int | None = None) -> Tree:
    """A preset name, `chain-<k>`, or a JSON file holding a list of rank paths (or
    {"paths": [...], "ngram": {...}, "per_round": n}); `@n` after any of them verifies n of
    its nodes per round, then `+ngram` grafts prompt lookups."""
    spec, ngram = split_ngram(spec)
    if ngram:
        return load_tree(spec, k).with_ngram()
    spec, per_round = split_per_round(spec)
    if per_round is not None:
        return load_tree(spec, k).with_per_round(per_round)
    if spec.startswith("chain-") and spec[6:].isdigit():
        tree = Tree.chain(int(spec[6:]))
        return Tree.from_paths([list(p) for p in tree.paths], spec, max_depth=k)
    path = PRESET_DIR / f"{spec}.json" if (PRESET_DIR / f"{spec}.json").is_file() else Path(spec)
    if not path.is_file():
        raise TreeError(
            f"unknown tree {spec!r}: not a preset ({available_trees()}) nor a JSON file"
        )
    try:
        paths = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise TreeError(f"tree file {path}: not valid JSON ({e})") from None
    graft, per_round = None, None
    if isinstance(
        paths, dict
    ):  # {"paths": [...], "ngram": {...}?, "per_round": n?} as `to_json` writes
        try:
            graft = NgramSpec.model_validate(paths["ngram"]) if paths.get("ngram") else None
        except ValueError as e:
            raise TreeError(f"tree file {path}: bad `ngram` ({e})") from None
        per_round = paths.get("per_round")
        if per_round is not None and (
            not isinstance(per_round, int) or isinstance(per_round, bool)
        ):
            raise TreeError(
                f"tree file {path}: `per_round` must be an integer node count (got {per_round!r})"
            )
        paths = paths.get("paths")
    tree = Tree.from_paths(
        paths, name=path.stem if path.parent == PRESET_DIR else str(path), max_depth=k
    )
    tree = tree.with_per_round(per_round)
    return tree.with_ngram(graft) if graft else tree
