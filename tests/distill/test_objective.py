"""Agreement metrics of the objective with a VocabTrim head."""

import datasets
import torch

from draftlab.config import TargetSpec, TrainConfig
from draftlab.distill.batching import collate
from draftlab.distill.objective import DistillModule, loss_and_backward, node_losses, noisy
from draftlab.distill.worker import frequent_tokens, teacher_states
from draftlab.models.drafters import init_drafter
from draftlab.models.target import load_target


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



def test_vocab_trim_takes_response_tokens_then_prompt_tokens_then_low_ids():
    rows = {
        # prompt | response: responses use 7 (x3), 9 (x2) and 30 (x1); prompts 12 (x2), 40 (x1)
        "input_ids": [[12, 40, 7, 7, 9], [12, 7, 9, 30]],
        "prompt_len": [2, 1],
    }
    train = datasets.Dataset.from_dict(rows)
    eos = frozenset({2})
    assert frequent_tokens(train, 4, 64, eos).tolist() == [2, 7, 9, 30]  # EOS always, then responses
    # every response token is in: spare slots go to prompt tokens by count, then to the lowest ids
    assert frequent_tokens(train, 6, 64, eos).tolist() == [2, 7, 9, 12, 30, 40]
    assert frequent_tokens(train, 8, 64, eos).tolist() == [0, 1, 2, 7, 9, 12, 30, 40]


def test_feature_noise_is_relative_per_state_and_only_in_training():
    # two concatenated states of very different scales: each gets noise of its own RMS
    g = torch.Generator().manual_seed(0)
    states = torch.cat([torch.randn(4000, 8, generator=g) * 100.0, torch.randn(4000, 8, generator=g) * 0.01], -1)
    torch.manual_seed(0)
    delta = noisy(states, 8, 0.1) - states  # (4000, 16)
    assert abs(float(delta[:, :8].std()) - 10.0) < 0.5  # 0.1 x RMS 100
    assert abs(float(delta[:, 8:].std()) - 0.001) < 0.00005  # 0.1 x RMS 0.01

    target = load_target(TargetSpec(name="tiny-llama", dtype="float32"))
    drafter = init_drafter("p-eagle", target, k=2, depth=1, seed=0)
    rows = [{"input_ids": torch.randint(3, target.vocab_size, (30,), generator=g).tolist(), "prompt_len": 4}]
    batch = collate(rows, 2, 512, False, None)
    hidden = teacher_states(target, batch, drafter.aux_layers)
    clean, noised = DistillModule(drafter), DistillModule(drafter, feature_noise=0.2)
    with torch.no_grad():
        assert torch.equal(noised.eval()(batch, hidden), clean.eval()(batch, hidden))  # evaluation: no noise
        assert not torch.allclose(noised.train()(batch, hidden), clean.train()(batch, hidden))
    stats = loss_and_backward(noised.train(), drafter, batch, hidden, TrainConfig(feature_noise=0.2), 2)
    assert stats.loss > 0 and all(p.grad is not None for p in drafter.fc.parameters())
