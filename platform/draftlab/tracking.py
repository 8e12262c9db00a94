"""The one module that talks to MLflow.

Everything else in draftlab logs through `Tracker`, a rank-0 wrapper around an explicit
`mlflow.MlflowClient` (no fluent `mlflow.start_run()` state, so several trackers, threads
or Tune trials in one process never write into each other's runs).

    tracker = Tracker(cfg.tracking.tracking_uri, cfg.tracking.experiment, enabled=rank == 0)
    tracker.start_or_resume("distill-smollm2-k4", tags={"draftlab.job": "distill"})
    tracker.log_params(cfg.model_dump())
    tracker.buffer_metrics({"loss": loss}, step)        # every step, in memory
    tracker.try_flush()                                 # before a checkpoint: never waits out an outage
    save(..., tracking=tracker.snapshot())              # what MLflow has not got yet rides in the checkpoint
    tracker.end("FINISHED")

`mlflow` is imported inside functions: `import mlflow` costs ~1.2 s and nothing here
should run (or slow down `draftlab --help`) at import time.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from draftlab.errors import DraftlabError

RUN_NAME_TAG = "draftlab.run_name"
EXPERIMENT_PREFIX = "draftlab"
DEFAULT_DIR = ".draftlab"
# Metrics shown by `list_runs` / `draftlab runs`, in column order.
KEY_METRICS = ("tau", "speedup_vs_ar", "loss", "eval/sim_accept_len")
END_STATUSES = ("FINISHED", "FAILED", "KILLED")

# MLflow's own limits (mlflow.utils.validation); copied so importing this module stays cheap.
MAX_PARAM_VAL_LENGTH = 6000
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_TAGS_PER_BATCH = 100
REDACTED = "***"

logger = logging.getLogger(__name__)

# MLflow error codes that retrying cannot fix (everything else, e.g. INTERNAL_ERROR for a
# refused connection or TEMPORARILY_UNAVAILABLE for a locked sqlite file, is retried).
_PERMANENT_ERRORS = frozenset({
    "INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "RESOURCE_ALREADY_EXISTS",
    "PERMISSION_DENIED", "UNAUTHENTICATED", "BAD_REQUEST", "INVALID_STATE",
    "ENDPOINT_NOT_FOUND", "FEATURE_DISABLED",
})
# A dotted-key component "looks like a credential" when it is, or ends in, one of these
# words (`hf_token`, `wandb.api_key`, `clientSecret`), but not `max_new_tokens`/`tokenizer`.
_SECRET_RE = re.compile(r"(?:^|_)(?:key|api_?keys|apikey|token|secrets?|password|passwd|credentials?)$")
# Tokenizer special tokens are not secrets.
_NOT_SECRET = frozenset({"pad_token", "eos_token", "bos_token", "unk_token", "sep_token",
                         "cls_token", "mask_token"})


class TrackingUnavailable(DraftlabError):
    """The tracking backend stayed unreachable for longer than a flush's `max_buffer_seconds`
    or, across flush attempts, than `max_outage_s`."""


class ParamConflictError(ValueError):
    """A param was already logged to this run with a different value."""


# ----------------------------------------------------------------------------- URIs


def resolve_tracking_uri(uri: str | None = None) -> str:
    """Explicit `uri`, else `$MLFLOW_TRACKING_URI`, else `sqlite:///<abs>/.draftlab/mlflow.db`."""
    if uri:
        return uri
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    root = Path(DEFAULT_DIR).resolve()
    root.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{root / 'mlflow.db'}"


def _sqlite_path(uri: str) -> Path | None:
    """The database file of a `sqlite:///...` URI, else None."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///"):].split("?", 1)[0]
    return Path(path) if path and path != ":memory:" else None


def _artifact_location(uri: str) -> str | None:
    """Where new experiments keep artifacts: beside a sqlite db, else the server decides.

    For the default backend that is `.draftlab/mlartifacts`; without it MLflow would scatter
    artifacts into `./mlruns` of whatever directory the process happened to start in.
    """
    db = _sqlite_path(uri)
    if db is None:
        return None
    loc = db.resolve().parent / "mlartifacts"
    loc.mkdir(parents=True, exist_ok=True)
    return loc.as_uri()


