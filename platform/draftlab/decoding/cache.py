"""KV-cache surgery on transformers' `DynamicCache`: keep the accepted rows, drop the rest."""

from __future__ import annotations

import torch
from transformers import DynamicCache


def keep_rows(cache: DynamicCache, start: int, keep: list[int]) -> None:
    """Keep rows `start + keep[i]` (in order) after the first `start` rows; drop the others.

    `keep` indexes the block appended by the last forward (0 = its first row). A prefix
    `[0, 1, ..., m-1]` (a chain) is a plain crop; a tree path gathers rows into place.
    """
    for layer in cache.layers:
        if not hasattr(layer, "keys") or layer.keys is None:
            continue
        if type(layer).__name__ != "DynamicLayer":
            raise NotImplementedError(
                f"speculative rollback supports full-attention DynamicLayer caches, not {type(layer).__name__}"
            )
        end = start + len(keep)
        if keep != list(range(len(keep))):
            idx = torch.tensor(keep, device=layer.keys.device) + start
            layer.keys[..., start:end, :] = layer.keys[..., idx, :]  # (B, h, m, d) gathered copy
            layer.values[..., start:end, :] = layer.values[..., idx, :]
        layer.keys = layer.keys[..., :end, :]
        layer.values = layer.values[..., :end, :]
