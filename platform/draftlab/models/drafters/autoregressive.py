"""Autoregressive (EAGLE-style) drafter: the same network, one token per forward.

After the committed entries, each drafted token is fed back paired with the drafter's own
output state (it has no target hidden state yet), k forwards per round. The k-1 speculative
rows are cropped afterwards; next round re-feeds accepted tokens with the target's states.
This is the baseline ParallelSpec's one-pass drafting is measured against.
"""

from __future__ import annotations

import torch

from draftlab.models.drafters.network import DrafterNet, DraftState, Pick
from draftlab.models.drafters.registry import register_drafter


@register_drafter("autoregressive")
class AutoregressiveDrafter(DrafterNet):
    @torch.inference_mode()
    def propose(self, state: DraftState, tokens, hidden, k: int, pick: Pick):
        self.check_k(k)
        last = self.step(state, self.fuse(tokens, hidden))[-1]  # (H,)
        rows, drafts = [], []
        for j in range(k):
            logits = self.logits(last)  # (V,)
            rows.append(logits)
            drafts.append(pick(j, logits))
            if j + 1 < k:
                tok = torch.tensor([drafts[-1]], device=tokens.device)
                last = self.step(state, self.fuse(tok, last[None]))[-1]
        if k > 1:
            state.cache.crop(-(k - 1))
            state.pos -= k - 1
        return torch.tensor(drafts, device=tokens.device), torch.stack(rows)  # (k,), (k, V)
