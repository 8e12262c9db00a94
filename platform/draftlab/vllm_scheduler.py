"""draftlab's vLLM scheduler: per-request draft lengths and prompt lookups merged with the
drafter's drafts.

It runs inside vLLM's engine core as its scheduler (`scheduler_cls`, vLLM's own extension
point: `DraftlabScheduler` below), where each request's committed tokens and sampling
arguments are at hand: the model runner hands the step's drafts to the scheduler
(`update_draft_token_ids`) and this scheduler edits them before they are scheduled for
verification. Its settings travel in `additional_config` (`LOOKUP_KEY`); an engine without
them and requests without `REQUEST_K` are scheduled exactly as vLLM's own scheduler does.

**Per-request draft length.** A request whose `SamplingParams.extra_args` (the OpenAI
server's `vllm_xargs`) carry `draftlab_k: n` gets at most n draft tokens a step; 0 decodes it
target-only. The step's drafting is sized for the requests in it: when none wants more than
n, the drafter drafts n (0: vLLM skips drafting), so a batch of `draftlab_k: 0` requests costs
what target-only decoding costs, on the same engine (`draftlab loadtest --speculation off`),
and one engine measures every k <= its `num_speculative_tokens` (`draftlab.contenders`).
vLLM's batch-size schedule (`num_speculative_tokens_per_batch_size`) applies first. vLLM's
suffix drafting takes none (its proposer asserts it drafts its k every step), so for it this
scheduler applies the schedule itself (`with_schedule`): the step's k stays, and every
request's drafts are trimmed to the schedule's k at the step's batch size (0: none verified;
proposing them is a CPU tree lookup).

**Prompt lookups** (`vllm_draftlab_ngram`). vLLM verifies one draft source per engine: its
n-gram drafting copies the spans a summary, a RAG answer or an edit repeats from its prompt,
and the drafter (EAGLE-3 layout) drafts the free text; neither does the other's part. Our
engine grafts both into one verified tree (`decoding/ngram.py`); vLLM verifies a chain, so
here each request's chain comes from whichever source has something to say: where the
request's text has a match for its last `min_match`..`max_match` tokens, the `tokens` tokens
that followed it, else the drafter's first `draft_tokens` tokens. Copies do not grow here
(`grow_to` is our engine's): vLLM sizes every step for `num_speculative_tokens`, the longest
chain either source may propose, and its drafter drafts that many tokens a step whichever
chain is verified: room for long copies makes every step dearer, and on CPU the longer
copies did not make up for it (docs/benchmarks.md#what-the-defaults-rest-on,
docs/guides/vllm.md).

Which tokens are drafted never changes what is generated: vLLM verifies every draft token
against the target (greedy: exact match; sampling: its rejection sampler, lossless for a
deterministic draft as long as the drafter's draft probabilities are not used, which
`engine_kwargs` enforces with `draft_sample_method="greedy"`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from draftlab.config import NgramSpec

if (
    TYPE_CHECKING
):  # torch: imported by vLLM's engine core when it builds the scheduler, not by clients
    from draftlab.decoding.ngram import NgramIndex

# additional_config: {"spec": NgramSpec fields | None, "draft_tokens": n, "schedule": ranges}
LOOKUP_KEY = "draftlab_lookup"
# SamplingParams.extra_args / vllm_xargs key: this request's most draft tokens a step
REQUEST_K = "draftlab_k"
SCHEDULER = "draftlab.vllm_scheduler.DraftlabScheduler"


def engine_kwargs(spec: NgramSpec | None, speculative_config: dict, draft_tokens: int) -> dict:
    """`vllm.LLM` / `AsyncEngineArgs` keyword arguments of `speculative_config` scheduled by
    `DraftlabScheduler` (per-request draft lengths), with prompt lookups of `spec.tokens`
    tokens (no growth: module doc) merged into the first `draft_tokens` of each draft when
    `spec` is given. vLLM drafts `num_speculative_tokens` a step, so that becomes the longer
    of the two chains."""
    extra = {"spec": None, "draft_tokens": draft_tokens}
    spec_cfg = dict(speculative_config)
    if spec is not None:
        extra["spec"] = spec.model_copy(update={"grow_to": spec.tokens}).model_dump()
        spec_cfg |= {
            "num_speculative_tokens": max(draft_tokens, spec.tokens),
            "draft_sample_method": "greedy",
        }
    return {
        "speculative_config": spec_cfg,
        "scheduler_cls": SCHEDULER,
        "additional_config": {LOOKUP_KEY: extra},
    }


def builtin_config(
    method: str,
    k: int | None,
    ngram_min: int = 2,
    ngram_max: int = 4,
    suffix_cached_requests: int = 0,
) -> dict:
    """vLLM's `speculative_config` for its own untrained drafting: `ngram` (prompt lookup of
    `ngram_min`..`ngram_max` tokens, k tokens drafted, default 4) or `suffix` (Arctic's suffix
    decoding: suffix trees of the prompt and, up to `suffix_cached_requests`, of past responses;
    k None = its own default depth). 0 cached requests by default: a benchmark that repeats a
    prompt would otherwise measure a cache of the very answer it asks for."""
    if method == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": k or 4,
            "prompt_lookup_min": ngram_min,
            "prompt_lookup_max": ngram_max,
        }
    if method == "suffix":
        require_arctic()
        return {
            "method": "suffix",
            "suffix_decoding_max_cached_requests": suffix_cached_requests,
        } | ({"num_speculative_tokens": k} if k else {})
    raise ValueError(f"unknown vLLM drafting method {method!r}: ngram, suffix")


def require_arctic() -> None:
    """An ImportError that says how to install Arctic Inference (vLLM's `suffix` drafting)."""
    try:
        import arctic_inference.suffix_decoding  # noqa: F401, PLC0415 -- optional extra
    except ImportError as e:
        raise ImportError(
            f"suffix decoding needs arctic-inference ({e}); PyPI has a source release only: "
            "`infra/install-arctic.sh .venv` builds and installs it (docs/install.md)"
        ) from None


def with_schedule(kwargs: dict, schedule: list[list[int]] | None) -> dict:
    """Engine kwargs (`engine_kwargs`) with a batch-size schedule of draft tokens: inclusive
    [first, last, k] ranges, k = 0 allowed. vLLM's own (`num_speculative_tokens_per_batch_size`)
    where it takes one, this scheduler's for suffix drafting (module doc)."""
    if not schedule or "speculative_config" not in kwargs:
        return kwargs
    ranges = [tuple(r) for r in schedule]
    if kwargs["speculative_config"].get("method") == "suffix":
        extra = kwargs["additional_config"][LOOKUP_KEY] | {"schedule": ranges}
        return kwargs | {"additional_config": kwargs["additional_config"] | {LOOKUP_KEY: extra}}
    return kwargs | {
        "speculative_config": kwargs["speculative_config"]
        | {"num_speculative_tokens_per_batch_size": ranges}
    }


def request_k(extra_args: dict | None) -> int | None:
    """A request's own draft-length cap (`REQUEST_K`), None when it sets none."""
    if not extra_args or extra_args.get(REQUEST_K) is None:
        return None
    value = extra_args[REQUEST_K]
    try:
        k = int(value)
        if isinstance(value, bool | list) or k != float(value):
            raise ValueError
    except (TypeError, ValueError):
        raise ValueError(f"{REQUEST_K} must be an integer >= 0, got {value!r}") from None
    if k < 0:
        raise ValueError(f"{REQUEST_K} must be >= 0, got {k}")
    return k


def merge(index: NgramIndex, draft: list[int], draft_tokens: int) -> list[int]:
    """The copy from the text where there is one, else the drafter's first tokens."""
    return index.propose() or draft[:draft_tokens]


def __getattr__(name: str):
    """`DraftlabScheduler` subclasses vLLM's scheduler, so it is built when vLLM resolves it
    (`scheduler_cls`), not when this module is imported."""
    if name != "DraftlabScheduler":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = cls = _scheduler()
    return cls


def _scheduler() -> type:
    from vllm.v1.core.sched.scheduler import Scheduler  # noqa: PLC0415 -- vLLM, optional
    from vllm.v1.spec_decode.dynamic.utils import (  # noqa: PLC0415 -- as above
        build_dynamic_sd_schedule_lookup,
    )

    from draftlab.decoding.ngram import NgramIndex  # noqa: PLC0415 -- torch (TYPE_CHECKING above)

    class DraftlabScheduler(Scheduler):
        """vLLM's scheduler with per-request draft lengths and prompt lookups (module doc)."""

        def __init__(self, vllm_config, *args, **kwargs):
            super().__init__(vllm_config, *args, **kwargs)
            extra = (vllm_config.additional_config or {}).get(LOOKUP_KEY) or {}
            self._spec = NgramSpec.model_validate(extra["spec"]) if extra.get("spec") else None
            self._draft_tokens = int(extra.get("draft_tokens") or self.num_spec_tokens)
            self._lookups: dict[str, NgramIndex] = {}  # request id -> its text's n-gram index
            # vLLM 0.29's parallel drafting drafts all its K slots or none: any other step K
            # fails in its proposer ("shape '[-1, 2]' is invalid for input of size 3")
            self._all_or_none = bool(
                getattr(vllm_config.speculative_config, "parallel_drafting", False)
            )
            # and its suffix proposer asserts every step drafts exactly its K: the step stays at K
            # (a request's cap still trims its own drafts, so `draftlab_k: 0` verifies none), and
            # the batch-size schedule trims every request's drafts (`with_schedule`)
            self._fixed = getattr(vllm_config.speculative_config, "method", None) == "suffix"
            self._by_batch = (
                build_dynamic_sd_schedule_lookup(
                    extra["schedule"], self.max_num_running_reqs, self.num_spec_tokens
                )
                if extra.get("schedule")
                else None
            )
            self._step_k = self.num_spec_tokens  # the last step's k: its batch size's, if scheduled

        def _cap(self, request) -> int:
            """The most draft tokens `request` takes a step."""
            own = request_k(request.sampling_params.extra_args if request.sampling_params else None)
            return self._step_k if own is None else min(own, self._step_k)

        def schedule(self, *args, **kwargs):
            out = super().schedule(*args, **kwargs)
            if out.num_scheduled_tokens:  # this step's k: our schedule's (suffix), else vLLM's
                self._step_k = (
                    self._by_batch[min(len(out.num_scheduled_tokens), len(self._by_batch) - 1)]
                    if self._by_batch is not None
                    else out.num_spec_tokens_to_schedule
                )  # vLLM's follows `num_speculative_tokens_per_batch_size`: merged copies too
            if out.num_scheduled_tokens and out.num_spec_tokens_to_schedule and not self._fixed:
                # the drafter drafts, after this step, for these requests only: as many as the
                # greediest of them takes (a copy from the text may need the whole chain)
                wanted = max(self._cap(self.requests[r]) for r in out.num_scheduled_tokens)
                if not (self._all_or_none and wanted):
                    out.num_spec_tokens_to_schedule = min(out.num_spec_tokens_to_schedule, wanted)
            return out

        def update_draft_token_ids(self, draft_token_ids) -> None:
            edited = []
            for req_id, draft in zip(
                draft_token_ids.req_ids, draft_token_ids.draft_token_ids, strict=True
            ):
                request = self.requests.get(req_id)
                if request is None or request.is_finished() or request.is_prefill_chunk:
                    edited.append(draft)
                    continue
                cap = self._cap(request)
                if cap == 0:  # nothing verified: no lookup (its index catches up when it drafts)
                    edited.append([])
                    continue
                draft = list(draft)
                if self._spec is not None:
                    tokens = request.all_token_ids
                    index = self._lookups.get(req_id)
                    if index is None:
                        index = self._lookups[req_id] = NgramIndex(self._spec, list(tokens))
                    else:
                        index.extend(list(tokens[len(index.tokens) :]))
                    draft = merge(index, draft, self._draft_tokens)
                edited.append(draft[:cap])
            for gone in [r for r in self._lookups if r not in self.requests]:
                del self._lookups[gone]
            super().update_draft_token_ids(type(draft_token_ids)(draft_token_ids.req_ids, edited))

    return DraftlabScheduler
