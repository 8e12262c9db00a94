"""Shared pieces for distillation tests: a tiny DistillConfig, a local prompt file, and
waiting on Ray Train's committed checkpoints (fault tests).

Every tiny config of a test session reads one prompt file and one data cache (`SHARED`,
set by `tests/conftest.py`): the data cache is keyed by the prompt file's path and mtime,
so each test writing its own file would regenerate the same samples (~8 s of Ray Data
actors a fit); shared, each data set (with or without aux-layer features) is generated once."""

from __future__ import annotations

import json
import time
from pathlib import Path

from draftlab.config import (
    BenchSpec,
    DataConfig,
    DistillConfig,
    DrafterSpec,
    PromptSourceConfig,
    ScalingSpec,
    TargetSpec,
    TrackingSpec,
    TrainConfig,
)

TOPICS = [
    "the sea",
    "a cat",
    "rain",
    "trains",
    "music",
    "bread",
    "the moon",
    "winter",
    "coffee",
    "books",
    "rivers",
    "snow",
    "birds",
    "cities",
    "stars",
    "gardens",
]


SHARED: Path | None = None
"""The session's directory for the tiny prompt file and data cache (`tests/conftest.py`)."""


def write_prompts(path: Path) -> Path:
    """The tiny prompt file; left untouched when it already holds them (its mtime keys the data)."""
    text = "".join(json.dumps({"prompt": f"Tell me about {t}."}) + "\n" for t in TOPICS)
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)
    return path


def tiny_config(tmp: Path, name: str, tracking_uri: str, **sections) -> DistillConfig:
    """A tiny-llama distillation whose checkpoints, drafter and sweep state go under `tmp`;
    prompts and generated data come from the session's `SHARED` directory."""
    assert SHARED is not None, "tests/conftest.py sets distill_support.SHARED"
    prompts = write_prompts(SHARED / "prompts.jsonl")
    cfg = dict(
        name=name,
        target=TargetSpec(name="tiny-llama"),
        data=DataConfig(
            source=PromptSourceConfig(
                kind="dataset", path=str(prompts), field="prompt", num_prompts=16
            ),
            max_new_tokens=24,
            batch_size=8,
            shard_size=8,
            eval_fraction=0.25,
            cache_dir=str(SHARED / "data"),
        ),
        drafter=DrafterSpec(family="parallel", k=3, depth=1),
        train=TrainConfig(
            epochs=4,
            batch_size=2,
            lr=3e-3,
            warmup_steps=2,
            checkpoint_every=4,
            eval_every=4,
            log_every=1,
        ),
        scaling=ScalingSpec(num_workers=1, max_failures=2),
        tracking=TrackingSpec(tracking_uri=tracking_uri, experiment=f"draftlab-test-{name}"),
        bench=BenchSpec(
            limit=2, max_new_tokens=12, fresh_process=False
        ),  # test_distill_ray runs the fresh one
        storage_path=str(tmp / "ray"),
    )
    cfg.update(sections)
    return DistillConfig(**cfg)


def committed_checkpoint(run_dir: Path) -> dict | None:
    """Ray Train's latest *committed* checkpoint of a run: {"step", "dir"}, or None."""
    try:
        latest = json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text()).get(
            "latest_checkpoint_result"
        )
    except (OSError, ValueError):
        return None
    return latest and {
        "step": latest["metrics"]["step"],
        "dir": run_dir / latest["checkpoint_dir_name"],
    }


def wait_for(pred, timeout: float, what: str):
    """`pred()`'s first truthy value, polled every 0.1 s; AssertionError after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
