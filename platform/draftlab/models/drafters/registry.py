"""Drafter families by name: what each trains on and reads, and the class that implements it.

A leaf: configs check family names and facts here without importing torch or any family
module. The classes register themselves with `@register_drafter("name")` when their module
is imported; `draftlab.models.drafters.build` imports the built-in ones. A new family
declares its facts where it registers: `@register_drafter("mine", Family(trains_groups=True))`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    trains_groups: bool = False
    """True: trained on packed parallel groups of depth K (mask tokens); False: K = 1 (EAGLE)."""
    uses_aux_features: bool = False
    """True: fuses the target's states at several layers (the data cache keeps them)."""


_FAMILIES: dict[str, Family] = {
    "autoregressive": Family(),
    "parallel": Family(trains_groups=True),
    "p-eagle": Family(trains_groups=True, uses_aux_features=True),
}
_CLASSES: dict[str, type] = {}


def register_drafter(name: str, family: Family | None = None) -> Callable[[type], type]:
    """Register the decorated class as family `name`; it gets the family's facts as class
    attributes (`family`, `trains_groups`, `uses_aux_features`)."""
    facts = family or _FAMILIES.get(name)
    if facts is None:
        raise ValueError(
            f"drafter family {name!r} is new: declare it with register_drafter({name!r}, "
            "Family(...))"
        )

    def deco(cls: type) -> type:
        if name in _CLASSES and _CLASSES[name] is not cls:
            raise ValueError(
                f"drafter family {name!r} is already registered by {_CLASSES[name].__name__}"
            )
        _FAMILIES[name], _CLASSES[name] = facts, cls
        cls.family, cls.trains_groups, cls.uses_aux_features = (
            name,
            facts.trains_groups,
            facts.uses_aux_features,
        )
        return cls

    return deco


def available_drafters() -> list[str]:
    return sorted(_FAMILIES)


def family(name: str) -> Family:
    """The facts of family `name`; a KeyError lists the known families."""
    try:
        return _FAMILIES[name]
    except KeyError:
        raise KeyError(
            f"unknown drafter family {name!r}; available: {available_drafters()}"
        ) from None


def drafter_class(name: str) -> type:
    """The class of family `name` (its module imported: `draftlab.models.drafters.build`
    imports the built-in ones)."""
    family(name)
    try:
        return _CLASSES[name]
    except KeyError:
        raise KeyError(
            f"drafter family {name!r} has no class registered: import its module first"
        ) from None
