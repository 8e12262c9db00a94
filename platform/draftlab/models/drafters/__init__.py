"""Drafter families (one per file) behind a registry; see `network.py` for the shared net."""

from draftlab.models.drafters.network import (
    DrafterConfig,
    DrafterNet,
    DraftState,
    init_drafter,
    load_drafter,
    resolve_drafter,
)
from draftlab.models.drafters.registry import available_drafters, drafter_class, register_drafter

__all__ = [
    "DraftState",
    "DrafterConfig",
    "DrafterNet",
    "available_drafters",
    "drafter_class",
    "init_drafter",
    "load_drafter",
    "register_drafter",
    "resolve_drafter",
]
