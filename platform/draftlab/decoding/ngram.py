"""Drafts that need no training, verified in the same tree as the drafter's.

Summaries, RAG answers and edits copy spans of their prompt; code and lists repeat what was
generated a moment ago. `NgramIndex` finds the latest earlier occurrence of the text's last
n tokens (n from `max_match` down to `min_match`, prompt and generated text alike) and
proposes the tokens that followed it: prompt-lookup decoding (HF `prompt_lookup_num_tokens`,
vLLM's `ngram`). Where those tools choose *one* draft source per step, here the proposal is
grafted onto the drafter's tree for the round (`graft`): a branch from the root that shares
the nodes it agrees with and adds the rest, so one target forward verifies the drafter's
rank paths and the copied span together and the walk keeps whichever the target agrees with.

When the text itself has no match, `NgramStore` looks the same suffix up in a fixed
corpus: the target's own responses to the drafter's training prompts (written next to the
drafter by `draftlab distill` as `lookup-store.safetensors`), proposing the continuation
that followed it most often there: retrieval drafting (REST) from data distillation
already produced.

Grafted nodes are deterministic drafts with distinct tokens under each parent, so greedy
identity and lossless sampling hold as for any top-k tree (`acceptance.py`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from draftlab.config import NgramSpec
from draftlab.decoding.tree import RoundTree, Topology

STORE_FILE = "lookup-store.safetensors"  # an `NgramStore` next to the drafter
_STORE_FIELDS = ("min_match", "max_match", "tokens")  # the spec a store was built with


class NgramStore:
    """The most frequent continuation of every n-gram (n in [min_match, max_match]) of a
    fixed corpus, looked up longest n first."""

    def __init__(self, spec: NgramSpec, table: dict[tuple[int, ...], list[int]]):
        self.spec, self.table = spec, table

    @classmethod
    def build(cls, sequences: Iterable[list[int]], spec: NgramSpec) -> NgramStore:
        """Count, in each sequence, the `spec.tokens` tokens that follow every n-gram (cut
        at the sequence's end); keep the most frequent (ties: the first seen)."""
        seen: Counter[tuple[int, ...]] = Counter()  # gram + continuation
        for seq in sequences:
            for end in range(1, len(seq)):
                nxt = tuple(seq[end : end + spec.tokens])
                for n in range(spec.min_match, min(spec.max_match, end) + 1):
                    seen[(n, *seq[end - n : end], *nxt)] += 1
        best: dict[tuple[int, ...], tuple[int, list[int]]] = {}
        for key, count in seen.items():
            n = key[0]
            gram = key[1 : n + 1]
            if gram not in best or count > best[gram][0]:
                best[gram] = (count, list(key[n + 1 :]))
        return cls(spec, {gram: nxt for gram, (_, nxt) in best.items()})

    def propose(self, tokens: list[int]) -> list[int]:
        """What followed the longest suffix of `tokens` found in the corpus; [] if none."""
        for n in range(self.spec.max_match, self.spec.min_match - 1, -1):
            if len(tokens) >= n and (nxt := self.table.get(tuple(tokens[-n:]))):
                return nxt
        return []

    def save(self, path: str | Path) -> None:
        """As (G, n) grams and (G, tokens) continuations per n, padded with -1."""
        tensors = {}
        for n in range(self.spec.min_match, self.spec.max_match + 1):
            items = [
                (g, c + [-1] * (self.spec.tokens - len(c)))
                for g, c in self.table.items()
                if len(g) == n
            ]
            grams = torch.tensor([g for g, _ in items], dtype=torch.int32).reshape(-1, n)
            nxt = torch.tensor([c for _, c in items], dtype=torch.int32).reshape(
                -1, self.spec.tokens
            )
            tensors |= {f"grams_{n}": grams, f"next_{n}": nxt}
        sizes = {f: str(getattr(self.spec, f)) for f in _STORE_FIELDS}
        save_file(tensors, str(path), metadata=sizes)

    @classmethod
    def load(cls, path: str | Path) -> NgramStore:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        if not set(_STORE_FIELDS) <= set(meta):
            raise ValueError(
                f"{path} is not an n-gram lookup store (no {list(_STORE_FIELDS)} in its metadata)"
            )
        spec = NgramSpec(**{f: int(meta[f]) for f in _STORE_FIELDS})
        tensors, table = load_file(str(path)), {}
        for n in range(spec.min_match, spec.max_match + 1):
            for gram, nxt in zip(
                tensors[f"grams_{n}"].tolist(), tensors[f"next_{n}"].tolist(), strict=True
            ):
                table[tuple(gram)] = [t for t in nxt if t >= 0]
        return cls(spec, table)

    @classmethod
    def beside(cls, drafter_dir: str | Path | None) -> NgramStore | None:
        """The store saved next to a drafter, if it has one."""
        path = Path(drafter_dir) / STORE_FILE if drafter_dir is not None else None
        return cls.load(path) if path is not None and path.is_file() else None


class NgramIndex:
    """Prompt lookup over one request's tokens, updated as tokens are committed.

    `_next[gram]` = the index just after the latest occurrence of `gram` (n-grams of every
    length in [min_match, max_match]) that has a continuation, so a lookup is a dict get per
    length and an update is O(max_match) per token.

    A copy from the text is `spec.tokens` long; after a round that committed the whole copy,
    the next may be twice as long, up to `spec.grow_to` (a RAG answer or a summary quoting
    its source copies long spans), and a copy the target cut short resets it.
    """

    def __init__(self, spec: NgramSpec, tokens: list[int], store: NgramStore | None = None):
        self.spec = spec
        self.store = (
            store if spec.store_tokens or spec.extend else None
        )  # consulted when the text has no match
        self.tokens: list[int] = []
        self._next: dict[tuple[int, ...], int] = {}
        self.copy_len = spec.tokens  # the next copy's length
        self._copied: list[int] = []  # the last proposal's copy from the text
        self.extend(tokens)

    def extend(self, new: list[int]) -> None:
        if self._copied:  # committed after a copy: was all of it right?
            whole = new[: len(self._copied)] == self._copied
            self.copy_len = (
                max(self.spec.tokens, min(2 * self.copy_len, self.spec.grow_to))
                if whole
                else self.spec.tokens
            )
            self._copied = []
        for tok in new:
            end = len(self.tokens)  # `tok` continues every n-gram ending just before it
            for n in range(self.spec.min_match, self.spec.max_match + 1):
                if end >= n:
                    self._next[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(tok)

    def _find(self, toks: list[int]) -> int | None:
        """Where the text continues the longest suffix of `toks` it holds; None if none."""
        for n in range(self.spec.max_match, self.spec.min_match - 1, -1):
            if len(toks) >= n and (start := self._next.get(tuple(toks[-n:]))) is not None:
                return start
        return None

    def propose(self) -> list[int]:
        """Up to `copy_len` tokens that followed the longest matching suffix in the text,
        else up to `spec.store_tokens` from the store; [] if neither has a match."""
        start = self._find(self.tokens)
        if start is not None:
            self._copied = self.tokens[start : start + self.copy_len]
            return self._copied
        self._copied = []
        return (
            self.store.propose(self.tokens)[: self.spec.store_tokens]
            if self.store is not None and self.spec.store_tokens
            else []
        )

    def propose_after(self, path: list[int]) -> list[int]:
        """Up to `spec.extend` tokens that followed the text's tokens plus the drafted `path`
        (not committed) in the text, else in the store; [] if neither has a match."""
        if not self.spec.extend:
            return []
        toks = self.tokens[-self.spec.max_match :] + path  # a suffix match needs no more
        start = self._find(toks)
        if start is not None:
            return self.tokens[start : start + self.spec.extend]
        if self.store is None:
            return []
        return self.store.propose(self.tokens[-self.store.spec.max_match :] + path)[
            : self.spec.extend
        ]

    def carried(self, path: list[int], firsts: list[int]) -> list[list[int]]:
        """Branches carrying on the prefixes of the drafter's likeliest `path` at least
        `spec.extend_from` deep (`carried_depths`) and, with `extend_from` 1, the
        `spec.extend_firsts` likeliest of its other first-position candidates (`firsts`, the
        round tree's, likeliest first) by `propose_after`; those with no match are left out."""
        others = (
            [[f] for f in firsts if f != path[0]][: self.spec.extend_firsts]
            if self.spec.extend_from == 1
            else []
        )
        starts = [path[:d] for d in carried_depths(self.spec, len(path))] + others
        return [start + after for start in starts if (after := self.propose_after(start))]


def carried_depths(spec: NgramSpec, depth: int) -> range:
    """The depths of the likeliest path's prefixes carried on in a `depth`-deep tree: from
    `spec.extend_from` (the whole path where the tree is shallower) down to `depth`."""
    return range(min(spec.extend_from, depth), depth + 1)


def graft(tree: Topology, nodes: list[int], branch: list[int]) -> tuple[Topology, list[int]]:
    """Add the token path `branch` (starting below the root) to `tree` whose node tokens are
    `nodes` (root first). Shared prefixes reuse existing nodes. Returns (tree, nodes), the
    inputs themselves when the branch adds nothing. Node order: the root, the branch (the
    static nodes it shares, then its new nodes), then the tree's other nodes in their order.
    The branch rows lead the verify block as a chain, so they see causal prefixes of the
    cache and need no per-row key gather (`attention.RowPlan.tree`): what a long prompt's
    copied spans are cheap for."""
    shared = []  # static nodes along the branch
    for tok in branch:
        nxt = next((c for c in tree.children[shared[-1] if shared else 0] if nodes[c] == tok), None)
        if nxt is None:
            break
        shared.append(nxt)
    new = branch[len(shared) :]
    if not new:
        return tree, nodes
    index = {old: i for i, old in enumerate([0, *shared])}  # static node -> new index
    toks = [nodes[old] for old in index] + list(new)
    parents = list(range(-1, len(toks) - 1))  # root, shared nodes, new nodes: one chain
    for old in range(1, len(nodes)):
        if old not in index:
            index[old] = len(toks)
            parents.append(index[tree.parents[old]])
            toks.append(nodes[old])
    return RoundTree(parents), toks
