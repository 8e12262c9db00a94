"""Shared fixtures: tiny random-config targets load in milliseconds and are reused."""

from __future__ import annotations

import pytest

from draftlab.models.target import load_target


@pytest.fixture(scope="session")
def tiny():
    return load_target("tiny-llama")


@pytest.fixture(scope="session")
def tiny_prompts(tiny):
    texts = ["Hello world", "The quick brown fox", "1 + 1 =", "Write a poem about the sea."]
    return [tiny.encode_prompt(t) for t in texts]
