"""The OpenAI wire format: request models, error bodies, response and stream-chunk shapes.

Requests are validated here (types, ranges, unsupported options) so that every bad input
becomes a 4xx with OpenAI's error JSON: `{"error": {"message", "type", "param", "code"}}`.
Unknown fields that clients commonly send (`user`, `stream_options`, `frequency_penalty`
at its default...) are accepted and ignored, like OpenAI's own server does for optional
features it does not use; options that would change the output and are not implemented
are refused by name. Strings must be valid Unicode (a lone surrogate such as `"\\ud800"`
is a 400, not a tokenizer crash); other control characters, NUL included, are text.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from draftlab.config import SamplingParams

GREEDY_BELOW = 1e-5  # temperatures under this decode greedily (see `_Request.sampling`)


class APIError(Exception):
    """An error returned to the client as OpenAI's error JSON with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status,
            message,
            param,
            code,
            type_,
        )
        self.headers = headers

    def body(self) -> dict:
        return {
            "error": {
                "message": _printable(self.message),
                "type": self.type,
                "param": _printable(self.param),
                "code": self.code,
            }
        }


def _printable(text: str | None) -> str | None:
    """`text` with lone surrogates (from a client's JSON) escaped: the error body must encode."""
    return text if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def unavailable(
    message: str, retry_after_s: float, code: str = "service_unavailable", status: int = 503
) -> APIError:
    """A retryable error: the request was not served, sending it again later may work.
    OpenAI's clients retry 503s (and 429s) by themselves, waiting `Retry-After` seconds."""
    return APIError(
        status,
        message,
        code=code,
        type_="server_error",
        headers={"Retry-After": str(max(0, math.ceil(retry_after_s)))},
    )


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every 4xx/5xx body (the OpenAPI schema documents it on every route)."""

    error: ErrorDetail


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(
        None, ge=-(2**63), le=2**64 - 1
    )  # what torch.Generator.manual_seed takes
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Options that would change the output and are not implemented: refused when set.
    logprobs: Any = None
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None
    tools: list | None = None
    echo: bool = False
    speculation: Literal["on", "off", "auto"] | None = None
    """draftlab extension: force drafting on/off for this request (default: the server's policy)."""

    @field_validator("temperature", "top_p", mode="before")
    @classmethod
    def _ints_are_floats(cls, v):  # strict mode would refuse `"temperature": 1`
        return float(v) if isinstance(v, int) and not isinstance(v, bool) else v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return stops

    def check_supported(self) -> None:
        if self.n != 1:
            raise APIError(
                400,
                f"n={self.n} is not supported: this server returns one choice per request (n=1)",
                param="n",
                code="unsupported_value",
            )
        unsupported = {
            "logprobs": self.logprobs not in (None, False, 0),
            "best_of": self.best_of not in (None, 1),
            "presence_penalty": self.presence_penalty != 0.0,
            "frequency_penalty": self.frequency_penalty != 0.0,
            "logit_bias": bool(self.logit_bias),
            "tools": bool(self.tools),
            "echo": self.echo,
        }
        for name, used in unsupported.items():
            if used:
                raise APIError(
                    400,
                    f"'{name}' is not supported by this server",
                    param=name,
                    code="unsupported_parameter",
                )

    def sampling(self, max_tokens: int) -> SamplingParams:
        # A tiny temperature overflows logits / temperature in float32 (inf, then NaN
        # probabilities); below GREEDY_BELOW the distribution is one-hot anyway: greedy, as in vLLM.
        temperature = self.temperature if (self.temperature or 0.0) >= GREEDY_BELOW else 0.0
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            stop=self.stop or [],
            seed=self.seed,
        )

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str]
    """A string, a list of token ids, or a one-element list of strings (n=1, no batching)."""
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if (
            isinstance(self.prompt, list)
            and self.prompt
            and isinstance(self.prompt[0], str)
            and len(self.prompt) != 1
        ):
            raise APIError(
                400,
                "a list of several prompts is not supported: send one request per prompt",
                param="prompt",
                code="unsupported_value",
            )
        if self.suffix:
            raise APIError(
                400,
                "'suffix' is not supported by this server",
                param="suffix",
                code="unsupported_parameter",
            )


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(
                    400,
                    "only text content parts are supported",
                    param="messages",
                    code="unsupported_value",
                )
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)


def parse_request(model: type[_Request], body: bytes) -> _Request:
    """JSON body -> validated request, or an APIError naming the offending parameter."""
    try:
        data = json.loads(body or b"null")
        bad = _invalid_unicode(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(
            400, f"the request body is not valid JSON: {e}", code="invalid_json"
        ) from None
    except RecursionError:  # `[[[[...` a few thousand deep
        raise APIError(400, "the request body is nested too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    if bad is not None:
        raise APIError(
            400,
            f"invalid value for '{bad}': not valid Unicode (a lone surrogate such as \\ud800)",
            param=bad or None,
            code="invalid_unicode",
        )
    try:
        req = model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None  # e.g. "messages.0.role"
        raise APIError(
            400,
            f"invalid value for '{param}': {err['msg']}",
            param=param,
            code="missing_required_parameter" if err["type"] == "missing" else "invalid_type",
        ) from None
    req.check_supported()
    return req


def _invalid_unicode(value: Any, path: str = "") -> str | None:
    """The dotted path of the first string (or key) that is not valid Unicode, else None.
    JSON can spell lone surrogates (`"\\udc00"`); tokenizers cannot encode them."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for key, item in items:
        where = f"{path}.{key}" if path else str(key)
        if isinstance(key, str) and _invalid_unicode(key) is not None:
            return where
        found = _invalid_unicode(item, where)
        if found is not None:
            return found
    return None


# ------------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, stats: dict) -> dict:
    """OpenAI `usage` plus `speculative`: tau (tokens per target forward), drafted/accepted."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "speculative": {
            "tau": stats.get("tau", 1.0),
            "drafted": stats.get("drafted", 0),
            "accepted": stats.get("accepted", 0),
            "target_forwards": stats.get("rounds", 0),
        },
    }


def completion_body(
    rid: str, model: str, chat: bool, text: str, finish: str | None, use: dict | None
) -> dict:
    choice = (
        {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
        if chat
        else {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    )
    body = {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }
    if use is not None:
        body["usage"] = use
    return body


def chunk_body(
    rid: str, model: str, chat: bool, text: str | None, finish: str | None, first: bool = False
) -> dict:
    if chat:
        delta = (
            {"role": "assistant", "content": text or ""}
            if first
            else {}
            if text is None
            else {"content": text}
        )
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    return {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }


def usage_chunk(rid: str, model: str, chat: bool, use: dict) -> dict:
    return {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [],
        "usage": use,
    }
