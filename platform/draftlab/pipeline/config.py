"""`jobs/configs/pipeline-*.yaml`: the main job, distill -> sweep -> promote -> serve.

A pipeline file names a DistillConfig YAML (the data, the target and the baseline drafter),
dotted overrides shared by the baseline and every sweep trial, the sweep's search space and
trees, the champion-vs-baselines comparison, a Serve config file and a smoke request.
`load_pipeline` validates all of it up front, so a bad field names the file and the field
before anything runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError

from draftlab.config import (
    ConfigError,
    DistillConfig,
    ServeArgs,
    StrictModel,
    apply_dotted,
    format_validation_error,
    load_yaml,
    read_mapping,
)
from draftlab.sweep.space import AshaSpec, SearchSpec, SweepConfig, sweep_base, trial_config


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


class CompareStage(StrictModel):
    """The champion against target-only decoding, HF `generate` and HF prompt lookup,
    side by side in one bench run, plus this hardware's cost profile."""

    methods: list[str] = Field(default_factory=lambda: ["ar", "hf_generate", "hf_prompt_lookup", "draftlab_tree"])
    """Bench methods (`draftlab_tree` = the champion with its own tree)."""
    limit: int | None = Field(5, ge=1)
    """First N packaged prompts (None = all)."""
    max_new_tokens: int = Field(96, ge=1)
    """New tokens per prompt."""
    profile_repeats: int = Field(3, ge=1)
    """Timed repeats per cost-profile point (`draftlab profile`)."""


class ServeStage(StrictModel):
    """Deploy the champion on the cluster (it stays up after the pipeline)."""

    config: str = "../../serving/smollm2-135m.yaml"
    """Serve config file (relative to the pipeline file or the cwd); its model_uri is replaced
    by the champion's."""
    overrides: dict[str, Any] = Field(default_factory=dict)
    """Dotted ServeArgs fields, e.g. autoscaling.max_replicas: 1."""
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
    compare: CompareStage = Field(default_factory=CompareStage)
    """Champion vs baselines."""
    serve: ServeStage = Field(default_factory=ServeStage)
    """The endpoint."""
    smoke: SmokeStage = Field(default_factory=SmokeStage)
    """The smoke request."""
    experiment: str = "draftlab-pipelines"
    """MLflow experiment of the parent run and of the distillation and sweep runs under it."""
    state_dir: str = ".draftlab/pipelines"
    """Stage records, bench/profile reports, summary and report land in `<state_dir>/<name>/`."""


def dotted(d: dict, prefix: str = "") -> dict:
    """Nested mappings as dotted keys: `{"train": {"lr": 1}}` -> `{"train.lr": 1}`, so a
    nested override (from YAML, or `overrides.train.lr=1` on the command line) sets one
    field instead of replacing its whole section."""
    out = {}
    for key, value in d.items():
        if isinstance(value, dict) and value:
            out |= dotted(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def _find(ref: str, pipeline_file: Path, what: str) -> Path:
    for candidate in (pipeline_file.parent / ref, Path(ref)):
        if candidate.is_file():
            return candidate.resolve()
    raise ConfigError(f"{pipeline_file}: {what}: file not found: {ref}")


class Pipeline:
    """A validated pipeline: the config, the baseline DistillConfig, the sweep (if any)
    with its base, and the Serve spec."""

    def __init__(self, cfg: PipelineConfig, source: Path):
        self.cfg, self.source = cfg, source
        self.distill_file = _find(cfg.distill, source, "distill")
        base = apply_dotted(read_mapping(self.distill_file), dotted(cfg.overrides))
        self.base = base | {"tracking": {**base.get("tracking", {}), "experiment": cfg.experiment}}
        self.distill: DistillConfig = trial_config(self.base, {}, name=f"{cfg.name}-baseline",
                                                   where=f"{source}: overrides (distill {self.distill_file})")
        self.sweep: SweepConfig | None = None
        if cfg.sweep is not None:
            try:
                self.sweep = SweepConfig(name=cfg.name, base=str(self.distill_file), experiment=cfg.experiment,
                                         promote=False, **cfg.sweep.model_dump(exclude={"overrides"}),
                                         overrides=dotted(cfg.overrides) | dotted(cfg.sweep.overrides))
            except ValidationError as e:
                raise ConfigError(format_validation_error(e, f"{source}: sweep", SweepConfig)) from None
        self.serve_file = _find(cfg.serve.config, source, "serve.config")

    def sweep_base(self, parent_run_id: str | None) -> dict:
        """The sweep's base DistillConfig dict, its runs nested under `parent_run_id`."""
        base = sweep_base(self.sweep, self.distill_file, f"{self.source}: sweep")
        base["tracking"] = {**base.get("tracking", {}), "experiment": self.cfg.experiment, "parent_run_id": parent_run_id}
        return base

    def serve_spec(self, model_uri: str, tracking_uri: str) -> dict:
        """`load_serve_config` of the Serve file with the champion and the overrides."""
        from draftlab.serve.control import load_serve_config

        spec = load_serve_config(self.serve_file)
        data = apply_dotted(spec["args"].model_dump(exclude_unset=True),
                            {"model_uri": model_uri, "tracking_uri": tracking_uri} | dotted(self.cfg.serve.overrides))
        try:
            spec["args"] = ServeArgs.model_validate(data)
        except ValidationError as e:
            raise ConfigError(format_validation_error(e, f"{self.source}: serve.overrides", ServeArgs)) from None
        return spec | {k: v for k, v in {"host": self.cfg.serve.host, "port": self.cfg.serve.port}.items() if v is not None}


def load_pipeline(path: str | Path, overrides: dict | None = None) -> Pipeline:
    """Validate the pipeline file and everything it names (errors name file and field)."""
    path = Path(path)
    pipeline = Pipeline(load_yaml(PipelineConfig, path, overrides), path)
    if pipeline.sweep is not None:
        pipeline.sweep_base(None)  # checks every point of the space against the base
    pipeline.serve_spec("models:/check@champion", "sqlite:///check.db")  # checks the overrides
    return pipeline
