r"""`draftlab submit` and `draftlab jobs`: Ray's job submission SDK with a runtime
environment built from this repo.

    draftlab submit --address http://HEAD:8265 \
        pipeline -c jobs/configs/pipeline-smollm2-135m-cpu.yaml
    draftlab jobs list | logs ID [--follow] | status ID | stop ID

The job runs `python <entrypoint> -c CONFIG [overrides]` in the uploaded repo (the
`working_dir`, minus virtualenvs, caches and run outputs). The draftlab package is shipped
as a `py_module`, so the cluster runs this checkout's code even where an older draftlab is
installed in the image; `--pip` also installs the project's requirements on the cluster
(torch excluded: it comes with the image's CUDA stack).

Ray's job SDK and huggingface_hub are imported by the functions that use them:
`draftlab --help` imports this module (cli).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import os
import subprocess
import sys
import tomllib
from pathlib import Path

from draftlab.config import ConfigError, DataConfig, TargetSpec

ROOT = Path(__file__).resolve().parents[2]
ENTRYPOINTS = {
    "distill": "jobs/distill.py",
    "sweep": "sweeps/run.py",
    "pipeline": "jobs/pipeline.py",
    "bench": "jobs/bench.py",
}
EXCLUDES = [
    ".git/",
    ".venv/",
    "venv/",
    ".draftlab/",
    "**/__pycache__/",
    "*.egg-info/",
    ".pytest_cache/",
    ".ruff_cache/",
    "mlruns/",
    "mlartifacts/",
    "*.safetensors",
    "*.gguf",
]
DEFAULT_ADDRESS = "http://127.0.0.1:8265"


def address(given: str | None) -> str:
    """--address, else $RAY_API_SERVER_ADDRESS / $RAY_ADDRESS when it is a dashboard URL,
    else the local dashboard."""
    for value in (given, os.environ.get("RAY_API_SERVER_ADDRESS"), os.environ.get("RAY_ADDRESS")):
        if value and value.startswith(("http://", "https://")):
            return value
    if given:
        raise ConfigError(
            f"--address {given!r}: give the head's dashboard URL, e.g. http://HEAD:8265"
        )
    return DEFAULT_ADDRESS


def requirements(root: Path = ROOT) -> list[str]:
    """The project's dependencies from pyproject.toml, without torch."""
    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    return [d for d in deps if not d.replace(" ", "").lower().startswith("torch")]


def runtime_env(
    pip: bool = False, env_vars: dict[str, str] | None = None, root: Path = ROOT
) -> dict:
    env = {
        "working_dir": str(root),
        "excludes": EXCLUDES,
        "py_modules": [str(root / "platform" / "draftlab")],
    }
    if pip:
        env["pip"] = requirements(root)
    if env_vars:
        env["env_vars"] = dict(env_vars)
    return env


def client(addr: str | None):
    from ray.job_submission import JobSubmissionClient  # noqa: PLC0415 -- Ray (module docstring)

    url = address(addr)
    try:
        return JobSubmissionClient(url)
    except (ConnectionError, RuntimeError) as e:
        raise ConnectionError(
            f"no Ray dashboard at {url} ({str(e).splitlines()[0]}): start the cluster with "
            f"`ray start --head` or pass --address http://HEAD:8265"
        ) from None


def staged_config(cfg: Path, root: Path = ROOT) -> Path:
    """`cfg` itself when it is inside the uploaded repo, else a copy in `<repo>/.submit/`.

    Ray's upload skips whatever `.gitignore` lists, so `.submit/` is hidden from git through
    `.git/info/exclude` instead (git reads it, Ray does not). Paths inside the config are not
    rewritten: use absolute or repo-relative ones."""
    excluded_dirs = {e.rstrip("/") for e in EXCLUDES if e.endswith("/") and "*" not in e}
    if cfg.is_relative_to(root) and cfg.relative_to(root).parts[0] not in excluded_dirs:
        return cfg
    data = cfg.read_bytes()
    staged = root / ".submit" / f"{hashlib.sha256(data).hexdigest()[:8]}-{cfg.name}"
    staged.parent.mkdir(exist_ok=True)
    staged.write_bytes(data)
    _git_exclude(root, "/.submit/")
    return staged


def _git_exclude(root: Path, pattern: str) -> None:
    """Add `pattern` to the checkout's `info/exclude` (worktrees included); no git, no-op."""
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--git-path", "info/exclude"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return
    exclude = (root / out).resolve()
    exclude.parent.mkdir(parents=True, exist_ok=True)
    if pattern not in (exclude.read_text().splitlines() if exclude.is_file() else []):
        with exclude.open("a") as f:
            f.write(f"\n{pattern}\n")