def _is_http(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


# ----------------------------------------------------------------------------- params


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """`{"a": {"b": 1}, "c": [1, 2]}` -> `{"a.b": "1", "c": "[1, 2]"}` (pydantic models too)."""
    if hasattr(d, "model_dump"):
        d = d.model_dump()
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if hasattr(v, "model_dump"):
            v = v.model_dump()
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = str(v)
    return out


def looks_secret(key: str) -> bool:
    """True if any dotted component of `key` names a credential (case-insensitive)."""
    for part in key.split("."):
        # camelCase -> snake_case, then normalise separators: `apiKey` -> `api_key`.
        snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", part).lower().replace("-", "_")
        if snake not in _NOT_SECRET and _SECRET_RE.search(snake):
            return True
    return False


def prepare_params(params: Mapping[str, Any]) -> dict[str, str]:
    """Flatten, redact credentials to `***` and truncate values to MLflow's length limit."""
    out = {}
    for k, v in flatten(params).items():
        if looks_secret(k):
            v = REDACTED
        elif len(v) > MAX_PARAM_VAL_LENGTH:
            v = v[: MAX_PARAM_VAL_LENGTH - 3] + "..."
        out[k] = v
    return out


# ----------------------------------------------------------------------------- helpers


def _now_ms() -> int:
    return int(time.time() * 1000)


def _chunks(seq: list, n: int):
    for i in range(0, len(seq), n):
        yield seq[i : i + n]


class _Deadline(Exception):
    pass


def _is_transient(exc: BaseException) -> bool:
    """Retrying may help: a refused / timed-out / overrun call, or a non-permanent MLflow error."""
    from mlflow.exceptions import MlflowException

    if isinstance(exc, _Deadline):
        return True
    if isinstance(exc, MlflowException):
        return exc.error_code not in _PERMANENT_ERRORS
    return isinstance(exc, (OSError, TimeoutError))  # requests' errors are OSErrors


def _server_reachable(uri: str, timeout: float) -> bool:
    """Cheap probe so a dead server costs milliseconds, not MLflow's ~4 min of retries."""
    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout):
            return True
    except urllib.error.HTTPError as e:
        # Any answer means something is listening; 502-504 is a proxy without a backend.
        return e.code not in (502, 503, 504)
    except (urllib.error.URLError, OSError):
        return False


def mlflow_client(tracking_uri: str | None = None):
    """(resolved tracking URI, `MlflowClient`) for a one-off query (`runs`, `promote`, serving
    a registered champion): a server that does not answer raises `TrackingUnavailable` at
    once instead of after MLflow's minutes of retries."""
    from mlflow import MlflowClient

    uri = resolve_tracking_uri(tracking_uri)
    if _is_http(uri) and not _server_reachable(uri, timeout=5.0):
        raise TrackingUnavailable(f"MLflow at {uri} does not answer (is the server up? set --tracking-uri or "
                                  "MLFLOW_TRACKING_URI)")
    return uri, MlflowClient(tracking_uri=uri)


