"""Data-parallel wrapping of the drafter (`scaling.strategy`) and its full state dicts.

* `ddp`: Ray's `prepare_model` (DistributedDataParallel): every worker keeps a replica.
* `fsdp`: FSDP2 (`torch.distributed.fsdp.fully_shard`) on each decoder layer, then on the
  `DistillModule` root (fc, parallel-slot inputs, final norm): parameters, gradients and
  optimizer state become DTensors sharded across the workers (NCCL on GPUs, gloo on CPUs).
  Ray's own `prepare_model(parallel_strategy="fsdp")` is FSDP1 and refuses CPUs.

Sharded or not, the loop reaches the weights through the wrapped model (forward, clipping,
optimizer) or through the helpers below, which gather full tensors (a collective under
FSDP: every rank calls them, rank 0 receives the tensors, on the CPU). They are
`torch.distributed.checkpoint.state_dict`'s, keyed by the drafter's parameter names, so a
checkpoint saved under one strategy resumes under the other.
"""

from __future__ import annotations

import ray.train.torch
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, fully_shard

from draftlab.models.drafters.network import DrafterNet
from draftlab.models.drafters.registry import drafter_class
from draftlab.models.target import Target

_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)  # full tensors, on rank 0's CPU


def wrap_model(module: nn.Module, strategy: str, world: int) -> nn.Module:
    """`module` (a DistillModule) on this worker's device, wrapped for `strategy` when
    `world` > 1; `fsdp` shards it in place (the drafter's parameters become DTensors)."""
    if world == 1 or strategy == "ddp":
        return ray.train.torch.prepare_model(module, parallel_strategy="ddp" if world > 1 else None)
    if strategy != "fsdp":
        raise ValueError(f"scaling.strategy must be ddp or fsdp, got {strategy!r}")
    module = ray.train.torch.prepare_model(module, parallel_strategy=None)  # to the device
    for layer in module.drafter.decoder.layers:  # one all-gather per layer: peak memory = a layer
        fully_shard(layer)
    fully_shard(module)  # the rest (fc, slot inputs, norm) in one group, gathered first
    return module


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def full_weights(drafter: DrafterNet) -> dict[str, torch.Tensor]:
    """The drafter's state dict as full CPU tensors on rank 0 (empty on the other ranks).
    Under FSDP every rank must call it (it all-gathers the shards)."""
    return get_model_state_dict(drafter, options=_GATHER)


def optimizer_state(drafter: DrafterNet, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state dict keyed by the drafter's parameter names, full CPU tensors on
    rank 0 (empty elsewhere). Under FSDP every rank must call it."""
    return get_optimizer_state_dict(drafter, optimizer, options=_GATHER)


def load_optimizer_state(
    drafter: DrafterNet, optimizer: torch.optim.Optimizer, state: dict
) -> None:
    """Load a full, name-keyed optimizer state (`optimizer_state`'s) into `optimizer`, built
    over `drafter`'s (possibly sharded) parameters: each rank keeps its shard."""
    set_optimizer_state_dict(
        drafter, optimizer, state, options=StateDictOptions(full_state_dict=True)
    )


def unsharded_copy(
    drafter: DrafterNet, weights: dict[str, torch.Tensor], target: Target
) -> DrafterNet:
    """A plain float32 drafter like `drafter` holding `weights` (`full_weights`): what rank 0
    exports after FSDP training."""
    copy = drafter_class(drafter.cfg.family)(drafter.cfg, target).float()
    copy.load_state_dict(weights)
    copy.refresh_head()
    return copy.train(drafter.training)
