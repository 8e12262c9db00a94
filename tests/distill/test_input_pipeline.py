"""The training input pipeline: the compact group mask (built on the device from (B, M)
vectors) against the dense fp32 (B, 1, M, M) mask collate used to build, and the prefetched
batch stream against the plain loop (same batches, same drop-token draws)."""

from __future__ import annotations

import datasets
import pytest
import torch

from draftlab.config import TrainConfig
from draftlab.distill.batching import collate
from draftlab.distill.group_mask import build_group_layout
from draftlab.distill.loader import TrainStream, batch_stream, epoch_batches, row_lengths
from draftlab.distill.objective import (
    DistillModule,
    gather_states,
    loss_and_backward,
    teacher_states,
)
from draftlab.models.drafters.build import init_drafter

K = 3
LENGTHS = (9, 17, 12, 5)


def _rows(lengths=LENGTHS, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [
        {"input_ids": torch.randint(3, 100, (n,), generator=g).tolist(), "prompt_len": 3}
        for n in lengths
    ]


def _brute_force_attend(anchor: list[int], depth: list[int]) -> torch.Tensor:
    m = len(anchor)
    out = torch.zeros(m, m, dtype=torch.bool)
    for i in range(m):
        for j in range(m):
            out[i, j] = (depth[j] == 0 and anchor[j] <= anchor[i]) or (
                anchor[j] == anchor[i] and depth[j] <= depth[i]
            )
    return out


def _old_dense_mask(rows: list[dict], seed: int) -> torch.Tensor:
    """The (B, 1, M, M) fp32 additive mask collate built before (same layouts, same draws):
    padding everywhere, 0 on padding nodes' diagonal, each sample's group mask at the top left."""
    g = torch.Generator().manual_seed(seed)
    layouts = [
        build_group_layout(len(r["input_ids"]) - 1, K, drop_tokens=True, generator=g) for r in rows
    ]
    m = max(lay.num_nodes for lay in layouts)
    neg = torch.finfo(torch.float32).min
    attn = torch.full((len(rows), 1, m, m), neg)
    attn[:, 0].diagonal(dim1=-2, dim2=-1).zero_()
    for b, lay in enumerate(layouts):
        allowed = _brute_force_attend(lay.anchor.tolist(), lay.depth.tolist())  # (n, n)
        attn[b, 0, : lay.num_nodes, : lay.num_nodes] = torch.where(allowed, 0.0, neg)
    return attn


def test_compact_mask_equals_the_old_dense_mask():
    rows = _rows()
    batch = collate(rows, K, 64, True, torch.Generator().manual_seed(5))
    mask = batch.attention_mask()  # (B, 1, M, M) bool, built from the (B, M) vectors
    assert mask.dtype == torch.bool
    dense = torch.where(mask, 0.0, torch.finfo(torch.float32).min)
    assert torch.equal(dense, _old_dense_mask(rows, seed=5))


class _OldDenseMaskModule(DistillModule):
    """DistillModule as it was: the dense fp32 additive mask straight into the decoder."""

    def __init__(self, drafter, dense: torch.Tensor):
        super().__init__(drafter)
        self.dense = dense

    def forward(self, batch, hidden):
        x = self.drafter.embed_nodes(
            batch.node_token, gather_states(hidden, batch.node_anchor), batch.mask_idx
        )
        return self.drafter(x, batch.position_ids, attention_mask=self.dense)


@pytest.mark.parametrize("family", ["parallel", "p-eagle"])
@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_compact_mask_gives_identical_losses_and_gradients(tiny, family, autocast):
    """The decoder now gets a bool mask (1 byte a pair, SDPA reads it as is); the losses and
    gradients are bit for bit those of the dense fp32 mask."""
    rows = _rows()
    batch = collate(rows, K, 64, True, torch.Generator().manual_seed(5))
    results, masks = [], []
    for make in (DistillModule, lambda d: _OldDenseMaskModule(d, _old_dense_mask(rows, seed=5))):
        drafter = init_drafter(family, tiny, k=K, depth=2, seed=0).float().train()
        drafter.decoder.register_forward_pre_hook(
            lambda m, a, kw: masks.append(kw["attention_mask"]), with_kwargs=True
        )
        feats = teacher_states(tiny, batch, drafter.cfg.aux_layers)
        with torch.autocast("cpu", dtype=autocast or torch.float32, enabled=autocast is not None):
            stats = loss_and_backward(
                make(drafter), drafter, batch, feats, TrainConfig(ce_weight=0.5), K
            )
        results.append(
            (
                stats,
                {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None},
            )
        )
    assert masks[0].dtype == torch.bool and masks[1].dtype == torch.float32
    (new, new_grads), (old, old_grads) = results
    assert new.loss == old.loss and new.agree == old.agree and new.kl == old.kl
    assert new_grads.keys() == old_grads.keys() and new_grads
    assert all(torch.equal(new_grads[n], old_grads[n]) for n in new_grads)


def _plain_loop(
    data, train: TrainConfig, rank: int, world: int, epoch0: int, start: int, seed: int
) -> list:
    """The worker's loop before prefetching: epoch by epoch, collating inline, one generator."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    lengths = row_lengths(data, train.max_seq_len)
    for epoch in range(epoch0, train.epochs):
        batches = epoch_batches(
            len(data),
            train.batch_size,
            epoch,
            train.seed,
            rank,
            world,
            lengths,
            train.length_window,
        )
        for i, idx in enumerate(
            batches[start if epoch == epoch0 else 0 :], start=start if epoch == epoch0 else 0
        ):
            b = collate(
                [data[j] for j in idx],
                K,
                train.max_seq_len,
                train.drop_tokens,
                gen,
                loss_on_prompt=train.loss_on_prompt,
            )
            out.append((epoch, i, len(batches), b))
    return out


@pytest.mark.parametrize("window", [0, 2])
@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize(("rank", "epoch0", "start"), [(0, 0, 0), (1, 1, 2)])
def test_prefetched_stream_is_the_plain_loop_batch_for_batch(prefetch, rank, epoch0, start, window):
    """A DataLoader worker process builds the batches ahead (prefetch=2): same order, same
    rows, same drop-token draws as collating in the loop; also from a resume position."""
    data = datasets.Dataset.from_list(_rows(lengths=[5 + (7 * i) % 19 for i in range(22)], seed=1))
    train = TrainConfig(
        epochs=3,
        batch_size=3,
        max_seq_len=16,
        drop_tokens=True,
        loss_on_prompt=True,
        seed=4,
        length_window=window,
    )
    ref = _plain_loop(data, train, rank, 2, epoch0, start, seed=11)
    stream = TrainStream(data, K, train, rank, 2, epoch0, start, torch.Generator().manual_seed(11))
    got = list(batch_stream(stream, torch.device("cpu"), prefetch))
    assert [(s.epoch, s.index, s.count) for s in got] == [r[:3] for r in ref]
    assert len(got) == 3 * 3 - 1 * 3 * epoch0 - start  # 11 rows a rank -> 3 batches an epoch
    for s, (*_, b) in zip(got, ref, strict=True):
        for name, value in vars(b).items():
            mine = getattr(s.batch, name)
            assert (mine is None and value is None) or torch.equal(mine, value), name


@pytest.mark.parametrize("world", [1, 2])
def test_length_grouped_batches_hold_the_same_rows_with_less_padding(world):
    """Sorting windows of the shuffle by length changes which rows share a batch, not which
    rows an epoch (and each rank) trains on, nor how many batches it has."""
    lengths = torch.randint(8, 300, (203,), generator=torch.Generator().manual_seed(0)).tolist()

    def padded(batches):  # nodes the batches of right-padded rows cost
        return sum(len(b) * max(lengths[j] for j in b) for b in batches)

    def spread(batches):  # summed length range within each batch
        return sum(max(lengths[j] for j in b) - min(lengths[j] for j in b) for b in batches)

    for rank in range(world):
        for epoch in range(3):
            plain = epoch_batches(len(lengths), 4, epoch, 5, rank, world)
            grouped = epoch_batches(len(lengths), 4, epoch, 5, rank, world, lengths, 8)
            assert grouped == epoch_batches(len(lengths), 4, epoch, 5, rank, world, lengths, 8)
            assert len(grouped) == len(plain) and all(len(b) == 4 for b in grouped)
            assert sorted(j for b in grouped for j in b) == sorted(j for b in plain for j in b)
            assert padded(grouped) < 0.75 * padded(plain)
            assert spread(grouped) < 0.25 * spread(plain)
            first = [max(lengths[j] for j in b) for b in grouped[:8]]
            assert first != sorted(first)  # the batches are shuffled, not short to long
    assert epoch_batches(len(lengths), 4, 0, 5, 0, 1, lengths, 8) != epoch_batches(
        len(lengths), 4, 1, 5, 0, 1, lengths, 8
    )


def test_a_last_state_family_reads_the_last_columns_of_a_fused_feature_cache(tiny):
    """The data cache holds the aux layers' states, then the last state (`target_features`);
    the autoregressive (last-state) family trains from its last H columns, as if the target
    had been run for it, and runs no target forward per step."""
    from draftlab.data.generation import target_features

    aux = [0, 1]
    rows = _rows()
    for r, h in zip(
        rows, target_features(tiny, [r["input_ids"] for r in rows], 4, aux), strict=True
    ):
        r["hidden"] = h  # (L, 3H) float16, as cached
    batch = collate(rows, K, 64, False, None)
    fresh = teacher_states(tiny, collate(_rows(), K, 64, False, None))  # (B, L, H): the target run
    run_decoder = tiny.run_decoder
    tiny.run_decoder = None  # any target forward now fails
    try:
        cached = teacher_states(tiny, batch)
        fused = teacher_states(tiny, batch, aux)
    finally:
        tiny.run_decoder = run_decoder
    assert cached.shape == fresh.shape and fused.shape[-1] == 3 * tiny.hidden_size
    valid = torch.arange(batch.input_ids.shape[1])[None] < batch.lengths[:, None]  # (B, L)
    torch.testing.assert_close(cached[valid].float(), fresh[valid].float(), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("family", ["parallel", "p-eagle"])
def test_leaving_out_prompt_chains_changes_no_loss_and_no_gradient(tiny, family):
    """Without `loss_on_prompt`, collate leaves out the mask nodes whose whole chain predicts
    prompt tokens. No kept node attends to them, so the step's loss, per-depth statistics and
    gradients are those of the full layout with the same response-only loss."""
    rows = [
        dict(r, prompt_len=p)
        for r, p in zip(_rows(lengths=(19, 23, 12, 9)), (9, 14, 3, 7), strict=True)
    ]
    short = collate(rows, K, 64, False, None)
    full = collate(rows, K, 64, False, None, loss_on_prompt=True)
    prompt_len = torch.tensor([r["prompt_len"] for r in rows])[:, None]  # (B, 1)
    full.loss_mask &= full.teacher_idx + 1 >= prompt_len  # response labels only, as `short`
    assert int(short.num_nodes.sum()) < int(full.num_nodes.sum())
    assert int(short.loss_mask.sum()) == int(full.loss_mask.sum()) > 0
    results = []
    for batch in (short, full):
        drafter = init_drafter(family, tiny, k=K, depth=2, seed=0).float().train()
        feats = teacher_states(tiny, batch, drafter.cfg.aux_layers)
        stats = loss_and_backward(
            DistillModule(drafter), drafter, batch, feats, TrainConfig(ce_weight=0.5), K
        )
        grads = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
        results.append((stats, grads))
    (s1, g1), (s2, g2) = results
    assert s1.nodes == s2.nodes and s1.agree == s2.agree
    assert s1.loss == pytest.approx(s2.loss, rel=1e-5) and s1.kl == pytest.approx(s2.kl, rel=1e-5)
    assert g1.keys() == g2.keys() and g1
    for n in g1:
        # Float32 sums over a different number of nodes: equal up to rounding (here <= 3e-4
        # of the largest gradient); a node seeing a left-out one would differ by O(1).
        scale = float(g2[n].abs().max())
        torch.testing.assert_close(
            g1[n], g2[n], atol=1e-3 * scale, rtol=1e-3, msg=lambda m, n=n: f"{n}: {m}"
        )
