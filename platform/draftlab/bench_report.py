"""The report of `draftlab bench` (`BenchReport`): what `run_bench` returns and `--json` writes.

    BenchReport                         one bench run
      methods: {method: MethodSummary}  tokens/s, tau, greedy agreement, speedups
        by_category: {category: CategorySummary}
      greedy_mismatches, vllm_greedy_mismatches: [Mismatch]
      drafter_head_coverage: HeadCoverage;  versus: {path: ContenderInfo}
      order: Order;  vllm: VllmInfo;  load: {method: {level: LoadLevel}}
      verdict: Verdict                  only with vLLM methods

`run_bench` validates the report through these models and returns it dumped (a plain dict
with the same keys, in the same order, as the JSON file): its readers (`report.py`, the
pipeline's compare stage, sweeps, `verdict.py`) index it by key. Every model forbids unknown
keys, so a new figure is documented here (docs/bench-report.md, `draftlab generate`) before it
can appear. A field marked "left out when None" is absent from the JSON rather than null.
Importing this module loads neither torch nor vLLM.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from draftlab.config.base import StrictModel, unset


class ByPass(StrictModel):
    """Each timed pass's figures (`BenchConfig.passes`), all left out with one pass."""

    tokens_per_s_by_pass: list[float] | None = Field(None, exclude_if=unset)
    """Each timed pass's `tokens_per_s`; left out with one pass."""
    speedup_vs_ar_by_pass: list[float] | None = Field(None, exclude_if=unset)
    """Each pass's `speedup_vs_ar`, against `ar` in the same pass; left out with one pass."""
    speedup_vs_vllm_ar_by_pass: list[float] | None = Field(None, exclude_if=unset)
    """Each pass's `speedup_vs_vllm_ar`; left out with one pass or without vLLM methods."""


class CategorySummary(ByPass):
    """One prompt category's figures of a method (`methods.<method>.by_category.<category>`);
    with several passes each pass's figures too, which on a kind's few prompts spread wider
    than over all prompts."""

    tokens_per_s: float
    """Output tokens per second over the category's prompts."""
    tau: float
    """Mean tokens per target forward (bonus token included)."""
    per_position_acceptance: list[float] | None = Field(None, exclude_if=unset)
    """Acceptance rate at each draft position; left out when None (methods that draft nothing)."""
    speedup_vs_ar: float
    """`tokens_per_s` over `ar`'s on the same category (0.0 when `ar` has none)."""
    speedup_vs_vllm_ar: float | None = Field(None, exclude_if=unset)
    """`tokens_per_s` over `vllm_ar`'s on the same category; left out when None (no vLLM
    methods)."""


class MethodSummary(ByPass):
    """One method's figures over all prompts (`methods.<method>`)."""

    tokens_per_s: float
    """Output tokens per second: all tokens over all decoding seconds."""
    tau: float
    """Tokens per target forward after the prefill; for `vllm_*` methods vLLM's mean acceptance
    length over rounds that had drafts (bonus included); 1.0 without drafts."""
    tokens: int
    """Output tokens over all prompts."""
    seconds: float
    """Decoding seconds over all prompts (prefill included)."""
    forwards: int
    """Target forwards after the prefill."""
    drafts: int | None = Field(None, exclude_if=unset)
    """`vllm_*`: verification rounds that had draft tokens; left out for other methods."""
    draft_tokens: int | None = Field(None, exclude_if=unset)
    """`vllm_*`: draft tokens proposed; left out for other methods."""
    accepted_tokens: int | None = Field(None, exclude_if=unset)
    """`vllm_*`: draft tokens accepted; left out for other methods."""
    per_position_acceptance: list[float] | None = Field(None, exclude_if=unset)
    """Acceptance rate at each draft position (ours: the mean over prompts of each prompt's rate;
    `vllm_*`: accepted over rounds with drafts); left out when the method drafted nothing."""
    by_category: dict[str, CategorySummary]
    """The same figures per prompt category, categories sorted."""
    draft_s: float | None = Field(None, exclude_if=unset)
    """Our engine's drafting seconds over all prompts; left out for methods without drafts."""
    verify_s: float | None = Field(None, exclude_if=unset)
    """Our engine's verification seconds over all prompts; left out for methods without drafts."""
    greedy_match_rate: float | None
    """Greedy: the fraction of prompts whose output equals `ar`'s; None when sampling."""
    greedy_token_match_rate: float | None
    """Greedy: the fraction of `ar`'s tokens reproduced before the first difference; None when
    sampling."""
    speedup_vs_ar: float
    """`tokens_per_s` over `ar`'s (our engine's KV-cached target-only loop, same run)."""
    speedup_vs_vllm_ar: float | None = Field(None, exclude_if=unset)
    """`tokens_per_s` over `vllm_ar`'s (vLLM target-only); left out when None (no vLLM methods)."""


