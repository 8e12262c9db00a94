"""Row-exact attention: a verified row is computed bit for bit as decoding computes it.

A speculative round verifies T tokens in one target forward, while target-only decoding
computes the same rows one token at a time. Linear layers give the same bits for a row
whatever the number of rows beside it (oneDNN's AMX bf16 matmuls), but a fused attention
kernel blocks a T-row query block differently from a single query, and a key count that is
not a whole number of its vector blocks takes a tail path: row i of a block can differ in
the last bits from the token-by-token row, which in bfloat16 flips near-tie argmaxes, so
greedy speculative output would drift from greedy decoding.

This attention (registered with transformers as `draftlab`) removes both sources. Given a
`RowPlan` (the caller's `draftlab_rows`), every query row becomes its own batch entry
over the keys it may see - in cache order, the context then its tree ancestors and itself -
padded with masked keys to a whole number of BLOCK keys. Within an entry, the query heads
that share a KV head form its query length (GQA folded: one decoding step and every
verified row run the kernel with the same shape, on one thread; SDPA's `enable_gqa` path,
one query per entry, was several times slower on CPU bf16). Fully masked key blocks add exact
zeros, so a row's result depends only on its own visible keys: the target's decode step
(`Target.forward` with one token) and a verify block of any width go through this same
call and agree bit for bit. It is one SDPA call per layer for the whole
block, or two when the leading rows see causal prefixes of the cache (a chain, a grafted
branch: `RowPlan.prefix`) - those read the cache in place, only the others are gathered.
Without a plan (prefill, HF `generate`) it is transformers' SDPA unchanged.

Where it builds (`row_kernel.py`), a CPU kernel of draftlab's own replaces those SDPA calls:
it computes each row over its own keys in the cache in place, by a fixed sequence of float32
operations, so rows are exact by construction (no padding, gathering or single thread), and
several times faster a row than the one-thread SDPA form. The SDPA form above stays
as the fallback where no compiler is at hand; a process uses one of the two throughout.

Row-exact is a CPU (oneDNN) measure. On CUDA the same `RowPlan` goes through one fused kernel
over the cache in place (`fused_attention.py`); `choose` picks per device (`auto`), or a
target's `attention` setting forces either.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from draftlab.models import fused_attention, row_kernel

NAME = "draftlab"
BLOCK = 16  # key padding granule: a multiple of the CPU flash kernel's vector block


def _padded(n: int) -> int:
    """n keys rounded up to whole BLOCKs."""
    return -(-n // BLOCK) * BLOCK


@dataclass(frozen=True)
class RowPlan:
    """Which cache keys each query row sees, padded to a multiple of BLOCK keys.

    The first `prefix` rows see causal prefixes of the cache (keys 0..n-1): they read the
    cache in place. The others see gathered keys (`index`). Build it once per forward with
    `RowPlan.build(rows)` or `RowPlan.tree`; every layer reuses it.
    """

    mask: torch.Tensor  # (T, 1, 1, Lp) bool: key j (of row i's keys) is visible to row i
    index: (
        torch.Tensor | None
    )  # (T, Lp) cache indices of row i's keys; None = all rows are prefixes
    prefix: int  # leading rows that see causal prefixes (index[i] = arange)
    prefix_keys: int  # Lp of those rows: a multiple of BLOCK
    # Host-side facts, so that no layer reads a device tensor back (a GPU sync per forward):
    fewest_keys: (
        int  # the smallest number of keys a row sees (all of the cache when it is its size)
    )
    last_key: int  # the largest cache index any row sees
    memo: dict = field(default_factory=dict, compare=False, repr=False)  # per-forward derived masks

    @property
    def num_rows(self) -> int:
        return self.mask.shape[0]

    @property
    def num_keys(self) -> int:
        return self.mask.shape[-1]

    @classmethod
    def build(cls, rows: list, device: torch.device | str = "cpu") -> RowPlan:
        """rows[i]: an int n (row i sees cache keys 0..n-1) or a LongTensor of the cache
        indices it sees, in order (context, then its tree ancestors and itself)."""
        if not rows:
            raise ValueError("a row plan needs at least one row")
        prefixes = all(isinstance(r, int) for r in rows)
        sizes = [r if prefixes else len(r) for r in rows]  # keys per row, on the host
        keys = _padded(max(sizes))  # Lp
        lengths = torch.tensor(sizes, device=device)  # (T,)
        visible = torch.arange(keys, device=device)[None, :] < lengths[:, None]  # (T, Lp)
        if prefixes:
            return cls(visible[:, None, None, :], None, len(rows), keys, min(sizes), max(sizes) - 1)
        index = torch.zeros(
            len(rows), keys, dtype=torch.long, device=device
        )  # pads -> key 0, masked
        for i, r in enumerate(rows):
            index[i, : len(r)] = r
        last = int(
            torch.cat([r.reshape(-1) for r in rows]).max()
        )  # gathered rows (a server's batch): one sync
        return cls(visible[:, None, None, :], index, 0, 0, min(sizes), last)

    @classmethod
    def tree(
        cls, ctx: int, ancestors: torch.Tensor, counts: torch.Tensor, sizes: list[int] | None = None
    ) -> RowPlan:
        """Rows of a tree block appended after `ctx` cached keys: row i sees the context,
        then block rows `ancestors[i, :counts[i]]` (its ancestors and itself, in order).
        Leading rows that form a chain (row i's ancestors are rows 0..i) are prefixes.

        ancestors: (T, A) block offsets, padded with anything; counts: (T,); sizes: `counts`
        as host ints where the caller has them (else read back from the device once).
        """
        sizes = counts.tolist() if sizes is None else sizes
        keys = _padded(ctx + max(sizes))  # Lp
        cols = torch.arange(keys, device=ancestors.device)  # (Lp,)
        slot = (cols - ctx).clamp(
            0, ancestors.shape[1] - 1
        )  # (Lp,) ancestor slot of a block column
        index = torch.where(cols < ctx, cols, ctx + ancestors[:, slot])  # (T, Lp)
        visible = cols[None, :] < (ctx + counts)[:, None]  # (T, Lp)
        # Row i with i + 1 ancestors (itself included, all < i + 1) sees rows 0..i, so its
        # parent i - 1 does too: these rows are a leading run.
        prefix = next((i for i, n in enumerate(sizes) if n != i + 1), len(sizes))
        return cls(
            visible[:, None, None, :],
            index,
            prefix,
            _padded(ctx + prefix),
            ctx + min(sizes),
            ctx + len(sizes) - 1,
        )

    def _checked(self, num_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(seen (T, Lp) bool, index (T, Lp)): row i's keys are index[i][seen[i]], in order,
        all within the first `num_keys` cache keys."""
        seen = self.mask[:, 0, 0]  # (T, Lp)
        index = self.index
        if index is None:  # prefixes: row i's keys are 0..Lp-1
            index = torch.arange(self.num_keys, device=seen.device).expand_as(seen)  # (T, Lp)
        self.sees_all(num_keys)  # checks the range
        return seen, index

    def key_lists(self, num_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(index (T or 1, Lp) int64, counts (T,)): row i's keys are index[i, :counts[i]] (one
        index row shared by prefix plans), the form the CPU row kernel reads. Computed once
        per forward and kept on the plan (every layer asks for the same one)."""
        memo_key = ("lists", num_keys)
        if memo_key not in self.memo:
            seen, index = self._checked(num_keys)
            self.memo[memo_key] = (index[:1] if self.index is None else index, seen.sum(-1))
        return self.memo[memo_key]

    def sees_all(self, num_keys: int) -> bool:
        """Every row sees all `num_keys` cache keys (a decoding step), decided on the host."""
        if self.last_key >= num_keys:
            raise ValueError(f"row plan reaches key {self.last_key} but the cache has {num_keys}")
        return self.fewest_keys >= num_keys

    def visible(self, num_keys: int) -> torch.Tensor:
        """(T, S) bool over the first `num_keys` cache keys: key j is visible to row i. The
        dense form the fused path masks with (the context, then ancestors and itself)."""
        seen, index = self._checked(num_keys)
        # hidden slots go to an extra column, dropped after the scatter
        spill = torch.where(seen, index, num_keys)  # (T, Lp)
        dense = torch.zeros(self.num_rows, num_keys + 1, dtype=torch.bool, device=seen.device)
        return dense.scatter_(1, spill, True)[:, :num_keys]


@contextmanager
def _one_thread() -> Iterator[None]:
    """The CPU flash kernel with a query length > 1 rounds a batch entry differently
    depending on how its work is split across threads (measured: identical entries of one
    2-thread call differ in the last bits), so row-exact calls run it on one thread: every
    entry is then computed alike, whatever the batch (rows) beside it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def row_exact_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # (1, heads, T, d)
    key: torch.Tensor,  # (1, kv_heads, S, d), the cache included
    value: torch.Tensor,  # (1, kv_heads, S, d)
    plan: RowPlan,
) -> tuple[torch.Tensor, None]:
    """Every row over its own keys: the CPU row kernel where it is built, else SDPA with a
    batch entry per row."""
    scale = getattr(module, "scaling", None)
    if row_kernel.supports(query, key):
        index, counts = plan.key_lists(key.shape[2])
        out = row_kernel.rows_attention(
            query[0].transpose(0, 1),
            key[0],
            value[0],
            index,
            counts,
            query.shape[3] ** -0.5 if scale is None else scale,
        )  # (T, heads, d)
        return out.to(query.dtype)[None], None  # (1, T, heads, d)
    return sdpa_rows_attention(query, key, value, plan, scale)