def _call_with_timeout(fn: Callable[[], Any], timeout: float) -> Any:
    """Run `fn` in a daemon thread, waiting at most `timeout` s (MLflow's HTTP client retries
    internally for minutes). A call that overruns is abandoned; if it lands later that is
    harmless, because a re-sent metric carries the same timestamp and MLflow's SQL store
    drops exact duplicates."""
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    t = threading.Thread(target=target, name="draftlab-mlflow", daemon=True)
    t.start()
    t.join(max(timeout, 0.0))
    if t.is_alive():
        raise _Deadline(f"MLflow call still running after {timeout:.1f} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


# ----------------------------------------------------------------------------- Tracker


class Tracker:
    """Rank-0 MLflow run: params, buffered metrics, artifacts, model registry.

    `enabled=False` (non-zero ranks) turns every method into a no-op that never imports
    mlflow or contacts a server; `start_or_resume` then returns `run_id or ""`.

    Metrics are buffered in memory and sent by `flush()`. Training flushes just before it
    commits a checkpoint, so every step up to a committed checkpoint is in MLflow (none
    lost). A crash between that flush and the commit means the restarted attempt re-runs
    steps that were already logged: `resume_after(key)` finds the last logged step and
    `buffer_metrics` then drops anything at or below it, so no step is logged twice.
    `end("FAILED"/"KILLED")` drops unflushed metrics (those steps are re-run), while
    `end("FINISHED")` flushes them.

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
    """

    def __init__(self, tracking_uri: str | None = None, experiment: str = "draftlab",
                 run_id: str | None = None, enabled: bool = True,
                 max_buffer_seconds: float = 120.0, max_outage_s: float = 300.0,
                 attempt_timeout_s: float = 5.0, retry_every_s: float = 5.0):
        self.enabled = enabled
        self.experiment = experiment
        self.run_id = run_id
        self.max_buffer_seconds = max_buffer_seconds
        self.max_outage_s = max_outage_s
        self.attempt_timeout_s = attempt_timeout_s
        self.retry_every_s = retry_every_s
        self.tracking_uri = resolve_tracking_uri(tracking_uri) if enabled else tracking_uri
        self.experiment_id: str | None = None
        self._client = None
        self._buffer: list[tuple[str, float, int, int]] = []  # (key, value, timestamp_ms, step)
        self._logged_through = -1  # see resume_after()
        self._resume_key: str | None = None  # resume_after() not resolved yet (backend was down)
        self._exempt = 0  # leading buffer records restored from a checkpoint: never resume-filtered
        self._down_since: float | None = None  # wall clock of the current outage's first failure
        self._last_attempt = float("-inf")  # monotonic time of the last try_flush()
        self._last_error: BaseException | None = None
        self._lock = threading.Lock()

    # -- plumbing

    @property
    def client(self):
        if self._client is None:
            from mlflow import MlflowClient

            self._client = MlflowClient(tracking_uri=self.tracking_uri)
        return self._client

    def _probe(self, timeout: float) -> None:
        """Raise ConnectionError at once if an HTTP backend does not answer its health check."""
        if _is_http(self.tracking_uri) and not _server_reachable(self.tracking_uri, timeout):
            raise ConnectionError(f"{self.tracking_uri}/health does not answer")

    def _require_run(self) -> str:
        if not self.run_id:
            raise RuntimeError("Tracker has no run: call start_or_resume() first")
        return self.run_id

    def _ensure_experiment(self) -> str:
        if self.experiment_id is not None:
            return self.experiment_id
        from mlflow.exceptions import MlflowException

        exp = self.client.get_experiment_by_name(self.experiment)
        if exp is None:
            try:
                self.experiment_id = self.client.create_experiment(
                    self.experiment, artifact_location=_artifact_location(self.tracking_uri))
            except MlflowException as e:  # another rank/trial created it first
                if e.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
                exp = self.client.get_experiment_by_name(self.experiment)
        if exp is not None:
            if exp.lifecycle_stage == "deleted":
                self.client.restore_experiment(exp.experiment_id)
            self.experiment_id = exp.experiment_id
        return self.experiment_id

    # -- run lifecycle

    def start_or_resume(self, run_name: str, tags: Mapping[str, Any] | None = None, resume: bool = True) -> str:
        """Resume the unfinished run tagged `draftlab.run_name == run_name`, else create one
        (`resume=False`: always create one).

        A restarted training job thus keeps logging into the same MLflow run. If the tracker
        was built with an explicit `run_id`, that run is resumed as is.
        """
        if not self.enabled:
            return self.run_id or ""
        tags = {k: str(v) for k, v in (tags or {}).items()}
        exp_id = self._ensure_experiment()
        if self.run_id is None and resume:
            self.run_id = self.find_unfinished(run_name)
        if self.run_id is not None:
            self.client.update_run(self.run_id, status="RUNNING")
            if tags:
                self.set_tags(tags)
        else:
            run = self.client.create_run(exp_id, run_name=run_name,
                                         tags={**tags, RUN_NAME_TAG: run_name})
            self.run_id = run.info.run_id
        return self.run_id

    def find_unfinished(self, run_name: str) -> str | None:
        """The newest run tagged `draftlab.run_name == run_name` unless it FINISHED."""
        escaped = run_name.replace("'", "\\'")
        found = self.client.search_runs(
            [self._ensure_experiment()], filter_string=f"tags.`{RUN_NAME_TAG}` = '{escaped}'",
            order_by=["attributes.start_time DESC"], max_results=1)
        return found[0].info.run_id if found and found[0].info.status != "FINISHED" else None

    def end(self, status: str = "FINISHED") -> None:
        """Terminate the run. FINISHED flushes pending metrics; FAILED/KILLED drop them."""
        if not self.enabled or not self.run_id:
            return
        if status not in END_STATUSES:
            raise ValueError(f"status must be one of {END_STATUSES}, got {status!r}")
        if status == "FINISHED":
            self.flush()
            self.client.set_terminated(self.run_id, status=status)
            return
        with self._lock:
            self._buffer.clear()
        # A failing run must fail now, not after MLflow's minutes of retries on a dead server.
        try:
            self._probe(self.attempt_timeout_s)
            _call_with_timeout(lambda: self.client.set_terminated(self.run_id, status=status), self.attempt_timeout_s)
        except Exception as e:
            if not _is_transient(e):
                raise
            logger.warning("could not mark MLflow run %s as %s at %s: %s", self.run_id, status, self.tracking_uri, e)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        from mlflow.entities import RunTag

        items = [RunTag(k, str(v)) for k, v in tags.items()]
        for chunk in _chunks(items, MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self._require_run(), tags=chunk, synchronous=True)

    # -- params

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log (nested) params: flattened with dots, secrets redacted, values truncated.

        Re-logging an identical value (a resumed run) is skipped; a different value raises
        `ParamConflictError` naming the keys, since MLflow params are immutable.
        """
        if not self.enabled:
            return
        from mlflow.entities import Param

        run_id = self._require_run()
        flat = prepare_params(params)
        existing = self.client.get_run(run_id).data.params
        conflicts = {k: (existing[k], v) for k, v in flat.items()
                     if k in existing and existing[k] != v}
        if conflicts:
            shown = "; ".join(f"{k}: logged {old!r}, now {new!r}"
                              for k, (old, new) in sorted(conflicts.items())[:10])
            raise ParamConflictError(
                f"run {run_id} already has {len(conflicts)} param(s) with different values "
                f"({shown}). MLflow params are immutable: start a new run (another run name) "
                f"or keep the config of the run being resumed.")
        new = [Param(k, v) for k, v in flat.items() if k not in existing]
        for chunk in _chunks(new, MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(run_id, params=chunk, synchronous=True)

    # -- metrics

    def resume_after(self, key: str) -> int | None:
        """After a restart: ignore metrics at steps already logged for `key` (returns that step).

        If the backend does not answer within `attempt_timeout_s`, the step is looked up by
        the first delivery that reaches it instead (returns None), and re-run metrics buffered
        meanwhile are filtered then. Records `restore()`d from a checkpoint are never dropped.
        """
        if not self.enabled:
            return 0
        with self._lock:
            self._resume_key = key
            try:
                self._resolve_resume(self._require_run(), time.monotonic() + self.attempt_timeout_s)
            except Exception as e:
                if not _is_transient(e):
                    raise
                logger.warning("MLflow at %s does not answer (%s); the last logged step is looked up later",
                               self.tracking_uri, e)
                return None
            return self._logged_through

    def _resolve_resume(self, run_id: str, deadline: float) -> None:
        key = self._resume_key
        if key is None:
            return
        self._probe(max(0.1, min(5.0, deadline - time.monotonic())))
        history = _call_with_timeout(lambda: self.client.get_metric_history(run_id, key), deadline - time.monotonic())
        self._logged_through = max((m.step for m in history), default=0)
        keep, rest = self._buffer[: self._exempt], self._buffer[self._exempt :]
        self._buffer = keep + [r for r in rest if r[3] > self._logged_through]
        self._resume_key, self._exempt = None, 0

    def buffer_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Remember `metrics` for `step` (timestamped now); nothing is sent until a flush.

        Buffer a step's metrics completely before any flush: a step is delivered whole or not
        at all (batches never split one), which `resume_after` relies on."""
        if not self.enabled or step <= self._logged_through:
            return
        ts = _now_ms()
        with self._lock:
            self._buffer.extend((k, float(v), ts, int(step)) for k, v in metrics.items())

    @property
    def pending(self) -> int:
        """Number of buffered, not yet delivered metric values."""
        return len(self._buffer)

    def flush(self) -> None:
        """Send all buffered metrics (`log_batch`, <= 1000 per call) and clear the buffer.

        Retries with backoff while the backend is unreachable; after `max_buffer_seconds`
        raises `TrackingUnavailable`, keeping whatever was not delivered.
        """
        if not self.enabled:
            return
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
                if not _is_transient(e):
                    raise
                self._down(e)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TrackingUnavailable(
                    f"MLflow at {self.tracking_uri} unreachable for {self.max_buffer_seconds:g} s "
                    f"({attempts} attempts); {len(self._buffer)} metric values stay buffered "
                    f"and will be sent by the next flush(). Last error: {self._last_error}")
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, 10.0)

    def _send(self, run_id: str, deadline: float) -> None:
        """One delivery attempt of the whole buffer before `deadline` (monotonic); raises on
        failure, keeping what was not delivered."""
        from mlflow.entities import Metric

        self._probe(max(0.1, min(5.0, deadline - time.monotonic())))
        self._resolve_resume(run_id, deadline)
        while self._buffer:
            chunk = self._next_chunk()
            batch = [Metric(k, v, ts, s) for k, v, ts, s in chunk]
            _call_with_timeout(lambda b=batch: self.client.log_batch(run_id, metrics=b, synchronous=True),
                               deadline - time.monotonic())
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
                f"MLflow at {self.tracking_uri} has been unreachable for {self.outage_seconds:.0f} s, "
                f"longer than tracking.max_outage_s = {self.max_outage_s:g} s: failing the run rather than "
                f"training on untracked. {len(self._buffer)} metric values were not delivered; the latest "
                f"checkpoint keeps those up to its step, and a resumed run sends them. "
                f"Last error: {self._last_error}")

    def try_flush(self) -> bool:
        """One delivery attempt bounded by `attempt_timeout_s`, for callers that must not wait
        out an outage: True when nothing is left buffered. Undelivered metrics stay buffered
        (save `snapshot()` with a checkpoint); past `max_outage_s` of outage it raises
        `TrackingUnavailable`."""
        if not self.enabled:
            return True
        with self._lock:
            if not self._buffer:
                return True
            self._last_attempt = time.monotonic()
            try:
                self._send(self._require_run(), time.monotonic() + self.attempt_timeout_s)
            except Exception as e:
                if not _is_transient(e):
                    raise
                self._down(e)
                self._check_outage()
                return False
            self._up()
            return True

    def poll(self) -> None:
        """Cheap, call it often (every training step): during an outage, retries delivery every
        `retry_every_s`, so metrics go out soon after the backend returns and an outage past
        `max_outage_s` fails promptly."""
        if self.enabled and self._down_since is not None and time.monotonic() - self._last_attempt >= self.retry_every_s:
            self.try_flush()

    def drain(self) -> None:
        """Deliver everything buffered, waiting through an outage for at most `max_outage_s`
        (counted from its start; then `TrackingUnavailable`)."""
        delay = 0.5
        while not self.try_flush():
            time.sleep(delay)
            delay = min(delay * 2, self.retry_every_s)

    def snapshot(self) -> dict | None:
        """The undelivered metrics and the outage clock, JSON-able, for a checkpoint's state."""
        if not self.enabled:
            return None
        with self._lock:
            exempt = self._exempt if self._resume_key is not None else len(self._buffer)
            return {"pending": [list(r) for r in self._buffer], "exempt": exempt, "down_since": self._down_since}

    def restore(self, snapshot: Mapping[str, Any] | None) -> None:
        """Take back a `snapshot()` from the checkpoint a restarted run resumes from (before
        `resume_after`): its metrics are sent by the next flush, its outage clock goes on."""
        if not self.enabled or not snapshot:
            return
        with self._lock:
            pending = [(str(k), float(v), int(ts), int(s)) for k, v, ts, s in snapshot.get("pending", [])]
            self._buffer[:0] = pending
            self._exempt = int(snapshot.get("exempt", len(pending)))
            self._down_since = snapshot.get("down_since")

    def log_metrics_now(self, metrics: Mapping[str, float], step: int) -> None:
        """`buffer_metrics` + `flush` (evaluation results, bench numbers)."""
        self.buffer_metrics(metrics, step)
        self.flush()

    # -- artifacts and models

    def _await_backend(self) -> None:
        """Before an unbuffered call: wait out an outage within `max_outage_s` (a dead server
        otherwise costs MLflow's own minutes of retries per call, then fails anyway)."""
        if not _is_http(self.tracking_uri):
            return
        delay = 0.5
        while not _server_reachable(self.tracking_uri, timeout=self.attempt_timeout_s):
            self._down(ConnectionError(f"{self.tracking_uri}/health does not answer"))
            self._check_outage()
            time.sleep(delay)
            delay = min(delay * 2, self.retry_every_s)
        if not self._buffer:
            self._up()

    def log_artifacts(self, local_dir: str | os.PathLike, artifact_path: str | None = None) -> None:
        if self.enabled:
            self._await_backend()
            self.client.log_artifacts(self._require_run(), str(local_dir), artifact_path)

    def log_text(self, text: str, artifact_file: str) -> None:
        if self.enabled:
            self._await_backend()
            self.client.log_text(self._require_run(), text, artifact_file)

    def log_dict(self, d: Mapping[str, Any], artifact_file: str) -> None:
        """Always JSON (MLflow's own `log_dict` switches to YAML for `.yaml` names)."""
        if self.enabled:
            self.log_text(json.dumps(d, indent=2, default=str), artifact_file)

    def run_exists(self) -> bool:
        """True if `run_id` names a run of this tracking store (a sqlite file that does not
        exist yet holds none, and is not created just to find that out). A server that does
        not answer raises `TrackingUnavailable` at once instead of retrying for minutes."""
        if not self.enabled or not self.run_id:
            return False
        db = _sqlite_path(self.tracking_uri)
        if db is not None and not db.exists():
            return False
        if _is_http(self.tracking_uri) and not _server_reachable(self.tracking_uri, timeout=5.0):
            raise TrackingUnavailable(f"MLflow at {self.tracking_uri} does not answer")
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(self.run_id)
        except MlflowException as e:
            if e.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                return False
            raise
        return True

    def download_artifacts(self, dst_dir: str | os.PathLike, names: Iterable[str] | None = None) -> list[str]:
        """Copy the run's top-level artifacts (files or folders) named in `names`, default
        all, into `dst_dir`; returns the names it had."""
        if not self.enabled:
            return []
        run_id, wanted = self._require_run(), None if names is None else set(names)
        present = sorted(a.path for a in self.client.list_artifacts(run_id) if wanted is None or a.path in wanted)
        for name in present:
            self.client.download_artifacts(run_id, name, str(dst_dir))
        return present

    def register_model(self, artifact_path: str, name: str,
                       tags: Mapping[str, Any] | None = None) -> str:
        """Register `runs:/<run_id>/<artifact_path>` as a new version of `name`; returns it."""
        if not self.enabled:
            return ""
        from mlflow.exceptions import MlflowException

        run_id = self._require_run()
        try:
            self.client.create_registered_model(name)
        except MlflowException as e:
            if e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        mv = self.client.create_model_version(
            name, source=f"runs:/{run_id}/{artifact_path.strip('/')}", run_id=run_id,
            tags={k: str(v) for k, v in (tags or {}).items()})
        return str(mv.version)

    def run_url(self) -> str | None:
        """Link to the run in the MLflow UI (http(s) tracking URIs only)."""
        if not self.enabled or not self.run_id or not _is_http(self.tracking_uri or ""):
            return None
        exp_id = self.experiment_id or self.client.get_run(self.run_id).info.experiment_id
        return f"{self.tracking_uri.rstrip('/')}/#/experiments/{exp_id}/runs/{self.run_id}"


