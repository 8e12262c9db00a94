"""Sweep definitions (`sweeps/*.yaml`): a base distillation config, a search space over its
fields, the tree shapes evaluated for every trained drafter, and the search algorithm.

A trial is (training parameters, tree). Trials that differ only in the tree share one
trained drafter: `training_key` digests everything that changes what training produces,
so a trained drafter is looked up by it and reused.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from draftlab.config import (
    ConfigError,
    DistillConfig,
    StrictModel,
    apply_dotted,
    format_validation_error,
    load_yaml,
    read_mapping,
)
from draftlab.decoding.tree import NGRAM, available_trees, split_ngram, split_per_round
from draftlab.decoding.tree_search import searched_budget

Scalar = int | float | str | bool
RANGES = ("uniform", "loguniform", "randint")
FIXED_SECTIONS = ("name", "target", "data", "tracking", "storage_path", "output_dir", "bench")


class SearchSpec(StrictModel):
    """How the space is searched."""

    algorithm: Literal["grid", "random", "optuna"] = "grid"
    """`grid`: every combination of the listed values; `random` / `optuna` draw
    `num_samples` points (ranges allowed)."""
    num_samples: int | None = Field(None, ge=1)
    """Points drawn by random/optuna (grid: repeats of the whole grid, default 1)."""
    max_concurrent_trials: int | None = Field(None, ge=1)
    """None = as many as the cluster's CPUs/GPUs fit (see `max_concurrency`)."""
    seed: int = 0
    """Seed of the random/optuna searcher."""


class AshaSpec(StrictModel):
    """ASHA early stopping on the training-time simulated acceptance length."""

    metric: str = "eval/sim_accept_len"
    """Reported while training; higher is better."""
    grace_period: int = Field(2, ge=1)
    """Evaluations a trial gets before it can be stopped."""
    reduction_factor: float = Field(3.0, gt=1.0)
    """Keep the top 1/reduction_factor at each rung."""
    max_t: int = Field(100, ge=1)
    """Most evaluations a training reports (rungs sit at grace_period x reduction_factor^i <
    max_t)."""


def is_chain_name(tree: str) -> bool:
    """`chain` (the drafter's K) or `chain-<k>`."""
    return tree == "chain" or re.fullmatch(r"chain-[1-9][0-9]*", tree) is not None


