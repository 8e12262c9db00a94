"""The target model a job loads (`TargetSpec`), and which hub repos are gated."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field

from draftlab.config.base import StrictModel, unset

GATED_ORGS = ("meta-llama/", "google/gemma")
"""Hub name prefixes under which every repo is gated (its licence must be accepted on the hub
by the token's account): a `gated` left unset is true for them, false elsewhere."""

_HUB_NAME = re.compile(r"[\w.-]+/[\w.-]+")  # `org/name`; presets have no slash


def gated_hub_repo(name: str | None, gated: bool | None) -> str | None:
    """`name` when it names a hub repo (not a local path) that is gated (`gated`, or by default
    one under `GATED_ORGS`); None otherwise. Decided from the config and the file system: a
    repo's hub settings cannot be read offline."""
    if not name or not _HUB_NAME.fullmatch(name) or Path(name).expanduser().exists():
        return None
    return name if (gated if gated is not None else name.startswith(GATED_ORGS)) else None


class TargetSpec(StrictModel):
    """Which frozen target LM to load and how."""

    name: str = "smollm2-135m"
    """A preset (`draftlab.models.presets.available_presets()`), a hub id, a local HF
    directory, or a `.gguf` file."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype. `auto` = bfloat16 on CUDA and on CPUs with AMX or AVX512-BF16, float32
    on other CPUs."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the target runs. `auto` = cuda when available, else cpu."""
    attention: Literal["auto", "row-exact", "fused"] = "auto"
    """Verify-block attention. `row-exact`: each row computed as decoding computes it (greedy
    output identical bit for bit; per-row key copies, a CPU device). `fused`: one kernel over
    the KV cache with a tree mask (no copies; identical up to floating-point ties). `auto` =
    row-exact on CPU, fused on CUDA."""
    trust_remote_code: bool = False
    """Allow the hub/dir to run its own modelling code. Off unless you trust the source."""
    gated: bool | None = Field(None, exclude_if=unset)
    """A hub target whose licence must be accepted on the hub (Llama, Gemma): distill, sweep
    and pipeline jobs then fail at start, before any Ray work, when no Hugging Face token is
    set (`HF_TOKEN`, or `hf auth login` on the node). None = true for hub ids under
    `meta-llama/` and `google/gemma`, false for others; presets and local paths never need one."""

    def gated_repo(self) -> str | None:
        """The hub repo a token is needed for (see `gated`), or None."""
        return gated_hub_repo(self.name, self.gated)
