"""Which drafted tokens the target accepts: greedy and lossless sampling, chain and tree.

One walk serves both: from the root, look at the current node's children (a chain has one
per node) and move to the accepted child, until none is accepted; then emit a bonus token.

Lossless sampling (Leviathan et al. 2023; SpecInfer-style for trees). For a child x drafted
from q at a node whose target distribution is p:
  accept with probability min(1, p(x) / q(x)); on rejection p <- norm(max(p - q, 0)).
A deterministic draft (top-k rank in a tree) is the point mass q = 1_x, for which this reads
"accept with p(x); else zero p(x) and renormalise" before the next sibling. When no child
is accepted the bonus token is sampled from the residual p, which keeps the output
distributed exactly as the target's.
"""

from __future__ import annotations

import torch

from draftlab.decoding.tree import Topology


def process_logits(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """(..., V) logits -> (..., V) probabilities after temperature and top-p (nucleus)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    # Keep the smallest prefix whose mass reaches top_p (the top token is always kept).
    drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
    drop[..., 0] = (
        False  # also when top_p rounds to 0 in float32 (e.g. 1e-300): never an empty nucleus
    )
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return kept / kept.sum(-1, keepdim=True)


def sample(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=gen))


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) -> (...,) each row's argmax (its first maximum, as `argmax` picks). `max`
    over a dim returns the same index and is several times faster on CPU, which a verify
    round pays once."""
    return logits.max(-1).indices


def greedy_walk(
    tree: Topology, nodes: list[int], target_logits: torch.Tensor
) -> tuple[list[int], int]:
    """Longest root-to-node path whose tokens equal the target's argmax.

    nodes: (N+1) verify-input token ids; target_logits: (N+1, V).
    Returns (accepted node indices in path order, bonus token).
    """
    best = greedy_tokens(target_logits).tolist()  # (N+1,)
    accepted, node = [], 0
    while True:
        want = best[node]
        nxt = next((c for c in tree.children[node] if nodes[c] == want), None)
        if nxt is None:
            return accepted, want
        accepted.append(nxt)
        node = nxt


def sampled_walk(
    tree: Topology,
    nodes: list[int],
    target_probs: torch.Tensor,  # (N+1, V) processed target distributions
    draft_probs: torch.Tensor
    | None,  # (depth, V) when drafts were sampled from q; None = deterministic
    gen: torch.Generator | None,
) -> tuple[list[int], int]:
    """Lossless acceptance; returns (accepted node indices, bonus token)."""
    accepted, node = [], 0
    while True:
        p = target_probs[node]
        nxt = None
        for child in tree.children[node]:
            x = nodes[child]
            u = float(torch.rand((), generator=gen, device=p.device))
            if draft_probs is None:  # point-mass draft
                if u < float(p[x]):
                    nxt = child
                    break
                p = p.clone()
                p[x] = 0.0
            else:
                q = draft_probs[int(tree.depths[child]) - 1]
                if float(q[x]) > 0 and u < min(1.0, float(p[x] / q[x])):
                    nxt = child
                    break
                p = (p - q).clamp_min(0.0)
            total = p.sum()
            if total <= 0:  # p == q exactly: a rejection has probability 0; keep p valid
                p = target_probs[node]
            else:
                p = p / total
        if nxt is None:
            return accepted, sample(p, gen)
        accepted.append(nxt)
        node = nxt
