"""The target's answers to prompts of token ids: by a vLLM engine (`VllmEngine`) or by the
target's own batched, left-padded HF `generate`; greedy or sampled with a seed per prompt."""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList

from draftlab.config import DataConfig
from draftlab.data.sampling import TopKTopPSampler


def _cut_after_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """Keep tokens up to and including the first EOS (what follows is HF's padding)."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


@torch.inference_mode()
def generate_responses(
    target,
    prompt_ids: list[list[int]],
    data: DataConfig,
    seed: int = 0,
    writer=None,
    lengths: list[int] | None = None,
) -> list[list[int]]:
    """The target's response to each prompt, at most `lengths[i]` tokens (None: all
    `data.max_new_tokens`); greedy when `data.temperature == 0`. Written by `writer` (a
    `VllmEngine` from `open_writer`: prompt i samples with seed `seed + i`) or by batched,
    left-padded HF `generate`, `data.batch_size` prompts per call."""
    eos = sorted(target.eos_token_ids)
    lengths = lengths or [data.max_new_tokens] * len(prompt_ids)
    if writer is not None:
        seeds = [seed + i for i in range(len(prompt_ids))] if data.temperature > 0 else None
        rows = writer.generate_many(
            prompt_ids,
            lengths,
            temperature=data.temperature,
            top_p=data.top_p,
            seeds=seeds,
            stop_token_ids=eos,
        )
    else:  # a batch decodes to its longest length; each row is cut to its own
        rows = _hf_responses(target, prompt_ids, lengths, data, seed, eos)
    stop = set(eos)
    return [_cut_after_eos(r[:n], stop) for r, n in zip(rows, lengths, strict=True)]


def _hf_responses(
    target,
    prompt_ids: list[list[int]],
    lengths: list[int],
    data: DataConfig,
    seed: int,
    eos: list[int],
) -> list[list[int]]:
    """HF `generate`'s new ids per prompt (padding after EOS included), left-padded batches,
    each decoded to the longest length asked in it: a row's first n tokens are what n would
    give (greedy, and our sampler draws the same numbers each step whatever the length)."""
    pad = target.tokenizer.pad_token_id
    pad = pad if pad is not None else (eos[0] if eos else 0)
    mode = {}
    if data.temperature > 0:  # our sampler in the greedy loop: fast on CPU
        mode = dict(
            logits_processor=LogitsProcessorList([TopKTopPSampler(data.temperature, data.top_p)])
        )
    devices = [target.device.index or 0] if target.device.type == "cuda" else []
    rows: list[list[int]] = []
    for start in range(0, len(prompt_ids), data.batch_size):
        chunk = prompt_ids[start : start + data.batch_size]
        ids, mask = left_padded(chunk, pad)  # (B, W) each
        width = ids.shape[1]
        with torch.random.fork_rng(devices=devices):  # seeded, global RNG untouched
            torch.manual_seed(seed + start)
            out = target.model.generate(
                ids.to(target.device),
                attention_mask=mask.to(target.device),
                max_new_tokens=max(lengths[start : start + data.batch_size]),
                eos_token_id=eos or None,
                pad_token_id=pad,
                do_sample=False,
                **mode,
            )  # (B, W + new)
        rows += out[:, width:].tolist()
    return rows


def left_padded(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id rows as one left-padded batch for HF `generate`: ids (B, W) and the attention
    mask (B, W), 1 on real tokens."""
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)  # (B, W)
    mask = torch.zeros_like(ids)  # (B, W)
    for b, row in enumerate(rows):
        ids[b, width - len(row) :] = torch.tensor(row)
        mask[b, width - len(row) :] = 1
    return ids, mask
