"""Shared pieces for distillation tests: a tiny DistillConfig, a local prompt file, and
waiting on Ray Train's committed checkpoints (fault tests)."""

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

TOPICS = ["the sea", "a cat", "rain", "trains", "music", "bread", "the moon", "winter",
          "coffee", "books", "rivers", "snow", "birds", "cities", "stars", "gardens"]


def write_prompts(path: Path) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"Tell me about {t}."}) + "\n" for t in TOPICS))
    return path


def tiny_config(tmp: Path, name: str, tracking_uri: str, **sections) -> DistillConfig:
    prompts = write_prompts(tmp / "prompts.jsonl")
    cfg = dict(
        name=name,
        target=TargetSpec(name="tiny-llama"),
        data=DataConfig(
            source=PromptSourceConfig(kind="dataset", path=str(prompts), field="prompt", num_prompts=16),
            max_new_tokens=24, batch_size=8, shard_size=8, eval_fraction=0.25, cache_dir=str(tmp / "data"),
        ),
        drafter=DrafterSpec(family="parallel", k=3, depth=1),
        train=TrainConfig(epochs=4, batch_size=2, lr=3e-3, warmup_steps=2, checkpoint_every=4, eval_every=4, log_every=1),
        scaling=ScalingSpec(num_workers=1, max_failures=2),
        tracking=TrackingSpec(tracking_uri=tracking_uri, experiment=f"draftlab-test-{name}"),
        bench=BenchSpec(limit=2, max_new_tokens=12),
        storage_path=str(tmp / "ray"),
    )
    cfg.update(sections)
    return DistillConfig(**cfg)


def committed_checkpoint(run_dir: Path) -> dict | None:
    """Ray Train's latest *committed* checkpoint of a run: {"step", "dir"}, or None."""
    try:
        latest = json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text()).get("latest_checkpoint_result")
    except (OSError, ValueError):
        return None
    return latest and {"step": latest["metrics"]["step"], "dir": run_dir / latest["checkpoint_dir_name"]}


def wait_for(pred, timeout: float, what: str):
    """`pred()`'s first truthy value, polled every 0.1 s; AssertionError after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
