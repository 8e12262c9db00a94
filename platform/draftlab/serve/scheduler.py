"""One decoding thread per replica that batches concurrent requests round by round.

    submit(prompt, params) -> Ticket       (any thread; `publish` receives its events)
    the loop: admit waiting tickets (prefill each) -> one round of all the others in ONE
              target forward (`step_many`) -> publish deltas, retire the finished

Every request owns a `Session` (its own target and drafter caches); the shared forward
gives each row exactly the keys of its own request (`Target.forward_many`), so batching
never mixes state and outputs equal target-only decoding. `_speculate()` applies the
speculation policy (`EngineSpec.speculation`, `serve/policy.py`) per request and round:
under load the rows of every request's tree add up, and plain steps (one row each) can beat
drafting; a request switches freely without changing its output (see `Session.step`).

Events put on a ticket's queue (via `publish`, on the caller's event loop; `serve/events.py`):
    Delta(text, tokens)                     text committed since the last event
    Done(finish_reason, stats, ...)         the last one
    Failed(message)                         the request failed (the engine lives on),
                                            or `shutdown` came first (then `alive` is False)
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from draftlab.config import SamplingParams
from draftlab.decoding.engine import Session, SpeculativeDecoder, step_many
from draftlab.serve.events import Delta, Done, EngineEvent, Failed
from draftlab.serve.policy import SpeculationPolicy

log = logging.getLogger(__name__)
# Partial UTF-8 (a multi-byte character split across tokens) decodes to U+FFFD until the
# rest arrives: such a tail is held back rather than streamed and then taken back.
REPLACEMENT = "\ufffd"


class ShuttingDown(RuntimeError):
    """`submit` after `shutdown`: the request was not taken (another replica may take it)."""


@dataclass(eq=False)  # identity: a ticket is one request
class Ticket:
    """A submitted request: what to decode, where its events go, and its progress."""

    id: int
    prompt: list[int]
    params: SamplingParams
    speculation: str  # "on" | "off" | "auto"
    publish: Callable[[EngineEvent], None]
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    session: Session | None = None
    sent_chars: int = 0  # text already published
    internal: bool = False  # a health probe: not counted in the metrics

    def cancel(self) -> None:
        """The client went away: the loop drops it at its next turn."""
        self.cancelled = True


class Scheduler:
    """Owns the decoding thread. Up to `max_active` sessions step together; more wait."""

    def __init__(
        self,
        decoder: SpeculativeDecoder,
        speculation: str = "auto",
        max_active: int = 16,
        policy: SpeculationPolicy | None = None,
        on_finish: Callable[[Ticket], None] | None = None,
    ):
        self.decoder = decoder
        self.speculation, self.max_active = speculation, max_active
        self.policy = policy  # `auto` without a policy drafts every round
        self.on_finish = on_finish
        self._waiting: deque[Ticket] = deque()
        self._active: list[Ticket] = []
        self._wake = threading.Condition()
        self._ids = itertools.count()
        self._stop = False
        self.last_step = time.monotonic()  # when a round last finished (health: a stuck thread)
        self._thread = threading.Thread(target=self._loop, name="draftlab-decode", daemon=True)
        self._thread.start()

    # -- called from request handlers -----------------------------------------------
    def submit(
        self,
        prompt: list[int],
        params: SamplingParams,
        publish: Callable[[EngineEvent], None],
        speculation: str | None = None,
        internal: bool = False,
    ) -> Ticket:
        mode = speculation or self.speculation
        if mode == "auto" and params.seed is not None and not params.greedy:
            # Which rounds draft changes which random numbers a sample uses: a seeded sample
            # drafts every round, so its text is the same whatever the load.
            mode = "on"
        t = Ticket(next(self._ids), prompt, params, mode, publish, internal=internal)
        with self._wake:
            if self._stop:
                raise ShuttingDown("the engine is shutting down")
            self._waiting.append(t)
            self._wake.notify()
        return t

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop

    @property
    def queue_length(self) -> int:
        return len(self._waiting)

    @property
    def num_active(self) -> int:
        return len(self._active)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Finish what runs (up to `timeout`), fail what waits, stop the thread."""
        deadline = time.monotonic() + timeout
        while self._active and time.monotonic() < deadline:
            time.sleep(0.05)
        with self._wake:
            self._stop = True
            for t in [*self._waiting, *self._active]:
                t.publish(Failed("the server is shutting down"))
            self._waiting.clear()
            self._wake.notify()
        self._thread.join(timeout=5)

    # -- the decoding thread -----------------------------------------------------------
    def _speculate(self, ready: list[Ticket]) -> list[bool]:
        """Per ticket: `on`/`off` as asked; `auto` tickets follow the policy at this load."""
        auto = any(t.speculation == "auto" for t in ready)
        auto_on = auto and (self.policy is None or self.policy.speculate(len(ready)))
        return [t.speculation == "on" or (t.speculation == "auto" and auto_on) for t in ready]

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stop and not self._waiting and not self._active:
                    self._wake.wait()
                if self._stop:
                    return
                while self._waiting and len(self._active) < self.max_active:
                    self._active.append(self._waiting.popleft())
            self._round()

    def _round(self) -> None:
        """Prefill the newly admitted, then one round of every other active request in a
        single target forward (`step_many`), then publish and retire."""
        ready = []
        for t in list(self._active):
            if t.cancelled:
                self._retire(t)
            elif t.session is None:
                try:
                    t.session = self.decoder.start(t.prompt, t.params)
                except Exception as e:  # one request's failure must not stop the others
                    self._fail(t, e)
                    continue
                self._progress(t)
            else:
                ready.append(t)
        if not ready:
            return
        by_session = {id(t.session): t for t in ready}
        failed: set[int] = set()

        def on_error(session, e: Exception) -> None:
            failed.add(id(session))
            self._fail(by_session[id(session)], e)

        flags = self._speculate(ready)
        before = [(t.session.stats.accepted, t.session.stats.draft_s) for t in ready]
        step_many([t.session for t in ready], flags, on_error)
        self.last_step = time.monotonic()
        for t, drafted, (acc, draft_s) in zip(ready, flags, before, strict=True):
            if id(t.session) in failed:
                continue
            if drafted and self.policy is not None:
                st = t.session.stats
                self.policy.observe(st.accepted - acc + 1, 1000 * (st.draft_s - draft_s))
            self._progress(t)

    def _progress(self, t: Ticket) -> None:
        self._publish_delta(t)
        if t.session.done:
            result = t.session.result()
            t.publish(
                Done(
                    finish_reason=result.finish_reason,
                    stats=result.stats.as_dict(),
                    completion_tokens=len(result.tokens),
                    queued_s=t.session.t_start - t.submitted,
                )
            )
            self._retire(t)

    def _fail(self, t: Ticket, e: Exception) -> None:
        log.error("request %d failed: %s: %s", t.id, type(e).__name__, e)
        t.publish(Failed(f"{type(e).__name__}: {e}"))
        self._retire(t)

    def _retire(self, t: Ticket) -> None:
        if t in self._active:
            self._active.remove(t)
        if self.on_finish:
            self.on_finish(t)

    @staticmethod
    def _publish_delta(t: Ticket) -> None:
        """Publish the text committed since the last event. While running, hold back what
        could still turn into a stop string (its length - 1 chars) or a partial character."""
        s = t.session
        text = s.stopper.text
        if not s.done:
            hold = max((len(x) for x in t.params.stop), default=1) - 1
            text = text[: len(text) - hold] if hold else text
            text = text.rstrip(REPLACEMENT)
        if len(text) > t.sent_chars or s.done:
            t.publish(Delta(text=text[t.sent_chars :], tokens=len(s.tokens)))
            t.sent_chars = max(t.sent_chars, len(text))