# ----------------------------------------------------------------------------- promotion


def parent_tags(parent_run_id: str | None) -> dict[str, str]:
    """The tag that nests a run under `parent_run_id` in the MLflow UI (none if None)."""
    return {"mlflow.parentRunId": parent_run_id} if parent_run_id else {}


def drafter_model_name(target: str) -> str:
    """The registered model that collects the drafters of `target`: `draftlab-<target>-drafter`."""
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in target.split("/")[-1])
    return f"draftlab-{safe}-drafter"


def promote(run_id: str, registered_model: str | None = None, alias: str = "champion",
            tracking_uri: str | None = None) -> dict[str, Any]:
    """Give `alias` to the model version of `run_id`'s `drafter` artifact (registered first
    if the run has none yet). The previous holder keeps its version; the new version's tags
    record the drafter (K, depth, family), its measured tau / speedup and who it replaced.

    `registered_model` defaults to the name the run's distillation registered under, else
    `draftlab-<target>-drafter` from the run's `draftlab.target` tag.
    """
    from mlflow.exceptions import MlflowException

    uri, client = mlflow_client(tracking_uri)
    try:
        run = client.get_run(run_id)
    except MlflowException:
        raise ValueError(f"run {run_id!r} not found in {uri}") from None
    if "drafter" not in {a.path for a in client.list_artifacts(run_id)}:
        raise ValueError(f"run {run_id!r} has no 'drafter' artifact to promote (is it a distillation run?)")
    versions = [v for v in client.search_model_versions(f"run_id = '{run_id}'")
                if registered_model in (None, v.name)]
    if registered_model is None and not versions:
        target = run.data.tags.get("draftlab.target")
        if not target:
            raise ValueError(f"run {run_id!r} has no draftlab.target tag: pass the registered model name")
        registered_model = drafter_model_name(target)
    name = registered_model or versions[0].name
    try:
        client.create_registered_model(name)
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    mine = [v for v in versions if v.name == name]
    version = mine[0] if mine else client.create_model_version(name, source=f"runs:/{run_id}/drafter", run_id=run_id)
    try:
        previous = client.get_model_version_by_alias(name, alias).version
    except MlflowException:
        previous = None
    params, metrics = run.data.params, run.data.metrics
    tags = {"k": params.get("drafter.k"), "depth": params.get("drafter.depth"), "family": params.get("drafter.family"),
            "tree": params.get("tree") or params.get("bench.tree"), "hardware": run.data.tags.get("draftlab.hardware"),
            "tau": metrics.get("tau"), "speedup_vs_ar": metrics.get("speedup_vs_ar"),
            f"{alias}_since_ms": _now_ms(), f"replaced_{alias}_version": previous}
    for key, value in tags.items():
        if value is not None:
            client.set_model_version_tag(name, version.version, key, str(value))
    client.set_registered_model_alias(name, alias, version.version)
    return {"model": name, "version": str(version.version), "alias": alias, "previous": previous, "run_id": run_id}


