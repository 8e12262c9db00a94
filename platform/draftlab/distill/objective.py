"""The distillation objective on packed groups, and its per-position metrics.

DistillModule is what DDP/FSDP wraps: one forward from a `Batch` (plus the target's states)
to the drafter's output states. The loss runs on detached outputs in node chunks so the
(B, M, V) logits never exist at once, and each chunk's gradient w.r.t. the outputs is
written in closed form through the frozen head (`distill_terms`); the summed gradient is
then pushed through the decoder in one backward (one DDP all-reduce).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from draftlab.config import TrainConfig
from draftlab.distill.batching import Batch
from draftlab.models.drafters.network import DrafterNet
from draftlab.models.target import Target

CHUNK_NODES = 512  # nodes per loss chunk: bounds (chunk, V) float32 logits to ~100 MB at V=49k


def gather_states(hidden: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """(B, L, H) states, (B, M) positions -> (B, M, H) the state at each node's position."""
    return torch.gather(hidden, 1, idx[..., None].expand(-1, -1, hidden.shape[-1]))


def teacher_states(
    target: Target, batch: Batch, aux_layers: list[int] | None = None
) -> torch.Tensor:
    """(B, L, F) target features for `aux_layers` (`Target.features`: the states after the
    aux layers, then the last hidden state), from the cache or from the frozen target. The
    features are the cache's last F columns: all of a matching cache, the last state of a
    fused one for a last-state family (`usable_features` keeps such caches)."""
    aux = tuple(aux_layers or ())
    width = (len(aux) + 1) * target.hidden_size  # F
    if batch.hidden is not None and (not aux or batch.hidden.shape[-1] == width):
        return batch.hidden[..., -width:].to(target.dtype)
    mask = (
        torch.arange(batch.input_ids.shape[1], device=batch.input_ids.device)[None]
        < batch.lengths[:, None]
    )
    with torch.inference_mode():
        feats = target.run_decoder(aux, input_ids=batch.input_ids, attention_mask=mask.long())
    return feats.clone()  # clone: leave inference mode for autograd


def decoder_mask(attend: torch.Tensor, attn_implementation: str) -> torch.Tensor:
    """(B, 1, M, M) bool group mask in the form the decoder's attention takes: SDPA reads the
    bool mask as is (1 byte a pair); other implementations add a float32 mask (0 / min)."""
    if attn_implementation == "sdpa":
        return attend
    neg = torch.finfo(torch.float32).min
    return torch.zeros(attend.shape, device=attend.device).masked_fill_(
        ~attend, neg
    )  # (B, 1, M, M)


def noisy(states: torch.Tensor, width: int, scale: float) -> torch.Tensor:
    """(..., F) states made of F / width concatenated target states, each plus Gaussian
    noise of std `scale` times that state's RMS."""
    parts = states.float().unflatten(-1, (-1, width))  # (..., F / width, width)
    rms = parts.pow(2).mean(-1, keepdim=True).sqrt()  # (..., F / width, 1)
    return (parts + torch.randn_like(parts) * rms * scale).flatten(-2).to(states.dtype)  # (..., F)


