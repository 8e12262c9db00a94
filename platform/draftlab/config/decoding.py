"""How tokens are decoded: `SamplingParams` (shared by the engine, the bench and the
server) and `NgramSpec` (prompt-lookup drafts grafted onto the drafter's tree)."""

from __future__ import annotations

from pydantic import ConfigDict, Field, field_validator, model_validator

from draftlab.config.base import StrictModel


class SamplingParams(StrictModel):
    """Decoding parameters shared by the engine, the bench and (later) the server."""

    max_new_tokens: int = Field(128, ge=1, le=32768)
    """Stop after this many generated tokens (an accepted draft is cut to fit)."""
    temperature: float = Field(0.0, ge=0.0, le=100.0)
    """0 = greedy. Otherwise softmax temperature applied to target and drafter logits."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass (ignored when greedy)."""
    stop: list[str] = Field(default_factory=list)
    """Stop strings: generation ends once the text contains one; it is cut from the text."""
    seed: int | None = None
    """Seed for sampling; None = nondeterministic."""

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must be non-empty")
        return v

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class NgramSpec(StrictModel):
    """Prompt-lookup drafts grafted onto the drafter's tree each round (`decoding/ngram.py`):
    the tokens that followed the latest earlier occurrence of the text's last n tokens."""

    model_config = ConfigDict(frozen=True)  # part of a (frozen, hashable) Tree

    tokens: int = Field(5, ge=1, le=64)
    """Longest grafted branch (tokens copied after a match)."""
    min_match: int = Field(2, ge=1, le=16)
    """Shortest suffix n-gram that counts as a match."""
    max_match: int = Field(4, ge=1, le=16)
    """Longest suffix n-gram tried first (a longer match is a likelier copy)."""
    grow_to: int = Field(16, ge=1, le=64)
    """Longest copy from the text: after a round that committed a whole copy, the next may
    copy twice as many tokens, up to this; a copy cut short resets it to `tokens`. A value
    <= `tokens` keeps every copy `tokens` long. Our engine only: vLLM's copies stay `tokens`
    long (`draftlab.vllm_scheduler`)."""
    store_tokens: int = Field(3, ge=0, le=64)
    """Where the text has no match, graft up to this many tokens from the drafter's
    `lookup-store` (the target's responses to the training prompts; `decoding/ngram.py`),
    if it has one; 0 = never. Shorter than `tokens`: a store match is a weaker guess than
    a copy from the text, and every grafted row costs verify time."""
    extend: int = Field(0, ge=0, le=64)
    """Carry on each prefix of the drafter's likeliest path (its argmax at every depth), and
    `extend_firsts` of the round tree's other first-position candidates, with up to this
    many tokens: what followed the draft's last n tokens (text and drafts) in the text, else
    in the `lookup-store`; 0 = never. The tree then has candidates past the drafter's K
    positions, and after first tokens it drafted little under, in rounds where the text has
    no copy to offer. Our engine only (vLLM merges the root lookups alone)."""
    extend_firsts: int = Field(1, ge=0, le=64)
    """With `extend`: how many of the round tree's other first-position candidates, likeliest
    first, are carried on too (each costs up to `extend` verified rows); only with
    `extend_from` 1."""
    extend_from: int = Field(1, ge=1, le=64)
    """With `extend`: the shallowest prefix of the drafter's likeliest path that is carried on.
    1 = every prefix (and `extend_firsts` other first-position candidates); larger = only the
    prefixes at least this deep, the whole path where it is shorter (the drafter's K, say:
    its whole path alone, where a carried-on row is accepted most often per row verified)."""

    @model_validator(mode="after")
    def _match_range(self) -> NgramSpec:
        if self.min_match > self.max_match:
            raise ValueError(
                f"min_match ({self.min_match}) must be <= max_match ({self.max_match})"
            )
        return self
