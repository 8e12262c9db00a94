"""Benchmark prompt files: JSON lines of `{"prompt": ...}`, a multi-turn chat
`{"messages": [{"role": "user", "content": ..}, {"role": "assistant", ..}, ..]}` (OpenAI
format, ending with a user turn), or Spec-Bench questions (`{"question_id": .., "category":
.., "turns": [..]}`, first turn used). Packaged sets: `default` (12 short prompts, 12
categories) and `heldout` (long summaries and RAG contexts, translation, math, QA,
multi-turn chat: prompts of other kinds and lengths than anything drafters are tuned on)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

PROMPT_SETS = Path(__file__).parent / "prompt_sets"
DEFAULT_PROMPTS = PROMPT_SETS / "default.jsonl"
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str  # the last user turn
    category: str = "default"
    turns: tuple[tuple[str, str], ...] = ()  # (role, content) of a multi-turn chat, the last a user turn

    @property
    def messages(self) -> list[dict]:
        """The chat as OpenAI messages (one user turn for a plain prompt)."""
        return [{"role": r, "content": c} for r, c in self.turns] or [{"role": "user", "content": self.text}]


def _messages(value: object, where: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    turns = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: messages[{i}] must be {{'role': one of {list(ROLES)}, 'content': str}}")
        turns.append((m["role"], m["content"]))
    if turns[-1][0] != "user":
        raise ValueError(f"{where}: the last message must be a user turn (the one to answer)")
    return tuple(turns)


def _parse(row: object, where: str) -> Prompt:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    chat: tuple[tuple[str, str], ...] = ()
    if "prompt" in row:
        text = row["prompt"]
    elif "messages" in row:
        chat = _messages(row["messages"], where)
        text = chat[-1][1]
    elif "turns" in row:
        turns = row["turns"]
        if not isinstance(turns, list) or not turns:
            raise ValueError(f"{where}: 'turns' must be a non-empty list of strings")
        text = turns[0]
    else:
        raise ValueError(f"{where}: needs a 'prompt', chat 'messages' or Spec-Bench 'turns' (keys found: {sorted(row)})")
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{where}: the prompt text must be a non-empty string")
    category = row.get("category", "default")
    pid = row.get("question_id", row.get("id", where))
    return Prompt(id=str(pid), text=text, category=str(category), turns=chat)


def available_prompt_sets() -> list[str]:
    return sorted(p.stem for p in PROMPT_SETS.glob("*.jsonl"))


def load_prompts(path: str | Path | None = None, limit: int | None = None) -> list[Prompt]:
    """Read a prompt file or a packaged set by name (None = `default`); errors name file and line."""
    path = Path(path) if path else DEFAULT_PROMPTS
    if not path.is_file() and (PROMPT_SETS / f"{path}.jsonl").is_file():
        path = PROMPT_SETS / f"{path}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path} (packaged sets: {', '.join(available_prompt_sets())})")
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