class DistillModule(nn.Module):
    def __init__(self, drafter: DrafterNet, feature_noise: float = 0.0):
        super().__init__()
        self.drafter = drafter
        self.feature_noise = feature_noise  # TrainConfig.feature_noise: in training mode only

    def forward(self, batch: Batch, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (B, L, F) target features -> (B, M, H) drafter outputs for every node."""
        anchor_h = gather_states(hidden, batch.node_anchor)  # (B, M, F)
        if self.training and self.feature_noise:
            anchor_h = noisy(anchor_h, self.drafter.hidden_size, self.feature_noise)
        x = self.drafter.embed_nodes(batch.node_token, anchor_h, batch.mask_idx)  # (B, M, D)
        mask = decoder_mask(
            batch.attention_mask(), self.drafter.decoder.config._attn_implementation
        )  # (B, 1, M, M)
        return self.drafter(x, batch.position_ids, attention_mask=mask)  # (B, M, H)


@dataclass
class Stats:
    """Sums over nodes, per depth, for loss and top-1 agreement with the target."""

    k: int
    loss: float = 0.0
    nodes: list[int] = field(default_factory=list)
    agree: list[int] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)

    def __post_init__(self):
        self.nodes = self.nodes or [0] * self.k
        self.agree = self.agree or [0] * self.k
        self.kl = self.kl or [0.0] * self.k

    def add(self, other: Stats) -> None:
        self.loss += other.loss
        for d in range(self.k):
            self.nodes[d] += other.nodes[d]
            self.agree[d] += other.agree[d]
            self.kl[d] += other.kl[d]

    @property
    def accuracy(self) -> list[float]:
        return [a / n if n else 0.0 for a, n in zip(self.agree, self.nodes, strict=True)]

    @property
    def sim_accept_len(self) -> float:
        """1 + sum_d prod_{j<=d} acc_j: expected tokens per round of a chain (bonus included)."""
        total, run = 1.0, 1.0
        for a in self.accuracy:
            run *= a
            total += run
        return total

    def metrics(self, prefix: str) -> dict[str, float]:
        out = {f"{prefix}/acc_pos{d + 1}": a for d, a in enumerate(self.accuracy)}
        out |= {
            f"{prefix}/kl_pos{d + 1}": kl / n
            for d, (kl, n) in enumerate(zip(self.kl, self.nodes, strict=True))
            if n
        }
        out[f"{prefix}/sim_accept_len"] = self.sim_accept_len
        return out


def distill_terms(
    z: torch.Tensor,  # (N, V) drafter logits over the head's vocabulary (any float dtype)
    t: torch.Tensor,  # (N, V) teacher logits over the same vocabulary
    label_row: torch.Tensor,  # (N,) head row of the data token, -1 = none (trimmed away)
    grad_scale: torch.Tensor,  # (2,) d total / d (KL, CE) of one node: the weights / node count
    ce: bool,  # the cross-entropy term is on
    grad_dtype: torch.dtype | None,  # None: no gradient (evaluation)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-node KL(teacher || drafter) (N,), cross-entropy on the data token (N,; 0 without
    `ce` or a label), top-1 agreement (N,) bool, and the step's gradient w.r.t. `z` (N, V) in
    `grad_dtype`:
    grad_scale[0] * (q - p) + grad_scale[1] * (q - onehot(label)), q and p the two softmaxes.

    A closed form, so no autograd graph spans the (N, V) logits, and a pure function that
    `torch.compile` fuses into a few loops (`TrainConfig.compile_loss`). The math is float32
    whatever the logits' dtype (the upcast happens inside the fused loop)."""
    z, t = z.float(), t.float()
    p_logp = torch.log_softmax(t, -1)  # (N, V)
    p = p_logp.exp()
    q_logp = torch.log_softmax(z, -1)  # (N, V)
    xent = torch.zeros(z.shape[0], device=z.device)  # (N,)
    hit = None
    if ce:
        has = label_row >= 0  # (N,)
        hit = (
            torch.arange(z.shape[-1], device=z.device) == label_row[:, None]
        )  # (N, V) one-hot (none: all False)
        xent = torch.where(has, -(q_logp * hit).sum(-1), 0.0)
    kl = torch.linalg.vecdot(p, p_logp.sub_(q_logp))  # (N,) sum_v p (log p - log q)
    agree = (
        z.max(-1).indices == t.max(-1).indices
    )  # (N,); max, not argmax: the same first index, faster on CPU
    if grad_dtype is None:
        return kl, xent, agree, None
    q = q_logp.exp_()  # (N, V), in place: eager training makes few (N, V) temporaries
    grad = (q - p).mul_(grad_scale[0])
    if hit is not None:
        grad += (q - hit.float()).mul_(has[:, None] * grad_scale[1])
    return kl, xent, agree, grad.to(grad_dtype)


@functools.cache
def compiled_terms():
    """`distill_terms` under `torch.compile`: built on first use, once per process (shapes go
    dynamic after the first recompile)."""
    return torch.compile(distill_terms)


def node_losses(
    drafter: DrafterNet,
    out: torch.Tensor,  # (N, H) drafter outputs of loss nodes
    teacher_h: torch.Tensor,  # (N, H) target states at the teacher positions
    label: torch.Tensor,  # (N,) data tokens
    cfg: TrainConfig,
    n_total: int = 1,
    backward: bool = True,
    full_vocab_agreement: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-node loss (N,), KL (N,), top-1 agreement (N,) bool, and with `backward` the
    gradient of sum(loss) / n_total w.r.t. `out` (N, H) (through the frozen head; no autograd
    graph), else None.

    Agreement compares argmaxes over the head's vocabulary, or with `full_vocab_agreement`
    over the target's whole vocabulary (a target token that VocabTrim dropped is a miss:
    what the engine sees; costs a full-vocabulary head pass, so evaluation only)."""
    with torch.no_grad():
        z = drafter.head_logits(out, upcast=False)  # (N, Vt) in the head's dtype
        t = drafter.head_logits(teacher_h, upcast=False)  # (N, Vt) teacher over the same vocab
        scale = torch.tensor([cfg.kl_weight, cfg.ce_weight], device=z.device) / n_total  # (2,)
        head = drafter.head_weight  # (Vt, H)
        kl, xent, agree, grad_z = (compiled_terms() if cfg.compile_loss else distill_terms)(
            z,
            t,
            drafter.head_rows(label),
            scale,
            bool(cfg.ce_weight),
            head.dtype if backward else None,
        )
        grad_out = (
            None if grad_z is None else (grad_z @ head).to(out.dtype)
        )  # (N, H): z = out @ head.T
        if full_vocab_agreement:
            full = drafter.target_head_weight  # (V, H)
            want = torch.nn.functional.linear(teacher_h.to(full.dtype), full).argmax(
                -1
            )  # (N,) target ids
            agree = drafter.head_rows(want) == z.float().argmax(
                -1
            )  # a trimmed-away target token (-1) never agrees
    return cfg.kl_weight * kl + cfg.ce_weight * xent, kl, agree, grad_out


def loss_and_backward(
    module: nn.Module,  # DistillModule, possibly DDP- or FSDP-wrapped
    drafter: DrafterNet,
    batch: Batch,
    hidden: torch.Tensor,  # (B, L, F) target features, the last hidden state last
    cfg: TrainConfig,
    k: int,
    backward: bool = True,
    scaler: torch.amp.GradScaler | None = None,
) -> Stats:
    """Forward, chunked loss and (optionally) one backward; returns per-depth statistics.

    `scaler` (fp16): the backward carries the scaled loss's gradients (unscale before clipping)."""
    out = module(batch, hidden)  # (B, M, H)
    sel = batch.loss_mask  # (B, M)
    n_total = max(int(sel.sum()), 1)
    flat_out = out.detach()[sel]  # (N, H): the loss runs on detached outputs, chunk by chunk
    teacher = gather_states(hidden[..., -out.shape[-1] :], batch.teacher_idx)[
        sel
    ]  # (N, H) last hidden states
    label, depth = batch.label[sel], batch.depth[sel]  # (N,), (N,)
    stats = Stats(k)
    grads = []
    for s in range(0, flat_out.shape[0], CHUNK_NODES):
        o = flat_out[s : s + CHUNK_NODES]
        t_h, d = teacher[s : s + CHUNK_NODES], depth[s : s + CHUNK_NODES]
        loss, kl, agree, g = node_losses(
            drafter,
            o,
            t_h,
            label[s : s + CHUNK_NODES],
            cfg,
            n_total,
            backward,
            full_vocab_agreement=not backward,
        )
        if cfg.feature_weight:  # EAGLE feature regression: depth-0 output ~ next target state
            o = o.requires_grad_(backward)
            feat = F.smooth_l1_loss(o.float(), t_h.float(), reduction="none").mean(-1)  # (n,)
            feat = cfg.feature_weight * torch.where(d == 0, feat, torch.zeros_like(feat))
            if backward:
                (g_feat,) = torch.autograd.grad(feat.sum() / n_total, o)
                g = g + g_feat.to(g.dtype)
            loss = loss + feat.detach()
        if backward:
            grads.append(g if scaler is None else scaler.scale(g))
        stats.loss += float(loss.sum()) / n_total
        for j in range(k):
            on = d == j
            stats.nodes[j] += int(on.sum())
            stats.agree[j] += int(agree[on].sum())
            stats.kl[j] += float(kl[on].sum())
    if backward:
        full = torch.zeros_like(out)  # (B, M, H)
        if grads:
            full[sel] = torch.cat(grads).to(full.dtype)
        out.backward(full)
    return stats
