"""Benchmark prompt files: JSON lines of `{"prompt": ...}` or Spec-Bench questions
(`{"question_id": .., "category": .., "turns": [..]}`, first turn used)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PROMPTS = Path(__file__).parent / "prompt_sets" / "default.jsonl"


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    category: str = "default"


def _parse(row: object, where: str) -> Prompt:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if "prompt" in row:
        text = row["prompt"]
    elif "turns" in row:
        turns = row["turns"]
        if not isinstance(turns, list) or not turns:
            raise ValueError(f"{where}: 'turns' must be a non-empty list of strings")
        text = turns[0]
    else:
        raise ValueError(f"{where}: needs a 'prompt' field or Spec-Bench 'turns' (keys found: {sorted(row)})")
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{where}: the prompt text must be a non-empty string")
    category = row.get("category", "default")
    pid = row.get("question_id", row.get("id", where))
    return Prompt(id=str(pid), text=text, category=str(category))


def load_prompts(path: str | Path | None = None, limit: int | None = None) -> list[Prompt]:
    """Read a prompt file (None = the packaged default set); errors name file and line."""
    path = Path(path) if path else DEFAULT_PROMPTS
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    prompts = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not valid JSON ({e.msg})") from None
        prompts.append(_parse(row, f"{path}:{i}"))
        if limit and len(prompts) >= limit:
            break
    if not prompts:
        raise ValueError(f"{path}: no prompts found")
    return prompts
