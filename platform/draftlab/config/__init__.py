"""Strict, typed configuration for every draftlab job.

Every model forbids unknown keys, every field carries a docstring, and validation errors
name the field (and, via :func:`load_yaml`, the file) so a typo fails before any work runs.

Submodules (importers use the names re-exported here; inside the package, import from the
submodule):

    base       StrictModel, ConfigError, validation errors naming file and field, dotted
               overrides (`parse_overrides`, `apply_dotted`), `read_mapping`, `load_yaml`
    target     TargetSpec, and which hub repos are gated (GATED_ORGS)
    decoding   SamplingParams, NgramSpec
    bench      BenchConfig (with VllmBenchSpec), ProfileConfig, DoctorConfig
    data       PromptSourceConfig, DataConfig: the self-distillation data
    distill    DistillConfig and its sections (DrafterSpec, TrainConfig with FeatureStreamSpec,
               ScalingSpec, TrackingSpec, BenchSpec); drafter families checked against the
               leaf registry
    serving    EngineSpec, AutoscalingSpec, ServingCommon, ServeArgs, LoadtestConfig

Importing it loads neither torch nor transformers (checking a job file stays cheap).
"""

from draftlab.config.base import (
    ConfigError,
    StrictModel,
    apply_dotted,
    format_validation_error,
    load_yaml,
    parse_overrides,
    read_mapping,
)
from draftlab.config.bench import BenchConfig, DoctorConfig, ProfileConfig, VllmBenchSpec
from draftlab.config.data import MAGPIE_SEEDS, DataConfig, MixSource, PromptSourceConfig
from draftlab.config.decoding import NgramSpec, SamplingParams
from draftlab.config.distill import (
    BenchSpec,
    DistillConfig,
    DrafterSpec,
    FeatureStreamSpec,
    ScalingSpec,
    TrackingSpec,
    TrainConfig,
)
from draftlab.config.serving import (
    AutoscalingSpec,
    EngineSpec,
    LoadtestConfig,
    ServeArgs,
    ServingCommon,
)
from draftlab.config.target import GATED_ORGS, TargetSpec

__all__ = [
    "GATED_ORGS",
    "MAGPIE_SEEDS",
    "MixSource",
    "AutoscalingSpec",
    "BenchConfig",
    "BenchSpec",
    "ConfigError",
    "DataConfig",
    "DistillConfig",
    "DrafterSpec",
    "EngineSpec",
    "FeatureStreamSpec",
    "LoadtestConfig",
    "NgramSpec",
    "ProfileConfig",
    "DoctorConfig",
    "PromptSourceConfig",
    "SamplingParams",
    "ScalingSpec",
    "ServeArgs",
    "ServingCommon",
    "StrictModel",
    "TargetSpec",
    "TrackingSpec",
    "TrainConfig",
    "VllmBenchSpec",
    "apply_dotted",
    "format_validation_error",
    "load_yaml",
    "parse_overrides",
    "read_mapping",
]
