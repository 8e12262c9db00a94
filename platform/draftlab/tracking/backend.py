"""Where MLflow lives and how a call to it is bounded.

The tracking URI (explicit, `$MLFLOW_TRACKING_URI`, else a sqlite file under `.draftlab/`),
where a new experiment keeps its artifacts, a one-off `MlflowClient`, and the guards that keep
a dead or stalled server from costing MLflow's minutes of retries: a cheap `/health` probe,
calls run against a deadline, and the split between errors worth retrying and permanent ones.
"""

from __future__ import annotations

import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from draftlab.errors import DraftlabError

DEFAULT_DIR = ".draftlab"

# MLflow error codes that retrying cannot fix (everything else, e.g. INTERNAL_ERROR for a
# refused connection or TEMPORARILY_UNAVAILABLE for a locked sqlite file, is retried).
_PERMANENT_ERRORS = frozenset(
    {
        "INVALID_PARAMETER_VALUE",
        "RESOURCE_DOES_NOT_EXIST",
        "RESOURCE_ALREADY_EXISTS",
        "PERMISSION_DENIED",
        "UNAUTHENTICATED",
        "BAD_REQUEST",
        "INVALID_STATE",
        "ENDPOINT_NOT_FOUND",
        "FEATURE_DISABLED",
    }
)


class TrackingUnavailable(DraftlabError):
    """The tracking backend stayed unreachable for longer than a flush's `max_buffer_seconds`
    or, across flush attempts, than `max_outage_s`."""


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


def sqlite_path(uri: str) -> Path | None:
    """The database file of a `sqlite:///...` URI, else None."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///") :].split("?", 1)[0]
    return Path(path) if path and path != ":memory:" else None


def artifact_location(uri: str) -> str | None:
    """Where new experiments keep artifacts: beside a sqlite db, else the server decides.

    For the default backend that is `.draftlab/mlartifacts`; without it MLflow would scatter
    artifacts into `./mlruns` of whatever directory the process happened to start in.
    """
    db = sqlite_path(uri)
    if db is None:
        return None
    loc = db.resolve().parent / "mlartifacts"
    loc.mkdir(parents=True, exist_ok=True)
    return loc.as_uri()


def is_http(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def now_ms() -> int:
    """MLflow's timestamps: epoch milliseconds."""
    return int(time.time() * 1000)


# ----------------------------------------------------------------------------- reachability


def server_reachable(uri: str, timeout: float) -> bool:
    """Cheap probe so a dead server costs milliseconds, not MLflow's ~4 min of retries."""
    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout):
            return True
    except urllib.error.HTTPError as e:
        # Any answer means something is listening; 502-504 is a proxy without a backend.
        return e.code not in (502, 503, 504)
    except (urllib.error.URLError, OSError):
        return False


def probe(uri: str, timeout: float) -> None:
    """Raise ConnectionError at once if an HTTP backend does not answer its health check."""
    if is_http(uri) and not server_reachable(uri, timeout):
        raise ConnectionError(f"{uri}/health does not answer")


def mlflow_client(tracking_uri: str | None = None):
    """(resolved tracking URI, `MlflowClient`) for a one-off query (`runs`, `promote`, serving
    a registered champion): a server that does not answer raises `TrackingUnavailable` at
    once instead of after MLflow's minutes of retries."""
    from mlflow import MlflowClient  # noqa: PLC0415 -- mlflow (package docstring)

    uri = resolve_tracking_uri(tracking_uri)
    if is_http(uri) and not server_reachable(uri, timeout=5.0):
        raise TrackingUnavailable(
            f"MLflow at {uri} does not answer (is the server up? set --tracking-uri or "
            "MLFLOW_TRACKING_URI)"
        )
    return uri, MlflowClient(tracking_uri=uri)


# ----------------------------------------------------------------------------- bounded calls


class _Deadline(Exception):
    pass


def is_transient(exc: BaseException) -> bool:
    """Retrying may help: a refused / timed-out / overrun call, or a non-permanent MLflow error."""
    from mlflow.exceptions import MlflowException  # noqa: PLC0415 -- mlflow (package docstring)

    if isinstance(exc, _Deadline):
        return True
    if isinstance(exc, MlflowException):
        return exc.error_code not in _PERMANENT_ERRORS
    return isinstance(exc, (OSError, TimeoutError))  # requests' errors are OSErrors


def call_with_timeout(fn: Callable[[], Any], timeout: float) -> Any:
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
