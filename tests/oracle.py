"""An oracle proposer for engine tests: it knows the target's greedy continuation.

It satisfies the drafter contract (`new_state`, `propose`, `check_k`) by running the target
itself without a cache (tiny models, or SmolLM2 for a few dozen tokens). `ranks[j]` puts the
true token at that rank of position j's distribution, so tree tests can force acceptance
along non-top-1 paths.
"""

from __future__ import annotations

import torch


class OracleDrafter:
    aux_layers = ()  # reads no target features

    def __init__(
        self,
        target,
        prompt: list[int],
        ranks: list[int] | None = None,
        wrong_after: int | None = None,
    ):
        self.target = target
        self.prompt = prompt
        self.ranks = ranks
        self.wrong_after = wrong_after  # draft garbage from this position on (partial acceptance)

    def check_k(self, k: int) -> None:
        pass

    def new_state(self):
        return {"committed": list(self.prompt[:1])}

    @torch.inference_mode()
    def _greedy(self, ids: list[int], k: int) -> list[int]:
        out = list(ids)
        for _ in range(k):
            logits = self.target.model(torch.tensor([out])).logits[0, -1]
            out.append(int(logits.argmax()))
        return out[len(ids) :]

    def propose(self, state, tokens, hidden, k, pick):
        state["committed"].extend(tokens.tolist())
        truth = self._greedy(state["committed"], k)
        V = self.target.vocab_size
        logits = torch.zeros(k, V)
        for j, tok in enumerate(truth):
            rank = self.ranks[j] if self.ranks else 0
            if self.wrong_after is not None and j >= self.wrong_after:
                tok = (tok + 1) % V
            logits[j, tok] = 10.0
            for r in range(rank):  # push `rank` other tokens above the true one
                logits[j, (tok + 1 + r) % V] = 11.0 + r
        drafts = torch.tensor([pick(j, logits[j]) for j in range(k)])
        return drafts, logits
