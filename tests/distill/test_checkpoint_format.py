"""Optimizer state in checkpoints is keyed by the drafter's parameter names (so a run saved
under DDP resumes under FSDP and back); checkpoints keyed by optimizer index (before names)
still resume."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from draftlab.distill.checkpoint import load_checkpoint, save_checkpoint
from draftlab.models.drafters.build import init_drafter


def _adamw(drafter):
    return torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-3)


def _stepped(tiny):
    drafter = init_drafter("parallel", tiny, k=3, depth=2, seed=0).float().train()
    opt = _adamw(drafter)
    for i, p in enumerate(p for p in drafter.parameters() if p.requires_grad):
        p.grad = torch.full_like(p, 1e-3 * (i + 1))  # a different moment per parameter
    opt.step()
    return drafter, opt


def _moments(drafter, opt) -> dict[str, torch.Tensor]:
    return {n: opt.state[p]["exp_avg"] for n, p in drafter.named_parameters() if p in opt.state}


def test_optimizer_state_is_saved_by_parameter_name_and_restored(tiny, tmp_path):
    drafter, opt = _stepped(tiny)
    path = save_checkpoint(tmp_path / "ckpt", drafter, opt, {"step": 1})
    keys = load_file(str(path / "optimizer.safetensors")).keys()
    names = {n for n, p in drafter.named_parameters() if p.requires_grad}
    assert {k.split("/")[0] for k in keys} == names
    loaded, opt2, state = load_checkpoint(path, tiny, _adamw)
    want, got = _moments(drafter, opt), _moments(loaded, opt2)
    assert state == {"step": 1} and want.keys() == got.keys() == names
    assert all(torch.equal(want[n], got[n]) for n in want)


def test_index_keyed_checkpoints_from_before_still_resume(tiny, tmp_path):
    drafter, opt = _stepped(tiny)
    path = save_checkpoint(
        tmp_path / "old", drafter, opt.state_dict(), {"step": 1}
    )  # {0: ..., 1: ...}
    assert all(k.split("/")[0].isdigit() for k in load_file(str(path / "optimizer.safetensors")))
    loaded, opt2, _ = load_checkpoint(path, tiny, _adamw)
    want, got = _moments(drafter, opt), _moments(loaded, opt2)
    assert want.keys() == got.keys() and all(torch.equal(want[n], got[n]) for n in want)
