"""The objective: its closed-form loss and gradient, and agreement with a VocabTrim head."""

import datasets
import pytest
import torch

from draftlab.config import TargetSpec, TrainConfig
from draftlab.distill.batching import collate
from draftlab.distill.drafter_setup import frequent_tokens
from draftlab.distill.objective import (
    DistillModule,
    gather_states,
    loss_and_backward,
    node_losses,
    noisy,
    teacher_states,
)
from draftlab.models.drafters.build import init_drafter
from draftlab.models.target import load_target


def test_full_vocab_agreement_counts_trimmed_target_tokens_as_misses(tiny):
    drafter = init_drafter("parallel", tiny, k=2, depth=1, seed=0, vocab_size=16)
    drafter.set_vocab(torch.arange(16))  # keep ids 0..15 only
    teacher = torch.randn(200, tiny.hidden_size, generator=torch.Generator().manual_seed(0)).to(
        tiny.dtype
    )
    out = teacher.clone()  # the drafter reproduces the teacher's state exactly
    label = torch.zeros(200, dtype=torch.long)
    _, _, trimmed, _ = node_losses(drafter, out, teacher, label, TrainConfig())
    _, _, full, _ = node_losses(
        drafter, out, teacher, label, TrainConfig(), full_vocab_agreement=True
    )
    in_vocab = tiny.lm_head(teacher).argmax(-1) < 16  # (N,)
    assert trimmed.all()  # over the trimmed head, a perfect copy always agrees
    assert torch.equal(full, in_vocab)  # ... but not where the target's token was trimmed away
    assert 0 < int(in_vocab.sum()) < 200


def _autograd_reference(drafter, out, teacher, label, cfg, n_total):
    """The objective as autograd sees it: per-node KL(teacher || drafter) over the head's
    vocabulary plus cross-entropy on the data token where the head has it."""
    o = out.clone().requires_grad_()
    q_logp = torch.log_softmax(drafter.head_logits(o), -1)
    p_logp = torch.log_softmax(drafter.head_logits(teacher), -1)
    kl = (p_logp.exp() * (p_logp - q_logp)).sum(-1)
    row = drafter.head_rows(label)
    ce = -q_logp.gather(-1, row.clamp(min=0)[:, None])[:, 0]
    loss = cfg.kl_weight * kl + cfg.ce_weight * torch.where(row >= 0, ce, torch.zeros_like(ce))
    (grad,) = torch.autograd.grad(loss.sum() / n_total, o)
    agree = q_logp.argmax(-1) == p_logp.argmax(-1)
    return loss.detach(), kl.detach(), agree, grad


@pytest.mark.parametrize(
    "compile_loss",
    [False, pytest.param(True, marks=pytest.mark.slow)],  # torch.compile: ~40 s
    ids=["eager", "compiled"],
)
@pytest.mark.parametrize("weights", [(1.0, 0.0), (0.7, 0.5)], ids=["kl", "kl+ce"])
def test_closed_form_loss_and_gradient_equal_autograd(tiny, compile_loss, weights):
    """`node_losses` writes the gradient through the frozen head in closed form (and may
    run compiled): the same loss, KL, agreement and gradient as autograd, a trimmed head's
    missing labels included, for chunks of two sizes (the compiled one goes dynamic)."""
    drafter = init_drafter("parallel", tiny, k=2, depth=1, seed=0, vocab_size=24).float()
    drafter.set_vocab(torch.arange(8, 32))
    cfg = TrainConfig(kl_weight=weights[0], ce_weight=weights[1], compile_loss=compile_loss)
    g = torch.Generator().manual_seed(1)
    for n in (40, 17):
        teacher = torch.randn(n, tiny.hidden_size, generator=g)
        out = teacher + 0.5 * torch.randn(n, tiny.hidden_size, generator=g)
        label = torch.randint(0, 40, (n,), generator=g)  # ids < 8 or >= 32 are not in the head
        assert (drafter.head_rows(label) < 0).any() and (drafter.head_rows(label) >= 0).any()
        loss, kl, agree, grad = node_losses(drafter, out, teacher, label, cfg, n_total=3 * n)
        ref_loss, ref_kl, ref_agree, ref_grad = _autograd_reference(
            drafter, out, teacher, label, cfg, 3 * n
        )
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(kl, ref_kl, rtol=1e-5, atol=1e-6)
        assert torch.equal(agree, ref_agree) and 0 < int(agree.sum()) < n
        torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-7)
        assert float(grad.abs().max()) > 1e-4
    _, _, _, none = node_losses(drafter, out, teacher, label, cfg, backward=False)
    assert none is None