def sdpa_rows_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: RowPlan, scale: float | None
) -> tuple[torch.Tensor, None]:
    """Row-exact attention through SDPA's flash kernel: each row its own batch entry over its
    keys padded to whole BLOCKs, on one thread (the module doc)."""
    rows = query.shape[2]
    kv_heads, d = key.shape[1], query.shape[3]
    # Each row its own batch entry; the query heads sharing a KV head are its query length
    # (heads are grouped as HF's repeat_kv groups them): (T, kv, heads/kv, d).
    q = query[0].transpose(0, 1).view(rows, kv_heads, -1, d)
    groups = []  # (first row, rows, keys, values, mask) per SDPA call
    if plan.prefix:  # causal prefixes: the cache itself, masked past each row's keys
        p, keys = plan.prefix, plan.prefix_keys
        if plan.index is None and keys < key.shape[2]:
            raise ValueError(f"row plan covers {keys} keys but the cache has {key.shape[2]}")
        k, v = (
            t[:, :, :keys] if keys <= t.shape[2] else F.pad(t, (0, 0, 0, keys - t.shape[2]))
            for t in (key, value)
        )
        groups.append(
            (0, p, k.expand(p, -1, -1, -1), v.expand(p, -1, -1, -1), plan.mask[:p, ..., :keys])
        )
    if plan.prefix < rows:  # the others: each row's keys gathered in order
        p, index = plan.prefix, plan.index[plan.prefix :]  # (T-P, Lp)
        k, v = (
            t[0][:, index].transpose(0, 1) for t in (key, value)
        )  # (kv, T-P, Lp, d) -> (T-P, kv, Lp, d)
        groups.append((p, rows - p, k, v, plan.mask[p:]))
    with _one_thread():
        outs = [
            F.scaled_dot_product_attention(q[a : a + n], k, v, attn_mask=m, scale=scale)
            for a, n, k, v, m in groups
        ]  # (n, kv, heads/kv, d) each
    out = outs[0] if len(outs) == 1 else torch.cat(outs)  # (T, kv, heads/kv, d)
    return out.reshape(1, rows, -1, d), None  # (1, T, heads, d)


