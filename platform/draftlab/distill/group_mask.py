"""Group attention mask for ParallelSpec training (parallel drafting groups packed in one sequence).

For a sequence of ``L`` real tokens ``x_0..x_{L-1}`` and ``K`` depths (``d = 0..K-1``):

* node ``(a, d)`` is the real token ``x_a`` if ``d == 0``, otherwise mask number ``d`` placed
  after position ``a``;
* its position id is ``a + d`` and its label is ``x_{a+d+1}`` (no label when ``a + d + 1 >= L``);
* node ``(a, d)`` may attend to node ``(a', d')`` iff
  ``(d' == 0 and a' <= a) or (a' == a and d' <= d)``.

So every node sees exactly what the drafter sees at inference time when it is asked for depth
``d`` after the prefix ``x_0..x_a``: the real prefix followed by masks ``1..d``.

Depth 0 always keeps all ``L`` anchors (the last one has no label: ``label_index == -1``).
Depth ``d >= 1`` only uses anchors with ``a + d + 1 < L`` (the others would have no label).
With ``drop_tokens`` (PARD's conditional drop-token subsampling, COD) depth ``d`` keeps
``floor(L * max(ratio**d, min_ratio))`` anchors (capped by how many are eligible), drawn at random
among the anchors kept at depth ``d - 1``, so every kept node ``(a, d)`` has its whole chain
``(a, 0), (a, 1), ..., (a, d - 1)`` in the layout.

With ``first_anchor`` f > 0, depths ``d >= 1`` only use anchors ``a >= f`` (and the drop-token
counts above take ``L - f`` for ``L``): training that puts no loss on a prompt leaves out the
mask nodes whose whole chain would predict prompt tokens, while depth 0 keeps the prompt as
context.

Nodes are ordered depth-major: all of depth 0 (by anchor), then depth 1 by anchor, and so on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["GroupLayout", "build_group_layout", "depth_keep_count", "group_attend"]


@dataclass
class GroupLayout:
    """Packed node layout of one sequence; ``M`` is the number of nodes."""

    anchor: torch.Tensor  # (M,) long: a of each node, depth-major order
    depth: torch.Tensor  # (M,) long: d of each node
    position_ids: torch.Tensor  # (M,) long: a + d
    label_index: torch.Tensor  # (M,) long: a + d + 1, or -1 where a + d + 1 >= L
    seq_len: int = -1  # L, the number of real tokens (-1: unknown, no shape check)

    @property
    def num_nodes(self) -> int:
        return int(self.anchor.numel())

    @property
    def attend(self) -> torch.Tensor:
        """(M, M) bool: attend[i, j] iff node i may attend to node j (built on each access:
        training batches build theirs on the device instead, see `group_attend`)."""
        return group_attend(self.anchor, self.depth)  # (M, M)

    def additive_mask(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(1, 1, M, M) additive mask: 0 where ``attend``, ``finfo(dtype).min`` elsewhere."""
        attend = self.attend  # (M, M)
        mask = torch.zeros(attend.shape, dtype=dtype, device=attend.device)  # (M, M)
        mask = mask.masked_fill(~attend, torch.finfo(dtype).min)  # (M, M)
        return mask[None, None]  # (1, 1, M, M)

    def _check_ids(self, ids: torch.Tensor) -> None:
        if self.seq_len >= 0 and ids.shape[-1] != self.seq_len:
            raise ValueError(
                f"ids: last dimension is {ids.shape[-1]}, the layout was built for "
                f"seq_len={self.seq_len}"
            )

    def input_ids(self, ids: torch.Tensor, mask_token: int = -1) -> torch.Tensor:
        """(..., M) node inputs: ``ids[..., anchor]`` at depth 0, ``mask_token`` elsewhere.

        ``ids`` is (L,) or (..., L).
        """
        self._check_ids(ids)
        gathered = ids[..., self.anchor.to(ids.device)]  # (..., M)
        is_real = (self.depth == 0).to(ids.device)  # (M,)
        return torch.where(is_real, gathered, torch.full_like(gathered, mask_token))  # (..., M)

    def labels(self, ids: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """(..., M) node labels: ``ids[..., label_index]``, or ``ignore_index`` where it is -1."""
        self._check_ids(ids)
        label_index = self.label_index.to(ids.device)  # (M,)
        gathered = ids[..., label_index.clamp(min=0)]  # (..., M)
        has_label = label_index >= 0  # (M,)
        return torch.where(has_label, gathered, torch.full_like(gathered, ignore_index))  # (..., M)


def depth_keep_count(seq_len: int, d: int, ratio: float = 0.7, min_ratio: float = 0.2) -> int:
    """COD target count of anchors at depth ``d``: ``floor(L * max(ratio**d, min_ratio))``.

    This is before capping by eligibility (``a + d + 1 < L`` and kept at depth ``d - 1``).
    """
    return math.floor(seq_len * max(ratio**d, min_ratio))


def _validate(seq_len: int, k: int, ratio: float, min_ratio: float) -> None:
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be an int >= 1, got {seq_len!r}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    if not (0.0 < min_ratio <= 1.0):
        raise ValueError(f"min_ratio must satisfy 0 < min_ratio <= 1, got {min_ratio!r}")
    if not (min_ratio <= ratio <= 1.0):
        raise ValueError(
            f"ratio must satisfy min_ratio <= ratio <= 1 (min_ratio={min_ratio!r}), got {ratio!r}"
        )


def build_group_layout(
    seq_len: int,
    k: int,
    drop_tokens: bool = False,
    ratio: float = 0.7,
    min_ratio: float = 0.2,
    generator: torch.Generator | None = None,
    first_anchor: int = 0,
) -> GroupLayout:
    """Build the packed node layout and group attention mask for ``seq_len`` tokens, ``k`` depths.

    See the module docstring for the rule. ``generator`` seeds the drop-token choice (CPU);
    ``first_anchor`` is the first anchor of the mask depths (0 = all).
    """
    _validate(seq_len, k, ratio, min_ratio)
    if isinstance(first_anchor, bool) or not isinstance(first_anchor, int) or first_anchor < 0:
        raise ValueError(f"first_anchor must be an int >= 0, got {first_anchor!r}")

    anchors_per_depth: list[torch.Tensor] = [torch.arange(seq_len)]  # depth 0: (L,)
    kept = anchors_per_depth[0][first_anchor:]  # (n_{d-1},) sorted anchors the next depth may use
    span = max(seq_len - first_anchor, 0)  # anchors open to the mask depths
    for d in range(1, k):
        eligible = kept[kept + d + 1 < seq_len]  # (n_elig,) chain complete and label in range
        if drop_tokens:
            count = min(depth_keep_count(span, d, ratio, min_ratio), eligible.numel())
            order = torch.randperm(eligible.numel(), generator=generator)[:count]  # (count,)
            kept = eligible[order].sort().values  # (count,)
        else:
            kept = eligible  # (n_elig,)
        anchors_per_depth.append(kept)

    anchor = torch.cat(anchors_per_depth)  # (M,)
    depth = torch.cat([torch.full_like(anc, d) for d, anc in enumerate(anchors_per_depth)])  # (M,)
    position_ids = anchor + depth  # (M,)
    label_index = torch.where(
        position_ids + 1 < seq_len, position_ids + 1, torch.full_like(position_ids, -1)
    )  # (M,)

    return GroupLayout(
        anchor=anchor,
        depth=depth,
        position_ids=position_ids,
        label_index=label_index,
        seq_len=seq_len,
    )


def group_attend(
    anchor: torch.Tensor, depth: torch.Tensor, num_nodes: torch.Tensor | None = None
) -> torch.Tensor:
    """The group mask from the nodes' (anchor, depth): (..., M) -> (..., M, M) bool.

    ``attend[..., i, j]`` iff ``(d_j == 0 and a_j <= a_i) or (a_j == a_i and d_j <= d_i)``.
    With ``num_nodes`` (...,), nodes ``>= num_nodes`` are padding: they see only themselves
    (no empty softmax rows) and no real node sees them. Built where ``anchor`` lives: a
    training batch ships (B, M) vectors and gets its (B, M, M) mask on the device.
    """
    a_q, d_q = anchor[..., :, None], depth[..., :, None]  # (..., M, 1) query node i
    a_k, d_k = anchor[..., None, :], depth[..., None, :]  # (..., 1, M) key node j
    attend = ((d_k == 0) & (a_k <= a_q)) | ((a_k == a_q) & (d_k <= d_q))  # (..., M, M)
    if num_nodes is None:
        return attend
    idx = torch.arange(anchor.shape[-1], device=anchor.device)  # (M,)
    real = idx < num_nodes[..., None]  # (..., M)
    attend = attend & real[..., :, None] & real[..., None, :]  # (..., M, M) real nodes only
    return attend | (
        ~real[..., :, None] & torch.eye(idx.numel(), dtype=torch.bool, device=idx.device)
    )  # pad: self
