"""A pipeline file resolved in one pass into the configs its stages run with.

`load_pipeline` reads the pipeline file, the DistillConfig file it names and the Serve file
once each, in that order, and composes: the baseline DistillConfig (the distill file with
the pipeline's overrides), the sweep (SweepConfig) with its trials' base (the same file with
the pipeline's and the sweep's overrides, every point of the space checked against it, as
`draftlab sweep` checks a sweep file: `sweep.space.sweep_base`), and the Serve spec. What is
left for run time is only what a run decides: the MLflow parent run the sweep nests under
and the champion the endpoint serves. Referenced files are found relative to the pipeline
file, else the cwd; every error names the pipeline file and the field.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from draftlab.config import (
    ConfigError,
    DistillConfig,
    VllmBenchSpec,
    apply_dotted,
    format_validation_error,
    load_yaml,
    read_mapping,
)
from draftlab.pipeline.config import PipelineConfig
from draftlab.serve.control import load_serve_config
from draftlab.sweep.space import SweepConfig, sweep_base, trial_config


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


def _with_tracking(base: dict, **fields) -> dict:
    """`base` with these `tracking` fields set (the pipeline's experiment, the parent run)."""
    return base | {"tracking": {**base.get("tracking", {}), **fields}}


@dataclass(frozen=True)
class Pipeline:
    """A validated pipeline (`load_pipeline`): the config and every config its stages run with."""

    cfg: PipelineConfig
    source: Path  # the pipeline file
    distill: DistillConfig  # the baseline
    sweep: SweepConfig | None  # None = promote the baseline
    trial_base: (
        dict | None
    )  # the sweep trials' base DistillConfig (a dict), under the pipeline's experiment
    serve: dict  # `load_serve_config` of serve.config with the pipeline's host and port
    serve_vllm: (
        dict | None
    )  # the same of serve.vllm_config (deployed when the compare stage measured in vLLM)

    def sweep_base(self, parent_run_id: str | None) -> dict:
        """The sweep's base DistillConfig dict, its runs nested under `parent_run_id`."""
        return _with_tracking(copy.deepcopy(self.trial_base), parent_run_id=parent_run_id)

    def compare_vllm(self, model_uri: str, tracking_uri: str) -> VllmBenchSpec:
        """`compare.vllm` with the environment vLLM is deployed with (`serve.vllm_config`'s
        `env` after `serve.vllm_overrides`) under its own `env`: the contenders are measured
        as they would be served."""
        c = self.cfg.compare.vllm
        if self.serve_vllm is None:
            return c
        served = self.serve_spec(model_uri, tracking_uri, {})["args"].env
        return c.model_copy(update={"env": served | c.env})

    def serve_spec(self, model_uri: str, tracking_uri: str, deploy: dict | None = None) -> dict:
        """The Serve spec with the champion (`model_uri` in `tracking_uri`'s registry) and,
        on top, `serve.overrides`. `deploy` (the compare stage's vLLM verdict: method, k,
        lookups, schedule) selects `serve.vllm_config` and is set on it, then
        `serve.vllm_overrides` (the user's word is last)."""
        spec = self.serve if deploy is None else self.serve_vllm
        if spec is None:
            raise ConfigError(
                f"{self.source}: the compare stage measured in vLLM but compare.engine is draftlab"
            )
        model = type(spec["args"])
        data = apply_dotted(
            spec["args"].model_dump(exclude_unset=True),
            {"model_uri": model_uri, "tracking_uri": tracking_uri}
            | dotted(self.cfg.serve.overrides)
            | (deploy or {})
            | (dotted(self.cfg.serve.vllm_overrides) if deploy is not None else {}),
        )
        try:
            args = model.model_validate(data)
        except ValidationError as e:
            raise ConfigError(
                format_validation_error(
                    e,
                    f"{self.source}: serve.overrides"
                    + ("" if deploy is None else " / serve.vllm_overrides"),
                    model,
                )
            ) from None
        return spec | {"args": args}


def load_pipeline(path: str | Path, overrides: dict | None = None) -> Pipeline:
    """Validate the pipeline file and everything it names (errors name file and field), and
    resolve it into the baseline, the sweep with its trials' base, and the Serve spec."""
    source = Path(path)
    cfg = load_yaml(PipelineConfig, source, overrides)
    distill_file = _find(cfg.distill, source, "distill")
    distill_doc = read_mapping(distill_file)
    base = _with_tracking(
        apply_dotted(copy.deepcopy(distill_doc), dotted(cfg.overrides)), experiment=cfg.experiment
    )
    distill = trial_config(
        base, {}, name=f"{cfg.name}-baseline", where=f"{source}: overrides (distill {distill_file})"
    )
    sweep = None
    if cfg.sweep is not None:
        try:
            sweep = SweepConfig(
                name=cfg.name,
                base=str(distill_file),
                experiment=cfg.experiment,
                promote=False,
                **cfg.sweep.model_dump(exclude={"overrides"}),
                overrides=dotted(cfg.overrides) | dotted(cfg.sweep.overrides),
            )
        except ValidationError as e:
            raise ConfigError(format_validation_error(e, f"{source}: sweep", SweepConfig)) from None
    serve_file = _find(cfg.serve.config, source, "serve.config")
    trial_base = None
    if sweep is not None:  # checks every point of the space against the base
        trial_base = _with_tracking(
            sweep_base(sweep, distill_doc, distill_file, f"{source}: sweep"),
            experiment=cfg.experiment,
        )
    http = {
        k: v for k, v in {"host": cfg.serve.host, "port": cfg.serve.port}.items() if v is not None
    }
    serve = load_serve_config(serve_file) | http
    serve_vllm = (
        None
        if cfg.compare.engine == "draftlab"
        else (load_serve_config(_find(cfg.serve.vllm_config, source, "serve.vllm_config")) | http)
    )
    pipeline = Pipeline(cfg, source, distill, sweep, trial_base, serve, serve_vllm)
    pipeline.serve_spec("models:/check@champion", "sqlite:///check.db")  # checks the overrides
    if serve_vllm is not None:
        pipeline.serve_spec("models:/check@champion", "sqlite:///check.db", deploy={})
    return pipeline
