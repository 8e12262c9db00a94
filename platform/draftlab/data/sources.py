"""Training prompts for self-distillation: read from any `datasets` source, or written by
the target itself (Magpie: sample from its chat template's bare user-turn header).

Both kinds go through the same filters (`reject_reason`) and deduplication, so a prompt set
is clean whatever produced it. Both are deterministic streams (rows in order; magpie rounds
seeded by their index), so the prompts for `num_prompts = n` are the first n of those for
any larger count, and `collect_prompts` can resume a shorter list where it stopped. The junk
filter is language-agnostic: it looks at Unicode categories, never at ASCII ranges, so
Chinese, Cyrillic or Arabic prompts pass.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import re
import time
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from tqdm import tqdm
from transformers import LogitsProcessorList

from draftlab.config import DataConfig, PromptSourceConfig
from draftlab.data.documents import document_stream
from draftlab.data.responses import generate_responses, left_padded
from draftlab.data.sampling import TopKTopPSampler
from draftlab.data.tables import describe_source, open_dataset

logger = logging.getLogger(__name__)

_USER_ROLES = ("human", "user")
_CHAT_ROLES = {"system": "system", "human": "user", "user": "user"} | {
    r: "assistant" for r in ("gpt", "assistant", "chatgpt", "bard", "model", "bing")
}
Prompt = str | list[dict[str, str]]  # a user turn's text, or chat messages ending in a user turn
# Cut point in the rendered chat template; private-use chars never occur in real templates.
_SENTINEL = "\ue000draftlab-magpie\ue001"

# Junk thresholds. Generous on purpose: they remove spam and byte soup, not style.
_MIN_TEXT_SHARE = 0.75  # letters, marks, digits, punctuation and spaces among all chars
_MIN_ALNUM_SHARE = 0.4  # letters/digits (+ combining marks) among non-space chars
_MAX_CHAR_SHARE = 0.5  # the most common non-space char may not exceed this share
_MAX_WORD_SHARE = 0.5  # ... nor the most common word (texts of >= 4 words)
_REPEAT_UNIT = re.compile(r"(.{1,8}?)\1{4,}", re.DOTALL)  # a short unit 5+ times in a row


# --- filters -------------------------------------------------------------------------------


def junk_reason(text: str) -> str | None:
    """Why `text` looks like junk rather than a prompt (None = it looks like text)."""
    if "\ufffd" in text:
        return "replacement char"
    if not text.strip():
        return "empty"
    cats = [unicodedata.category(c)[0] for c in text]
    texty = sum(cat in "LMNPZ" or c.isspace() for c, cat in zip(text, cats, strict=True))
    if texty < _MIN_TEXT_SHARE * len(text):
        return "not mostly text"
    visible = [c for c in text if not c.isspace()]
    alnum = sum(c.isalnum() or unicodedata.category(c).startswith("M") for c in visible)
    if alnum < _MIN_ALNUM_SHARE * len(visible):
        return "too few letters/digits"
    if Counter(visible).most_common(1)[0][1] > _MAX_CHAR_SHARE * len(visible):
        return "one repeated character"
    words = [w.strip(".,;:!?\"'()").casefold() for w in text.split()]
    words = [w for w in words if w]
    if len(words) >= 4 and Counter(words).most_common(1)[0][1] > _MAX_WORD_SHARE * len(words):
        return "one repeated word"
    repeated = sum(m.end() - m.start() for m in _REPEAT_UNIT.finditer(text))
    if repeated > 0.5 * len(text):
        return "repeated pattern"
    return None


def prompt_text(prompt: Prompt) -> str:
    """What a prompt is filtered and deduplicated by: its text, or a chat's turns joined."""
    return prompt if isinstance(prompt, str) else "\n\n".join(m["content"] for m in prompt)