def check_hub_access(target: TargetSpec, data: DataConfig | None = None) -> None:
    """Job driver validation, before any Ray work (`draftlab distill`, `sweep` and `pipeline`,
    from the CLI or `jobs/*.py` / `sweeps/run.py` under `ray job submit`): a gated hub target or
    dataset (their `gated` field) needs a Hugging Face token where the job runs. Raises one
    ConfigError line otherwise. `draftlab submit` leaves this to the driver: the cluster may
    hold a token (a Kubernetes secret) that the submitting machine does not."""
    gated = [f"target.name {target.gated_repo()!r}"] if target.gated_repo() else []
    for source in data.sources if data is not None else []:
        if source.gated_repo():
            gated.append(f"data.source.path {source.gated_repo()!r}")
    if not gated:
        return
    from huggingface_hub import get_token  # noqa: PLC0415 -- huggingface_hub (module docstring)

    if not get_token():
        raise ConfigError(
            f"{gated[0]} is a gated hub repo and no Hugging Face token is set: set HF_TOKEN to a "
            "token of an account that accepted its terms (on KubeRay: the secret draftlab-hf, see "
            "infra/README.md), or `gated: false`"
        )


def submit(
    kind: str,
    config: str,
    overrides: list[str],
    addr: str | None = None,
    pip: bool = False,
    env_vars: dict[str, str] | None = None,
    root: Path = ROOT,
) -> str:
    """Submit `kind` with `config` (a path inside the repo); returns the job id."""
    if kind not in ENTRYPOINTS:
        raise ConfigError(f"unknown job kind {kind!r} (allowed: {', '.join(ENTRYPOINTS)})")
    cfg = Path(config).resolve()
    if not cfg.is_file():
        raise ConfigError(f"-c {config}: config file not found")
    rel = staged_config(cfg, root).relative_to(root)
    entrypoint = " ".join(
        ["python", ENTRYPOINTS[kind], "-c", str(rel), *(f"'{o}'" for o in overrides)]
    )
    return client(addr).submit_job(
        entrypoint=entrypoint,
        runtime_env=runtime_env(pip, env_vars, root),
        metadata={"draftlab.kind": kind, "draftlab.config": str(rel)},
    )


def list_jobs(addr: str | None = None) -> list[dict]:
    rows = []
    for j in sorted(client(addr).list_jobs(), key=lambda j: j.start_time or 0, reverse=True):
        rows.append(
            {
                "id": j.submission_id or j.job_id,
                "status": str(j.status.value if hasattr(j.status, "value") else j.status),
                "kind": (j.metadata or {}).get("draftlab.kind", ""),
                "config": (j.metadata or {}).get("draftlab.config", ""),
                "entrypoint": j.entrypoint,
                "start_time": j.start_time,
                "message": j.message,
            }
        )
    return rows


def format_jobs(rows: list[dict]) -> str:
    lines = [f"{'job id':<30} {'status':<10} {'kind':<9} {'started':<20} entrypoint"]
    for r in rows:
        started = (
            dt.datetime.fromtimestamp(r["start_time"] / 1000).strftime("%Y-%m-%d %H:%M:%S")
            if r["start_time"]
            else ""
        )
        lines.append(
            f"{r['id']:<30} {r['status']:<10} {r['kind']:<9} {started:<20} {r['entrypoint']}"
        )
    return "\n".join(lines)


def logs(job_id: str, addr: str | None = None, follow: bool = False) -> None:
    """Print the job's logs (`follow`: stream them until the job ends)."""
    c = client(addr)
    status(job_id, addr)  # an unknown id fails here, clearly
    if not follow:
        sys.stdout.write(c.get_job_logs(job_id))
        return

    async def tail():
        async for chunk in c.tail_job_logs(job_id):
            sys.stdout.write(chunk)
            sys.stdout.flush()

    asyncio.run(tail())


def _unknown(job_id: str, e: RuntimeError) -> ValueError:
    return ValueError(f"job {job_id!r}: {str(e).splitlines()[0]} (see `draftlab jobs list`)")


def status(job_id: str, addr: str | None = None) -> str:
    try:
        info = client(addr).get_job_info(job_id)
    except RuntimeError as e:
        raise _unknown(job_id, e) from None
    return f"{job_id}: {info.status}" + (f" ({info.message})" if info.message else "")


def stop(job_id: str, addr: str | None = None) -> str:
    try:
        stopped = client(addr).stop_job(job_id)
    except RuntimeError as e:
        raise _unknown(job_id, e) from None
    return f"{job_id}: stop requested" if stopped else f"{job_id}: already finished"
