"""A run's metrics on their way to MLflow: buffered in memory, delivered in step-whole
batches, kept through an outage (and through a checkpoint, as a snapshot), and the outage
clock that fails the run once the backend has been gone too long.

`Tracker` composes one `MetricDelivery` and hands its metric methods to it; nothing here
starts, ends or names a run.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from draftlab.tracking.backend import (
    TrackingUnavailable,
    call_with_timeout,
    is_http,
    is_transient,
    now_ms,
    probe,
    server_reachable,
)

# MLflow's own limit (mlflow.utils.validation); copied so importing this module stays cheap.
MAX_METRICS_PER_BATCH = 1000

logger = logging.getLogger(__name__)


class MetricDelivery:
    """The metric buffer of one run and its delivery.

    `flush()` retries with exponential backoff while the backend is unreachable, for at most
    `max_buffer_seconds`; then it raises `TrackingUnavailable` and keeps the buffer, so a
    later `flush()` still delivers everything. It never blocks longer than that budget.

    Training must not wait out an outage, so it uses the non-blocking side instead:
    `try_flush()` makes one attempt bounded by `attempt_timeout_s` and keeps what it could
    not send; `poll()` retries every `retry_every_s` while the backend is down; `snapshot()`
    / `restore()` carry the undelivered metrics (and the outage clock) through a checkpoint,
    so a crash during an outage loses none (a re-sent record that had in fact arrived is an
    exact duplicate, which MLflow's SQL store drops). Once the backend has been unreachable
    for longer than `max_outage_s`, `try_flush()` raises `TrackingUnavailable` naming the URI
    and the limit: the run fails instead of training on untracked. `drain()` waits for
    delivery, within that same limit.

    `client()` returns the run's `MlflowClient` and `require_run()` its run id (raising if it
    has none yet); both are asked only when a delivery needs them.
    """

    def __init__(
        self,
        tracking_uri: str | None,
        client: Callable[[], Any],
        require_run: Callable[[], str],
        max_buffer_seconds: float,
        max_outage_s: float,
        attempt_timeout_s: float,
        retry_every_s: float,
    ):
        self.tracking_uri = tracking_uri
        self.max_buffer_seconds = max_buffer_seconds
        self.max_outage_s = max_outage_s
        self.attempt_timeout_s = attempt_timeout_s
        self.retry_every_s = retry_every_s
        self._client = client
        self._require_run = require_run
        self._buffer: list[tuple[str, float, int, int]] = []  # (key, value, timestamp_ms, step)
        self._logged_through = -1  # see resume_after()
        self._resume_key: str | None = None  # resume_after() not resolved yet (backend was down)
        self._exempt = 0  # leading buffer records restored from a checkpoint: never resume-filtered
        self._down_since: float | None = None  # wall clock of the current outage's first failure
        self._last_attempt = float("-inf")  # monotonic time of the last try_flush()
        self._last_error: BaseException | None = None
        self._lock = threading.Lock()

    # -- buffering

    def resume_after(self, key: str) -> int | None:
        """Drop buffered and future metrics at steps already logged for `key` (returns that
        step), or None when the backend does not answer: the first delivery looks it up."""
        with self._lock:
            self._resume_key = key
            try:
                self._resolve_resume(self._require_run(), time.monotonic() + self.attempt_timeout_s)
            except Exception as e:
                if not is_transient(e):
                    raise
                logger.warning(
                    "MLflow at %s does not answer (%s); the last logged step is looked up later",
                    self.tracking_uri,
                    e,
                )
                return None
            return self._logged_through

    def _resolve_resume(self, run_id: str, deadline: float) -> None:
        key = self._resume_key
        if key is None:
            return
        probe(self.tracking_uri, max(0.1, min(5.0, deadline - time.monotonic())))
        history = call_with_timeout(
            lambda: self._client().get_metric_history(run_id, key), deadline - time.monotonic()
        )
        self._logged_through = max((m.step for m in history), default=0)
        keep, rest = self._buffer[: self._exempt], self._buffer[self._exempt :]
        self._buffer = keep + [r for r in rest if r[3] > self._logged_through]
        self._resume_key, self._exempt = None, 0

    def buffer_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Remember `metrics` for `step` (timestamped now) unless that step is already logged."""
        if step <= self._logged_through:
            return
        ts = now_ms()
        with self._lock:
            self._buffer.extend((k, float(v), ts, int(step)) for k, v in metrics.items())

    @property
    def pending(self) -> int:
        """Number of buffered, not yet delivered metric values."""
        return len(self._buffer)

    def discard(self) -> None:
        """Forget everything buffered (a run that ends FAILED/KILLED re-runs those steps)."""
        with self._lock:
            self._buffer.clear()

    # -- delivery

    def flush(self) -> None:
        """Send everything buffered, retrying for at most `max_buffer_seconds`."""
        with self._lock:  # one flush at a time; buffer_metrics from other threads waits
            if not self._buffer:
                return
            self._flush_locked(self._require_run())

    def _flush_locked(self, run_id: str) -> None:
        deadline = time.monotonic() + self.max_buffer_seconds
        delay, attempts = 0.5, 0
        while True:
            attempts += 1
            try:
                self._send(run_id, deadline)
                self._up()
                return
            except Exception as e:
                if not is_transient(e):
                    raise
                self._down(e)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TrackingUnavailable(
                    f"MLflow at {self.tracking_uri} unreachable for {self.max_buffer_seconds:g} s "
                    f"({attempts} attempts); {len(self._buffer)} metric values stay buffered "
                    f"and will be sent by the next flush(). Last error: {self._last_error}"
                )
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, 10.0)

    def _send(self, run_id: str, deadline: float) -> None:
        """One delivery attempt of the whole buffer before `deadline` (monotonic); raises on
        failure, keeping what was not delivered."""
        from mlflow.entities import Metric  # noqa: PLC0415 -- mlflow (package docstring)

        probe(self.tracking_uri, max(0.1, min(5.0, deadline - time.monotonic())))
        self._resolve_resume(run_id, deadline)
        while self._buffer:
            chunk = self._next_chunk()
            batch = [Metric(k, v, ts, s) for k, v, ts, s in chunk]
            call_with_timeout(
                lambda b=batch: self._client().log_batch(run_id, metrics=b, synchronous=True),
                deadline - time.monotonic(),
            )
            del self._buffer[: len(chunk)]  # delivered: a later retry only sends the rest

    def _next_chunk(self) -> list[tuple[str, float, int, int]]:
        """The next <= 1000 records, cut at a step boundary (a step is delivered whole)."""
        n = min(len(self._buffer), MAX_METRICS_PER_BATCH)
        if n < len(self._buffer):
            cut = n
            while cut > 0 and self._buffer[cut - 1][3] == self._buffer[cut][3]:
                cut -= 1
            n = cut or n
        return self._buffer[:n]

    def try_flush(self) -> bool:
        """One delivery attempt bounded by `attempt_timeout_s`: True when nothing is left
        buffered; past `max_outage_s` of outage raises `TrackingUnavailable`."""
        with self._lock:
            if not self._buffer:
                return True
            self._last_attempt = time.monotonic()
            try:
                self._send(self._require_run(), time.monotonic() + self.attempt_timeout_s)
            except Exception as e:
                if not is_transient(e):
                    raise
                self._down(e)
                self._check_outage()
                return False
            self._up()
            return True

    def poll(self) -> None:
        """During an outage, `try_flush()` again once `retry_every_s` has passed."""
        if (
            self._down_since is not None
            and time.monotonic() - self._last_attempt >= self.retry_every_s
        ):
            self.try_flush()

    def drain(self) -> None:
        """`try_flush()` with backoff until everything is delivered or the outage is too long."""
        delay = 0.5
        while not self.try_flush():
            time.sleep(delay)
            delay = min(delay * 2, self.retry_every_s)

    # -- the outage clock

    def _up(self) -> None:
        self._down_since, self._last_error = None, None

    def _down(self, error: BaseException) -> None:
        if self._down_since is None:
            self._down_since = time.time()
        self._last_error = error

    @property
    def outage_seconds(self) -> float:
        """How long delivery has been failing (0 while the backend answers)."""
        return 0.0 if self._down_since is None else max(0.0, time.time() - self._down_since)

    def _check_outage(self) -> None:
        if self.outage_seconds > self.max_outage_s:
            raise TrackingUnavailable(
                f"MLflow at {self.tracking_uri} has been unreachable for {self.outage_seconds:.0f} "
                f"s, longer than tracking.max_outage_s = {self.max_outage_s:g} s: failing the run "
                f"rather than training on untracked. {len(self._buffer)} metric values were not "
                "delivered; the latest checkpoint keeps those up to its step, and a resumed run "
                f"sends them. Last error: {self._last_error}"
            )

    def await_backend(self) -> None:
        """Before an unbuffered call: wait out an outage within `max_outage_s` (a dead server
        otherwise costs MLflow's own minutes of retries per call, then fails anyway)."""
        if not is_http(self.tracking_uri):
            return
        delay = 0.5
        while not server_reachable(self.tracking_uri, timeout=self.attempt_timeout_s):
            self._down(ConnectionError(f"{self.tracking_uri}/health does not answer"))
            self._check_outage()
            time.sleep(delay)
            delay = min(delay * 2, self.retry_every_s)
        if not self._buffer:
            self._up()

    # -- through a checkpoint

    def snapshot(self) -> dict:
        """The undelivered metrics and the outage clock, JSON-able."""
        with self._lock:
            exempt = self._exempt if self._resume_key is not None else len(self._buffer)
            return {
                "pending": [list(r) for r in self._buffer],
                "exempt": exempt,
                "down_since": self._down_since,
            }

    def restore(self, snapshot: Mapping[str, Any]) -> None:
        """Put a `snapshot()`'s metrics ahead of the buffer and take over its outage clock."""
        with self._lock:
            pending = [
                (str(k), float(v), int(ts), int(s)) for k, v, ts, s in snapshot.get("pending", [])
            ]
            self._buffer[:0] = pending
            self._exempt = int(snapshot.get("exempt", len(pending)))
            self._down_since = snapshot.get("down_since")
