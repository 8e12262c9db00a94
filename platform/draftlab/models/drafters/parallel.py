"""ParallelSpec drafter: one forward pass drafts k tokens.

The committed entries are followed by k-1 learnable mask embeddings at the next positions.
The last real entry predicts the next token; mask j (at position pos+j) predicts the token
j places further. The masks attend causally (to the context and earlier masks), exactly as
the training group mask prescribes, and their KV rows are cropped after the round.
"""

from __future__ import annotations

import torch
from torch import nn

from draftlab.models.drafters.network import DrafterConfig, DrafterNet, DraftState, Pick
from draftlab.models.drafters.registry import register_drafter
from draftlab.models.target import Target


@register_drafter("parallel")
class ParallelDrafter(DrafterNet):
    def __init__(self, cfg: DrafterConfig, target: Target):
        super().__init__(cfg, target)
        hidden = cfg.decoder["hidden_size"]
        # k-1 masks: the last real token already yields the first draft.
        self.mask_embeddings = nn.Parameter(torch.randn(cfg.k - 1, hidden) * 0.02)
        self.to(device=target.device, dtype=target.dtype)

    def check_k(self, k: int) -> None:
        super().check_k(k)
        if k > self.cfg.k:
            raise ValueError(f"this parallel drafter has {self.cfg.k - 1} masks, so k <= {self.cfg.k} (got {k})")

    @torch.inference_mode()
    def propose(self, state: DraftState, tokens, hidden, k: int, pick: Pick):
        self.check_k(k)
        n = tokens.shape[0]
        x = torch.cat([self.fuse(tokens, hidden), self.mask_embeddings[: k - 1]])  # (n + k-1, H)
        h = self.step(state, x)  # (n + k-1, H)
        if k > 1:
            state.cache.crop(-(k - 1))  # drop the mask rows: they are re-drafted next round
            state.pos -= k - 1
        logits = self.logits(h[n - 1 :])  # (k, V): last real entry, then the k-1 masks
        drafts = torch.tensor([pick(j, logits[j]) for j in range(k)], device=tokens.device)
        return drafts, logits
