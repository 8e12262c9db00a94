"""`draftlab bench` (`BenchConfig`, with its vLLM engines' `VllmBenchSpec`) and
`draftlab profile` (`ProfileConfig`) and `draftlab doctor` (`DoctorConfig`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from draftlab.config.base import StrictModel
from draftlab.config.decoding import NgramSpec
from draftlab.config.target import TargetSpec
from draftlab.models.shapes import SHAPES


class VllmBenchSpec(StrictModel):
    """The vLLM engines of `draftlab bench`'s `vllm_*` methods (one engine per method)."""

    side_by_side: bool = True
    """Start every engine at once and decode each prompt with every method in turn, ours and
    vLLM's alike, so machine noise lands on every ratio alike (engines run one after another
    measured the same drafter 0.1-0.4x apart on this machine's CPUs). Each engine holds its
    weights and a KV cache of `max_model_len` tokens per request of the highest load level,
    all at once. False: one engine at a time after ours, each as one block (less memory: a
    large target on one GPU)."""
    memory_fraction: float = Field(0.3, gt=0.0, le=0.95)
    """The device memory share of the engines together (vLLM's `gpu_memory_utilization`,
    split evenly among the engines alive at once). The KV cache is sized by the bench itself
    (`side_by_side`), so on the CPU backend vLLM does not use this share; on GPUs it caps
    each engine's weights + activations + KV cache."""
    enforce_eager: bool = True
    """Skip vLLM's torch.compile warm-up: each engine starts much sooner (vLLM 0.29's
    compile cache fails to reload with torch 2.13, so every compiled start compiles) and
    decodes somewhat slower."""
    max_model_len: int = Field(2048, ge=16)
    """Longest prompt + completion an engine accepts (sizes its KV cache)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment of each engine while it runs, over the caller's (e.g.
    `VLLM_CPU_OMP_THREADS_BIND: "0-1"`: vLLM's CPU worker on both cores of a 2-core machine
    instead of vLLM's default, all cores but one). The pipeline's compare stage measures with
    the environment its vLLM serve config deploys with."""
    ngram_min: int = Field(2, ge=1)
    """`vllm_ngram`: shortest prompt n-gram matched (`prompt_lookup_min`)."""
    ngram_max: int = Field(4, ge=1)
    """`vllm_ngram`: longest prompt n-gram matched (`prompt_lookup_max`)."""
    suffix_cached_requests: int = Field(0, ge=0)
    """`vllm_suffix`: past responses its global suffix tree keeps
    (`suffix_decoding_max_cached_requests`). 0: the load levels repeat prompts, and a cache of
    the very answer asked for would be an invented win."""
    draft_lengths: list[int] = Field(default_factory=list)
    """`vllm_draftlab` is also measured drafting each of these k (< its draft length), one
    `vllm_draftlab@k<n>` method each, on the same engine (per-request draft lengths,
    `draftlab.vllm_scheduler`; vLLM's parallel drafting still drafts every slot a step)."""
    suffix_draft_lengths: list[int] = Field(default_factory=lambda: [8])
    """`vllm_suffix` is also measured with each request's drafts capped at each of these k
    (< its depth), one `vllm_suffix@k<n>` method each, on the same engine (per-request draft
    lengths, `draftlab.vllm_scheduler`). Where a verified draft token costs much of a target
    step (CPUs), shorter suffix drafts can pay more than its long ones; the verdict deploys
    the k that won."""

    @model_validator(mode="after")
    def _ngram_range(self) -> VllmBenchSpec:
        if self.ngram_min > self.ngram_max:
            raise ValueError(
                f"ngram_min ({self.ngram_min}) must be <= ngram_max ({self.ngram_max})"
            )
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
    versus: list[str] = Field(default_factory=list)
    """Other saved drafters (directories or storage URIs) for the same target, each benched
    with its own tree (`tree` resolved for it: None = its `tree.json`) and its own lookup store
    as a `draftlab_tree@<path>` method, interleaved with the rest against the same `ar`: an
    A/B of two trainings in one run."""
    temperature: float = Field(0.0, ge=0.0, le=100.0)
    """0 = greedy (the only mode in which `greedy_identical` is checked)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus mass when sampling."""
    seed: int = 0
    """Seed for sampling and for `init:` drafter weights."""
    warmup: int = Field(1, ge=0)
    """Untimed prompts run per method before timing."""
    passes: int = Field(1, ge=1)
    """Timed passes over the prompts, every method on each prompt in turn each pass; with 2 or
    more the report adds each pass's tokens/s and speedups (`*_by_pass`): the spread of a ratio
    is the machine's noise."""
    methods: list[
        Literal[
            "ar",
            "hf_generate",
            "hf_prompt_lookup",
            "draftlab_chain",
            "draftlab_tree",
            "draftlab_chain_ngram",
            "draftlab_tree_ngram",
            "vllm_ar",
            "vllm_ngram",
            "vllm_suffix",
            "vllm_draftlab",
            "vllm_draftlab_ngram",
        ]
    ] = Field(
        default_factory=lambda: [
            "ar",
            "hf_generate",
            "hf_prompt_lookup",
            "draftlab_chain",
            "draftlab_tree",
        ]
    )
    """Which methods to run; `ar` is always run because every speedup is relative to it, and
    `vllm_ar` whenever another `vllm_*` method is (vLLM target-only, for `speedup_vs_vllm_ar`
    and `vllm_greedy_identical`). `draftlab_chain_ngram` / `draftlab_tree_ngram` are the chain
    and the tree with prompt-lookup drafts grafted on each round (`ngram`). `vllm_suffix` is
    Arctic's suffix decoding (needs arctic-inference). `vllm_*` need vLLM installed and are
    not in the default because each engine's start-up costs tens of seconds to minutes;
    `vllm_draftlab` exports the drafter (a `p-eagle` one) to vLLM's EAGLE-3 layout with
    `parallel_drafting`; `vllm_draftlab_ngram` runs it with `ngram`'s prompt lookups merged in
    (a copy from the text where it has a match, else the drafter's draft:
    `draftlab.vllm_scheduler`)."""
    prompt_lookup_tokens: int = Field(10, ge=1)
    """`prompt_lookup_num_tokens` for transformers' prompt-lookup decoding."""
    ngram: NgramSpec = Field(default_factory=NgramSpec)
    """Prompt-lookup drafts grafted onto our engine's tree by the `*_ngram` methods."""
    vllm: VllmBenchSpec = Field(default_factory=VllmBenchSpec)
    """vLLM engine settings for the `vllm_*` methods."""
    concurrency: list[int] = Field(default_factory=list)
    """After the one-at-a-time runs, every `vllm_*` method is measured under load at each of
    these levels (that many requests in flight, a new one as each finishes: closed-loop clients
    without HTTP), and the report adds `load` and the `verdict` (the configuration to deploy,
    with its batch-size schedule of draft tokens). Empty = none."""
    load_requests: int | None = Field(None, ge=1)
    """Requests per load level (prompts cycled); None = max(prompts, 2 x level)."""
    load_all: bool = False
    """Measure every `vllm_*` method under load; False = the finalists only: `vllm_ar` and each
    method faster than it one request at a time (a slower one is never deployed)."""
    json_out: str | None = None
    """Write the JSON report here."""

    @field_validator("concurrency")
    @classmethod
    def _levels(cls, v: list[int]) -> list[int]:
        if any(c < 1 for c in v) or v != sorted(set(v)):
            raise ValueError(f"concurrency levels must be distinct, increasing and >= 1, got {v}")
        return v

    @field_validator("versus")
    @classmethod
    def _saved_and_distinct(cls, versus: list[str]) -> list[str]:
        if untrained := [v for v in versus if v.startswith("init:")]:
            raise ValueError(
                f"{untrained[0]}: versus takes saved drafters (an init: drafter has no tree of its "
                "own)"
            )
        if len(set(versus)) < len(versus):
            raise ValueError(f"a drafter is named twice: {versus}")
        return versus


