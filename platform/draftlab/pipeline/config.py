"""`jobs/configs/pipeline-*.yaml`: the main job, distill -> sweep -> promote -> serve.

A pipeline file names a DistillConfig YAML (the data, the target and the baseline drafter),
dotted overrides shared by the baseline and every sweep trial, the sweep's search space and
trees, the champion-vs-baselines comparison, a Serve config file and a smoke request. These
are its models; `pipeline/compose.py` resolves a file into the configs the stages run with,
validating all of it up front, so a bad field names the file and the field before anything
runs.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from draftlab.config import StrictModel, VllmBenchSpec
from draftlab.sweep.space import AshaSpec, SearchSpec


class SweepStage(StrictModel):
    """The sweep stage: SweepConfig's search fields (its name, base, experiment and
    promotion are the pipeline's)."""

    space: dict[str, Any] = Field(default_factory=dict)
    """Dotted DistillConfig fields -> list of values or {uniform|loguniform|randint: [lo, hi]}."""
    trees: list[str] = Field(default_factory=lambda: ["chain"], min_length=1)
    """Tree shapes benchmarked for every trained drafter (see SweepConfig.trees)."""
    overrides: dict[str, Any] = Field(default_factory=dict)
    """Dotted DistillConfig fields for the sweep trials only (on top of the pipeline's)."""
    search: SearchSpec = Field(default_factory=SearchSpec)
    """The search algorithm."""
    asha: AshaSpec | None = None
    """Early stopping; None = every trial trains to its budget."""
    max_failures: int = Field(1, ge=-1)
    """Retries of a crashed trial."""
    tie: float = Field(0.05, ge=0, lt=1)
    """Among the trials, speedups within this fraction of the fastest are a tie, broken by the
    higher tau (SweepConfig.tie); at promotion the sweep's best replaces the baseline only
    where it measured more than this fraction faster (no tau decides between them: a wider
    tree or a deeper drafter has more tau and costs more a round)."""


VLLM_CONTENDERS = ["vllm_ar", "vllm_ngram", "vllm_suffix", "vllm_draftlab", "vllm_draftlab_ngram"]


class CompareStage(StrictModel):
    """Where the champion is measured against its contenders, side by side in one bench run on
    the pipeline's `prompts`, plus this hardware's cost profile. With vLLM (the deploy engine):
    vLLM target-only, vLLM's n-gram and suffix drafting, the drafter at each k and with lookups,
    one request at a time and under load; the fastest becomes the served configuration (with a
    batch-size schedule of draft tokens) and the serve stage deploys it with vLLM. Without
    vLLM: our engine's champion against target-only, HF `generate` and HF prompt lookup."""

    engine: Literal["auto", "vllm", "draftlab"] = "auto"
    """Where contenders are measured and the winner deployed: `auto` = vLLM when installed."""
    methods: list[str] = Field(
        default_factory=lambda: ["ar", "hf_generate", "hf_prompt_lookup", "draftlab_tree"]
    )
    """Bench methods without vLLM (`draftlab_tree` = the champion with its own tree)."""
    vllm_methods: list[str] = Field(default_factory=lambda: list(VLLM_CONTENDERS))
    """vLLM contenders (`vllm_suffix` is left out, and the stage says so, when arctic-inference
    is not installed); our `ar` runs beside them as the exact reference."""
    each_k: bool = True
    """With vLLM: also measure the drafter at every k below its draft length
    (`vllm_draftlab@k<n>`)."""
    concurrency: list[int] = Field(default_factory=lambda: [1, 4, 16])
    """With vLLM: load levels (requests in flight) each contender is measured at; the served
    configuration drafts only at the levels where it beat vLLM target-only."""
    load_requests: int | None = Field(None, ge=1)
    """Requests per load level; None = max(prompts, 2 x level)."""
    vllm: VllmBenchSpec = Field(default_factory=VllmBenchSpec)
    """vLLM engine settings of the contenders; their `env` starts from the environment of
    `serve.vllm_config` (after `serve.vllm_overrides`), so they are measured as deployed."""
    limit: int | None = Field(5, ge=1)
    """First N of the pipeline's prompts (None = all)."""
    max_new_tokens: int = Field(96, ge=1)
    """New tokens per prompt."""
    profile_repeats: int = Field(3, ge=1)
    """Timed repeats per cost-profile point (`draftlab profile`)."""


