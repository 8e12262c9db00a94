"""Prompt lookups merged with the drafter's drafts in vLLM (`vllm_draftlab_ngram`).

vLLM verifies one draft source per engine: its n-gram drafting copies the spans a summary,
a RAG answer or an edit repeats from its prompt, and the drafter (EAGLE-3 layout) drafts
the free text; neither does the other's part. Our engine grafts both into one verified
tree (`decoding/ngram.py`); vLLM verifies a chain, so here each request's chain comes from
whichever source has something to say: where the request's text has a match for its last
`min_match`..`max_match` tokens, the `tokens` tokens that followed it, else the drafter's
first `draft_tokens` tokens.

Copies do not grow here (`grow_to` is our engine's): vLLM sizes every step for
`num_speculative_tokens`, the longest chain either source may propose, and its drafter
drafts that many tokens a step whichever chain is verified: on a 2-core CPU a step took
1.31x a target-only step with room for 16-token copies and 1.16x with room for 5, and the
longer copies did not make up for it (README "Prompt lookups in vLLM on a 2-core CPU").

It runs inside vLLM's engine core as its scheduler (`scheduler_cls`, vLLM's own extension
point: `LookupScheduler` below), where each request's committed tokens are at hand: the
model runner hands the drafter's drafts to the scheduler after every step
(`update_draft_token_ids`) and this scheduler swaps in the copies before they are
scheduled for verification. The settings travel in `additional_config` (`LOOKUP_KEY`), so
an engine without them schedules exactly as vLLM's own scheduler does.

Which tokens are drafted never changes what is generated: vLLM verifies every draft token
against the target (greedy: exact match; sampling: its rejection sampler, lossless for a
deterministic draft as long as the drafter's draft probabilities are not used, which
`engine_kwargs` enforces with `draft_sample_method="greedy"`).
"""

from __future__ import annotations

from draftlab.config import NgramSpec
from draftlab.decoding.ngram import NgramIndex

LOOKUP_KEY = "draftlab_lookup"  # additional_config key: {"spec": NgramSpec fields, "draft_tokens": n}
SCHEDULER = "draftlab.vllm_lookup.LookupScheduler"


def engine_kwargs(spec: NgramSpec, speculative_config: dict, draft_tokens: int) -> dict:
    """`vllm.LLM` / `AsyncEngineArgs` keyword arguments that merge prompt lookups of
    `spec.tokens` tokens (no growth: module doc) with `speculative_config`'s drafter, of which
    the first `draft_tokens` of each draft are kept. vLLM drafts `num_speculative_tokens` a
    step, so that becomes the longer of the two chains."""
    fixed = spec.model_copy(update={"grow_to": spec.tokens})
    return {
        "speculative_config": speculative_config
        | {"num_speculative_tokens": max(draft_tokens, spec.tokens), "draft_sample_method": "greedy"},
        "scheduler_cls": SCHEDULER,
        "additional_config": {LOOKUP_KEY: {"spec": fixed.model_dump(), "draft_tokens": draft_tokens}},
    }


def merge(index: NgramIndex, draft: list[int], draft_tokens: int) -> list[int]:
    """The copy from the text where there is one, else the drafter's first tokens."""
    return index.propose() or draft[:draft_tokens]


def __getattr__(name: str):
    """`LookupScheduler` subclasses vLLM's scheduler, so it is built when vLLM resolves it
    (`scheduler_cls`), not when this module is imported."""
    if name != "LookupScheduler":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = cls = _lookup_scheduler()
    return cls


def _lookup_scheduler() -> type:
    from vllm.v1.core.sched.scheduler import Scheduler  # noqa: PLC0415 -- vLLM: an optional extra, needed once vLLM resolves the scheduler

    class LookupScheduler(Scheduler):
        """vLLM's scheduler, with each step's drafts merged with prompt lookups (module doc)."""

        def __init__(self, vllm_config, *args, **kwargs):
            super().__init__(vllm_config, *args, **kwargs)
            extra = (vllm_config.additional_config or {}).get(LOOKUP_KEY)
            self._spec = NgramSpec.model_validate(extra["spec"]) if extra else None
            self._draft_tokens = int(extra["draft_tokens"]) if extra else 0
            self._lookups: dict[str, NgramIndex] = {}  # request id -> its text's n-gram index

        def update_draft_token_ids(self, draft_token_ids) -> None:
            if self._spec is not None:
                merged = []
                for req_id, draft in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids, strict=True):
                    request = self.requests.get(req_id)
                    if request is None or request.is_finished() or request.is_prefill_chunk:
                        merged.append(draft)
                        continue
                    tokens = request.all_token_ids
                    index = self._lookups.get(req_id)
                    if index is None:
                        index = self._lookups[req_id] = NgramIndex(self._spec, list(tokens))
                    else:
                        index.extend(list(tokens[len(index.tokens):]))
                    merged.append(merge(index, list(draft), self._draft_tokens))
                for gone in [r for r in self._lookups if r not in self.requests]:
                    del self._lookups[gone]
                draft_token_ids = type(draft_token_ids)(draft_token_ids.req_ids, merged)
            super().update_draft_token_ids(draft_token_ids)

    return LookupScheduler