def _with_plan(mode: str, rows_fn):
    """The transformers attention function for `rows_fn(module, query, key, value, plan)`:
    transformers' SDPA unchanged without a row plan (prefill, HF `generate`), else `rows_fn`
    once the block's shape is checked against the plan."""

    def attention(
        module: torch.nn.Module,
        query: torch.Tensor,  # (1, heads, T, d)
        key: torch.Tensor,  # (1, kv_heads, S, d), the cache included
        value: torch.Tensor,  # (1, kv_heads, S, d)
        attention_mask: torch.Tensor | None,
        draftlab_rows: RowPlan | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        if draftlab_rows is None:
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        if query.shape[0] != 1:
            raise ValueError(
                f"{mode} attention runs one sequence at a time, got a batch of {query.shape[0]}"
            )
        if draftlab_rows.num_rows != query.shape[2]:
            raise ValueError(
                f"row plan has {draftlab_rows.num_rows} rows for {query.shape[2]} queries"
            )
        return rows_fn(module, query, key, value, draftlab_rows)

    return attention


Mode = Literal["auto", "row-exact", "fused"]
IMPLEMENTATIONS = {  # mode -> (name registered with transformers, attention function)
    "row-exact": (NAME, _with_plan("row-exact", row_exact_attention)),
    "fused": (fused_attention.NAME, _with_plan("fused", fused_attention.fused_attention)),
}


def choose(mode: Mode, device: torch.device | str) -> str:
    """The verify attention for `device`: `auto` = `row-exact` on CPU (verified rows equal
    decoded rows bit for bit under oneDNN), `fused` elsewhere (CUDA: one kernel over the
    cache, no per-row copies; greedy identity up to floating-point ties)."""
    if mode == "auto":
        return "row-exact" if torch.device(device).type == "cpu" else "fused"
    if mode not in IMPLEMENTATIONS:
        raise ValueError(f"attention {mode!r} is not one of auto, {', '.join(IMPLEMENTATIONS)}")
    return mode


def install(model, mode: Mode = "auto") -> str:
    """Register both attentions with transformers (idempotent), switch `model` to the one
    `choose(mode, model.device)` picks, and return its mode."""
    chosen = choose(mode, model.device)
    for name, fn in IMPLEMENTATIONS.values():
        if name not in AttentionInterface._global_mapping:
            AttentionInterface.register(name, fn)
            AttentionMaskInterface.register(name, sdpa_mask)
    model.set_attn_implementation(IMPLEMENTATIONS[chosen][0])
    return chosen