# ----------------------------------------------------------------------------- listing


def list_runs(tracking_uri: str | None = None, experiment: str | None = None,
              max_results: int = 20) -> list[dict[str, Any]]:
    """Recent runs of `experiment` (default: every experiment named `draftlab*`), newest first.

    Each row: run_id, run_name, experiment, status, start_time (epoch ms) and `metrics`
    holding those of `KEY_METRICS` the run has.
    """
    uri = resolve_tracking_uri(tracking_uri)
    db = _sqlite_path(uri)
    if db is not None and not db.exists():
        return []  # nothing logged yet; don't create an empty database just to list it
    _, client = mlflow_client(uri)
    if experiment is not None:
        exp = client.get_experiment_by_name(experiment)
        exps = [exp] if exp is not None else []
    else:
        exps = [e for e in client.search_experiments(
            filter_string=f"name LIKE '{EXPERIMENT_PREFIX}%'", max_results=1000)]
    if not exps:
        return []
    names = {e.experiment_id: e.name for e in exps}
    runs = client.search_runs(list(names), order_by=["attributes.start_time DESC"],
                              max_results=max_results)
    return [{
        "run_id": r.info.run_id,
        "run_name": r.info.run_name,
        "experiment": names.get(r.info.experiment_id, r.info.experiment_id),
        "status": r.info.status,
        "start_time": r.info.start_time,
        "metrics": {k: r.data.metrics[k] for k in KEY_METRICS if k in r.data.metrics},
    } for r in runs]


def format_runs_table(rows: list[dict[str, Any]], width: int = 140) -> str:
    """`list_runs` rows as a rich table, rendered to plain text."""
    from datetime import datetime

    from rich.console import Console
    from rich.table import Table

    table = Table(title="draftlab runs", title_justify="left")
    for col in ("run id", "name", "experiment", "status", "started"):
        table.add_column(col, no_wrap=col in ("run id", "started"))
    for key in KEY_METRICS:
        table.add_column(key, justify="right")
    for r in rows:
        started = (datetime.fromtimestamp(r["start_time"] / 1000).strftime("%Y-%m-%d %H:%M")
                   if r.get("start_time") else "-")
        metrics = r.get("metrics", {})
        table.add_row(r["run_id"][:12], r.get("run_name") or "-", r.get("experiment", "-"),
                      r.get("status", "-"), started,
                      *(f"{metrics[k]:.4g}" if k in metrics else "-" for k in KEY_METRICS))
    buf = io.StringIO()
    Console(file=buf, width=width, color_system=None, force_terminal=False).print(table)
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines()) + "\n"
