"""KV-cache surgery on transformers' `DynamicCache`: keep the accepted rows, drop the rest."""

from __future__ import annotations

import torch
from transformers import DynamicCache


def keep_rows(cache: DynamicCache, start: int, keep: list[int]) -> None:
    """Keep rows `start + keep[i]` (in order) after the first `start` rows; drop the others.

    `keep` indexes the block appended by the last forward (0 = its first row). A prefix
    `[0, 1, ..., m-1]` (a chain) is a plain crop; a tree path gathers rows into place.
    """
    end, idx = start + len(keep), None
    for layer in cache.layers:
        if not hasattr(layer, "keys") or layer.keys is None:
            continue
        if type(layer).__name__ != "DynamicLayer":
            raise NotImplementedError(
                "speculative rollback supports full-attention DynamicLayer caches, not "
                f"{type(layer).__name__}"
            )
        if idx is None and keep != list(range(len(keep))):  # built once for every layer
            idx = torch.tensor(keep, device=layer.keys.device) + start
        if idx is not None:
            layer.keys[..., start:end, :] = layer.keys[..., idx, :]  # (B, h, m, d) gathered copy
            layer.values[..., start:end, :] = layer.values[..., idx, :]
        layer.keys = layer.keys[..., :end, :]
        layer.values = layer.values[..., :end, :]


class StackedCache(DynamicCache):
    """Several requests' caches seen as one by a single forward (`Target.forward_many`).

    The forward's rows are request after request (`lengths` rows each). Each layer's update
    appends every request's rows to that request's own cache and returns the layer's keys
    and values concatenated in the same order, which the forward's row plan indexes: a row
    only ever sees keys of its own request.
    """

    def __init__(self, caches: list[DynamicCache], lengths: list[int]):
        super().__init__()  # no layers of its own: mask sizes fall back to the query length
        self.caches, self.lengths = caches, lengths

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ):
        keys, values = [], []
        for cache, k, v in zip(
            self.caches,
            key_states.split(self.lengths, dim=2),
            value_states.split(self.lengths, dim=2),
            strict=True,
        ):  # (1, kv, T_i, d) each
            kk, vv = cache.update(k, v, layer_idx)
            keys.append(kk)
            values.append(vv)
        return torch.cat(keys, dim=2), torch.cat(values, dim=2)  # (1, kv, sum of S_i, d)
