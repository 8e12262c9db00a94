"""`draftlab distill` (`DistillConfig`) and its sections: the drafter, optimisation,
Ray Train resources, MLflow tracking and the final benchmark (the target and the data are
in `config/target.py` and `config/data.py`).

Drafter families are checked against the leaf registry `draftlab.models.drafters.registry`,
so validating a job file loads neither torch nor a family module.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from draftlab.config.base import StrictModel
from draftlab.config.data import DataConfig
from draftlab.config.target import TargetSpec
from draftlab.models.drafters.registry import available_drafters
from draftlab.models.drafters.registry import family as drafter_family


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
            raise ValueError(
                f"unknown drafter family {family!r} (allowed: {', '.join(available_drafters())})"
            )
        return family


class FeatureStreamSpec(StrictModel):
    """Online teacher features: a pool of Ray Data actors, each holding the frozen target,
    computes the target's states for each training batch and streams them to the training
    worker, so no feature cache is written (`data.store_features` is then off). For targets
    whose cached states do not fit on disk (an 8B target at 8K tokens: ~268 MB a sample);
    for a small target the cache is cheaper. Each training worker streams its own batches
    from its saved position (a restart resumes there); a killed actor is restarted and its
    batch computed again, so no batch is lost or repeated."""

    actors: int = Field(1, ge=1)
    """Feature actors per training worker (one target copy each)."""
    cpus_per_actor: float = Field(1.0, gt=0.0)
    """CPUs reserved per feature actor (also its torch threads, at least 1)."""
    gpus_per_actor: float = Field(0.0, ge=0.0)
    """GPUs per feature actor (the target then runs on CUDA)."""
    prefetch_batches: int = Field(2, ge=1)
    """Batches of features the training worker keeps ready ahead of the step."""
    buffer_mb: float = Field(1024.0, gt=0.0)
    """Object-store memory the stream may fill with computed features beyond those (Ray
    Data's budget for it): with the batches the actors are computing, the bound on a
    stream's memory. Past it the actors wait (back-pressure); one batch always flows, however
    large."""


class TrainConfig(StrictModel):
    """Optimisation."""

    epochs: int = Field(1, ge=1)
    """Passes over the training split (a time budget may stop earlier)."""
    time_budget_minutes: float | None = Field(None, gt=0.0)
    """Stop training after this much wall-clock time (checkpointed), e.g. to compare
    drafters under the same budget."""
    max_samples: int | None = Field(None, ge=1)
    """Train on the first N samples of the training split only (None = all of it): the
    data-size axis of a scaling sweep over one cached data set
    (`sweeps/scaling-data-smollm2-135m-cpu.yaml`). The held-out split is unchanged; N above the
    split's size is an error that names both."""
    batch_size: int = Field(4, ge=1)
    """Sequences per step per worker."""
    max_seq_len: int = Field(384, ge=8)
    """Truncate prompt+response to this many tokens."""
    length_window: int = Field(64, ge=0)
    """Length-grouped batches: each run of this many batches' rows of an epoch's shuffle is
    sorted by length and cut into batches, which are then shuffled, so rows of like length
    share a batch and little of a step is padding (random batches of responses of varied
    lengths spend a good share of every step on padding nodes). 0 = plain shuffled batches."""
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
    (inside the time budget; needs a C++ compiler on CPU), so it pays on long runs with a
    wide head, as in the long config; a run's step time is its `train/ms_forward_backward`
    metric."""
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
    only prompt tokens: at equal minutes that is more steps, and it reached better held-out
    acceptance (docs/benchmarks.md#what-the-defaults-rest-on). Evaluation stays on response
    tokens."""
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
    AMX or AVX512-BF16 on CPUs that have them; `fp16` adds a GradScaler (loss scaling). On CUDA
    every mode but `none` (strict fp32) also enables TF32 matmuls."""
    prefetch: int = Field(2, ge=0)
    """Batches a background DataLoader worker builds ahead of the step (pinned on CUDA);
    0 = build each batch in the training loop. The batches are the same either way."""
    torch_threads: int | None = Field(None, ge=1)
    """torch intra-op threads per worker (None = torch's default)."""
    feature_stream: FeatureStreamSpec | None = None
    """Stream the target's features from Ray Data actors instead of caching them with the
    data (None = the cache, or the worker's own target when `data.store_features` is off)."""


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
    fresh_process: bool = True
    """Time the costs, search the tree and bench it in a fresh Python process on the rank-0
    worker's node (`distill/end_stage.py`), not in the training worker itself: there, after
    training, a CPU's decode step times markedly slower than in a fresh process, and the search
    picks smaller trees than the served drafter deserves
    (docs/benchmarks.md#what-the-defaults-rest-on). Without the
    bench (sweep trials) the training curve alone is priced in the worker. False = in the
    worker (no second target load)."""
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
    search_budgets: list[int] = Field(
        default_factory=lambda: [1, 2, 3, 4, 6, 8, 12, 16], min_length=1
    )
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
    def _documents_fit_the_sequence(self) -> DistillConfig:
        """Training cuts samples at `train.max_seq_len`: a document-grounded prompt or a
        written chat must leave room for its response, or its sample would train on the prompt
        alone."""
        mix = isinstance(self.data.source, list)
        for i, (src, answer) in enumerate(
            zip(self.data.sources, self.data.response_lengths, strict=True)
        ):
            need = src.prompt_token_limit + answer
            if (src.documents or src.writes_chats) and need > self.train.max_seq_len:
                where = f"data.source[{i}]" if mix else "data.source"
                length = f"{where}.max_new_tokens" if mix else "data.max_new_tokens"
                kind = "document-grounded prompts" if src.documents else "written chats"
                grown_by = (("document_tokens", src.documents), ("answer_tokens", src.writes_chats))
                lower = " / ".join([*(name for name, on in grown_by if on), "max_prompt_tokens"])
                raise ValueError(
                    f"{where}: {kind} of up to {src.prompt_token_limit} tokens "
                    f"plus answers of {answer} tokens ({length}) exceed "
                    f"train.max_seq_len = {self.train.max_seq_len}: raise train.max_seq_len "
                    f"or lower {lower}"
                )
        return self

    @model_validator(mode="after")
    def _streamed_features_are_not_cached(self) -> DistillConfig:
        if self.train.feature_stream is None:
            return self
        if "store_features" in self.data.model_fields_set and self.data.store_features:
            raise ValueError(
                "train.feature_stream computes the target's features while training: "
                "data.store_features=true would cache them as well; leave it unset or false"
            )
        self.data.store_features = False
        return self

    @model_validator(mode="after")
    def _cache_what_the_drafter_fuses(self) -> DistillConfig:
        if drafter_family(self.drafter.family).uses_aux_features and self.data.aux_layers is None:
            self.data.aux_layers = self.drafter.aux_layers or "eagle3"
        return self