class ServeStage(StrictModel):
    """Deploy the champion on the cluster (it stays up after the pipeline)."""

    config: str = "../../serving/smollm2-135m.yaml"
    """Serve config file of our engine (relative to the pipeline file or the cwd); its model_uri
    is replaced by the champion's."""
    vllm_config: str = "../../serving/smollm2-135m-vllm.yaml"
    """Serve config file used when the compare stage measured in vLLM: the verdict's
    configuration (method, k, lookups, batch-size schedule) is set on it."""
    overrides: dict[str, Any] = Field(default_factory=dict)
    """Dotted ServeArgs fields, e.g. autoscaling.max_replicas: 1."""
    vllm_overrides: dict[str, Any] = Field(default_factory=dict)
    """Dotted fields set on the vLLM Serve config alone (`vllm_config`), last: after
    `overrides` and the verdict's configuration, e.g. `enforce_eager: true`, or
    `speculate_up_to: 1` to route load to a target-only engine (for engines on GPUs of their
    own: docs/guides/vllm.md)."""
    host: str | None = None
    """HTTP host (None = the Serve config's)."""
    port: int | None = Field(None, ge=1, le=65535)
    """HTTP port (None = the Serve config's)."""


class SmokeStage(StrictModel):
    """One chat completion through the live endpoint."""

    prompt: str = Field("Write one sentence about the sea.", min_length=1)
    """User message."""
    max_tokens: int = Field(32, ge=1, le=1024)
    """New tokens."""
    timeout_s: float = Field(120.0, gt=0)
    """Request timeout."""


class PipelineConfig(StrictModel):
    """`draftlab pipeline -c jobs/configs/pipeline-<name>.yaml`: the whole loop."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]+$")
    """Pipeline name: its state directory, MLflow parent run, and the prefix of its runs."""
    distill: str
    """DistillConfig YAML of the baseline drafter, the target and the data (relative to the
    pipeline file or the cwd)."""
    overrides: dict[str, Any] = Field(default_factory=dict)
    """Dotted DistillConfig fields for the baseline and every sweep trial."""
    sweep: SweepStage | None = Field(default_factory=SweepStage)
    """The sweep; None = promote the baseline."""
    prompts: str = "mixed"
    """The evaluation traffic the compare stage measures on, reported per kind: a JSONL file
    (`{"prompt"}`, chat `{"messages"}` or Spec-Bench `{"turns"}`, with `category`), a
    `datasets:<name or file>[:<split>]` source, or a packaged set (`mixed` = `default` +
    `heldout`: short prompts of 12 kinds, long summaries and RAG, translation, math, QA, chat)."""
    compare: CompareStage = Field(default_factory=CompareStage)
    """Champion vs contenders."""

    @field_validator("prompts")
    @classmethod
    def _readable(cls, v: str) -> str:
        from draftlab.data.prompts import load_prompts  # noqa: PLC0415 -- `datasets:` sources

        try:  # here, not after the training stages: a bad path fails before anything runs
            load_prompts(v, limit=1)
        except (OSError, ValueError) as e:
            raise ValueError(str(e)) from None
        return v

    serve: ServeStage = Field(default_factory=ServeStage)
    """The endpoint."""
    smoke: SmokeStage = Field(default_factory=SmokeStage)
    """The smoke request."""
    experiment: str = "draftlab-pipelines"
    """MLflow experiment of the parent run and of the distillation and sweep runs under it."""
    state_dir: str = ".draftlab/pipelines"
    """Stage records, bench/profile reports, summary and report land in `<state_dir>/<name>/`."""