def prompt_key(prompt: Prompt) -> str:
    """A prompt as one string (the data's `prompt` column): its text, or a chat's messages as
    JSON."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False)


def reject_reason(text: str, cfg: PromptSourceConfig, tokenizer=None) -> str | None:
    """Why a (stripped) prompt is dropped: length limits of `cfg` (its document included),
    then `junk_reason`."""
    if len(text) < cfg.min_chars:
        return "too short"
    if tokenizer is not None:
        n_tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if n_tokens > cfg.prompt_token_limit:
            return "too many tokens"
    return junk_reason(text)


def dedup_key(text: str) -> str:
    """Prompts equal up to whitespace and case are duplicates."""
    return " ".join(text.split()).casefold()


@dataclass(frozen=True)
class PromptList:
    """Prompts collected from a source stream, and how many of the stream's texts (kept or
    dropped) that took: where a longer list resumes (None: not recorded, it cannot)."""

    prompts: list[Prompt]
    consumed: int | None


class _Collector:
    """Strips, filters and deduplicates candidate prompts; counts why others were dropped.
    Starts from `start` (a shorter list of the same stream) when given."""

    def __init__(self, cfg: PromptSourceConfig, tokenizer, start: PromptList | None = None):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.prompts: list[Prompt] = list(start.prompts) if start else []
        self.consumed = start.consumed if start else 0
        self.dropped: Counter[str] = Counter()
        self._seen: set[str] = {dedup_key(prompt_text(p)) for p in self.prompts}

    @property
    def full(self) -> bool:
        return len(self.prompts) >= self.cfg.num_prompts

    def offer(self, prompt: Prompt | None) -> bool:
        self.consumed += 1
        if not isinstance(prompt, str | list):
            self.dropped["no text"] += 1
            return False
        if isinstance(prompt, str):
            prompt = prompt.strip()
        else:
            prompt = [m | {"content": m["content"].strip()} for m in prompt]
        text = prompt_text(prompt)
        reason = reject_reason(text, self.cfg, self.tokenizer)
        if reason is None and dedup_key(text) in self._seen:
            reason = "duplicate"
        if reason is not None:
            self.dropped[reason] += 1
            return False
        self._seen.add(dedup_key(text))
        self.prompts.append(prompt)
        return True

    def summary(self) -> str:
        drops = ", ".join(f"{k}={v}" for k, v in self.dropped.most_common()) or "none"
        return f"{len(self.prompts)} prompts kept; dropped: {drops}"


# --- kind = "dataset" ----------------------------------------------------------------------


def _turn_text(turn: dict) -> str | None:
    content = turn.get("value", turn.get("content"))
    if isinstance(content, list):  # OpenAI-style parts: [{"type": "text", "text": ...}, ...]
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else None


def chat_to_last_user_turn(conversation: object) -> list[dict[str, str]] | None:
    """A ShareGPT (`from`/`value`) or OpenAI (`role`/`content`) conversation up to and with its
    last user turn, as OpenAI chat messages (roles system, user, assistant); None without a
    user turn, or with a turn of another role or without text."""
    if not isinstance(conversation, list):
        return None
    messages = []
    for turn in conversation:
        role = str(turn.get("from", turn.get("role", ""))).lower() if isinstance(turn, dict) else ""
        text = _turn_text(turn) if role else None
        if role not in _CHAT_ROLES or text is None:
            return None
        messages.append({"role": _CHAT_ROLES[role], "content": text})
    while messages and messages[-1]["role"] != "user":
        messages.pop()
    return messages or None


def first_user_turn(conversation: object) -> str | None:
    """The first human/user turn of a ShareGPT (`from`/`value`) or OpenAI (`role`/`content`)
    conversation; None when there is none."""
    if not isinstance(conversation, list):
        return None
    for turn in conversation:
        if (
            isinstance(turn, dict)
            and str(turn.get("from", turn.get("role", ""))).lower() in _USER_ROLES
        ):
            return _turn_text(turn)
    return None


def _dataset_texts(cfg: PromptSourceConfig, first: int = 0) -> Iterator[Prompt | None]:
    """The prompt column's texts (or chats: `turns`) from row `first` on."""
    ds = open_dataset(cfg)
    column = cfg.conversations or cfg.field
    if column is None:
        raise ValueError(f"{describe_source(cfg)}: set source.field or source.conversations")
    if column not in ds.column_names:
        which = "conversations" if cfg.conversations else "field"
        raise ValueError(
            f"{describe_source(cfg)} has no column {column!r} (source.{which}); "
            f"available columns: {ds.column_names}"
        )
    rows = ds.select_columns([column])
    for value in rows.select(
        range(min(first, rows.num_rows), rows.num_rows)
    ):  # lazy: read until enough are kept
        value = value[column]
        if not cfg.conversations:
            yield value
        else:
            yield chat_to_last_user_turn(value) if cfg.turns == "chat" else first_user_turn(value)


