"""The one package that talks to MLflow; everything else in draftlab logs through `Tracker`.

    backend.py   where MLflow lives (tracking URI, sqlite artifacts), a one-off client, and
                 the guards that bound a call to it (health probe, deadline, transient errors)
    params.py    params as MLflow takes them: flattened, secrets redacted, values truncated
    delivery.py  `MetricDelivery`: a run's metric buffer, its delivery and the outage clock
    tracker.py   `Tracker`: a rank-0 run (start/resume/end, params, tags, artifacts)
    registry.py  the registered model of a target's drafters and `promote`
    listing.py   recent runs for `draftlab runs`

`mlflow` is imported inside functions: `import mlflow` takes about a second and nothing here
should run (or slow down `draftlab --help`) at import time.
"""

from draftlab.tracking.backend import TrackingUnavailable, mlflow_client, resolve_tracking_uri
from draftlab.tracking.delivery import MAX_METRICS_PER_BATCH
from draftlab.tracking.listing import format_runs_table, list_runs
from draftlab.tracking.params import (
    MAX_PARAM_VAL_LENGTH,
    MAX_PARAMS_TAGS_PER_BATCH,
    REDACTED,
    ParamConflictError,
    flatten,
    looks_secret,
    prepare_params,
)
from draftlab.tracking.registry import drafter_model_name, promote
from draftlab.tracking.tracker import Tracker, parent_tags

__all__ = [
    "MAX_METRICS_PER_BATCH",
    "MAX_PARAMS_TAGS_PER_BATCH",
    "MAX_PARAM_VAL_LENGTH",
    "REDACTED",
    "ParamConflictError",
    "Tracker",
    "TrackingUnavailable",
    "drafter_model_name",
    "flatten",
    "format_runs_table",
    "list_runs",
    "looks_secret",
    "mlflow_client",
    "parent_tags",
    "prepare_params",
    "promote",
    "resolve_tracking_uri",
]
