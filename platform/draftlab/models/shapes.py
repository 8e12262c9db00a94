"""Llama-architecture shapes of real models, for checks that need a target of a real size
but no weights (`draftlab doctor`): built in memory with random weights, no hub needed.

Plain numbers only (no torch import): configs validate shape names against `SHAPES`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    # Init std of the random weights: HF's 0.02 leaves the logits of a deep random model
    # nearly flat (many exact argmax ties); the small shapes use a wider one.
    init: float = 0.02

    @property
    def parameters(self) -> int:
        """Weights of the Llama of this shape (untied embeddings), norms left out."""
        head_dim = self.hidden // self.heads
        attn = self.hidden * head_dim * (2 * self.heads + 2 * self.kv_heads)  # q, o; k, v
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attn + mlp) + 2 * self.vocab * self.hidden


SHAPES: dict[str, Shape] = {
    # seconds on a CPU: what CI runs
    "tiny": Shape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=512, init=0.25),
    "small": Shape(
        hidden=512, layers=4, heads=8, kv_heads=2, intermediate=1536, vocab=32000, init=0.25
    ),
    "llama-3.2-1b": Shape(
        hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, vocab=128256
    ),
    "llama-3.1-8b": Shape(
        hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256
    ),
}
