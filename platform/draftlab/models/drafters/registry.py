"""Drafter families by name. `@register_drafter("name")` adds one; errors list what exists."""

from __future__ import annotations

from collections.abc import Callable

_DRAFTERS: dict[str, type] = {}


def register_drafter(name: str) -> Callable[[type], type]:
    def deco(cls: type) -> type:
        if name in _DRAFTERS and _DRAFTERS[name] is not cls:
            raise ValueError(f"drafter family {name!r} is already registered by {_DRAFTERS[name].__name__}")
        _DRAFTERS[name] = cls
        cls.family = name
        return cls

    return deco


def _load_builtin() -> None:
    # Importing the family modules registers them; done lazily so nothing runs at import.
    from draftlab.models.drafters import autoregressive, p_eagle, parallel  # noqa: F401


def available_drafters() -> list[str]:
    _load_builtin()
    return sorted(_DRAFTERS)


def drafter_class(name: str) -> type:
    _load_builtin()
    try:
        return _DRAFTERS[name]
    except KeyError:
        raise KeyError(f"unknown drafter family {name!r}; available: {available_drafters()}") from None
