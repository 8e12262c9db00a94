"""Serving: a replica's decoding (`EngineSpec`), Serve's autoscaling (`AutoscalingSpec`),
what every serving application takes (`ServingCommon`), the draftlab app's arguments
(`ServeArgs`), and `draftlab loadtest` (`LoadtestConfig`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field

from draftlab.config.base import ConfigError, StrictModel
from draftlab.config.target import TargetSpec


class EngineSpec(StrictModel):
    """How a serving replica decodes (see `draftlab.serve.scheduler`)."""

    tree: str | None = None
    """Verification tree: a preset, `chain-<k>`, `searched-<n>` or a JSON file of rank
    paths; None = the drafter's `tree.json` (written by distill/sweep), else `chain-<K>`."""
    speculation: Literal["on", "off", "auto"] = "auto"
    """`on`: every round drafts; `off`: target-only decoding; `auto`: per round, draft only
    while the predicted tokens/s beat plain steps at the current load (`serve/policy.py`:
    the replica's measured forward costs by row count, observed tau and drafting time). A
    request may override it with the `speculation` extension field; a sampled request
    with a `seed` drafts every round under `auto`, so the seed reproduces its text."""
    max_active: int = Field(16, ge=1)
    """Requests decoded at once (verified together in one forward per round); later ones
    wait their turn."""
    policy_context: int = Field(128, ge=1)
    """`auto`: cached context length at which the start-up profile times forwards."""
    max_context: int | None = Field(None, ge=16)
    """Prompt + completion tokens allowed per request; None = the target's
    `max_position_embeddings`."""
    default_max_tokens: int = Field(256, ge=1)
    """Completion length when a chat request gives no `max_tokens` (completions: 16, as
    OpenAI)."""


class AutoscalingSpec(StrictModel):
    """Ray Serve `autoscaling_config` of the engine deployment."""

    min_replicas: int = Field(1, ge=0)
    """Replicas kept when idle (0 = scale to zero; the first request then waits for a load)."""
    max_replicas: int = Field(1, ge=1)
    """Upper bound; each replica holds its own target + drafter."""
    target_ongoing_requests: float = Field(4.0, gt=0)
    """Requests per replica the autoscaler aims for."""
    upscale_delay_s: float = Field(10.0, ge=0)
    """Load must stay high this long before adding replicas."""
    downscale_delay_s: float = Field(60.0, ge=0)
    """Load must stay low this long before removing replicas."""
    look_back_period_s: float = Field(30.0, gt=0)
    """Window over which ongoing requests are averaged (longer than `metrics_interval_s`)."""
    metrics_interval_s: float = Field(10.0, gt=0)
    """How often replicas report their load to the autoscaler."""


class ServingCommon(StrictModel):
    """What every serving application (`--engine draftlab` and `--engine vllm`) takes: the
    drafter/target pair, the clients' keys, and Serve's replicas, queues and health checks."""

    model_uri: str | None = None
    """MLflow model URI of a registered drafter (`models:/<name>@<alias>` or
    `models:/<name>/<version>`); resolved at replica start to the drafter directory, its
    target and its tree. None (and no `drafter`) = `models:/draftlab-<target>-drafter@champion`."""
    drafter: str | None = None
    """Instead of `model_uri`: a drafter directory, or `init:<family>` (untrained; tests)."""
    target: TargetSpec = Field(default_factory=TargetSpec)
    """The target; with `model_uri` its name comes from the drafter's config unless set."""
    served_model_name: str | None = None
    """The `model` clients send; None = the target's name."""
    tracking_uri: str | None = None
    """MLflow server of `model_uri`; None = `MLFLOW_TRACKING_URI`, else the local default."""
    api_keys: list[str] = Field(default_factory=list)
    """Accepted `Authorization: Bearer` keys; empty = no authentication."""
    api_keys_env: str | None = None
    """Also accept the comma-separated keys in this environment variable (keeps secrets out
    of config files)."""
    api_keys_file: str | None = None
    """Also accept the keys in this file, one per line (`#` comments allowed), read by each
    replica at start (a mounted Kubernetes secret, say)."""
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec)
    """Replicas of the engine deployment (each holds its own target + drafter)."""
    max_ongoing_requests: int = Field(32, ge=1)
    """Requests routed to one replica at once (Serve's default of 5 would idle the engine)."""
    max_queued_requests: int = Field(256, ge=-1)
    """Requests waiting for a replica before callers get 503 (-1 = unbounded)."""
    health_check_timeout_s: float = Field(60.0, gt=0)
    """A replica whose model check takes longer is restarted."""
    health_check_period_s: float = Field(10.0, gt=0)
    """How often Serve checks each engine replica: a crashed one is noticed at the next
    check and replaced, so this bounds the outage after a crash."""
    graceful_shutdown_timeout_s: float = Field(30.0, ge=0)
    """Running requests get this long to finish when a replica stops."""

    def accepted_keys(self) -> list[str]:
        """`api_keys` plus those in `$api_keys_env` and `api_keys_file` (read where this runs:
        the replica). A key file that cannot be read is an error, never an open endpoint."""
        env = os.environ.get(self.api_keys_env, "") if self.api_keys_env else ""
        keys = list(self.api_keys) + [k.strip() for k in env.split(",") if k.strip()]
        if self.api_keys_file:
            try:
                lines = Path(self.api_keys_file).expanduser().read_text().splitlines()
            except OSError as e:
                raise ConfigError(
                    f"api_keys_file {self.api_keys_file!r} cannot be read: {e.strerror}"
                ) from None
            keys += [k.strip() for k in lines if k.strip() and not k.lstrip().startswith("#")]
        return keys

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys or self.api_keys_env or self.api_keys_file)


