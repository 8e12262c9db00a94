"""The events of one request's stream, engine replica -> ingress (`DraftEngine.generate`).

    Accepted(prompt_tokens)                                  first: the request was taken
    Delta(text, tokens) ...                                  text committed since the last event
    Done(finish_reason, stats, completion_tokens, queued_s)  the last one
    Failed(message, status, param, code)                     instead of Accepted (a rejected
                                                             request), or at any point after it

The scheduler publishes `Delta`, `Done` and `Failed` (without a status); the deployment adds
`Accepted`, its rejections (`status=400`) and `status=503` when the replica shut down under a
request (retryable). They cross a Ray actor boundary: plain frozen dataclasses, pickled by
reference to this module, which imports nothing heavy (the ingress replica loads no torch).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Accepted:
    """The request was admitted: its prompt's length in tokens (the usage block's)."""

    prompt_tokens: int


@dataclass(frozen=True)
class Delta:
    """Text committed since the last event (possibly "" on the last round) and the number of
    tokens generated so far."""

    text: str
    tokens: int


@dataclass(frozen=True)
class Done:
    """The request finished: why (`stop`, `length`), its decoding stats
    (`DecodeStats.as_dict()`), its completion tokens and its seconds in the queue."""

    finish_reason: str
    stats: dict
    completion_tokens: int
    queued_s: float


@dataclass(frozen=True)
class Failed:
    """The request failed: a rejection before decoding (`status` 400, the offending `param`
    and an OpenAI error `code`), a decoding failure (`status` None: the engine lives on) or a
    replica shutting down (`status` 503, retryable)."""

    message: str
    status: int | None = None
    param: str | None = None
    code: str | None = None


EngineEvent = Accepted | Delta | Done | Failed
"""Any event of the stream."""
