"""Documents for document-grounded magpie prompts (`source.documents`): the texts that
summaries, questions over a context (RAG) and translations are about.

Three corpora, each a deterministic stream (document i depends on i and, when HF `generate`
writes it, on its round), so prompt lists built on them resume and extend like plain magpie
ones:

* `self`: the target writes them, answering `DOCUMENT_REQUESTS` in turn, sampled at the
  source's magpie temperature with a seed per document;
* `python-docs`: the Python language reference shipped with Python (`pydoc_data`), cut
  into passages; always there, though only about one subject;
* a local file or `datasets` source: its `document_field` column, each text cut to the
  document length.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from draftlab.config import DataConfig, PromptSourceConfig
from draftlab.config.data import DOCUMENT_REQUESTS
from draftlab.data.responses import generate_responses
from draftlab.data.tables import open_dataset

SELF, PYTHON_DOCS = "self", "python-docs"


def cut_to_tokens(text: str, tokenizer, limit: int) -> str:
    """`text` cut to at most `limit` tokens: at the last paragraph, line or sentence end in the
    last two thirds of what fits, else where the tokens end."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= limit:
        return text.strip()
    head = tokenizer.decode(ids[:limit])
    for sep in ("\n\n", "\n", ". "):
        cut = head.rfind(sep)
        if cut > len(head) // 3:
            return head[: cut + (1 if sep == ". " else 0)].strip()
    return head.strip()


def _passages(texts: list[str], tokenizer, limit: int) -> list[str]:
    """Consecutive paragraphs of `texts` joined into passages of at most `limit` tokens;
    passages under a quarter of that (headings, stubs) say too little to ask about."""
    out: list[str] = []

    def close(paras: list[str], used: int) -> None:
        if paras and used >= limit // 4:
            out.append("\n\n".join(paras))

    for text in texts:
        current: list[str] = []
        used = 0
        for para in (p.strip() for p in text.split("\n\n")):
            if not para:
                continue
            n = len(tokenizer(para, add_special_tokens=False)["input_ids"])
            if current and used + n > limit:
                close(current, used)
                current, used = [], 0
            if n > limit:
                out.append(cut_to_tokens(para, tokenizer, limit))
                continue
            current.append(para)
            used += n
        close(current, used)
    return out


def _corpus_texts(cfg: PromptSourceConfig) -> list[str]:
    if cfg.documents == PYTHON_DOCS:
        from pydoc_data.topics import topics  # noqa: PLC0415 -- 0.5 MB of text, only here

        return [topics[name] for name in sorted(topics)]
    field = cfg.document_field or "text"
    corpus = cfg.model_copy(update={"kind": "dataset", "path": cfg.documents, "field": field})
    ds = open_dataset(corpus)
    if field not in ds.column_names:
        raise ValueError(
            f"documents {cfg.documents!r} have no column {field!r} (source.document_field); "
            f"available columns: {ds.column_names}"
        )
    return [t for t in ds[field] if isinstance(t, str) and t.strip()]


def document_stream(
    cfg: PromptSourceConfig, target, writer=None, batch_size: int = 16
) -> Callable[[int, int], list[str]]:
    """`docs(first, n)`: documents `first .. first + n - 1` of the source's stream.

    A corpus is cut into passages and shuffled by `cfg.seed` (document i is passage
    i mod their count: a corpus smaller than the prompts asked for is used again, with other
    openings); `self` documents are written on demand by `writer` (a `VllmEngine`) or the
    target's HF `generate` (a round's documents seeded by `cfg.seed` and its first index; a
    `writer` seeds each by its own)."""
    limit = cfg.doc_tokens
    if cfg.documents != SELF:
        passages = _passages(_corpus_texts(cfg), target.tokenizer, limit)
        if not passages:
            raise ValueError(f"documents {cfg.documents!r}: no text of {limit // 4} tokens or more")
        random.Random(cfg.seed).shuffle(passages)
        return lambda first, n: [passages[i % len(passages)] for i in range(first, first + n)]

    writing = DataConfig(
        max_new_tokens=limit,
        temperature=cfg.magpie_temperature,
        top_p=cfg.magpie_top_p,
        batch_size=batch_size,
    )

    def written(first: int, n: int) -> list[str]:
        asks = [DOCUMENT_REQUESTS[i % len(DOCUMENT_REQUESTS)] for i in range(first, first + n)]
        rows = generate_responses(
            target,
            [target.encode_prompt(a) for a in asks],
            writing,
            seed=cfg.seed * 7_000_003 + first,
            writer=writer,
        )
        texts = [target.tokenizer.decode(r, skip_special_tokens=True) for r in rows]
        return [cut_to_tokens(t, target.tokenizer, limit) for t in texts]

    return written