class Mismatch(StrictModel):
    """A (method, prompt) whose greedy output left the reference's (`agreement.mismatches`)."""

    method: str
    """The method whose output differs."""
    prompt: int
    """The prompt's index in the bench's prompt list."""
    position: int
    """The first differing output position."""
    tokens: list[int | None]
    """The reference's token and the method's there (None where one output already stopped)."""
    logits: list[float] | None = Field(None, exclude_if=unset)
    """The target's logits of those two tokens; left out when one output stopped earlier."""
    margin: float | None = Field(None, exclude_if=unset)
    """The gap between those two logits; left out when one output stopped earlier."""
    top2_gap: float | None = Field(None, exclude_if=unset)
    """The gap between the target's top two logits there: a rounding step or so is a tie, a wide
    gap a bug; left out when one output stopped earlier."""


class HeadCoverage(StrictModel):
    """The share of `ar`'s output tokens that the drafter's head scores at all (1.0 untrimmed)."""

    all: float
    """Over all prompts."""
    by_category: dict[str, float]
    """Per prompt category."""


class ContenderInfo(StrictModel):
    """Another saved drafter benched beside the main one (`versus.<path>`), as
    `draftlab_tree@<path>`."""

    tree: str
    """Its tree's name."""
    tree_nodes: int
    """Its tree's node count."""
    k: int
    """Its draft length."""
    drafter_parameters: int
    """Its parameter count."""


class Order(StrictModel):
    """How the methods took turns (`draftlab.bench`'s module doc)."""

    groups: list[list[str]]
    """The methods in run order, one list per group run prompt by prompt (every method of the
    group on a prompt, then the next prompt): one group with every vLLM engine beside ours
    (`vllm.side_by_side`), else ours, then each vLLM engine's methods alone."""
    passes: int
    """Timed passes over the prompts (`BenchConfig.passes`)."""
    warmup_requests: int
    """Untimed warm-up prompts per method before timing."""
    warmup_batch: int | None = Field(None, exclude_if=unset)
    """Before those, every prompt once with all of them in flight on each vLLM engine, untimed;
    left out without vLLM methods."""


class VllmInfo(StrictModel):
    """The vLLM engines of the `vllm_*` methods: version, settings (`VllmBenchSpec`'s fields as
    benched) and what each engine ran."""

    version: str
    """vLLM's version."""
    target_dir: str
    """What vLLM loaded as the target (an HF directory or hub id)."""
    dtype: str
    """The engines' dtype (`float32`, `bfloat16`, ...)."""
    side_by_side: bool
    """`VllmBenchSpec.side_by_side` as benched."""
    memory_fraction: float
    """`VllmBenchSpec.memory_fraction` as benched."""
    enforce_eager: bool
    """`VllmBenchSpec.enforce_eager` as benched."""
    max_model_len: int
    """`VllmBenchSpec.max_model_len` as benched."""
    env: dict[str, str]
    """`VllmBenchSpec.env` as benched."""
    ngram_min: int
    """`VllmBenchSpec.ngram_min` as benched."""
    ngram_max: int
    """`VllmBenchSpec.ngram_max` as benched."""
    suffix_cached_requests: int
    """`VllmBenchSpec.suffix_cached_requests` as benched."""
    draft_lengths: list[int]
    """`VllmBenchSpec.draft_lengths` as benched."""
    suffix_draft_lengths: list[int]
    """`VllmBenchSpec.suffix_draft_lengths` as benched."""
    startup_s: dict[str, float]
    """Seconds each engine took to start."""
    kv_cache_bytes: dict[str, int]
    """Each engine's KV cache (vLLM's `kv_cache_memory_bytes`)."""
    engines: dict[str, list[str]]
    """The methods each engine measured (`vllm_draftlab` and `vllm_suffix` also `<engine>@k<n>`)."""
    speculative_config: dict[str, dict[str, Any] | None]
    """Each engine's vLLM `speculative_config` (None: target only)."""
    lookups: dict[str, dict[str, Any]]
    """Each scheduled engine's `additional_config` for draftlab's vLLM scheduler (draft lengths,
    prompt lookups)."""


class LoadLevel(StrictModel):
    """One vLLM method at one load level (`load.<method>.<level>`), closed loop."""

    tokens_per_s: float
    """Output tokens per second of all requests in flight together."""
    tau: float
    """vLLM's mean acceptance length at this level."""
    requests: int
    """Requests sent at this level."""
    seconds: float
    """Wall seconds of the level."""
    speedup_vs_vllm_ar: float | None
    """`tokens_per_s` over `vllm_ar`'s at the same level; None when `vllm_ar` has none."""


