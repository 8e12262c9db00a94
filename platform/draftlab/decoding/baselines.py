"""What a timed decode returns (`Run`), and HF `generate` as a timed baseline.

Shared by `draftlab bench` and `draftlab doctor`; it needs torch and transformers alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from draftlab.config import SamplingParams
from draftlab.hardware import sync
from draftlab.models.target import Target
from draftlab.vllm_offline import SpecCounters


@dataclass
class Run:
    tokens: list[int]
    seconds: float
    forwards: int  # target forwards after the prefill
    per_position_acceptance: list[float] | None = None
    draft_s: float = 0.0
    verify_s: float = 0.0
    spec: SpecCounters | None = None  # vLLM's counters for this request (vllm_* only)


def hf_runner(target: Target, params: SamplingParams, **extra) -> Callable[[list[int]], Run]:
    """transformers `generate`; target forwards are counted with a forward hook."""
    calls = [0]
    sampling = (
        {"do_sample": False}
        if params.greedy
        else {
            "do_sample": True,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": None,
        }
    )
    eos = sorted(target.eos_token_ids) or None
    pad = (
        target.tokenizer.pad_token_id
        if target.tokenizer.pad_token_id is not None
        else (eos or [0])[0]
    )

    def run(prompt: list[int]) -> Run:
        ids = torch.tensor([prompt], device=target.device)
        calls[0] = 0
        hook = target.model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        try:
            sync(target.device)
            t0 = time.perf_counter()
            out = target.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=params.max_new_tokens,
                eos_token_id=eos,
                pad_token_id=pad,
                **sampling,
                **extra,
            )
            sync(target.device)
            seconds = time.perf_counter() - t0
        finally:
            hook.remove()
        new = out[0, len(prompt) :].tolist()
        for i, tok in enumerate(new):  # cut after the first EOS, as our Stopper does
            if tok in target.eos_token_ids:
                new = new[: i + 1]
                break
        return Run(new, seconds, max(calls[0] - 1, 1))

    return run
