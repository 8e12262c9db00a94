"""`Tracker`: one rank-0 MLflow run, around an explicit `mlflow.MlflowClient` (no fluent
`mlflow.start_run()` state, so several trackers, threads or Tune trials in one process never
write into each other's runs). It starts, resumes and ends the run and logs its params, tags
and artifacts; its metrics go through the `MetricDelivery` it composes (delivery.py).

    tracker = Tracker(cfg.tracking.tracking_uri, cfg.tracking.experiment, enabled=rank == 0)
    tracker.start_or_resume("distill-smollm2-k4", tags={"draftlab.job": "distill"})
    tracker.log_params(cfg.model_dump())
    tracker.buffer_metrics({"loss": loss}, step)        # every step, in memory
    tracker.try_flush()                                 # before a checkpoint: never waits
    save(..., tracking=tracker.snapshot())              # what MLflow lacks rides in the checkpoint
    tracker.end("FINISHED")
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any

from draftlab.tracking.backend import (
    TrackingUnavailable,
    artifact_location,
    call_with_timeout,
    is_http,
    is_transient,
    probe,
    resolve_tracking_uri,
    server_reachable,
    sqlite_path,
)
from draftlab.tracking.delivery import MetricDelivery
from draftlab.tracking.params import MAX_PARAMS_TAGS_PER_BATCH, ParamConflictError, prepare_params

RUN_NAME_TAG = "draftlab.run_name"
END_STATUSES = ("FINISHED", "FAILED", "KILLED")

logger = logging.getLogger(__name__)


def _chunks(seq: list, n: int):
    for i in range(0, len(seq), n):
        yield seq[i : i + n]


def parent_tags(parent_run_id: str | None) -> dict[str, str]:
    """The tag that nests a run under `parent_run_id` in the MLflow UI (none if None)."""
    return {"mlflow.parentRunId": parent_run_id} if parent_run_id else {}


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

    Delivery through an outage is `MetricDelivery`'s (delivery.py), and the metric methods
    here hand to it: `flush()` retries for at most `max_buffer_seconds`, keeping what it could
    not send; training, which must not wait one out, uses `try_flush()` (one attempt bounded
    by `attempt_timeout_s`), `poll()` (a retry every `retry_every_s`), `snapshot()` /
    `restore()` (the undelivered metrics and the outage clock through a checkpoint) and
    `drain()`; past `max_outage_s` of outage these raise `TrackingUnavailable`.
    """

    def __init__(
        self,
        tracking_uri: str | None = None,
        experiment: str = "draftlab",
        run_id: str | None = None,
        enabled: bool = True,
        max_buffer_seconds: float = 120.0,
        max_outage_s: float = 300.0,
        attempt_timeout_s: float = 5.0,
        retry_every_s: float = 5.0,
    ):
        self.enabled = enabled
        self.experiment = experiment
        self.run_id = run_id
        self.attempt_timeout_s = attempt_timeout_s
        self.tracking_uri = resolve_tracking_uri(tracking_uri) if enabled else tracking_uri
        self.experiment_id: str | None = None
        self._client = None
        self._delivery = MetricDelivery(
            self.tracking_uri,
            lambda: self.client,
            self._require_run,
            max_buffer_seconds=max_buffer_seconds,
            max_outage_s=max_outage_s,
            attempt_timeout_s=attempt_timeout_s,
            retry_every_s=retry_every_s,
        )

    # -- plumbing

    @property
    def client(self):
        if self._client is None:
            from mlflow import MlflowClient  # noqa: PLC0415 -- mlflow (package docstring)

            self._client = MlflowClient(tracking_uri=self.tracking_uri)
        return self._client

    def _require_run(self) -> str:
        if not self.run_id:
            raise RuntimeError("Tracker has no run: call start_or_resume() first")
        return self.run_id

    def _ensure_experiment(self) -> str:
        if self.experiment_id is not None:
            return self.experiment_id
        from mlflow.exceptions import MlflowException  # noqa: PLC0415 -- mlflow (package docstring)

        exp = self.client.get_experiment_by_name(self.experiment)
        if exp is None:
            try:
                self.experiment_id = self.client.create_experiment(
                    self.experiment, artifact_location=artifact_location(self.tracking_uri)
                )
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

    def start_or_resume(
        self, run_name: str, tags: Mapping[str, Any] | None = None, resume: bool = True
    ) -> str:
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
            run = self.client.create_run(
                exp_id, run_name=run_name, tags={**tags, RUN_NAME_TAG: run_name}
            )
            self.run_id = run.info.run_id
        return self.run_id

    def find_unfinished(self, run_name: str) -> str | None:
        """The newest run tagged `draftlab.run_name == run_name` unless it FINISHED."""
        escaped = run_name.replace("'", "\\'")
        found = self.client.search_runs(
            [self._ensure_experiment()],
            filter_string=f"tags.`{RUN_NAME_TAG}` = '{escaped}'",
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
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
        self._delivery.discard()
        # A failing run must fail now, not after MLflow's minutes of retries on a dead server.
        try:
            probe(self.tracking_uri, self.attempt_timeout_s)
            call_with_timeout(
                lambda: self.client.set_terminated(self.run_id, status=status),
                self.attempt_timeout_s,
            )
        except Exception as e:
            if not is_transient(e):
                raise
            logger.warning(
                "could not mark MLflow run %s as %s at %s: %s",
                self.run_id,
                status,
                self.tracking_uri,
                e,
            )

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        from mlflow.entities import RunTag  # noqa: PLC0415 -- mlflow (package docstring)

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
        from mlflow.entities import Param  # noqa: PLC0415 -- mlflow (package docstring)

        run_id = self._require_run()
        flat = prepare_params(params)
        existing = self.client.get_run(run_id).data.params
        conflicts = {
            k: (existing[k], v) for k, v in flat.items() if k in existing and existing[k] != v
        }
        if conflicts:
            shown = "; ".join(
                f"{k}: logged {old!r}, now {new!r}"
                for k, (old, new) in sorted(conflicts.items())[:10]
            )
            raise ParamConflictError(
                f"run {run_id} already has {len(conflicts)} param(s) with different values "
                f"({shown}). MLflow params are immutable: start a new run (another run name) "
                f"or keep the config of the run being resumed."
            )
        new = [Param(k, v) for k, v in flat.items() if k not in existing]
        for chunk in _chunks(new, MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(run_id, params=chunk, synchronous=True)

    # -- metrics (delivered by MetricDelivery)

    def resume_after(self, key: str) -> int | None:
        """After a restart: ignore metrics at steps already logged for `key` (returns that step).

        If the backend does not answer within `attempt_timeout_s`, the step is looked up by
        the first delivery that reaches it instead (returns None), and re-run metrics buffered
        meanwhile are filtered then. Records `restore()`d from a checkpoint are never dropped.
        """
        if not self.enabled:
            return 0
        return self._delivery.resume_after(key)

    def buffer_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Remember `metrics` for `step` (timestamped now); nothing is sent until a flush.

        Buffer a step's metrics completely before any flush: a step is delivered whole or not
        at all (batches never split one), which `resume_after` relies on."""
        if self.enabled:
            self._delivery.buffer_metrics(metrics, step)

    @property
    def pending(self) -> int:
        """Number of buffered, not yet delivered metric values."""
        return self._delivery.pending

    def flush(self) -> None:
        """Send all buffered metrics (`log_batch`, <= 1000 per call) and clear the buffer.

        Retries with backoff while the backend is unreachable; after `max_buffer_seconds`
        raises `TrackingUnavailable`, keeping whatever was not delivered.
        """
        if self.enabled:
            self._delivery.flush()

    @property
    def outage_seconds(self) -> float:
        """How long delivery has been failing (0 while the backend answers)."""
        return self._delivery.outage_seconds

    def try_flush(self) -> bool:
        """One delivery attempt bounded by `attempt_timeout_s`, for callers that must not wait
        out an outage: True when nothing is left buffered. Undelivered metrics stay buffered
        (save `snapshot()` with a checkpoint); past `max_outage_s` of outage it raises
        `TrackingUnavailable`."""
        if not self.enabled:
            return True
        return self._delivery.try_flush()

    def poll(self) -> None:
        """Cheap, call it often (every training step): during an outage, retries delivery every
        `retry_every_s`, so metrics go out soon after the backend returns and an outage past
        `max_outage_s` fails promptly."""
        if self.enabled:
            self._delivery.poll()

    def drain(self) -> None:
        """Deliver everything buffered, waiting through an outage for at most `max_outage_s`
        (counted from its start; then `TrackingUnavailable`)."""
        if self.enabled:
            self._delivery.drain()

    def snapshot(self) -> dict | None:
        """The undelivered metrics and the outage clock, JSON-able, for a checkpoint's state."""
        if not self.enabled:
            return None
        return self._delivery.snapshot()

    def restore(self, snapshot: Mapping[str, Any] | None) -> None:
        """Take back a `snapshot()` from the checkpoint a restarted run resumes from (before
        `resume_after`): its metrics are sent by the next flush, its outage clock goes on."""
        if self.enabled and snapshot:
            self._delivery.restore(snapshot)

    def log_metrics_now(self, metrics: Mapping[str, float], step: int) -> None:
        """`buffer_metrics` + `flush` (evaluation results, bench numbers)."""
        self.buffer_metrics(metrics, step)
        self.flush()

    # -- artifacts and models

    def log_artifacts(self, local_dir: str | os.PathLike, artifact_path: str | None = None) -> None:
        if self.enabled:
            self._delivery.await_backend()
            self.client.log_artifacts(self._require_run(), str(local_dir), artifact_path)

    def log_text(self, text: str, artifact_file: str) -> None:
        if self.enabled:
            self._delivery.await_backend()
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
        db = sqlite_path(self.tracking_uri)
        if db is not None and not db.exists():
            return False
        if is_http(self.tracking_uri) and not server_reachable(self.tracking_uri, timeout=5.0):
            raise TrackingUnavailable(f"MLflow at {self.tracking_uri} does not answer")
        from mlflow.exceptions import MlflowException  # noqa: PLC0415 -- mlflow (package docstring)

        try:
            self.client.get_run(self.run_id)
        except MlflowException as e:
            if e.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                return False
            raise
        return True

    def download_artifacts(
        self, dst_dir: str | os.PathLike, names: Iterable[str] | None = None
    ) -> list[str]:
        """Copy the run's top-level artifacts (files or folders) named in `names`, default
        all, into `dst_dir`; returns the names it had."""
        if not self.enabled:
            return []
        run_id, wanted = self._require_run(), None if names is None else set(names)
        present = sorted(
            a.path for a in self.client.list_artifacts(run_id) if wanted is None or a.path in wanted
        )
        for name in present:
            self.client.download_artifacts(run_id, name, str(dst_dir))
        return present

    def register_model(
        self, artifact_path: str, name: str, tags: Mapping[str, Any] | None = None
    ) -> str:
        """Register `runs:/<run_id>/<artifact_path>` as a new version of `name`; returns it."""
        if not self.enabled:
            return ""
        from mlflow.exceptions import MlflowException  # noqa: PLC0415 -- mlflow (package docstring)

        run_id = self._require_run()
        try:
            self.client.create_registered_model(name)
        except MlflowException as e:
            if e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        mv = self.client.create_model_version(
            name,
            source=f"runs:/{run_id}/{artifact_path.strip('/')}",
            run_id=run_id,
            tags={k: str(v) for k, v in (tags or {}).items()},
        )
        return str(mv.version)

    def run_url(self) -> str | None:
        """Link to the run in the MLflow UI (http(s) tracking URIs only)."""
        if not self.enabled or not self.run_id or not is_http(self.tracking_uri or ""):
            return None
        exp_id = self.experiment_id or self.client.get_run(self.run_id).info.experiment_id
        return f"{self.tracking_uri.rstrip('/')}/#/experiments/{exp_id}/runs/{self.run_id}"