class VerdictLevel(StrictModel):
    """The served method against `vllm_ar` at one load level."""

    concurrency: int
    """Requests in flight."""
    tokens_per_s: float
    """The served method's output tokens per second."""
    vllm_ar_tokens_per_s: float
    """`vllm_ar`'s output tokens per second."""
    drafts: bool
    """Whether the served method beat `vllm_ar` here (the schedule drafts at this batch size)."""


class Verdict(StrictModel):
    """What to deploy (`draftlab.verdict`): the fastest served configuration one request at a
    time, with its batch-size schedule of draft tokens."""

    served: str
    """The method to serve (`vllm_ar` when target-only decoding won)."""
    deploy: dict[str, Any]
    """The `VllmServeArgs` fields that serve it as measured (`speculation`, `method`,
    `num_speculative_tokens`, `schedule`, ...)."""
    levels: list[VerdictLevel]
    """The served method against `vllm_ar` at each load level."""
    reason: str
    """Why, in a sentence."""
    speedup_vs_vllm_ar: float
    """The served method's speedup over `vllm_ar` one request at a time."""
    prompts: int
    """Prompts benched."""


class BenchReport(StrictModel):
    """`draftlab bench`'s report: every method's speed on the same prompts, greedy agreement,
    the drafter's and vLLM engines' settings, and (with vLLM methods) load levels and a verdict."""

    target: str
    """The target model's name."""
    drafter: str | None
    """The main drafter (a directory, URI or `init:<family>`); None when no method used it."""
    device: str
    """The device our engine ran on, with its threads (CPU) or name (CUDA)."""
    prompts: int
    """Prompts benched."""
    max_new_tokens: int
    """New tokens per prompt."""
    greedy_identical: bool
    """Greedy: every `draftlab_*` method's output equals `ar`'s on every prompt (False when
    sampling or without such methods: see `greedy_checked`)."""
    greedy_checked: bool
    """Whether `greedy_identical` was checked (greedy decoding and a `draftlab_*` method)."""
    temperature: float
    """Sampling temperature (0 = greedy)."""
    k: int | None
    """Draft length of the chain methods: `BenchConfig.k`, else the drafter's K (None when unset
    and no method uses the main drafter)."""
    tree: str | None
    """The `draftlab_tree` methods' tree; None without them."""
    tree_nodes: int | None
    """That tree's node count; None without it."""
    drafter_parameters: int | None
    """The main drafter's parameter count; None without a drafter."""
    drafter_head_coverage: HeadCoverage | None
    """How much of the target's output the drafter's head can score at all; None without a
    drafter."""
    versus: dict[str, ContenderInfo]
    """The other drafters benched beside the main one (`BenchConfig.versus`), by path."""
    hf_generate_matches_ar: bool
    """Greedy: `hf_generate`'s outputs equal `ar`'s (False when not run or sampling)."""
    greedy_mismatches: list[Mismatch]
    """Greedy: where our engine's and HF's methods first leave `ar`'s output, with the target's
    logit margins there (ties told from bugs)."""
    vllm_greedy_identical: bool
    """Greedy: every vLLM method with speculation equals `vllm_ar` on every prompt."""
    vllm_greedy_checked: bool
    """Whether `vllm_greedy_identical` was checked (greedy and a vLLM method with speculation)."""
    vllm_greedy_mismatches: list[Mismatch]
    """Greedy: where vLLM methods with speculation first leave `vllm_ar`'s output."""
    vllm_ar_matches_ar: bool
    """Greedy: `vllm_ar`'s outputs equal `ar`'s (False when not run or sampling)."""
    order: Order
    """How the methods took turns: the groups, passes and warm-up."""
    vllm: VllmInfo | None
    """The vLLM engines' version and settings; None without vLLM methods."""
    torch: str
    """torch's version."""
    methods: dict[str, MethodSummary]
    """Each method's figures, `ar` first."""
    load: dict[str, dict[str, LoadLevel]] | None
    """Each vLLM method under load, by level (requests in flight, a string); None without vLLM
    methods."""
    verdict: Verdict | None = Field(None, exclude_if=unset)
    """What to deploy; present only with vLLM methods."""


def speedup_text(figures: dict, key: str) -> str | None:
    """A report's `figures[key]` speedup as text, with its passes' range after it where the bench
    ran several (`<key>_by_pass`); None when the figure is absent."""
    if figures.get(key) is None:
        return None
    passes = figures.get(f"{key}_by_pass")
    return f"{figures[key]:.2f}x" + (f" ({min(passes):.2f}-{max(passes):.2f})" if passes else "")
