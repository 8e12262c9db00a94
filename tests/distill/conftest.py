"""Fixtures for the distillation tests (Ray Train tuning knobs are set before Ray starts)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# (the health-check interval and the preemption watcher: tests/conftest.py)
os.environ.setdefault("RAY_TRAIN_ENABLE_STATE_ACTOR_RECONCILIATION", "0")


@pytest.fixture(scope="module")
def tmp_module(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("distill")
