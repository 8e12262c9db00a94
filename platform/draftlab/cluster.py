"""Where a job runs and writes: the Ray instance it joins, and its storage locations (a local
absolute path, or a URI such as s3:// that Ray Train and `draftlab.storage` write through)."""

from __future__ import annotations

import os
from pathlib import Path

import ray

from draftlab.config import DistillConfig
from draftlab.storage import join


def ensure_ray() -> None:
    """Join the cluster named by RAY_ADDRESS (set inside `ray job submit`), else start a
    fresh local instance ("local": never silently join a stale `ray start` cluster)."""
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS") or "local", log_to_driver=True)


def storage_uri(path: str) -> str:
    """Ray Train needs an absolute local path (or a URI such as s3://)."""
    return path if "://" in path else str(Path(path).expanduser().resolve())


def output_dir(cfg: DistillConfig) -> str:
    """The drafter directory of a distill job: a local absolute path or a URI."""
    if cfg.output_dir:
        return storage_uri(cfg.output_dir)
    return join(storage_uri(cfg.storage_path), cfg.name, "drafter")