def test_a_training_step_has_the_gradients_of_the_whole_objective_under_autograd(tiny):
    """loss_and_backward (closed-form head gradient per chunk, EAGLE's feature loss by
    autograd, one decoder backward) against one autograd graph over the whole objective:
    the same loss and parameter gradients."""
    cfg = TrainConfig(kl_weight=1.0, ce_weight=0.3, feature_weight=0.5)
    g = torch.Generator().manual_seed(2)
    rows = [
        {"input_ids": torch.randint(3, 100, (n,), generator=g).tolist(), "prompt_len": 4}
        for n in (21, 15)
    ]
    batch = collate(rows, 3, 64, False, None)
    results = []
    for closed_form in (True, False):
        drafter = init_drafter("p-eagle", tiny, k=3, depth=1, seed=0).float().train()
        hidden = teacher_states(tiny, batch, drafter.aux_layers)
        module = DistillModule(drafter)
        if closed_form:
            loss = loss_and_backward(module, drafter, batch, hidden, cfg, 3).loss
        else:
            out = module(batch, hidden)[batch.loss_mask]  # (N, H)
            teacher = gather_states(hidden[..., -out.shape[-1] :], batch.teacher_idx)[
                batch.loss_mask
            ]
            label, depth = batch.label[batch.loss_mask], batch.depth[batch.loss_mask]
            q_logp = torch.log_softmax(drafter.head_logits(out), -1)
            p_logp = torch.log_softmax(drafter.head_logits(teacher), -1)
            ce = -q_logp.gather(-1, drafter.head_rows(label)[:, None])[:, 0]
            feat = torch.nn.functional.smooth_l1_loss(out, teacher, reduction="none").mean(-1)
            per_node = (
                (p_logp.exp() * (p_logp - q_logp)).sum(-1)
                + 0.3 * ce
                + 0.5 * torch.where(depth == 0, feat, 0.0)
            )
            total = per_node.mean()
            total.backward()
            loss = float(total)
        results.append(
            (loss, {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None})
        )
    (loss1, g1), (loss2, g2) = results
    assert loss1 == pytest.approx(loss2, rel=1e-5)
    assert g1.keys() == g2.keys() and len(g1) > 3
    for n in g1:
        torch.testing.assert_close(
            g1[n],
            g2[n],
            rtol=1e-4,
            atol=1e-6 * float(g2[n].abs().max()),
            msg=lambda m, n=n: f"{n}: {m}",
        )


def test_lr_decays_with_whichever_budget_runs_out_first():
    from draftlab.distill.worker import lr_factor

    assert lr_factor(4, warmup=10, total=100) == 0.5  # warm-up
    assert lr_factor(10, warmup=10, total=100) == 1.0
    assert (
        abs(lr_factor(55, warmup=10, total=100) - 0.55) < 1e-9
    )  # half the steps: halfway down the cosine
    # epochs far beyond what a time budget allows: the clock drives the decay instead
    assert abs(lr_factor(55, warmup=10, total=10**6, time_used=0.5) - 0.55) < 1e-9
    assert lr_factor(56, warmup=10, total=10**6, time_used=1.0) == 0.1


def test_vocab_trim_takes_response_tokens_then_prompt_tokens_then_low_ids():
    rows = {
        # prompt | response: responses use 7 (x3), 9 (x2) and 30 (x1); prompts 12 (x2), 40 (x1)
        "input_ids": [[12, 40, 7, 7, 9], [12, 7, 9, 30]],
        "prompt_len": [2, 1],
    }
    train = datasets.Dataset.from_dict(rows)
    eos = frozenset({2})
    assert frequent_tokens(train, 4, 64, eos).tolist() == [
        2,
        7,
        9,
        30,
    ]  # EOS always, then responses
    # every response token is in: spare slots go to prompt tokens by count, then to the lowest ids
    assert frequent_tokens(train, 6, 64, eos).tolist() == [2, 7, 9, 12, 30, 40]
    assert frequent_tokens(train, 8, 64, eos).tolist() == [0, 1, 2, 7, 9, 12, 30, 40]


def test_feature_noise_is_relative_per_state_and_only_in_training():
    # two concatenated states of very different scales: each gets noise of its own RMS
    g = torch.Generator().manual_seed(0)
    states = torch.cat(
        [torch.randn(4000, 8, generator=g) * 100.0, torch.randn(4000, 8, generator=g) * 0.01], -1
    )
    torch.manual_seed(0)
    delta = noisy(states, 8, 0.1) - states  # (4000, 16)
    assert abs(float(delta[:, :8].std()) - 10.0) < 0.5  # 0.1 x RMS 100
    assert abs(float(delta[:, 8:].std()) - 0.001) < 0.00005  # 0.1 x RMS 0.01

    target = load_target(TargetSpec(name="tiny-llama", dtype="float32"))
    drafter = init_drafter("p-eagle", target, k=2, depth=1, seed=0)
    rows = [
        {
            "input_ids": torch.randint(3, target.vocab_size, (30,), generator=g).tolist(),
            "prompt_len": 4,
        }
    ]
    batch = collate(rows, 2, 512, False, None)
    hidden = teacher_states(target, batch, drafter.aux_layers)
    clean, noised = DistillModule(drafter), DistillModule(drafter, feature_noise=0.2)
    with torch.no_grad():
        assert torch.equal(
            noised.eval()(batch, hidden), clean.eval()(batch, hidden)
        )  # evaluation: no noise
        assert not torch.allclose(noised.train()(batch, hidden), clean.train()(batch, hidden))
    stats = loss_and_backward(
        noised.train(), drafter, batch, hidden, TrainConfig(feature_noise=0.2), 2
    )
    assert stats.loss > 0 and all(p.grad is not None for p in drafter.fc.parameters())
