"""Mixed precision for the drafter's training compute (`train.autocast`).

Weights and optimizer state stay float32 in every mode; autocast runs the matmuls in a
16-bit type. `auto` picks per device: bf16 where the device computes it natively (CUDA
GPUs from Ampere on: tensor cores, no loss scaling needed; CPUs with AMX or AVX512-BF16),
full float32 elsewhere (a CPU without them emulates bf16: its matmuls run more than an order
of magnitude slower than fp32's). TF32 matmuls are switched on for whatever still runs
in float32 on CUDA (head logits, the optimizer) unless the mode is `none` (strict float32).
`fp16` needs a loss scale: a `torch.amp.GradScaler` comes with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftlab.models.target import cpu_has_fast_bf16


@dataclass(frozen=True)
class Precision:
    """What `train.autocast` means on one device."""

    dtype: torch.dtype | None  # autocast compute type; None = float32 throughout
    tf32: bool  # allow TF32 tensor-core matmuls for float32 (CUDA only)
    loss_scaling: bool  # fp16: scale the loss so small gradients do not flush to zero


def resolve_precision(mode: str, device_type: str, bf16_supported: bool) -> Precision:
    """`train.autocast` on a device: `device_type` ("cpu", "cuda", ...) and whether that
    device computes bf16 natively (`torch.cuda.is_bf16_supported()` for CUDA,
    `cpu_has_fast_bf16()` for CPUs). Pure: it queries no device, so it is testable anywhere."""
    if mode not in ("auto", "none", "bf16", "fp16"):
        raise ValueError(f"train.autocast must be auto, none, bf16 or fp16, got {mode!r}")
    if mode == "auto":
        dtype = torch.bfloat16 if bf16_supported else None
    else:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mode)
    return Precision(
        dtype=dtype,
        tf32=device_type == "cuda" and mode != "none",
        loss_scaling=dtype == torch.float16,
    )


def precision_for(mode: str, device: torch.device) -> Precision:
    """`resolve_precision` for this process's training device (asks CUDA only on CUDA)."""
    bf16 = torch.cuda.is_bf16_supported() if device.type == "cuda" else cpu_has_fast_bf16()
    return resolve_precision(mode, device.type, bf16)


def apply_matmul_precision(precision: Precision) -> None:
    """Switch TF32 matmuls on where `precision` asks (CUDA); a no-op otherwise."""
    if precision.tf32:
        torch.set_float32_matmul_precision("high")  # TF32 for float32 matmuls on Ampere+


def autocast_context(precision: Precision, device: torch.device) -> torch.autocast:
    """The autocast context for drafter compute on `device`."""
    return torch.autocast(device.type, dtype=precision.dtype, enabled=precision.dtype is not None)


def grad_scaler(precision: Precision, device: torch.device) -> torch.amp.GradScaler:
    """A GradScaler, enabled for fp16 only (disabled, its calls pass straight through)."""
    return torch.amp.GradScaler(device.type, enabled=precision.loss_scaling)
