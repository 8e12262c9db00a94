"""Training checkpoints: drafter + optimizer + trainer state, safetensors only (no pickle).

Layout of a checkpoint directory:
    drafter/config.json, drafter/model.safetensors   the drafter (loadable as is)
    optimizer.safetensors                             optimizer tensors, keys "<param>/<name>"
                                                      (<param>: the drafter's parameter name;
                                                      older checkpoints: its index)
    state.json                                        step, data position, optimizer scalars,
                                                      undelivered MLflow metrics
    MANIFEST.json                                     size and sha256 of every file above

Saves are atomic: everything is written into a hidden `.<name>.partial-*` sibling, each file
fsynced, MANIFEST.json last, and one rename publishes the directory. A save killed at any
point leaves no `<name>` (only a partial sibling, never loaded) or the complete checkpoint.
Loading verifies the manifest first, so a checkpoint damaged later (a partial upload, a
truncated copy) is refused with a `CheckpointError` naming the file, never loaded;
`restore_checkpoint` then falls back to the run's newest older checkpoint that verifies.

Under FSDP the files hold full (gathered) tensors, as for DDP: every rank gathers them
(`distill.sharding`) and rank 0 passes them to `save_checkpoint`; on load each rank keeps
its shard. A checkpoint saved under either strategy resumes under the other.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import posixpath
import shutil
import tempfile
from pathlib import Path

import ray.train
import torch
from pyarrow.fs import FileSelector, FileType
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from draftlab.distill.sharding import load_optimizer_state, optimizer_state
from draftlab.errors import DraftlabError
from draftlab.models.drafters.build import load_drafter
from draftlab.models.drafters.network import DrafterNet
from draftlab.models.target import Target

FILES = ("drafter/config.json", "drafter/model.safetensors", "optimizer.safetensors", "state.json")
MANIFEST = "MANIFEST.json"

logger = logging.getLogger(__name__)


class CheckpointError(DraftlabError):
    """A checkpoint is incomplete or corrupt."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    """Flush a file's (or a directory's entries') data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_drafter(path: Path, drafter: DrafterNet, weights: dict[str, torch.Tensor] | None) -> None:
    """`drafter.save(path)`, or its config with `weights` (the gathered full state under FSDP)."""
    if weights is None:
        drafter.save(path)
        return
    path.mkdir(parents=True)
    save_file(
        {n: t.detach().to("cpu").contiguous() for n, t in weights.items()},
        str(path / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (path / "config.json").write_text(json.dumps(drafter.cfg.model_dump(), indent=2) + "\n")


def save_checkpoint(
    path: str | Path,
    drafter: DrafterNet,
    optimizer: torch.optim.Optimizer | dict,
    state: dict,
    weights: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write a checkpoint to `path` (absent or an empty directory) atomically; returns `path`.

    `optimizer`: the optimizer, or its gathered state (`sharding.optimizer_state`);
    `weights`: the drafter's gathered state (`sharding.full_weights`) when it is sharded."""
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise CheckpointError(f"checkpoint {path} already exists; refusing to overwrite it")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.partial-", dir=path.parent))
    try:
        _save_drafter(tmp / "drafter", drafter, weights)
        opt = optimizer if isinstance(optimizer, dict) else optimizer_state(drafter, optimizer)
        tensors, scalars = {}, {}
        for pid, pstate in opt["state"].items():
            for key, val in pstate.items():
                if isinstance(val, torch.Tensor):
                    tensors[f"{pid}/{key}"] = val.detach().to("cpu").contiguous()
                else:
                    scalars[f"{pid}/{key}"] = val
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        doc = {"trainer": state, "param_groups": opt["param_groups"], "optimizer_scalars": scalars}
        (tmp / "state.json").write_text(json.dumps(doc, indent=2))
        for f in FILES:
            _fsync(tmp / f)
        manifest = {
            "files": {
                f: {"bytes": (tmp / f).stat().st_size, "sha256": _sha256(tmp / f)} for f in FILES
            }
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))  # last: marks completeness
        for p in (tmp / MANIFEST, tmp / "drafter", tmp):
            _fsync(p)
        os.replace(tmp, path)  # the publish: atomic, and allowed onto an empty directory
        _fsync(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def verify_checkpoint(path: str | Path) -> None:
    """Raise `CheckpointError` naming the problem unless `path` is a complete checkpoint."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist (a save that never completed?)")
    man = path / MANIFEST
    if not man.is_file():
        raise CheckpointError(
            f"checkpoint {path} has no {MANIFEST} (incomplete save); refusing to load it"
        )
    try:
        doc = json.loads(man.read_text())
        # {"files": {name: {"bytes", "sha256"}}}; checkpoints from before sizes were recorded:
        # {name: sha256}
        expected = {
            f: (e if isinstance(e, dict) else {"sha256": e})
            for f, e in doc.get("files", doc).items()
        }
    except (ValueError, AttributeError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"checkpoint {path}: {MANIFEST} is unreadable ({e}); refusing to load it"
        ) from None
    for f in FILES:
        file, want = path / f, expected.get(f)
        if want is None:
            raise CheckpointError(f"checkpoint {path}: {MANIFEST} does not list {f}")
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path}: {f} is missing")
        size = file.stat().st_size
        if "bytes" in want and size != want["bytes"]:
            raise CheckpointError(
                f"checkpoint {path}: {f} is truncated or padded ({size} bytes, manifest says "
                f"{want['bytes']})"
            )
        if _sha256(file) != want.get("sha256"):
            raise CheckpointError(
                f"checkpoint {path}: {f} does not match its sha256 in {MANIFEST} (corrupt)"
            )


def load_checkpoint(
    path: str | Path, target: Target, optimizer_factory
) -> tuple[DrafterNet, torch.optim.Optimizer, dict]:
    """Verify, then load (drafter, optimizer built by `optimizer_factory(drafter)`, trainer state).

    The factory may wrap the drafter first (DDP, or FSDP in place): the saved optimizer state
    is loaded by parameter name into whatever parameters the optimizer holds."""
    path = Path(path)
    verify_checkpoint(path)
    try:
        drafter = load_drafter(path / "drafter", target).float().train()  # float32 master weights
        trainable = [n for n, p in drafter.named_parameters() if p.requires_grad]  # optimizer order
        optimizer = optimizer_factory(drafter)
        doc = json.loads((path / "state.json").read_text())
        tensors = load_file(str(path / "optimizer.safetensors"), device=str(target.device))

        def name(
            pid: str | int,
        ) -> str:  # older checkpoints: the parameter's index in the optimizer
            return trainable[int(pid)] if str(pid).isdigit() else pid

        per_param: dict[str, dict] = {}
        for key, val in list(tensors.items()) + list(doc["optimizer_scalars"].items()):
            pid, item = key.split("/", 1)
            per_param.setdefault(name(pid), {})[item] = val
        groups = [g | {"params": [name(p) for p in g["params"]]} for g in doc["param_groups"]]
        load_optimizer_state(drafter, optimizer, {"state": per_param, "param_groups": groups})
    except (
        SafetensorError,
        ValueError,
        KeyError,
        IndexError,
        RuntimeError,
    ) as e:  # verified but unusable
        raise CheckpointError(f"checkpoint {path} is complete but cannot be loaded: {e}") from e
    return drafter, optimizer, doc["trainer"]


def _older_checkpoints(ckpt: ray.train.Checkpoint) -> list[ray.train.Checkpoint]:
    """The run's other checkpoints older than `ckpt`, newest first (Ray names them
    `checkpoint_<date>`, so names sort by age; newer ones were never committed)."""
    parent, name = posixpath.split(ckpt.path.rstrip("/"))
    try:
        infos = ckpt.filesystem.get_file_info(FileSelector(parent))
    except OSError:
        return []
    older = [
        i.path
        for i in infos
        if i.type == FileType.Directory
        and i.base_name.startswith("checkpoint_")
        and i.base_name < name
    ]
    return [
        ray.train.Checkpoint(path, filesystem=ckpt.filesystem)
        for path in sorted(older, reverse=True)
    ]


def restore_checkpoint(
    ckpt: ray.train.Checkpoint, target: Target, make_optimizer
) -> tuple[DrafterNet, torch.optim.Optimizer, dict]:
    """Load Ray's latest checkpoint; if it fails verification (a partial upload, a damaged
    file), the newest older one of the run that verifies. Never loads an unverified one:
    with none left it raises `CheckpointError` listing what was wrong with each."""
    problems = []
    for candidate in [ckpt, *_older_checkpoints(ckpt)]:
        try:
            with candidate.as_directory() as d:
                loaded = load_checkpoint(d, target, make_optimizer)
        except CheckpointError as e:
            problems.append(str(e))
            logger.warning("skipping unusable checkpoint %s: %s", candidate.path, e)
            continue
        if problems:
            logger.warning(
                "resuming from the older checkpoint %s (newer ones are unusable)", candidate.path
            )
        return loaded
    raise CheckpointError(
        f"no usable checkpoint to resume from (latest: {ckpt.path}): " + " | ".join(problems)
    )
