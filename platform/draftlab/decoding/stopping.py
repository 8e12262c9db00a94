"""When generation ends: EOS, max new tokens, stop strings. Shared by every decoder so the
speculative and target-only loops cut their outputs by exactly the same rule."""

from __future__ import annotations

from draftlab.config import SamplingParams


class Stopper:
    """Feed tokens as they are committed; `feed` returns True once generation must end.

    `tokens` holds the output cut at the stopping token (EOS is kept, like HF `generate`);
    `text` is its decoded text with any stop string and what follows removed.
    """

    def __init__(self, tokenizer, eos_ids: frozenset[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.params = params
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        # A stop string can only complete inside the last few tokens; decoding just that
        # tail keeps the check O(1) per token. 16 extra tokens cover multi-byte pieces.
        self._tail = max((len(s) for s in params.stop), default=0) + 16

    def feed(self, new: list[int]) -> bool:
        for tok in new:
            if self.finish_reason is not None:
                break
            self.tokens.append(tok)
            if tok in self.eos_ids:
                self.finish_reason = "stop"
            elif self.params.stop and self._hit_stop():
                self.finish_reason = "stop"
            elif len(self.tokens) >= self.params.max_new_tokens:
                self.finish_reason = "length"
        return self.finish_reason is not None

    def _hit_stop(self) -> bool:
        tail = self.tokenizer.decode(self.tokens[-self._tail :], skip_special_tokens=False)
        return any(s in tail for s in self.params.stop)

    @property
    def text(self) -> str:
        toks = [t for t in self.tokens if t not in self.eos_ids]
        text = self.tokenizer.decode(toks, skip_special_tokens=True)
        cuts = [text.find(s) for s in self.params.stop if s in text]
        return text[: min(cuts)] if cuts else text
