"""ParallelSpec drafter: one forward pass drafts k tokens.

The committed entries are followed by k-1 parallel slots at the next positions. The last
real entry predicts the next token; slot j (at position pos+j) predicts the token j places
further. The slots attend causally (to the context and earlier slots), exactly as the
training group mask prescribes, and their KV rows are cropped after the round.

This family gives each slot its own learnable input (k-1 mask embeddings); `p-eagle`
(vLLM's parallel drafting) shares one input across slots and reuses this round.
"""

from __future__ import annotations

import torch
from torch import nn

from draftlab.models.drafters.network import DrafterConfig, DrafterNet, DraftState, Pick
from draftlab.models.drafters.registry import register_drafter


@register_drafter("parallel")
class ParallelDrafter(DrafterNet):
    def build_extra(self, cfg: DrafterConfig) -> None:
        # k-1 masks: the last real token already yields the first draft.
        self.mask_embeddings = nn.Parameter(
            torch.randn(cfg.k - 1, cfg.decoder["hidden_size"]) * 0.02
        )

    def mask_input(self, j: torch.Tensor) -> torch.Tensor:
        """(...,) slot numbers (0 = the first parallel slot) -> (..., D) decoder inputs."""
        return self.mask_embeddings[j]  # (..., H)

    def embed_nodes(
        self, tokens: torch.Tensor, features: torch.Tensor, mask_idx: torch.Tensor
    ) -> torch.Tensor:
        """Training's packed groups (`distill/group_mask.py`): real nodes fused as in the base
        network, mask nodes (mask_idx (B, M) >= 0) given their slot's input."""
        x = super().embed_nodes(tokens, features, mask_idx)  # (B, M, D)
        if not bool((mask_idx >= 0).any()):
            return x
        m = self.mask_input(mask_idx.clamp(min=0)).to(x.dtype)  # (B, M, D)
        return torch.where((mask_idx >= 0)[..., None], m, x)  # (B, M, D)

    def check_k(self, k: int) -> None:
        super().check_k(k)
        if k > self.cfg.k:
            raise ValueError(
                f"this {self.family} drafter was built for k <= {self.cfg.k} (got {k})"
            )

    @torch.inference_mode()
    def propose(self, state: DraftState, tokens, features, k: int, pick: Pick):
        self.check_k(k)
        n = tokens.shape[0]
        slots = state.slots.get(k)
        if slots is None:  # p-eagle's slot input runs `fc`: once per request, not per round
            slots = state.slots[k] = self.mask_input(torch.arange(k - 1, device=tokens.device)).to(
                self.fc.weight.dtype
            )
        x = torch.cat([self.fuse(tokens, features), slots])  # (n + k-1, D)
        h = self.step(state, x)  # (n + k-1, H)
        if k > 1:
            state.cache.crop(-(k - 1))  # drop the slot rows: they are re-drafted next round
            state.pos -= k - 1
        logits = self.logits(h[n - 1 :])  # (k, V): last real entry, then the k-1 slots
        drafts = torch.tensor([pick(j, logits[j]) for j in range(k)], device=tokens.device)
        return drafts, logits
