"""The engine deployment: target + drafter on one replica (the drafter reads the target's
hidden states), a decoding thread (`Scheduler`) and Ray metrics.

    generate(request) -> async stream of events      (the ingress turns them into OpenAI JSON;
                                                      `serve/events.py`)
        Accepted(prompt_tokens)     first: the request was accepted
        Delta(text, tokens) ...
        Done(finish_reason, stats, completion_tokens, queued_s)
        or Failed(message, status=400, param, code) instead of the first event
        or Failed(message, status=503) at any point: the replica is shutting down (retryable)
        or Failed(message) after the first: decoding failed

Metrics (Ray's Prometheus exporter, `ray_draftlab_*`): requests by status, generated
tokens, tau per request, end-to-end latency, queue length and active requests.

torch and the model stack are imported inside `DraftEngine` (and `build_policy`, which it
calls): the engine replica loads them; the ingress replica, the app builder (`serve.app`)
and `draftlab serve` import this module without them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from pathlib import Path

from ray import serve
from ray.serve import metrics as m

from draftlab.config import SamplingParams, ServeArgs
from draftlab.serve.events import Accepted, Done, EngineEvent, Failed
from draftlab.serve.pair import resolve_pair
from draftlab.serve.policy import SpeculationPolicy
from draftlab.storage import local_copy

log = logging.getLogger(__name__)
HEALTH_STALL_S = 60.0  # a replica with work that has not finished a round for this long is stuck
TAU_BOUNDARIES = [1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0]
LATENCY_BOUNDARIES = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]


class _Metrics:
    def __init__(self):
        self.requests = m.Counter(
            "draftlab_requests", "Finished requests by status.", tag_keys=("status",)
        )
        self.tokens = m.Counter("draftlab_generated_tokens", "Completion tokens generated.")
        self.tau = m.Histogram(
            "draftlab_tau", "Tokens per target forward, per request.", boundaries=TAU_BOUNDARIES
        )
        self.latency = m.Histogram(
            "draftlab_request_latency_s",
            "Engine time per request (queue included).",
            boundaries=LATENCY_BOUNDARIES,
        )
        self.tokens_per_s = m.Gauge(
            "draftlab_tokens_per_s", "Generated tokens per second over the last request."
        )
        self.queue = m.Gauge("draftlab_queue_length", "Requests waiting for a decoding slot.")
        self.active = m.Gauge("draftlab_active_requests", "Requests being decoded.")


def build_policy(target, drafter, tree, drafter_dir: str | None, eng) -> SpeculationPolicy:
    """The `auto` policy's inputs measured on this replica: target forward cost by row count
    (up to a full batch of trees), drafting time, and the drafter's expected tau."""
    # torch: the engine replica only (module docstring)
    from draftlab.decoding.tree_search import expected_accepted, static_equivalent  # noqa: PLC0415
    from draftlab.profiling import draft_ms, profile_target  # noqa: PLC0415

    rows = (tree.per_round or tree.num_nodes) + 1  # a per-round tree verifies per_round nodes
    sizes = sorted(
        {1, rows}
        | {n for n in (2, 4, 8, 16, 32, 64, 128, 256, 512) if n < eng.max_active * rows}
        | {eng.max_active, eng.max_active * rows}
    )
    costs = profile_target(target, eng.policy_context, sizes, repeats=3)
    prior_tau = 1.5  # no held-out estimate: a middling drafter's
    report = Path(drafter_dir) / "tree-search.json" if drafter_dir else None
    if report is not None and report.is_file():
        acc = json.loads(report.read_text())["acceptance"]
        shape = static_equivalent(tree, acc)
        if shape.depth <= len(acc) and shape.max_rank < min(len(a) for a in acc):
            prior_tau = 1.0 + expected_accepted(shape, acc)
    return SpeculationPolicy(
        {int(n): ms for n, ms in costs.items()},
        rows,
        prior_tau,
        draft_ms(drafter, tree.depth, eng.policy_context, repeats=3),
    )


