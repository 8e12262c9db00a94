"""Row-exact verification attention: each verified row is computed as decoding would.

A speculative round verifies T tokens in one target forward, while target-only decoding
computes the same rows one token at a time. Linear layers give the same bits for a row
whatever the number of rows beside it on AMX bf16 (oneDNN), but fused attention kernels
block the queries and the keys differently for T > 1 than for T == 1, so row i of a
block can differ in the last bits from the token-by-token row, and in bfloat16 that
flips near-tie argmaxes: greedy speculative output would drift from greedy decoding.

This attention (registered with transformers as `draftlab`) is plain SDPA unless the
caller passes `draftlab_rows`: then row i attends with its own SDPA call, q_len == 1 and no
mask, to exactly the keys it may see, in cache order (the context, then its tree
ancestors and itself) - the same call, on the same keys, that decoding makes for it.
The price is T small attention calls per layer instead of one.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "draftlab"
Rows = list  # per query row: an int (it sees keys [0, n)) or a LongTensor of key indices


def row_exact_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # (B, heads, T, d)
    key: torch.Tensor,  # (B, kv_heads, S, d), the cache included
    value: torch.Tensor,  # (B, kv_heads, S, d)
    attention_mask: torch.Tensor | None,
    draftlab_rows: Rows | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if draftlab_rows is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if len(draftlab_rows) != query.shape[2]:
        raise ValueError(f"draftlab_rows has {len(draftlab_rows)} rows for {query.shape[2]} queries")
    outs = []
    for i, seen in enumerate(draftlab_rows):
        if isinstance(seen, int):
            k, v = key[:, :, :seen].contiguous(), value[:, :, :seen].contiguous()  # (B, kv, n, d)
        else:
            k, v = key.index_select(2, seen), value.index_select(2, seen)  # (B, kv, n, d)
        out, _ = sdpa_attention_forward(module, query[:, :, i : i + 1], k, v, None, **kwargs)
        outs.append(out)  # (B, 1, heads, d)
    return torch.cat(outs, dim=1), None  # (B, T, heads, d)


def install(model) -> None:
    """Register the attention with transformers (idempotent) and switch `model` to it."""
    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, row_exact_attention)
        AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
