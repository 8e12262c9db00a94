"""Drafts that need no training, verified in the same tree as the drafter's.

Summaries, RAG answers and edits copy spans of their prompt; code and lists repeat what was
generated a moment ago. `NgramIndex` finds the latest earlier occurrence of the text's last
n tokens (n from `max_match` down to `min_match`, prompt and generated text alike) and
proposes the tokens that followed it: prompt-lookup decoding (HF `prompt_lookup_num_tokens`,
vLLM's `ngram`). Where those tools choose *one* draft source per step, here the proposal is
grafted onto the drafter's tree for the round (`graft`): a branch from the root that shares
the nodes it agrees with and adds the rest, so one target forward verifies the drafter's
rank paths and the copied span together and the walk keeps whichever the target agrees with.

Grafted nodes are deterministic drafts with distinct tokens under each parent, so greedy
identity and lossless sampling hold as for any top-k tree (`acceptance.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from draftlab.config import NgramSpec
from draftlab.decoding.tree import Topology


class NgramIndex:
    """Prompt lookup over one request's tokens, updated as tokens are committed.

    `_next[gram]` = the index just after the latest occurrence of `gram` (n-grams of every
    length in [min_match, max_match]) that has a continuation, so a lookup is a dict get per
    length and an update is O(max_match) per token.
    """

    def __init__(self, spec: NgramSpec, tokens: list[int]):
        self.spec = spec
        self.tokens: list[int] = []
        self._next: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, new: list[int]) -> None:
        for tok in new:
            end = len(self.tokens)  # `tok` continues every n-gram ending just before it
            for n in range(self.spec.min_match, self.spec.max_match + 1):
                if end >= n:
                    self._next[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(tok)

    def propose(self) -> list[int]:
        """Up to `spec.tokens` tokens that followed the longest matching suffix; [] if none."""
        toks = self.tokens
        for n in range(self.spec.max_match, self.spec.min_match - 1, -1):
            if len(toks) < n:
                continue
            start = self._next.get(tuple(toks[-n:]))
            if start is not None:
                return toks[start : start + self.spec.tokens]
        return []


@dataclass(frozen=True)
class GraftedTree(Topology):
    """One round's verification tree: a static tree plus a grafted token branch.

    Node order: the root, the branch (the static nodes it shares, then its new nodes), then
    the static tree's other nodes in their order. The branch rows lead the verify block as a
    chain, so they see causal prefixes of the cache and need no per-row key gather
    (`attention.RowPlan.tree`): what a long prompt's copied spans are cheap for."""

    parents: list[int]  # (N+1,), the root's is -1


def graft(tree: Topology, nodes: list[int], branch: list[int]) -> tuple[Topology, list[int]]:
    """Add the token path `branch` (starting below the root) to `tree` whose node tokens are
    `nodes` (root first). Shared prefixes reuse existing nodes. Returns (tree, nodes) in
    `GraftedTree`'s order, the inputs themselves when the branch adds nothing."""
    shared = []  # static nodes along the branch
    for tok in branch:
        nxt = next((c for c in tree.children[shared[-1] if shared else 0] if nodes[c] == tok), None)
        if nxt is None:
            break
        shared.append(nxt)
    new = branch[len(shared):]
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
    return GraftedTree(parents), toks
