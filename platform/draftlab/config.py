"""Strict, typed configuration for every draftlab job.

Every model forbids unknown keys, every field carries a docstring, and validation errors
name the field (and, via :func:`load_yaml`, the file) so a typo fails before any work runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

M = TypeVar("M", bound=BaseModel)


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False, validate_assignment=True)


class TargetSpec(StrictModel):
    """Which frozen target LM to load and how."""

    name: str = "smollm2-135m"
    """A preset (`draftlab.models.presets.available_presets()`), a hub id, a local HF
    directory, or a `.gguf` file."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype. `auto` = bfloat16 on CUDA, float32 on CPU."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the target runs. `auto` = cuda when available, else cpu."""
    trust_remote_code: bool = False
    """Allow the hub/dir to run its own modelling code. Off unless you trust the source."""


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


class BenchConfig(StrictModel):
    """`draftlab bench`: side-by-side speed of target-only and speculative decoding."""

    target: TargetSpec = Field(default_factory=TargetSpec)
    """The target model."""
    drafter: str | None = "init:parallel"
    """A saved drafter directory, `init:<family>` for an untrained drafter, or None to skip
    the speculative methods."""
    prompts: str | None = None
    """JSONL prompt file (`{"prompt": ...}` or Spec-Bench `{"turns": [...]}`); None = the
    packaged default set."""
    limit: int | None = Field(None, ge=1)
    """Use only the first N prompts."""
    max_new_tokens: int = Field(128, ge=1, le=32768)
    """New tokens per prompt."""
    k: int = Field(4, ge=1, le=64)
    """Draft length for the chain method (<= the drafter's trained K for `parallel`)."""
    depth: int = Field(1, ge=1, le=32)
    """Decoder layers of an `init:` drafter (a saved drafter keeps its own)."""
    tree: str = "default"
    """Tree for `draftlab_tree`: a preset name or a JSON file of rank paths."""
    temperature: float = Field(0.0, ge=0.0, le=100.0)
    """0 = greedy (the only mode in which `greedy_identical` is checked)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus mass when sampling."""
    seed: int = 0
    """Seed for sampling and for `init:` drafter weights."""
    warmup: int = Field(1, ge=0)
    """Untimed prompts run per method before timing."""
    methods: list[Literal["ar", "hf_generate", "hf_prompt_lookup", "draftlab_chain", "draftlab_tree"]] = Field(
        default_factory=lambda: ["ar", "hf_generate", "hf_prompt_lookup", "draftlab_chain", "draftlab_tree"]
    )
    """Which methods to run; `ar` is always run because every speedup is relative to it."""
    prompt_lookup_tokens: int = Field(10, ge=1)
    """`prompt_lookup_num_tokens` for transformers' prompt-lookup decoding."""
    json_out: str | None = None
    """Write the JSON report here."""


class ProfileConfig(StrictModel):
    """`draftlab profile`: verification and drafting costs on this hardware."""

    target: TargetSpec = Field(default_factory=TargetSpec)
    """The target model."""
    context: int = Field(256, ge=1)
    """Cached context length the new tokens attend to."""
    new_tokens: list[int] = Field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    """Target forward sizes (tree nodes) to time."""
    depths: list[int] = Field(default_factory=lambda: [1, 2, 3, 4])
    """Drafter depths to time."""
    ks: list[int] = Field(default_factory=lambda: list(range(1, 9)))
    """Draft lengths K to time."""
    repeats: int = Field(5, ge=1)
    """Timed repeats per point (median reported)."""
    json_out: str | None = None
    """Write the JSON report here."""


def format_validation_error(err: ValidationError, source: str) -> str:
    """One line per problem: `source: field.path: message (allowed: ...)`."""
    lines = [f"invalid configuration in {source}:"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


class ConfigError(ValueError):
    """A configuration file or override is invalid; the message names file and field."""


def load_yaml(model: type[M], path: str | Path, overrides: dict | None = None) -> M:
    """Load a YAML file into `model`, applying dotted `overrides` (`a.b=1`) on top."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, str(path))) from None
