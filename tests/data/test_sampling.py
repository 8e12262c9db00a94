"""The greedy-loop sampler draws from HF's temperature -> top-k -> top-p distribution."""

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from draftlab.data.sampling import TopKTopPSampler


def _hf_probs(scores: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    warpers = LogitsProcessorList(
        [TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k), TopPLogitsWarper(top_p)]
    )
    return warpers(None, scores.clone()).softmax(-1)  # (B, V)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, 50, 0.9), (0.7, 8, 1.0), (1.3, 1000, 0.5)]
)
def test_distribution_equals_hf_warpers(temperature, top_k, top_p):
    scores = torch.randn(6, 300, generator=torch.Generator().manual_seed(1)) * 3
    sampler = TopKTopPSampler(temperature, top_p, top_k)
    ids, probs = sampler.candidates(scores)
    mine = torch.zeros_like(scores).scatter_(-1, ids, probs)  # (B, V)
    assert torch.allclose(mine, _hf_probs(scores, temperature, top_k, top_p), atol=1e-6)


def test_greedy_argmax_of_the_output_follows_the_distribution():
    scores = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(20000, 1)  # (N, 4)
    sampler = TopKTopPSampler(
        1.0, top_p=0.9, top_k=4
    )  # nucleus {0, 1, 2}: 0.5/0.3/0.15 renormalised
    torch.manual_seed(0)
    picks = sampler(None, scores).argmax(-1)  # what the greedy loop takes
    freq = torch.bincount(picks, minlength=4).float() / len(picks)
    assert freq[3] == 0
    assert torch.allclose(freq[:3], torch.tensor([0.5, 0.3, 0.15]) / 0.95, atol=0.015)


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="temperature"):
        TopKTopPSampler(0.0)
    with pytest.raises(ValueError, match="top_p"):
        TopKTopPSampler(1.0, top_p=1.5)
