"""Which drafter/target pair a replica serves: an MLflow model URI or explicit paths.

    models:/<name>@<alias>    (default: models:/draftlab-<target>-drafter@champion)
    models:/<name>/<version>
    drafter: <dir> | init:<family>

A registered version's `drafter` artifact is mirrored once per machine under
`$DRAFTLAB_CACHE/storage` (fetched again file by file when a stored file changes); its
`config.json` names the target it was trained for and its `tree.json` the tree it verifies
with, unless the serve args override them.

mlflow is imported for a models:/ URI only: `draftlab --help` imports this module (cli ->
serve.control).
"""

from __future__ import annotations

import json
import os
import posixpath
import tempfile
from dataclasses import dataclass
from pathlib import Path

from draftlab.config import ConfigError, ServeArgs, TargetSpec
from draftlab.storage import is_uri, local_copy, mirror_dir, sync_mirror
from draftlab.tracking import drafter_model_name, mlflow_client


@dataclass(frozen=True)
class Pair:
    target: TargetSpec
    drafter: str  # a local drafter directory or `init:<family>`
    source: dict  # where it came from (model URI, version, run id): shown by /v1/models


def default_model_uri(args: ServeArgs) -> str:
    return f"models:/{drafter_model_name(args.target.name)}@champion"


def _parse_models_uri(uri: str) -> tuple[str, str | None, str | None]:
    """`models:/name@alias` -> (name, alias, None); `models:/name/3` -> (name, None, "3")."""
    if not uri.startswith("models:/"):
        raise ConfigError(
            f"model_uri {uri!r}: expected models:/<name>@<alias> or models:/<name>/<version>"
        )
    rest = uri.removeprefix("models:/").strip("/")
    if "@" in rest:
        name, alias = rest.split("@", 1)
        return name, alias, None
    name, _, version = rest.rpartition("/")
    if not name or not version.isdigit():
        raise ConfigError(
            f"model_uri {uri!r}: expected models:/<name>@<alias> or models:/<name>/<version>"
        )
    return name, None, version


def model_version(args: ServeArgs):
    """The registered version `args` names (no download): (uri, tracking uri, version).
    Raises ConfigError naming the URI and the store when it does not exist."""
    from mlflow.exceptions import MlflowException  # noqa: PLC0415 -- mlflow (module docstring)

    uri = args.model_uri or default_model_uri(args)
    name, alias, version = _parse_models_uri(uri)
    tracking, client = mlflow_client(args.tracking_uri)
    try:
        mv = (
            client.get_model_version_by_alias(name, alias)
            if alias
            else client.get_model_version(name, version)
        )
    except MlflowException as e:
        raise ConfigError(
            f"model_uri {uri!r} not found in MLflow at {tracking}: {e.message.splitlines()[0]} "
            f"(train and promote one first: `draftlab sweep` or `draftlab promote RUN_ID`)"
        ) from None
    return uri, tracking, mv


def _artifact_sizes(client, run_id: str, path: str) -> dict[str, int]:
    """{artifact path: size in bytes} of every file under `path` of the run."""
    out: dict[str, int] = {}
    for f in client.list_artifacts(run_id, path):
        out |= _artifact_sizes(client, run_id, f.path) if f.is_dir else {f.path: f.file_size}
    return out


def cached_drafter(client, run_id: str) -> Path:
    """The run's `drafter` artifact as a local mirror (`storage.sync_mirror`, under
    `$DRAFTLAB_CACHE/storage`): downloaded once per machine and shared by its replicas,
    fetched again file by file when a stored file's size changes."""

    def fetch(
        rel: str, local: Path
    ) -> None:  # each file whole: downloaded beside it, then moved in
        with tempfile.TemporaryDirectory(dir=local.parent, prefix=".download-") as tmp:
            os.replace(client.download_artifacts(run_id, f"drafter/{rel}", tmp), local)

    stored = {
        posixpath.relpath(p, "drafter"): [size]
        for p, size in _artifact_sizes(client, run_id, "drafter").items()
    }
    return sync_mirror(mirror_dir(f"runs:/{run_id}/drafter"), stored, fetch)


def resolve_pair(args: ServeArgs) -> Pair:
    if args.drafter is not None:  # a URI (s3://...) is served from its local mirror
        local = str(local_copy(args.drafter)) if is_uri(args.drafter) else args.drafter
        return Pair(args.target, local, {"drafter": args.drafter})
    from mlflow import MlflowClient  # noqa: PLC0415 -- mlflow (module docstring)

    uri, tracking, mv = model_version(args)
    local = cached_drafter(MlflowClient(tracking_uri=tracking), mv.run_id)
    cfg = json.loads((local / "config.json").read_text())
    target = args.target
    if "target" not in args.model_fields_set:  # the drafter knows its target
        target = args.target.model_copy(update={"name": cfg["target_name"]})
    return Pair(
        target,
        str(local),
        {
            "model_uri": uri,
            "registered_model": mv.name,
            "version": str(mv.version),
            "run_id": mv.run_id,
            "tracking_uri": tracking,
        },
    )
