"""The model registry side of drafters: the registered model that collects a target's
drafters (`drafter_model_name`) and `promote`, which moves an alias (`champion`) to the
drafter of a run and tags the version with what it measured and whom it replaced."""

from __future__ import annotations

from typing import Any

from draftlab.tracking.backend import mlflow_client, now_ms


def drafter_model_name(target: str) -> str:
    """The registered model that collects the drafters of `target`: `draftlab-<target>-drafter`."""
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in target.split("/")[-1])
    return f"draftlab-{safe}-drafter"


def promote(
    run_id: str,
    registered_model: str | None = None,
    alias: str = "champion",
    tracking_uri: str | None = None,
) -> dict[str, Any]:
    """Give `alias` to the model version of `run_id`'s `drafter` artifact (registered first
    if the run has none yet). The previous holder keeps its version; the new version's tags
    record the drafter (K, depth, family), its measured tau / speedup and who it replaced.

    `registered_model` defaults to the name the run's distillation registered under, else
    `draftlab-<target>-drafter` from the run's `draftlab.target` tag.
    """
    from mlflow.exceptions import MlflowException  # noqa: PLC0415 -- mlflow (package docstring)

    uri, client = mlflow_client(tracking_uri)
    try:
        run = client.get_run(run_id)
    except MlflowException:
        raise ValueError(f"run {run_id!r} not found in {uri}") from None
    if "drafter" not in {a.path for a in client.list_artifacts(run_id)}:
        raise ValueError(
            f"run {run_id!r} has no 'drafter' artifact to promote (is it a distillation run?)"
        )
    versions = [
        v
        for v in client.search_model_versions(f"run_id = '{run_id}'")
        if registered_model in (None, v.name)
    ]
    if registered_model is None and not versions:
        target = run.data.tags.get("draftlab.target")
        if not target:
            raise ValueError(
                f"run {run_id!r} has no draftlab.target tag: pass the registered model name"
            )
        registered_model = drafter_model_name(target)
    name = registered_model or versions[0].name
    try:
        client.create_registered_model(name)
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    mine = [v for v in versions if v.name == name]
    version = (
        mine[0]
        if mine
        else client.create_model_version(name, source=f"runs:/{run_id}/drafter", run_id=run_id)
    )
    try:
        previous = client.get_model_version_by_alias(name, alias).version
    except MlflowException:
        previous = None
    params, metrics = run.data.params, run.data.metrics
    tags = {
        "k": params.get("drafter.k"),
        "depth": params.get("drafter.depth"),
        "family": params.get("drafter.family"),
        "tree": params.get("tree") or params.get("bench.tree"),
        "hardware": run.data.tags.get("draftlab.hardware"),
        "tau": metrics.get("tau"),
        "speedup_vs_ar": metrics.get("speedup_vs_ar"),
        f"{alias}_since_ms": now_ms(),
        f"replaced_{alias}_version": previous,
    }
    for key, value in tags.items():
        if value is not None:
            client.set_model_version_tag(name, version.version, key, str(value))
    client.set_registered_model_alias(name, alias, version.version)
    return {
        "model": name,
        "version": str(version.version),
        "alias": alias,
        "previous": previous,
        "run_id": run_id,
    }
