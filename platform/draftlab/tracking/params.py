"""Run params as MLflow takes them: nested configs flattened to dotted keys, credentials
redacted to `***`, values cut to MLflow's length limit (`prepare_params`)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# MLflow's own limits (mlflow.utils.validation); copied so importing this module stays cheap.
MAX_PARAM_VAL_LENGTH = 6000
MAX_PARAMS_TAGS_PER_BATCH = 100
REDACTED = "***"

# A dotted-key component "looks like a credential" when it is, or ends in, one of these
# words (`hf_token`, `wandb.api_key`, `clientSecret`), but not `max_new_tokens`/`tokenizer`.
_SECRET_RE = re.compile(
    r"(?:^|_)(?:key|api_?keys|apikey|token|secrets?|password|passwd|credentials?)$"
)
# Tokenizer special tokens are not secrets.
_NOT_SECRET = frozenset(
    {"pad_token", "eos_token", "bos_token", "unk_token", "sep_token", "cls_token", "mask_token"}
)


class ParamConflictError(ValueError):
    """A param was already logged to this run with a different value."""


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """`{"a": {"b": 1}, "c": [1, 2]}` -> `{"a.b": "1", "c": "[1, 2]"}` (pydantic models too);
    a list of sections gets a key per item: `{"s": [{"k": 1}]}` -> `{"s.0.k": "1"}` (a mix of
    prompt sources)."""
    if hasattr(d, "model_dump"):
        d = d.model_dump()
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if hasattr(v, "model_dump"):
            v = v.model_dump()
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, key + "."))
        elif isinstance(v, list) and v and all(isinstance(x, Mapping) for x in v):
            out.update(flatten({str(i): x for i, x in enumerate(v)}, key + "."))
        else:
            out[key] = str(v)
    return out


def looks_secret(key: str) -> bool:
    """True if any dotted component of `key` names a credential (case-insensitive)."""
    for part in key.split("."):
        # camelCase -> snake_case, then normalise separators: `apiKey` -> `api_key`.
        snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", part).lower().replace("-", "_")
        if snake not in _NOT_SECRET and _SECRET_RE.search(snake):
            return True
    return False


def prepare_params(params: Mapping[str, Any]) -> dict[str, str]:
    """Flatten, redact credentials to `***` and truncate values to MLflow's length limit."""
    out = {}
    for k, v in flatten(params).items():
        if looks_secret(k):
            v = REDACTED
        elif len(v) > MAX_PARAM_VAL_LENGTH:
            v = v[: MAX_PARAM_VAL_LENGTH - 3] + "..."
        out[k] = v
    return out
