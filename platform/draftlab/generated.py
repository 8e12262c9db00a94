"""Files generated from the code (`draftlab generate`): rewrite the stale ones, or list them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path


def sync(root: str | Path, renders: Mapping[str, Callable[[], str]], check: bool) -> list[str]:
    """For each `relative path -> render()`, rewrite the file under `root` when its text
    differs; returns the paths that differed. `check=True` writes nothing."""
    changed = []
    for rel, render in renders.items():
        path, text = Path(root) / rel, render()
        if path.is_file() and path.read_text() == text:
            continue
        changed.append(rel)
        if not check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    return changed