# --- kind = "magpie" -----------------------------------------------------------------------


def user_turn_header(tokenizer, chat: list[dict[str, str]] | None = None) -> str:
    """The chat template's text up to where a user message starts (system turn included),
    after the messages of `chat` when given (the header of a chat's next user turn)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("magpie prompts need a target with a chat template; use kind='dataset'")
    rendered = tokenizer.apply_chat_template(
        [*(chat or []), {"role": "user", "content": _SENTINEL}],
        tokenize=False,
        add_generation_prompt=False,
    )
    if _SENTINEL not in rendered:
        raise ValueError(
            "the chat template does not render the user message verbatim; use kind='dataset'"
        )
    return rendered.split(_SENTINEL, 1)[0]


def _end_of_turn_ids(target, tokenizer) -> list[int]:
    """EOS ids plus the first token after the user message (e.g. `<|im_end|>`)."""
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": _SENTINEL}], tokenize=False, add_generation_prompt=False
    )
    suffix = tokenizer(rendered.split(_SENTINEL, 1)[1], add_special_tokens=False)["input_ids"]
    ids = set(target.eos_token_ids) | ({tokenizer.eos_token_id} - {None})
    if suffix and suffix[0] in tokenizer.all_special_ids:
        ids.add(suffix[0])
    return sorted(ids)


_VLLM_MAGPIE_REQUESTS = (
    256  # turns a vLLM writer is asked for at a time (whole rounds; the last call overshoots)
)
_FOLLOW_UP_SEED_OFFSET = 10**12  # second turns of chats: seeds apart from the first turns'


def _magpie_texts(
    cfg: PromptSourceConfig, target, batch_size: int, max_rounds: int, writer=None, first: int = 0
) -> Iterator[str]:
    """Sample user turns from the user-turn header, `batch_size` at a time, up to round
    `max_rounds`; turn i of the stream (turn b of round r: i = r * batch_size + b) opens with
    `cfg.magpie_seeds[i % len(seeds)]`, grounded in document i with `cfg.documents`. Written
    by HF `generate` on `target`, or by `writer` (a `VllmEngine`, several rounds per call,
    turn i seeded with `cfg.seed * 1_000_003 + i`). The stream starts at its text `first`:
    the round holding it is written again and its earlier turns skipped (every round is
    seeded by its index)."""
    yield from itertools.islice(
        _magpie_rounds(cfg, target, batch_size, first // batch_size, max_rounds, writer),
        first % batch_size,
        None,
    )


def _magpie_rounds(
    cfg: PromptSourceConfig, target, batch_size: int, first_round: int, max_rounds: int, writer
) -> Iterator[Prompt | None]:
    """The turns (or `turns: chat` chats) of rounds `first_round` .. `max_rounds - 1` (see
    `_magpie_texts`)."""
    tok = target.tokenizer
    header = user_turn_header(tok)
    stop = _end_of_turn_ids(target, tok)
    docs = document_stream(cfg, target, writer, batch_size) if cfg.documents else None

    def openings(round_: int) -> list[tuple[str, list[int]]]:
        """The opening words of the round's turns (turn i of the stream takes seed i), and
        their start ids."""
        first = round_ * batch_size
        seeds = cfg.magpie_seeds
        words = [seeds[i % len(seeds)] for i in range(first, first + batch_size)]
        if docs is not None:
            words = [ground(w, d) for w, d in zip(words, docs(first, batch_size), strict=True)]
        return [(w, tok(header + w, add_special_tokens=False)["input_ids"]) for w in words]

    def turns(starts: list[tuple[str, list[int]]], rounds: range, seed: int) -> list[str]:
        """Each opening's words and what the target writes after them, to its end of turn:
        sampled with seed `seed` + the turn's index (HF: `seed` + the round's, one round)."""
        if writer is not None:
            rows = writer.generate_many(
                [ids for _, ids in starts],
                cfg.max_prompt_tokens,
                temperature=cfg.magpie_temperature,
                top_p=cfg.magpie_top_p,
                stop_token_ids=stop,
                seeds=[seed + r * batch_size + b for r in rounds for b in range(batch_size)],
            )
        else:
            rows = _hf_sampled(cfg, target, [ids for _, ids in starts], stop, seed + rounds[0])
        out = []
        for (words, _), row in zip(starts, rows, strict=True):
            cut = next((i for i, t in enumerate(row) if t in stop), len(row))
            out.append(words + tok.decode(row[:cut], skip_special_tokens=True))
        return out

    # grounded rounds and chats are costly (documents to write, answers, long prompts): one
    # round a vLLM call, so a list that fills up mid-call wastes no other round
    several = writer is not None and docs is None and not cfg.writes_chats
    per_call = max(1, _VLLM_MAGPIE_REQUESTS // batch_size) if several else 1
    for first in range(first_round, max_rounds, per_call):
        rounds = range(first, min(first + per_call, max_rounds))
        written = turns([s for r in rounds for s in openings(r)], rounds, cfg.seed * 1_000_003)
        if cfg.writes_chats:
            yield from _chats(cfg, target, written, rounds, batch_size, writer, turns)
        else:
            yield from written


def _chats(
    cfg: PromptSourceConfig,
    target,
    firsts: list[str],
    rounds: range,
    batch_size: int,
    writer,
    turns: Callable[[list[tuple[str, list[int]]], range, int], list[str]],
) -> list[list[dict[str, str]] | None]:
    """Two-turn chats on the rounds' first turns: the target's greedy answer to each, then a
    second user turn that `turns` writes after it (turn i opens with follow-up seed i). None
    where the answer is empty (nothing to follow up)."""
    tok = target.tokenizer
    answers = generate_responses(
        target,
        [target.encode_prompt(t) for t in firsts],
        DataConfig(max_new_tokens=cfg.chat_answer_tokens, temperature=0.0, batch_size=batch_size),
        writer=writer,
    )
    chats = [
        [{"role": "user", "content": t}, {"role": "assistant", "content": a.strip()}]
        for t, a in zip(firsts, tok.batch_decode(answers, skip_special_tokens=True), strict=True)
    ]
    seeds, first = cfg.follow_up_seeds, rounds[0] * batch_size
    starts = []
    for i, chat in enumerate(chats, start=first):
        words = seeds[i % len(seeds)]
        ids = tok(user_turn_header(tok, chat) + words, add_special_tokens=False)["input_ids"]
        starts.append((words, ids))
    seconds = turns(starts, rounds, cfg.seed * 1_000_003 + _FOLLOW_UP_SEED_OFFSET)
    return [
        [*chat, {"role": "user", "content": second}] if chat[1]["content"] else None
        for chat, second in zip(chats, seconds, strict=True)
    ]


def _hf_sampled(
    cfg: PromptSourceConfig, target, starts: list[list[int]], stop: list[int], seed: int
) -> list[list[int]]:
    """HF `generate`'s new ids after each start (sampled at the source's magpie temperature,
    `seed` for the whole batch), one left-padded batch."""
    tok = target.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else stop[0]
    devices = [target.device.index or 0] if target.device.type == "cuda" else []
    ids, mask = left_padded(starts, pad)  # (B, W) each
    with torch.random.fork_rng(devices=devices):  # seeded, without touching global RNG
        torch.manual_seed(seed)
        out = target.model.generate(
            ids.to(target.device),
            attention_mask=mask.to(target.device),
            do_sample=False,  # the sampler runs in the greedy loop (fast on CPU)
            logits_processor=LogitsProcessorList(
                [TopKTopPSampler(cfg.magpie_temperature, cfg.magpie_top_p)]
            ),
            max_new_tokens=cfg.max_prompt_tokens,
            eos_token_id=stop,
            pad_token_id=pad,
        )  # (B, W + new)
    return out[:, ids.shape[1] :].tolist()


def ground(opening: str, document: str) -> str:
    """A document-grounded opening: `{document}` replaced, or the document after the words
    (a request that comes first: "Translate the following text into")."""
    if "{document}" in opening:
        return opening.replace("{document}", document)
    return f"{opening}\n\n{document}\n\n" if opening else document


# --- entry point ---------------------------------------------------------------------------


# How often a collection hands its list so far to `save` (a long magpie list takes 40 minutes
# on 2 cores: an interrupted run resumes where the last save stopped, not from the start).
SAVE_EVERY_S = 60.0


def _collect(
    texts: Iterable[Prompt | None],
    collector: _Collector,
    bar: tqdm,
    save: Callable[[PromptList], None] | None = None,
) -> None:
    saved = time.monotonic()
    for text in texts:
        if collector.offer(text):
            bar.update(1)
            if save is not None and time.monotonic() - saved >= SAVE_EVERY_S:
                save(PromptList(list(collector.prompts), collector.consumed))
                saved = time.monotonic()
        if collector.full:
            return


def load_prompts_from_source(cfg: PromptSourceConfig, target, **kwargs) -> list[Prompt]:
    """`collect_prompts(...).prompts`: the prompt texts alone."""
    return collect_prompts(cfg, target, **kwargs).prompts


def collect_prompts(
    cfg: PromptSourceConfig,
    target,
    *,
    progress: bool = True,
    magpie_batch_size: int = 16,
    magpie_max_rounds: int | None = None,
    writer=None,
    start: PromptList | None = None,
    save: Callable[[PromptList], None] | None = None,
) -> PromptList:
    """Up to `cfg.num_prompts` filtered, deduplicated prompt texts (in source order).

    `target` is a loaded `Target`: its tokenizer measures prompt length, and for
    `kind="magpie"` its model writes the prompts (`kind="dataset"` needs only the tokenizer:
    a `TargetInfo` from `describe_target` will do) (`magpie_batch_size` samples per call, up
    to round `magpie_max_rounds`; default: 4x what a zero-rejection run would need + 2;
    `writer`: a `VllmEngine` that writes them instead of the target's HF `generate`).
    `start`, a shorter list collected from the same source, is extended from where it
    stopped: the result equals a collection from scratch. A `start` at least as long as
    asked is cut to `cfg.num_prompts`. `save`, when given, receives the list so far every
    `SAVE_EVERY_S` seconds (a valid `start` for a run that resumes after an interruption).
    Fewer prompts than asked is a warning, none at all a `ValueError`.
    """
    if start is not None and len(start.prompts) >= cfg.num_prompts:
        return PromptList(start.prompts[: cfg.num_prompts], start.consumed)
    if start is not None and start.consumed is None:
        raise ValueError("a prompt list without its stream position cannot be extended")
    collector = _Collector(cfg, target.tokenizer, start)
    bar = tqdm(
        total=cfg.num_prompts,
        initial=len(collector.prompts),
        desc=f"prompts ({cfg.kind}{f', documents {cfg.documents}' if cfg.documents else ''})",
        unit="prompt",
        disable=not progress,
    )
    with bar:
        if cfg.kind == "dataset":
            _collect(_dataset_texts(cfg, collector.consumed), collector, bar, save)
            where = describe_source(cfg)
        else:
            rounds = magpie_max_rounds or 4 * math.ceil(cfg.num_prompts / magpie_batch_size) + 2
            texts = _magpie_texts(
                cfg, target, magpie_batch_size, rounds, writer, collector.consumed
            )
            _collect(texts, collector, bar, save)
            where = f"magpie prompts from {target.name!r} ({rounds} rounds max)"
    resumed = f" ({len(start.prompts)} of them resumed from a shorter list)" if start else ""
    logger.info("%s: %s%s", where, collector.summary(), resumed)
    if not collector.prompts:
        raise ValueError(f"{where}: no prompt passed the filters ({collector.summary()})")
    if not collector.full:
        logger.warning(
            "%s: only %d of %d prompts (%s)",
            where,
            len(collector.prompts),
            cfg.num_prompts,
            collector.summary(),
        )
    return PromptList(collector.prompts, collector.consumed)
