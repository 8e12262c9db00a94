"""Held-out evaluation, sharded across the Ray Train ranks (every rank gets the
single-worker totals), and the cross-rank reductions the training loop shares with it: the
slowest rank's clock, summed throughput, gathered values and the DDP replicas' weight digest.
Each reduction is the identity without a process group or with one rank.
"""

from __future__ import annotations

import hashlib

import datasets
import torch
import torch.distributed as dist

from draftlab.config import DistillConfig
from draftlab.distill.batching import collate
from draftlab.distill.objective import Stats, loss_and_backward, teacher_states
from draftlab.distill.precision import autocast_context, precision_for
from draftlab.models.drafters.network import DrafterNet
from draftlab.models.target import Target


def autocast(cfg: DistillConfig, device: torch.device):
    """The mixed-precision context for drafter compute (`train.autocast` on `device`)."""
    return autocast_context(precision_for(cfg.train.autocast, device), device)


def all_ranks_max(x: float, device: torch.device) -> float:
    """The largest `x` of any rank."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x
    t = torch.tensor([x], device=device, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def all_ranks_gather(obj) -> list:
    """Every rank's `obj`, in rank order."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def weights_digest(drafter: DrafterNet) -> str:
    """Digest of the trainable weights: equal on every DDP replica after a correct step."""
    h = hashlib.sha256()
    for name, p in sorted(drafter.named_parameters()):
        if p.requires_grad:
            h.update(name.encode())
            h.update(p.detach().to("cpu", torch.float32).numpy().tobytes())
    return h.hexdigest()


def all_ranks_sum(x: float, device: torch.device) -> float:
    """The sum of every rank's `x`."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x
    t = torch.tensor([x], device=device, dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item())


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _sum_over_ranks(stats: Stats) -> Stats:
    """`stats` summed over every rank (each rank gets the totals)."""
    if _rank_world()[1] == 1:
        return stats
    k = stats.k
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    t = torch.tensor(
        [stats.loss, *stats.nodes, *stats.agree, *stats.kl], dtype=torch.float64, device=device
    )  # (1 + 3k,)
    dist.all_reduce(t)
    v = t.tolist()
    return Stats(
        k,
        loss=v[0],
        nodes=[round(x) for x in v[1 : 1 + k]],
        agree=[round(x) for x in v[1 + k : 1 + 2 * k]],
        kl=v[1 + 2 * k :],
    )


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, target: Target, evalset: datasets.Dataset, cfg: DistillConfig, k: int
) -> Stats:
    """Held-out per-position top-1 agreement (no drop-token: every depth of every anchor).

    `model`: the DistillModule as trained (DDP- or FSDP-wrapped). Sharded over the ranks:
    rank r evaluates batches r, r + W, ... of the batches a single worker would make, and the
    sums are all-reduced, so every rank returns the single-worker totals. Every rank runs the
    same number of forwards (an FSDP forward gathers weights from all ranks): a rank out of
    batches in the last round re-runs batch 0 and discards it."""
    rank, world = _rank_world()
    drafter = getattr(model, "module", model).drafter  # DDP keeps the DistillModule in .module
    size = cfg.train.batch_size
    n_batches = -(-len(evalset) // size)  # ceil
    stats = Stats(k)
    model.eval()
    for j in range(rank, -(-n_batches // world) * world, world):
        lo = j * size if j < n_batches else 0
        rows = [evalset[i] for i in range(lo, min(lo + size, len(evalset)))]
        batch = collate(rows, k, cfg.train.max_seq_len, False, None).to(target.device)
        with autocast(cfg, target.device):
            feats = teacher_states(target, batch, drafter.cfg.aux_layers)
            batch_stats = loss_and_backward(
                model, drafter, batch, feats, cfg.train, k, backward=False
            )
        if j < n_batches:
            stats.add(batch_stats)
    model.train()
    return _sum_over_ranks(stats)
