"""Mixed precision (`train.autocast`): what each mode means per device, the GPU configs'
effective precision, TF32, and fp16 loss scaling through the chunked backward.

CUDA cannot run here: the CUDA cases are resolved from arguments (`resolve_precision`
takes the device type and whether it supports bf16), never by querying a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draftlab.config import DistillConfig, TrainConfig, load_yaml
from draftlab.distill.batching import collate
from draftlab.distill.objective import DistillModule, loss_and_backward, teacher_states
from draftlab.distill.precision import apply_matmul_precision, resolve_precision
from draftlab.models.drafters.build import init_drafter

CONFIGS = Path(__file__).resolve().parents[2] / "jobs" / "configs"


@pytest.mark.parametrize(
    ("mode", "device", "bf16_ok", "dtype", "tf32", "scaling"),
    [
        ("auto", "cuda", True, torch.bfloat16, True, False),  # Ampere+ GPU
        ("auto", "cuda", False, None, True, False),  # older GPU: fp32 (TF32 is a no-op there)
        ("auto", "cpu", False, None, False, False),
        ("auto", "cpu", True, torch.bfloat16, False, False),  # AMX / AVX512-BF16 CPUs
        ("bf16", "cpu", False, torch.bfloat16, False, False),  # explicit: even where emulated
        ("bf16", "cuda", True, torch.bfloat16, True, False),
        ("fp16", "cuda", True, torch.float16, True, True),
        ("none", "cuda", True, None, False, False),  # strict fp32: no TF32 either
    ],
)
def test_resolution_per_device(mode, device, bf16_ok, dtype, tf32, scaling):
    p = resolve_precision(mode, device, bf16_ok)
    assert (p.dtype, p.tf32, p.loss_scaling) == (dtype, tf32, scaling)


def test_default_is_auto_and_the_gpu_config_trains_in_bf16():
    assert TrainConfig().autocast == "auto"
    gpu = load_yaml(DistillConfig, CONFIGS / "llama3-8b-parallel-k5-2x8gpu.yaml")
    assert gpu.target.device == "cuda" and gpu.scaling.use_gpu
    assert resolve_precision(gpu.train.autocast, "cuda", True).dtype == torch.bfloat16
    cpu = load_yaml(DistillConfig, CONFIGS / "smollm2-135m-parallel-k4.yaml")
    assert resolve_precision(cpu.train.autocast, "cpu", True).dtype == torch.bfloat16
    assert resolve_precision(cpu.train.autocast, "cpu", False).dtype is None  # no emulated bf16


def test_tf32_only_where_resolved_for_cuda():
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        apply_matmul_precision(resolve_precision("auto", "cpu", False))
        assert torch.get_float32_matmul_precision() == "highest"
        apply_matmul_precision(
            resolve_precision("auto", "cuda", True)
        )  # a global flag: settable without a GPU
        assert (
            torch.get_float32_matmul_precision() == "high" and torch.backends.cuda.matmul.allow_tf32
        )
    finally:
        torch.set_float32_matmul_precision(before)


def test_grad_scaler_scales_the_chunked_backward_and_unscales_exactly(tiny):
    """fp16's GradScaler reaches the drafter's gradients through the detached, chunked loss
    (float32 math here, a power-of-two scale: exact)."""
    rows = [{"input_ids": list(range(4, 4 + n)), "prompt_len": 3} for n in (11, 8)]
    batch = collate(rows, 3, 64, False, None)
    grads, stats = [], []
    for scaler in (None, torch.amp.GradScaler("cpu", init_scale=1024.0)):
        drafter = init_drafter("parallel", tiny, k=3, depth=1, seed=0).float().train()
        opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad])
        feats = teacher_states(tiny, batch)
        stats.append(
            loss_and_backward(
                DistillModule(drafter), drafter, batch, feats, TrainConfig(), 3, scaler=scaler
            )
        )
        scaled = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
        if scaler is not None:
            scaler.unscale_(opt)
        grads.append(
            (
                scaled,
                {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None},
            )
        )
    (plain, _), (scaled, unscaled) = grads
    assert stats[0].loss == stats[1].loss  # the reported loss is never the scaled one
    assert all(torch.equal(scaled[n], 1024.0 * plain[n]) for n in plain)
    assert all(torch.equal(unscaled[n], plain[n]) for n in plain)
