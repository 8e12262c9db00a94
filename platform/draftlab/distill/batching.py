"""Training batches: self-distilled sequences -> packed ParallelSpec groups.

A sequence x_0..x_{L-1} with target states h_0..h_{L-1} gives drafter *entries*
e_i = (x_{i+1}, h_i) at position i+1 (EAGLE alignment, as at inference). The group layout
over the L-1 entries adds, for anchor a and depth d >= 1, mask d after entry a. Node (a, d)
predicts x_{a+d+2}; its teacher is the target's distribution at position a+d+1, i.e.
softmax(head(h_{a+d+1})). Only nodes predicting response tokens carry loss.

A batch carries no (B, M, M) mask: the group mask follows from each node's (anchor, depth)
(`group_attend`), so it is built on the device from (B, M) vectors (`Batch.attention_mask`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftlab.distill.group_mask import build_group_layout, group_attend


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, L) right-padded sequences
    lengths: torch.Tensor  # (B,) true lengths
    node_token: torch.Tensor  # (B, M) entry token of real nodes (0 for masks / padding)
    node_anchor: torch.Tensor  # (B, M) entry index a: its hidden input is h_a
    mask_idx: torch.Tensor  # (B, M) mask embedding j = d-1 for masks, -1 for real nodes
    depth: torch.Tensor  # (B, M)
    position_ids: torch.Tensor  # (B, M) a + d + 1
    teacher_idx: torch.Tensor  # (B, M) index of the teacher state h_{a+d+1}
    label: torch.Tensor  # (B, M) token x_{a+d+2}
    loss_mask: torch.Tensor  # (B, M) bool: a real node predicting a response token
    num_nodes: torch.Tensor  # (B,) nodes of each row; the rest of its M is padding
    hidden: torch.Tensor | None = None  # (B, L, H) cached target states, if stored

    def _map(self, fn) -> Batch:
        kw = {f: getattr(self, f) for f in self.__dataclass_fields__}
        return Batch(**{f: (fn(v) if isinstance(v, torch.Tensor) else v) for f, v in kw.items()})

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        """On `device` (`non_blocking` overlaps the copy with compute when pinned)."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Batch:
        """Page-locked copy (what a DataLoader with `pin_memory=True` calls)."""
        return self._map(lambda t: t.pin_memory())

    def attention_mask(self) -> torch.Tensor:
        """(B, 1, M, M) bool group mask (True = may attend), built where the batch lives;
        padding nodes see only themselves."""
        return group_attend(self.node_anchor, self.depth, self.num_nodes)[:, None]  # (B, 1, M, M)

    @property
    def response_tokens(self) -> int:
        return int((self.loss_mask & (self.depth == 0)).sum())


def row_ids(sample: dict, max_seq_len: int) -> torch.Tensor:
    """(L,) a sample's token ids as training reads them: cut at `max_seq_len`."""
    return torch.as_tensor(sample["input_ids"], dtype=torch.long)[:max_seq_len]


def collate(
    samples: list[dict],
    k: int,
    max_seq_len: int,
    drop_tokens: bool,
    generator: torch.Generator | None,
    dtype: torch.dtype = torch.float32,
    loss_on_prompt: bool = False,
) -> Batch:
    """Pack `samples` (dicts with input_ids, prompt_len and optionally hidden (L, H), read
    as `dtype`).

    Nodes whose label is a response token carry loss; with `loss_on_prompt`, every node
    with a label does (after the first token, which nothing predicts). Without it, mask nodes
    whose whole chain predicts prompt tokens are left out (`first_anchor`): they would cost a
    step's compute and carry no loss.
    """
    layouts, seqs = [], []
    for s in samples:
        ids = row_ids(s, max_seq_len)  # (L,)
        if ids.numel() < 3:
            raise ValueError("training sequences need at least 3 tokens (prompt + response)")
        seqs.append(ids)
        # Node (a, d) predicts x_{a+d+2}; the deepest of an anchor's chain (d = k-1) reaches
        # the response (index prompt_len) from a = prompt_len - k - 1 on.
        first = 0 if loss_on_prompt else max(0, int(s["prompt_len"]) - k - 1)
        layouts.append(
            build_group_layout(
                ids.numel() - 1, k, drop_tokens=drop_tokens, generator=generator, first_anchor=first
            )
        )
    B, L = len(samples), max(s.numel() for s in seqs)
    M = max(lay.num_nodes for lay in layouts)
    input_ids = torch.zeros(B, L, dtype=torch.long)
    fields = {
        n: torch.zeros(B, M, dtype=torch.long)
        for n in ("node_token", "node_anchor", "depth", "position_ids", "teacher_idx", "label")
    }
    mask_idx = torch.full((B, M), -1, dtype=torch.long)
    loss_mask = torch.zeros(B, M, dtype=torch.bool)
    for b, (s, ids, lay) in enumerate(zip(samples, seqs, layouts, strict=True)):
        n, m = ids.numel(), lay.num_nodes
        input_ids[b, :n] = ids
        entries = ids[1:]  # (L-1,) entry tokens x_1..x_{L-1}
        has_label = lay.label_index >= 0  # (m,)
        teacher = lay.label_index.clamp(min=0)  # (m,) entry index a+d+1 == state index
        fields["node_token"][b, :m] = torch.where(lay.depth == 0, entries[lay.anchor], 0)
        fields["node_anchor"][b, :m] = lay.anchor
        fields["depth"][b, :m] = lay.depth
        fields["position_ids"][b, :m] = lay.position_ids + 1
        fields["teacher_idx"][b, :m] = teacher
        fields["label"][b, :m] = entries[teacher]  # x_{a+d+2}
        mask_idx[b, :m] = torch.where(lay.depth > 0, lay.depth - 1, -1)
        prompt_len = 1 if loss_on_prompt else int(s["prompt_len"])
        loss_mask[b, :m] = has_label & (
            teacher + 1 >= prompt_len
        )  # label x_{teacher+1} is past the prompt
    hidden = None
    if samples and samples[0].get("hidden") is not None:
        H = torch.as_tensor(samples[0]["hidden"]).shape[-1]
        hidden = torch.zeros(B, L, H, dtype=dtype)
        for b, s in enumerate(samples):
            h = torch.as_tensor(s["hidden"])[: seqs[b].numel()]  # (L_b, H) float16 on disk
            hidden[b, : h.shape[0]] = h.to(dtype)
    return Batch(
        input_ids=input_ids,
        lengths=torch.tensor([s.numel() for s in seqs]),
        mask_idx=mask_idx,
        loss_mask=loss_mask,
        num_nodes=torch.tensor([lay.num_nodes for lay in layouts]),
        hidden=hidden,
        **fields,
    )