class ProfileConfig(StrictModel):
    """`draftlab profile`: verification and drafting costs on this hardware."""

    target: TargetSpec = Field(default_factory=TargetSpec)
    """The target model."""
    context: int = Field(256, ge=1)
    """Cached context length the new tokens attend to."""
    new_tokens: list[int] = Field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    """Target forward sizes (tree nodes) to time."""
    trees: list[str] = Field(default_factory=lambda: ["small-6", "default", "wide-16"])
    """Trees whose verify forward is timed as the engine runs it (`chain-<n>`, a preset or a
    JSON file of rank paths): their rows gather the keys of their ancestors, a chain's read
    the cache in place."""
    depths: list[int] = Field(default_factory=lambda: [1, 2, 3, 4])
    """Drafter depths to time."""
    ks: list[int] = Field(default_factory=lambda: list(range(1, 9)))
    """Draft lengths K to time."""
    repeats: int = Field(5, ge=1)
    """Timed repeats per point (median reported)."""
    json_out: str | None = None
    """Write the JSON report here."""


DoctorCheck = Literal["env", "identity", "verify", "decode", "profile", "search", "train"]


class DoctorConfig(StrictModel):
    """`draftlab doctor`: the engine checked on this machine's device, one JSON line per check.
    Fields left unset take the device's defaults (small shapes on a CPU, real ones on CUDA)."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the checks run. `auto` = cuda when available, else cpu."""
    checks: list[DoctorCheck] = Field(
        default_factory=lambda: [
            "env",
            "identity",
            "verify",
            "decode",
            "profile",
            "search",
            "train",
        ]
    )
    """Which checks to run, in this order."""
    target: str | None = None
    """A local HF model directory (or preset) checked instead of the random-weight shapes."""
    identity_shape: str | None = None
    """Shape (`draftlab.models.shapes.SHAPES`) of the identity and train checks' target.
    Default: `tiny` on a CPU, `llama-3.2-1b` on CUDA."""
    speed_shape: str | None = None
    """Shape of the verify, decode, profile and search checks' target. Default: `tiny` on a CPU,
    `llama-3.1-8b` on CUDA."""
    dtypes: list[Literal["float32", "bfloat16"]] = Field(
        default_factory=lambda: ["bfloat16", "float32"]
    )
    """Target dtypes the identity check runs (the speed checks use the device's own: bf16 on
    CUDA)."""
    attentions: list[Literal["row-exact", "fused"]] = Field(
        default_factory=lambda: ["fused", "row-exact"]
    )
    """Verify attentions the identity check runs."""
    trees: list[str] = Field(default_factory=lambda: ["chain-4", "default", "wide-16"])
    """Trees the identity check verifies (`chain-<n>`, a preset or a JSON file of rank paths)."""
    prompts: int = Field(4, ge=1)
    """Random-token prompts the identity check decodes."""
    prompt_tokens: int = Field(32, ge=1)
    """Tokens per identity prompt."""
    new_tokens: int = Field(64, ge=2)
    """Greedy tokens decoded per identity prompt, and by the decode check."""
    contexts: list[int] | None = None
    """Cached context lengths of the verify and decode checks. Default: [64] on a CPU,
    [512, 2048] on CUDA."""
    rows: list[int] = Field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    """Verify block sizes k timed for t(k)/t(1)."""
    repeats: int = Field(15, ge=1)
    """Timed repeats per verify point (median reported)."""
    acceptance: str | None = None
    """The search check's conditional rank acceptance: a drafter's `tree-search.json` (or its
    directory). Default: a packaged table measured for a SmolLM2-135M p-eagle drafter."""
    search_budgets: list[int] = Field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 48, 64])
    """Node budgets whose best trees the search check prices."""
    train_batch: int | None = Field(None, ge=1)
    """Sequences per training step. Default: 2 on a CPU, 8 on CUDA."""
    train_seq: int | None = Field(None, ge=8)
    """Tokens per training sequence. Default: 64 on a CPU, 1024 on CUDA."""
    json_out: str | None = None
    """Also write the JSON lines to this file."""

    @field_validator("identity_shape", "speed_shape")
    @classmethod
    def _known_shape(cls, v: str | None) -> str | None:
        if v is not None and v not in SHAPES:
            raise ValueError(f"unknown shape {v!r}; shapes: {', '.join(SHAPES)}")
        return v
