"""Per-depth top-R acceptance of a drafter on held-out data: the tree search's input.

For every anchor of every held-out sequence (no drop-token), the drafter's node at depth d
ranks its full-vocabulary logits; the rank of the target's greedy token there says which
tree child would be accepted. Greedy tree verification reaches depth d only if every
shallower target token was in the tree, so the conditional rate is

    acc[d][r] = P(rank_d == r | rank_j < R for all j < d),

which is what `decoding.tree_search.best_tree` consumes.
"""

from __future__ import annotations

import torch

from draftlab.distill.batching import collate
from draftlab.distill.objective import CHUNK_NODES, DistillModule, gather_states, teacher_states
from draftlab.models.drafters.network import DrafterNet
from draftlab.models.target import Target


def _target_ranks(
    drafter: DrafterNet, target: Target, out: torch.Tensor, teacher_h: torch.Tensor
) -> torch.Tensor:
    """(N,) rank of the target's greedy token among the drafter's logits, chunk by chunk."""
    ranks = []
    for s in range(0, out.shape[0], CHUNK_NODES):
        want = target.lm_head(teacher_h[s : s + CHUNK_NODES]).argmax(
            -1
        )  # (n,) full-vocab greedy token
        logits = drafter.logits(out[s : s + CHUNK_NODES])  # (n, V), trimmed ids = -inf
        mine = logits.gather(-1, want[:, None])  # (n, 1)
        ranks.append((logits > mine).sum(-1))  # (n,); a trimmed-away token ranks last
    return torch.cat(ranks) if ranks else torch.zeros(0, dtype=torch.long)


def conditional_rates(table: torch.Tensor, max_ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, k) target ranks per anchor and depth (-1 = no node) -> hits (k, R) and reach (k,).

    An anchor reaches depth d if it has a node there and every shallower rank was < R.
    """
    k = table.shape[1]
    hits = torch.zeros(k, max_ranks, dtype=torch.long)
    reach = torch.zeros(k, dtype=torch.long)
    alive = torch.ones(table.shape[0], dtype=torch.bool)
    for d in range(k):
        alive &= table[:, d] >= 0
        reach[d] = int(alive.sum())
        for r in range(max_ranks):
            hits[d, r] = int((alive & (table[:, d] == r)).sum())
        alive &= table[:, d] < max_ranks
    return hits, reach


@torch.no_grad()
def rank_tables(
    drafter: DrafterNet,
    target: Target,
    rows: list[dict],  # held-out samples: input_ids, prompt_len (and optionally hidden)
    k: int,
    max_seq_len: int = 512,
    batch_size: int = 8,
) -> list[torch.Tensor]:
    """Per row, (L-1, k) target ranks: [a, d] = the rank of the target's greedy token among
    the drafter's logits at node (anchor a, depth d), i.e. for x_{a+d+2} after committing
    x_0..x_{a+1}; -1 where no node carries loss (prompt labels, past the end)."""
    module = DistillModule(drafter).eval()
    tables = []
    for i in range(0, len(rows), batch_size):
        batch = collate(rows[i : i + batch_size], k, max_seq_len, False, None).to(target.device)
        hidden = teacher_states(target, batch, drafter.cfg.aux_layers)  # (B, L, F)
        out = module(batch, hidden)  # (B, M, H)
        teacher = gather_states(hidden[..., -target.hidden_size :], batch.teacher_idx)  # (B, M, H)
        sel = batch.loss_mask  # (B, M)
        rank = _target_ranks(drafter, target, out[sel], teacher[sel]).cpu()  # (N,)
        b_idx = torch.arange(sel.shape[0], device=sel.device)[:, None].expand_as(sel)[sel].cpu()
        anchor, depth = batch.node_anchor[sel].cpu(), batch.depth[sel].cpu()
        table = torch.full(
            (sel.shape[0], batch.input_ids.shape[1], k), -1, dtype=torch.long
        )  # (B, L, k)
        table[b_idx, anchor, depth] = rank
        tables += [table[b, : int(n) - 1] for b, n in enumerate(batch.lengths.cpu())]
    return tables


def acceptance_rates(tables: list[torch.Tensor], max_ranks: int) -> list[list[float]]:
    """(k, max_ranks) conditional acceptance rates acc[d][r] (see the module docstring) of
    `rank_tables`' output."""
    k = tables[0].shape[1] if tables else 1
    hits, reach = conditional_rates(
        torch.cat(tables) if tables else torch.zeros(0, k, dtype=torch.long), max_ranks
    )
    return [
        [float(hits[d, r]) / int(reach[d]) if reach[d] else 0.0 for r in range(max_ranks)]
        for d in range(k)
    ]
