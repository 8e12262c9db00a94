"""Fused verify attention: the whole block in one SDPA call per layer, the cache read in place.

The accelerator counterpart of `attention.row_exact_attention` (registered with
transformers as `draftlab-fused`; `attention.choose` picks it on CUDA). It takes the same
`RowPlan` - which cache keys each verified row sees - but instead of gathering every row's
keys into its own batch entry (a copy of the KV cache per row per step: out of memory at
serving batch sizes, and SDPA's math kernel on CUDA), it turns the plan into one additive
mask over the cache (context columns open, block columns = tree ancestors + self) and runs
a single SDPA call over the cache tensors as they are. GQA is folded into the query length
(the heads sharing a KV head are stacked as extra query rows), so the keys are never
repeated per head either, and SDPA keeps a fused backend (memory-efficient or cuDNN with a
mask; flash for a decoding step, which sees every key and needs no mask).

The price: a verified row is no longer computed exactly as a decoding step computes it (a
different kernel and blocking), so greedy speculative output equals greedy decoding up to
floating-point ties (`draftlab bench` reports the match rate). Without a plan (prefill, HF
`generate`) transformers' SDPA runs unchanged (`attention._with_plan`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from draftlab.models.attention import RowPlan

NAME = "draftlab-fused"


def block_mask(
    plan: RowPlan, num_keys: int, groups: int, dtype: torch.dtype
) -> torch.Tensor | None:
    """The plan as an additive SDPA mask over `num_keys` cache keys with GQA folded:
    (groups * T, S), row j * T + t = row t's visibility (0 seen, -inf hidden), for query head
    j of each KV head. None when every row sees every key (a decoding step): no mask lets
    SDPA use its flash kernel. Computed once per forward and kept on the plan (every layer
    asks for the same one)."""
    memo_key = ("fused", num_keys, groups, dtype)
    if memo_key not in plan.memo:
        if plan.sees_all(num_keys):
            mask = None
        else:  # every row sees at least itself: no all -inf row
            seen = plan.visible(num_keys)  # (T, S) bool
            mask = torch.zeros(seen.shape, dtype=dtype, device=seen.device)  # (T, S)
            mask.masked_fill_(~seen, float("-inf"))
            mask = mask.repeat(groups, 1)  # (groups * T, S)
        plan.memo[memo_key] = mask
    return plan.memo[memo_key]


def fused_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # (1, heads, T, d)
    key: torch.Tensor,  # (1, kv_heads, S, d), the cache included
    value: torch.Tensor,  # (1, kv_heads, S, d)
    plan: RowPlan,
) -> tuple[torch.Tensor, None]:
    """The verify block (shape checked against `plan` by `attention._with_plan`)."""
    _, heads, rows, d = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads  # query heads per KV head, grouped as HF's repeat_kv groups them
    mask = block_mask(plan, key.shape[2], groups, query.dtype)  # (groups * T, S) or None
    # GQA folded into the rows: (1, heads, T, d) -> (1, kv, groups * T, d)
    q = query.reshape(1, kv_heads, groups * rows, d)
    scale = getattr(module, "scaling", None)
    out = F.scaled_dot_product_attention(
        q, key, value, attn_mask=mask, scale=scale
    )  # (1, kv, groups * T, d)
    # reshape, not view: SDPA's CUDA float32 (memory-efficient) kernel returns its output in a
    # (B, T, H, d) buffer seen through a transpose, whose strides no view can regroup
    return out.reshape(1, heads, rows, d).transpose(1, 2).contiguous(), None  # (1, T, heads, d)