class SweepConfig(StrictModel):
    """`draftlab sweep -c sweeps/X.yaml`."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]+$")
    """Sweep name: its Tune experiment directory and MLflow parent run."""
    base: str
    """DistillConfig YAML every trial starts from (relative to the sweep file or the cwd)."""
    overrides: dict[str, Any] = Field(default_factory=dict)
    """Dotted DistillConfig fields fixed for every trial (e.g. a shorter time budget)."""
    space: dict[str, list[Scalar] | dict[str, list[float]]] = Field(default_factory=dict)
    """Dotted DistillConfig fields -> a list of values, or {uniform|loguniform|randint: [lo,
    hi]}."""
    trees: list[str] = Field(default_factory=lambda: ["chain"], min_length=1)
    """Tree shapes evaluated for every trained drafter: `chain` (the drafter's K),
    `chain-<k>`, a preset name, or `searched-<n>` (the best n-node tree from the drafter's
    held-out rank acceptance)."""
    objective: Literal["draftlab", "vllm"] = "draftlab"
    """The speedup trials are ranked by (`speedup_vs_ar` in results): `draftlab` = our
    engine against our target-only loop (trees included); `vllm` = the drafter exported to
    vLLM (`draftlab export`) against vLLM target-only decoding, the speedup users get when
    they deploy on vLLM (chains only: `trees` must be `chain` or `chain-<k>`; p-eagle
    drafters; needs the vllm extra)."""
    search: SearchSpec = Field(default_factory=SearchSpec)
    """The search algorithm."""
    asha: AshaSpec | None = None
    """Early stopping; None = every trial trains to its budget."""
    experiment: str = "draftlab-sweeps"
    """MLflow experiment of the parent run (one per sweep) and its nested trial runs."""
    promote: bool = True
    """Give the best trial's drafter the `champion` alias on the target's registered model."""
    tie: float = Field(0.05, ge=0, lt=1)
    """Measured speedups within this fraction of the fastest are a tie, which the higher tau
    breaks (`sweep.runner.fastest`): one short bench on a shared CPU moves a speed this much
    (a 1-minute trial once measured 4% faster than the 4-minute baseline, with less tau),
    while acceptance does not move with load. 0 = the fastest measured, always."""
    max_failures: int = Field(1, ge=-1)
    """Retries of a crashed trial (it resumes its training from the latest checkpoint)."""

    @field_validator("space")
    @classmethod
    def _dimensions(cls, space: dict) -> dict:
        for key, dim in space.items():
            if isinstance(dim, list):
                if not dim:
                    raise ValueError(f"space.{key}: the list of values is empty")
                continue
            if len(dim) != 1 or next(iter(dim)) not in RANGES:
                raise ValueError(
                    f"space.{key}: a range is one of {list(RANGES)} with [low, high], got {dim}"
                )
            low_high = next(iter(dim.values()))
            if len(low_high) != 2 or not low_high[0] < low_high[1]:
                raise ValueError(
                    f"space.{key}: a range needs [low, high] with low < high, got {low_high}"
                )
        return space

    @field_validator("space")
    @classmethod
    def _trainable_fields(cls, space: dict) -> dict:
        for key in space:
            if key.split(".")[0] in FIXED_SECTIONS:
                raise ValueError(
                    f"space.{key}: trials share one target, dataset and tracking setup; sweep over "
                    "drafter.*, train.* or scaling.* fields (set the others in the base or "
                    "overrides)"
                )
        return space

    @model_validator(mode="after")
    def _vllm_runs_chains(self) -> SweepConfig:
        if self.objective == "vllm":
            bad = [t for t in self.trees if not is_chain_name(t)]
            if bad:
                raise ValueError(
                    f"trees {bad}: objective vllm measures chains only (vLLM verifies no static "
                    "trees and grafts no lookups); use chain or chain-<k>"
                )
        return self

    @field_validator("trees")
    @classmethod
    def _trees(cls, trees: list[str]) -> list[str]:
        presets = [t for t in available_trees() if "<" not in t]
        for t in trees:
            shape, per_round = split_per_round(split_ngram(t)[0])
            if not is_chain_name(shape) and searched_budget(shape) is None and shape not in presets:
                raise ValueError(
                    f"unknown tree {t!r} (allowed: chain, chain-<k>, searched-<n>, "
                    f"{', '.join(presets)}; each may end in @n to verify n of its nodes per round, "
                    f"then {NGRAM} to graft prompt lookups)"
                )
            if per_round is not None and (per_round < 1 or is_chain_name(shape)):
                raise ValueError(f"tree {t!r}: @n needs n >= 1 and a tree that is not a chain")
        return trees


def _resolve(base: str, sweep_file: Path) -> Path:
    for candidate in (sweep_file.parent / base, Path(base)):
        if candidate.is_file():
            return candidate
    raise ConfigError(f"{sweep_file}: base: config file not found: {base}")


def load_sweep(path: str | Path, overrides: dict | None = None) -> tuple[SweepConfig, dict]:
    """The sweep and its base DistillConfig (as a dict); every space value is checked
    against the base, so a bad field or value names the sweep file and the field."""
    path = Path(path)
    sweep = load_yaml(SweepConfig, path, overrides)
    base_file = _resolve(sweep.base, path)
    return sweep, sweep_base(sweep, read_mapping(base_file), base_file, str(path))


def sweep_base(sweep: SweepConfig, base_doc: dict, base_file: Path, where: str) -> dict:
    """`base_doc` (the mapping read from `base_file`, left unchanged) with the sweep's
    overrides, after checking every point of the space against it (errors start with
    `where`, the sweep's source, and name `base_file`). `draftlab sweep` and a pipeline's
    sweep stage (`pipeline/compose.py`) compose their trials' base through this."""
    base = apply_dotted(copy.deepcopy(base_doc), sweep.overrides)
    trial_config(base, {}, where=f"{where}: overrides (base {base_file})")
    if sweep.search.algorithm == "grid":
        ranged = [k for k, d in sweep.space.items() if isinstance(d, dict)]
        if ranged:
            raise ConfigError(
                f"{where}: space.{ranged[0]}: grid search needs a list of values (ranges need "
                "random or optuna)"
            )
    for key, dim in sweep.space.items():
        for value in dim if isinstance(dim, list) else next(iter(dim.values())):
            trial_config(
                base, {key: value}, where=f"{where}: space.{key}={value!r} (base {base_file})"
            )
    return base


def trial_config(
    base: dict, params: dict[str, Any], name: str | None = None, where: str = "trial"
) -> DistillConfig:
    """The DistillConfig of one trial: `base` with the dotted `params` set."""
    data = apply_dotted(json.loads(json.dumps(base)), params)  # deep copy
    if name:
        data["name"] = name
    try:
        return DistillConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, where, DistillConfig)) from None


def training_key(cfg: DistillConfig) -> str:
    """Digest of what determines the trained drafter: everything but its name, outputs,
    tracking, benchmark, attention and prefetch settings (trees and benches never retrain;
    the last two do not change the weights)."""
    drop = {
        "name": True,
        "output_dir": True,
        "tracking": True,
        "bench": True,
        "storage_path": True,
        "target": {"attention"},
        "train": {"prefetch"},
    }
    keep = cfg.model_dump(mode="json", exclude=drop)
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


def param_space(sweep: SweepConfig) -> dict:
    """Ray Tune's `param_space`: the training dimensions plus the tree dimension."""
    from ray import tune  # noqa: PLC0415 -- Ray Tune: sweep files validate without it

    def dimension(dim):
        if isinstance(dim, list):
            return tune.grid_search(dim) if sweep.search.algorithm == "grid" else tune.choice(dim)
        kind, (low, high) = next(iter(dim.items()))
        return {"uniform": tune.uniform, "loguniform": tune.loguniform, "randint": tune.randint}[
            kind
        ](low, high)

    space = {key: dimension(dim) for key, dim in sweep.space.items()}
    space["tree"] = dimension(sweep.trees)
    return space


def max_concurrency(
    resources: dict[str, float], cpus_per_trial: float, gpus_per_trial: float = 0.0
) -> int:
    """How many trials the cluster runs at once (at least one)."""
    fits = [resources.get("CPU", 0.0) // cpus_per_trial] if cpus_per_trial else []
    if gpus_per_trial:
        fits.append(resources.get("GPU", 0.0) // gpus_per_trial)
    return max(1, int(min(fits))) if fits else 1
