"""Benchmark prompt files: JSON lines of `{"prompt": ...}`, a multi-turn chat
`{"messages": [{"role": "user", "content": ..}, {"role": "assistant", ..}, ..]}` (OpenAI
format, ending with a user turn), or Spec-Bench questions (`{"question_id": .., "category":
.., "turns": [..]}`, first turn used), or the same rows from a `datasets` source
(`datasets:<name or local file/dir>[:<split>]`, e.g. `datasets:./traffic.parquet:train`).
Packaged sets: `default` (12 short prompts, 12 categories), `heldout` (long summaries and RAG
contexts, translation, math, QA, multi-turn chat: prompts of other kinds and lengths than
anything drafters are tuned on) and `mixed` (both, one prompt of each kind in turn: the
pipeline's default traffic)."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

PROMPT_SETS = Path(__file__).parent / "prompt_sets"
DEFAULT_PROMPTS = PROMPT_SETS / "default.jsonl"
MIXED = ("default", "heldout")  # the packaged `mixed` set: these sets, in turn
DATASETS = "datasets:"
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str  # the last user turn
    category: str = "default"
    turns: tuple[
        tuple[str, str], ...
    ] = ()  # (role, content) of a multi-turn chat, the last a user turn

    @property
    def messages(self) -> list[dict]:
        """The chat as OpenAI messages (one user turn for a plain prompt)."""
        return [{"role": r, "content": c} for r, c in self.turns] or [
            {"role": "user", "content": self.text}
        ]


def _messages(value: object, where: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise ValueError(
            f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects"
        )
    turns = []
    for i, m in enumerate(value):
        if (
            not isinstance(m, dict)
            or m.get("role") not in ROLES
            or not isinstance(m.get("content"), str)
        ):
            raise ValueError(
                f"{where}: messages[{i}] must be {{'role': one of {list(ROLES)}, 'content': str}}"
            )
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
        raise ValueError(
            f"{where}: needs a 'prompt', chat 'messages' or Spec-Bench 'turns' (keys found: "
            f"{sorted(row)})"
        )
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{where}: the prompt text must be a non-empty string")
    category = row.get("category", "default")
    pid = row.get("question_id", row.get("id", where))
    return Prompt(id=str(pid), text=text, category=str(category), turns=chat)


def available_prompt_sets() -> list[str]:
    return sorted([p.stem for p in PROMPT_SETS.glob("*.jsonl")] + ["mixed"])


def _from_datasets(source: str, limit: int | None) -> list[Prompt]:
    """Prompts from a `datasets` source: `datasets:<name or path>[:<split>]` (default split:
    train)."""
    import datasets  # noqa: PLC0415 -- heavy; only for this source

    spec = source.removeprefix(DATASETS)
    name, _, split = (
        spec.rpartition(":") if spec.count(":") and not Path(spec).exists() else (spec, "", "")
    )
    name, split = name or spec, split or "train"
    local = Path(name)
    try:
        if local.is_file():  # a local file: datasets' builder by extension
            kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}.get(
                local.suffix
            )
            if kind is None:
                raise ValueError(f"unknown file type {local.suffix!r} (jsonl, json, parquet, csv)")
            ds = datasets.load_dataset(kind, data_files=str(local), split=split)
        elif (
            local.is_dir() and (local / "dataset_info.json").is_file()
        ):  # `save_to_disk` output of one split
            ds = datasets.load_from_disk(str(local))
        else:
            ds = datasets.load_dataset(name, split=split)
    except Exception as e:  # noqa: BLE001 - any datasets error means "cannot read this source"
        raise ValueError(
            f"prompts {source!r}: cannot load it with datasets ({type(e).__name__}: {e})"
        ) from None
    rows = ds.select(range(min(limit, len(ds)))) if limit else ds
    # a table has every column in every row: a None is a column this row does not use
    out = [
        _parse({k: v for k, v in row.items() if v is not None}, f"{source}[{i}]")
        for i, row in enumerate(rows)
    ]
    if not out:
        raise ValueError(f"prompts {source!r}: no rows")
    return out


def load_prompts(path: str | Path | None = None, limit: int | None = None) -> list[Prompt]:
    """Read a prompt file, a packaged set by name (None = `default`) or a `datasets:` source;
    errors name file and line."""
    if str(path) == "mixed":  # kind by kind in turn: any first N covers as many kinds as N allows
        by_kind: dict[str, list[Prompt]] = {}
        for p in (p for name in MIXED for p in load_prompts(name)):
            by_kind.setdefault(p.category, []).append(p)
        rounds = itertools.zip_longest(*by_kind.values())
        return [p for r in rounds for p in r if p is not None][:limit]
    if str(path or "").startswith(DATASETS):
        return _from_datasets(str(path), limit)
    path = Path(path) if path else DEFAULT_PROMPTS
    if not path.is_file() and (PROMPT_SETS / f"{path}.jsonl").is_file():
        path = PROMPT_SETS / f"{path}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"prompt file not found: {path} (packaged sets: {', '.join(available_prompt_sets())})"
        )
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
