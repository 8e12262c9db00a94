"""Agreement metrics of the objective with a VocabTrim head."""

import torch

from draftlab.config import TrainConfig
from draftlab.distill.objective import node_losses
from draftlab.models.drafters import init_drafter


def test_full_vocab_agreement_counts_trimmed_target_tokens_as_misses(tiny):
    drafter = init_drafter("parallel", tiny, k=2, depth=1, seed=0, vocab_size=16)
    drafter.set_vocab(torch.arange(16))  # keep ids 0..15 only
    teacher = torch.randn(200, tiny.hidden_size, generator=torch.Generator().manual_seed(0)).to(tiny.dtype)
    out = teacher.clone()  # the drafter reproduces the teacher's state exactly
    label = torch.zeros(200, dtype=torch.long)
    _, _, trimmed = node_losses(drafter, out, teacher, label, TrainConfig())
    _, _, full = node_losses(drafter, out, teacher, label, TrainConfig(), full_vocab_agreement=True)
    in_vocab = tiny.lm_head(teacher).argmax(-1) < 16  # (N,)
    assert trimmed.all()  # over the trimmed head, a perfect copy always agrees
    assert torch.equal(full, in_vocab)  # ... but not where the target's token was trimmed away
    assert 0 < int(in_vocab.sum()) < 200


def test_lr_decays_with_whichever_budget_runs_out_first():
    from draftlab.distill.worker import lr_factor

    assert lr_factor(4, warmup=10, total=100) == 0.5  # warm-up
    assert lr_factor(10, warmup=10, total=100) == 1.0
    assert abs(lr_factor(55, warmup=10, total=100) - 0.55) < 1e-9  # half the steps: halfway down the cosine
    # epochs far beyond what a time budget allows: the clock drives the decay instead
    assert abs(lr_factor(55, warmup=10, total=10**6, time_used=0.5) - 0.55) < 1e-9
    assert lr_factor(56, warmup=10, total=10**6, time_used=1.0) == 0.1


def test_shared_teacher_loss_equals_per_node_reference():
    """`loss_and_backward` sorts nodes by predicted position and runs each teacher's head pass
    once; loss, per-depth statistics and gradients must equal the plain per-node objective."""
    from draftlab.config import TargetSpec
    from draftlab.distill.batching import collate
    from draftlab.distill.objective import (
        CHUNK_NODES,
        DistillModule,
        gather_states,
        loss_and_backward,
    )
    from draftlab.distill.worker import teacher_states
    from draftlab.models.target import load_target

    tiny = load_target(TargetSpec(name="tiny-llama", dtype="float32"))
    g = torch.Generator().manual_seed(1)
    rows = [{"input_ids": torch.randint(3, tiny.vocab_size, (n,), generator=g).tolist(), "prompt_len": 4}
            for n in (90, 140, 60, 200)]  # > CHUNK_NODES loss nodes: sharing crosses chunk edges
    k = 4
    batch = collate(rows, k, 512, True, torch.Generator().manual_seed(2))
    assert int(batch.loss_mask.sum()) > 2 * CHUNK_NODES
    cfg = TrainConfig(ce_weight=0.3, feature_weight=0.1)
    drafter = init_drafter("p-eagle", tiny, k=k, depth=1, seed=0)
    hidden = teacher_states(tiny, batch, drafter.cfg.aux_layers)
    module = DistillModule(drafter)
    params = [p for p in drafter.parameters() if p.requires_grad]

    stats = loss_and_backward(module, drafter, batch, hidden, cfg, k)
    fast = [p.grad.clone() for p in params]
    drafter.zero_grad()

    out = module(batch, hidden)  # the reference: every node its own teacher, one plain backward
    sel = batch.loss_mask
    teacher = gather_states(hidden[..., -out.shape[-1]:], batch.teacher_idx)[sel]
    loss, kl, agree = node_losses(drafter, out[sel], teacher, batch.label[sel], cfg)
    feat = torch.nn.functional.smooth_l1_loss(out[sel].float(), teacher.float(), reduction="none").mean(-1)
    loss = loss + cfg.feature_weight * torch.where(batch.depth[sel] == 0, feat, torch.zeros_like(feat))
    total = loss.sum() / int(sel.sum())
    total.backward()
    ref = float(total.detach())
    assert abs(stats.loss - ref) < 1e-4 * max(1.0, abs(ref))
    depth = batch.depth[sel]
    assert stats.nodes == [int((depth == d).sum()) for d in range(k)]
    assert stats.agree == [int(agree[depth == d].sum()) for d in range(k)]
    for p, f in zip(params, fast, strict=True):
        torch.testing.assert_close(f, p.grad, rtol=1e-4, atol=1e-6)