@serve.deployment(name="DraftEngine")
class DraftEngine:
    def __init__(self, args: dict):
        # torch: the engine replica only (module docstring)
        from draftlab.decoding.engine import SpeculativeDecoder  # noqa: PLC0415
        from draftlab.decoding.ngram import NgramStore  # noqa: PLC0415
        from draftlab.decoding.tree_files import resolve_tree  # noqa: PLC0415
        from draftlab.models.drafters.build import resolve_drafter  # noqa: PLC0415
        from draftlab.models.target import load_target  # noqa: PLC0415
        from draftlab.serve.scheduler import Scheduler  # noqa: PLC0415

        self.args = ServeArgs.model_validate(args)
        pair = resolve_pair(self.args)
        self.target = load_target(pair.target)
        drafter = resolve_drafter(pair.drafter, self.target)
        saved = None if pair.drafter.startswith("init:") else pair.drafter
        tree = resolve_tree(self.args.engine.tree, saved, drafter.cfg.k)
        eng = self.args.engine
        store = (
            NgramStore.beside(local_copy(saved)) if saved and tree.ngram else None
        )  # the drafter's lookup store
        self.max_context = eng.max_context or int(
            getattr(self.target.model.config, "max_position_embeddings", 2048)
        )
        self.info_ = {
            "model": self.args.served_model_name or pair.target.name,
            "target": pair.target.name,
            "drafter": {
                "family": drafter.cfg.family,
                "k": drafter.cfg.k,
                "depth": drafter.cfg.depth,
            },
            "tree": [list(p) for p in tree.paths],
            "ngram": tree.ngram and tree.ngram.model_dump(),
            "lookup_store_grams": len(store.table) if store else None,
            "speculation": eng.speculation,
            "max_context": self.max_context,
            "source": pair.source,
            "device": str(self.target.device),
        }
        self.metrics = _Metrics()
        policy = (
            build_policy(self.target, drafter, tree, saved, eng)
            if eng.speculation == "auto"
            else None
        )
        self.info_["policy"] = policy.as_dict() if policy else None
        self.scheduler = Scheduler(
            SpeculativeDecoder(self.target, drafter, tree, store),
            eng.speculation,
            eng.max_active,
            policy,
            on_finish=self._on_finish,
        )
        log.info("draftlab engine ready: %s", self.info_)

    def info(self) -> dict:
        return self.info_

    # -- requests --------------------------------------------------------------------
    def _tokenize(self, req: dict) -> list[int]:
        tok = self.target.tokenizer
        if req.get("messages") is not None:
            if not getattr(tok, "chat_template", None):
                raise ValueError("this model has no chat template: use /v1/completions")
            ids = tok.apply_chat_template(
                req["messages"], add_generation_prompt=True, tokenize=True
            )
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        prompt = req["prompt"]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list):
            vocab = self.target.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"token ids out of range [0, {vocab}): {bad[:5]}")
            return list(prompt)
        return tok(prompt, add_special_tokens=True)["input_ids"]

    def _admit(self, req: dict) -> tuple[list[int], SamplingParams] | Failed:
        """The prompt's ids and sampling params, or an error event (bad prompt, too long)."""
        try:
            ids = self._tokenize(req)
        except (ValueError, TypeError) as e:
            return Failed(str(e), status=400, param="messages" if req.get("messages") else "prompt")
        if not ids:
            return Failed("the prompt is empty", status=400, param="prompt")
        room = self.max_context - len(ids)
        if room < 1:
            return Failed(
                f"this model's maximum context length is {self.max_context} tokens; the prompt has "
                f"{len(ids)}",
                status=400,
                param="messages" if req.get("messages") else "prompt",
                code="context_length_exceeded",
            )
        default = (
            self.args.engine.default_max_tokens if req.get("messages") else 16
        )  # OpenAI's completions default
        wanted = req.get("max_tokens") or min(default, room)
        if wanted > room:
            return Failed(
                f"this model's maximum context length is {self.max_context} tokens; you requested "
                f"{len(ids) + wanted} ({len(ids)} in the prompt, {wanted} for the completion)",
                status=400,
                param="max_tokens",
                code="context_length_exceeded",
            )
        return ids, SamplingParams(max_new_tokens=wanted, **req["sampling"])

    async def generate(self, req: dict):
        admitted = self._admit(req)
        if isinstance(admitted, Failed):
            self.metrics.requests.inc(tags={"status": "rejected"})
            yield admitted
            return
        ids, params = admitted
        yield Accepted(prompt_tokens=len(ids))
        async for event in self._decode(ids, params, req.get("speculation")):
            yield event

    async def _decode(
        self,
        ids: list[int],
        params: SamplingParams,
        speculation: str | None,
        internal: bool = False,
    ):
        from draftlab.serve.scheduler import ShuttingDown  # noqa: PLC0415 -- torch

        loop, queue = asyncio.get_running_loop(), asyncio.Queue()

        def publish(event: EngineEvent) -> None:  # called on the decoding thread
            loop.call_soon_threadsafe(queue.put_nowait, event)

        try:
            ticket = self.scheduler.submit(ids, params, publish, speculation, internal)
        except ShuttingDown as e:
            yield Failed(str(e), status=503)
            return
        try:
            while True:
                event = await queue.get()
                if (
                    isinstance(event, Failed) and not self.scheduler.alive
                ):  # shut down under it: retryable
                    event = dataclasses.replace(event, status=503)
                yield event
                if isinstance(event, Done | Failed):
                    return
        finally:  # the client went away (or we are done): free the slot
            ticket.cancel()

    def _on_finish(self, ticket) -> None:
        if ticket.internal:
            return
        s = ticket.session
        if s is None or not s.done:
            self.metrics.requests.inc(tags={"status": "cancelled"})
            return
        r = s.result()
        self.metrics.requests.inc(tags={"status": "ok"})
        self.metrics.tokens.inc(len(r.tokens))
        self.metrics.tau.observe(r.stats.tau)
        self.metrics.latency.observe(time.perf_counter() - ticket.submitted)
        self.metrics.tokens_per_s.set(r.stats.tokens_per_s)

    # -- health and shutdown ---------------------------------------------------------------
    async def check_health(self) -> None:
        """Serve restarts the replica if this raises: a dead decoding thread, a thread stuck
        on its work, or (when idle) a one-token generation that fails."""
        s = self.scheduler
        self.metrics.queue.set(s.queue_length)
        self.metrics.active.set(s.num_active)
        if not s.alive:
            raise RuntimeError("the decoding thread has stopped")
        if s.num_active:  # busy: real requests are the probe
            if time.monotonic() - s.last_step > HEALTH_STALL_S:
                raise RuntimeError(
                    f"no decoding round finished for {HEALTH_STALL_S:.0f} s with {s.num_active} "
                    "active"
                )
            return
        # idle: one speculative round end to end (prefill, draft, verify) on a 1-token prompt
        async for event in self._decode([0], SamplingParams(max_new_tokens=2), "on", internal=True):
            if isinstance(event, Failed):
                raise RuntimeError(f"health probe failed: {event.message}")

    def __del__(self):
        # Serve has already waited `graceful_shutdown_timeout_s` for running requests to drain
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None:
            scheduler.shutdown(timeout=1.0)
