"""Drafters built and loaded: a new one of a family, a saved one from its directory.

Importing this module imports the built-in families (`autoregressive`, `parallel`,
`p-eagle`), which registers them (`registry.py`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from draftlab.models.drafters import autoregressive, p_eagle, parallel  # noqa: F401 (registration)
from draftlab.models.drafters.network import DrafterConfig, DrafterNet, decoder_config
from draftlab.models.drafters.registry import drafter_class
from draftlab.models.target import Target
from draftlab.storage import local_copy


def init_drafter(
    family: str,
    target: Target,
    k: int = 4,
    depth: int = 1,
    seed: int = 0,
    vocab_size: int | None = None,
    aux_layers: list[int] | None = None,
) -> DrafterNet:
    """A freshly initialised (untrained) drafter of `family` for `target` (`aux_layers`:
    None = the family's default)."""
    cls = drafter_class(family)
    if k < 1 or depth < 1:
        raise ValueError(f"k and depth must be >= 1 (got k={k}, depth={depth})")
    cfg = DrafterConfig(
        family=family,
        k=k,
        depth=depth,
        target_name=target.name,
        target_fingerprint=target.fingerprint,
        decoder=decoder_config(target, depth),
        vocab_size=vocab_size,
        aux_layers=aux_layers,
    )
    cfg = cls.configure(cfg, target)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return cls(cfg, target).eval()


def load_drafter(path: str | Path, target: Target) -> DrafterNet:
    """Load a saved drafter (a directory, or a URI such as s3://... read through its local
    mirror); fails clearly if it was built for another target."""
    path = local_copy(path)
    cfg_file, weights = path / "config.json", path / "model.safetensors"
    if not cfg_file.is_file() or not weights.is_file():
        raise FileNotFoundError(
            f"{path} is not a drafter directory (needs config.json and model.safetensors)"
        )
    cfg = DrafterConfig.model_validate_json(cfg_file.read_text())
    if cfg.target_fingerprint != target.fingerprint:
        raise ValueError(
            f"drafter {path} was built for target {cfg.target_name!r} (fingerprint "
            f"{cfg.target_fingerprint}), but the loaded target is {target.name!r} (fingerprint "
            f"{target.fingerprint}). Load it with its own target or train a new drafter."
        )
    model = drafter_class(cfg.family)(cfg, target)
    state = load_file(str(weights), device=str(target.device))
    state.pop("_head_weight", None)  # the target's own head, saved by older versions: never loaded
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"{weights}: weights do not match the config (missing={missing}, "
            f"unexpected={unexpected})"
        )
    model.refresh_head()
    return model.to(target.dtype).eval()


def resolve_drafter(
    spec: str, target: Target, k: int = 4, depth: int = 1, seed: int = 0
) -> DrafterNet:
    """`init:<family>` builds an untrained drafter; anything else is a saved drafter dir."""
    if spec.startswith("init:"):
        return init_drafter(spec.removeprefix("init:"), target, k=k, depth=depth, seed=seed)
    return load_drafter(spec, target)