class ServeArgs(ServingCommon):
    """`draftlab.serve.app:build_app` arguments: which drafter/target pair and how to serve it
    (an idle replica's health check is a one-token generation)."""

    engine: EngineSpec = Field(default_factory=EngineSpec)
    """Decoding on each replica."""
    num_cpus: float = Field(1.0, ge=0)
    """CPUs reserved per engine replica."""
    num_gpus: float = Field(0.0, ge=0)
    """GPUs per engine replica (1 on a GPU node)."""
    max_body_bytes: int = Field(1024 * 1024, ge=1024)
    """Request bodies over this many bytes get 413, checked from Content-Length before the
    body is read (and while reading a chunked one). Raise it for long-context targets: a
    prompt of N token ids takes about 7 N bytes."""
    queue_timeout_s: float = Field(60.0, gt=0)
    """A request that no engine replica takes within this long (all busy, or the only one
    being replaced) gets 503 with `Retry-After` instead of waiting on. Raise it above the
    model's load time with `autoscaling.min_replicas: 0`."""
    retry_after_s: int = Field(2, ge=0)
    """`Retry-After` seconds of 503 answers (replica lost or draining, queues full): about
    how long Serve takes to route around a lost replica."""


class LoadtestConfig(StrictModel):
    """`draftlab loadtest`: closed-loop load on an OpenAI-compatible endpoint."""

    url: str = "http://127.0.0.1:8000/v1"
    """Base URL of the API (ending in /v1)."""
    model: str | None = None
    """Model id to request; None = the first one `GET /v1/models` lists."""
    api_key: str | None = None
    """Bearer key, if the server wants one."""
    concurrency: list[int] = Field(default_factory=lambda: [1, 4, 16], min_length=1)
    """Concurrency levels: that many clients each send a request, wait for it, send the next."""
    requests: int | None = Field(None, ge=1)
    """Requests per level (and mode), prompts cycled; None = max(prompts, 2 x concurrency): every
    prompt at least once, so each kind is measured at every level (`by_kind`)."""
    speculation: list[Literal["server", "on", "off"]] = Field(
        default_factory=lambda: ["server"], min_length=1
    )
    """Modes compared level by level in one run: `server` = its policy; `on`/`off` force
    drafting per request (draftlab's `speculation` extension field)."""
    rounds: int = Field(2, ge=1)
    """Each level's requests per mode are sent in this many timed rounds, the modes' order
    reversed every other round (server, off, off, server): on a machine whose speed drifts
    (shared CPUs, thermal limits) the modes are still compared like with like. Rounds are
    pooled per mode. A soak (`duration_s`) runs each mode once."""
    prompts: str | None = None
    """JSONL prompt file or packaged set (`default`, `heldout`), cycled; None = `default`."""
    max_tokens: int = Field(128, ge=1)
    """Completion tokens per request."""
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    """0 = greedy."""
    stream: bool = True
    """Stream (time to first token is measured only when streaming)."""
    timeout_s: float = Field(600.0, gt=0)
    """Per-request timeout."""
    warmup: int | None = Field(None, ge=0)
    """Untimed requests per speculation mode before the first level, sent as many at a time as
    the highest level's concurrency, cycling the prompts: first-use costs (an engine compiles
    and caches kernels per new shape; a speculative step verifies new token counts) are paid
    by every mode before any is timed. None = each prompt once (at most 16)."""
    duration_s: float | None = Field(None, gt=0)
    """Soak: run each level for this long instead of a request count, and report latency
    and the serving processes' memory (RSS, when they run on this machine) per window."""
    window_s: float = Field(60.0, gt=0)
    """Soak: the window of the per-window latency / memory timeline."""
    json_out: str | None = None
    """Write the JSON report here."""
