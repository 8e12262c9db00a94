"""Recent draftlab runs for `draftlab runs`: `list_runs` queries MLflow, `format_runs_table`
renders the rows as a plain-text table."""

from __future__ import annotations

import io
from datetime import datetime
from typing import Any

from rich.console import Console
from rich.table import Table

from draftlab.tracking.backend import mlflow_client, resolve_tracking_uri, sqlite_path

EXPERIMENT_PREFIX = "draftlab"
# Metrics shown by `list_runs` / `draftlab runs`, in column order.
KEY_METRICS = ("tau", "speedup_vs_ar", "loss", "eval/sim_accept_len")


def list_runs(
    tracking_uri: str | None = None, experiment: str | None = None, max_results: int = 20
) -> list[dict[str, Any]]:
    """Recent runs of `experiment` (default: every experiment named `draftlab*`), newest first.

    Each row: run_id, run_name, experiment, status, start_time (epoch ms) and `metrics`
    holding those of `KEY_METRICS` the run has.
    """
    uri = resolve_tracking_uri(tracking_uri)
    db = sqlite_path(uri)
    if db is not None and not db.exists():
        return []  # nothing logged yet; don't create an empty database just to list it
    _, client = mlflow_client(uri)
    if experiment is not None:
        exp = client.get_experiment_by_name(experiment)
        exps = [exp] if exp is not None else []
    else:
        exps = [
            e
            for e in client.search_experiments(
                filter_string=f"name LIKE '{EXPERIMENT_PREFIX}%'", max_results=1000
            )
        ]
    if not exps:
        return []
    names = {e.experiment_id: e.name for e in exps}
    runs = client.search_runs(
        list(names), order_by=["attributes.start_time DESC"], max_results=max_results
    )
    return [
        {
            "run_id": r.info.run_id,
            "run_name": r.info.run_name,
            "experiment": names.get(r.info.experiment_id, r.info.experiment_id),
            "status": r.info.status,
            "start_time": r.info.start_time,
            "metrics": {k: r.data.metrics[k] for k in KEY_METRICS if k in r.data.metrics},
        }
        for r in runs
    ]


def format_runs_table(rows: list[dict[str, Any]], width: int = 140) -> str:
    """`list_runs` rows as a rich table, rendered to plain text."""
    table = Table(title="draftlab runs", title_justify="left")
    for col in ("run id", "name", "experiment", "status", "started"):
        table.add_column(col, no_wrap=col in ("run id", "started"))
    for key in KEY_METRICS:
        table.add_column(key, justify="right")
    for r in rows:
        started = (
            datetime.fromtimestamp(r["start_time"] / 1000).strftime("%Y-%m-%d %H:%M")
            if r.get("start_time")
            else "-"
        )
        metrics = r.get("metrics", {})
        table.add_row(
            r["run_id"][:12],
            r.get("run_name") or "-",
            r.get("experiment", "-"),
            r.get("status", "-"),
            started,
            *(f"{metrics[k]:.4g}" if k in metrics else "-" for k in KEY_METRICS),
        )
    buf = io.StringIO()
    Console(file=buf, width=width, color_system=None, force_terminal=False).print(table)
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines()) + "\n"
