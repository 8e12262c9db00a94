"""Greedy agreement between decoders, and the target's margins where they part.

Greedy speculative output must equal target-only greedy output. On CPU (row-exact attention)
it does bit for bit; on CUDA (fused attention, bf16) and across engines (vLLM, HF `generate`)
floating-point rounding may flip a near-tie. Where two outputs first differ, the target's own
logits there tell which: a top-2 gap of a rounding step or so is a tie, a wide one a bug.
"""

from __future__ import annotations

import torch

from draftlab.models.target import Target


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (the shorter length if one is a prefix), or None."""
    i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return None if i == len(a) == len(b) else i


def greedy_match(reference: list[list[int]], outputs: list[list[int]]) -> dict:
    """Greedy agreement with the reference outputs, prompt by prompt:
    `greedy_match_rate` = the fraction of prompts whose output is identical,
    `greedy_token_match_rate` = the fraction of the reference's tokens reproduced before the
    first difference (every later token counts as lost)."""
    same = sum(a == b for a, b in zip(reference, outputs, strict=True))
    total = sum(len(a) for a in reference)
    kept = sum(
        len(a) if (i := first_difference(a, b)) is None else i
        for a, b in zip(reference, outputs, strict=True)
    )
    return {
        "greedy_match_rate": same / len(reference) if reference else 1.0,
        "greedy_token_match_rate": kept / total if total else 1.0,
    }


@torch.inference_mode()
def near_tie(target: Target, prompt: list[int], a: list[int], b: list[int], pos: int) -> dict:
    """Where two greedy outputs first differ (`pos`): the target's own logits there (one
    prefill of the prompt and the common prefix) for both tokens, and the gap between its
    top two."""
    if pos >= min(len(a), len(b)):  # one output stopped earlier (EOS): nothing to compare
        return {"tokens": [a[pos] if pos < len(a) else None, b[pos] if pos < len(b) else None]}
    ids = torch.tensor(prompt + a[:pos], device=target.device)
    logits, _ = target.forward(
        ids, torch.arange(ids.numel(), device=target.device), target.new_cache(), last_logits=True
    )
    last = logits[-1]  # (V,)
    top = last.topk(2).values
    return {
        "tokens": [a[pos], b[pos]],
        "logits": [float(last[a[pos]]), float(last[b[pos]])],
        "margin": abs(float(last[a[pos]] - last[b[pos]])),
        "top2_gap": float(top[0] - top[1]),
    }


def mismatches(
    target: Target, prompts: list[list[int]], reference: list[list[int]], outputs: list[list[int]]
) -> list[dict]:
    """Each prompt whose output differs from the reference's: its index, the first
    differing position and the target's margins there (`near_tie`)."""
    return [
        {"prompt": i, "position": pos, **near_tie(target, prompt, a, b, pos)}
        for i, (prompt, a, b) in enumerate(zip(prompts, reference, outputs, strict=True))
        if (pos := first_difference(a, b)) is not None
    ]


def describe_mismatches(found: list[dict]) -> str:
    """One line on a mismatch list: how many, and the widest top-2 gap among them (a gap
    near a bf16 rounding step says tie, a wide one says bug)."""
    if not found:
        return "none"
    gaps = [m["top2_gap"] for m in found if "top2_gap" in m]
    widest = f", widest top-2 gap at a difference {max(gaps):.3g}" if gaps else ""
    return f"{len(found)} outputs differ{widest}"
