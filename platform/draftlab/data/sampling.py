"""Fast sampling for batched HF `generate` on CPU (magpie prompts, sampled responses).

HF's sampling path runs `torch.multinomial` over the whole vocabulary and its top-p warper
sorts the whole vocabulary, for every row and step: at a batch of 64 and a 49k vocabulary
each costs more on a small CPU than the model's own step. `TopKTopPSampler`
is a logits processor for the *greedy* loop instead: it draws the token itself from the
standard temperature -> top-k -> top-p distribution (HF's warper order), working on the
top-k slice only, and returns scores whose argmax is the drawn token.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor


class TopKTopPSampler(LogitsProcessor):
    """Use with `do_sample=False`; draws from softmax(scores / temperature), restricted to
    the `top_k` best tokens and then to the top-p nucleus of those (renormalised)."""

    def __init__(self, temperature: float, top_p: float = 1.0, top_k: int = 512):
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 to sample, got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k

    def candidates(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, V) scores -> token ids (B, k) and their probabilities (B, k) (rows sum to 1)."""
        top = (scores.float() / self.temperature).topk(
            min(self.top_k, scores.shape[-1]), dim=-1
        )  # descending
        probs = top.values.softmax(-1)  # (B, k)
        before = probs.cumsum(-1) - probs  # mass of the higher tokens
        probs = torch.where(before < self.top_p, probs, torch.zeros_like(probs))  # the nucleus
        return top.indices, probs / probs.sum(-1, keepdim=True)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        ids, probs = self.candidates(scores)  # (B, k), (B, k)
        token = ids.gather(-1, torch.multinomial(probs, 1))  # (B, 1)
        return torch.full_like(scores, float("-inf")).scatter_(-1, token, 0.0)  # argmax = token
