"""Training checkpoints: drafter + optimizer + trainer state, safetensors only (no pickle).

Layout of a checkpoint directory:
    drafter/config.json, drafter/model.safetensors   the drafter (loadable as is)
    optimizer.safetensors                             optimizer tensors, keys "<param>/<name>"
    state.json                                        step, data position, optimizer scalars
    MANIFEST.json                                     sha256 of every file above, written last
A checkpoint without a manifest, or whose files do not match it, is refused: a save that
was killed half-way can never be loaded.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from draftlab.models.drafters.network import DrafterNet, load_drafter
from draftlab.models.target import Target

FILES = ("drafter/config.json", "drafter/model.safetensors", "optimizer.safetensors", "state.json")


class CheckpointError(RuntimeError):
    """A checkpoint is incomplete or corrupt."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def save_checkpoint(path: str | Path, drafter: DrafterNet, optimizer: torch.optim.Optimizer, state: dict) -> Path:
    path = Path(path)
    drafter.save(path / "drafter")
    opt = optimizer.state_dict()
    tensors, scalars = {}, {}
    for pid, pstate in opt["state"].items():
        for key, val in pstate.items():
            if isinstance(val, torch.Tensor):
                tensors[f"{pid}/{key}"] = val.detach().to("cpu").contiguous()
            else:
                scalars[f"{pid}/{key}"] = val
    save_file(tensors, str(path / "optimizer.safetensors"))
    doc = {"trainer": state, "param_groups": opt["param_groups"], "optimizer_scalars": scalars}
    (path / "state.json").write_text(json.dumps(doc, indent=2))
    manifest = {f: _sha256(path / f) for f in FILES}
    (path / "MANIFEST.json").write_text(json.dumps(manifest, indent=2))  # last: marks completeness
    return path


def verify_checkpoint(path: str | Path) -> None:
    path = Path(path)
    man = path / "MANIFEST.json"
    if not man.is_file():
        raise CheckpointError(f"checkpoint {path} has no MANIFEST.json (incomplete save); refusing to load it")
    expected = json.loads(man.read_text())
    for f in FILES:
        if not (path / f).is_file() or _sha256(path / f) != expected.get(f):
            raise CheckpointError(f"checkpoint {path}: {f} is missing or does not match its manifest")


def load_checkpoint(path: str | Path, target: Target, optimizer_factory) -> tuple[DrafterNet, torch.optim.Optimizer, dict]:
    """Verify, then load (drafter, optimizer built by `optimizer_factory(drafter)`, trainer state)."""
    path = Path(path)
    verify_checkpoint(path)
    drafter = load_drafter(path / "drafter", target).float().train()  # float32 master weights
    optimizer = optimizer_factory(drafter)
    doc = json.loads((path / "state.json").read_text())
    tensors = load_file(str(path / "optimizer.safetensors"), device=str(target.device))
    per_param: dict[int, dict] = {}
    for key, val in list(tensors.items()) + list(doc["optimizer_scalars"].items()):
        pid, name = key.split("/", 1)
        per_param.setdefault(int(pid), {})[name] = val
    optimizer.load_state_dict({"state": per_param, "param_groups": doc["param_groups"]})
    return drafter, optimizer, doc["trainer"]
