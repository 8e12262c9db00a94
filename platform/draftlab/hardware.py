"""Facts about the device a measurement ran on, and timing helpers."""

from __future__ import annotations

import os
import platform as std_platform  # the stdlib module (our source root has no __init__.py)

import torch


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    cpu = std_platform.processor() or std_platform.machine()
    return f"cpu: {cpu}, {torch.get_num_threads()} threads ({os.cpu_count()} cores)"


def sync(device: torch.device) -> None:
    """Wait for queued kernels so wall-clock timings are real on CUDA."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
