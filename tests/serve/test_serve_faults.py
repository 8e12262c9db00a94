"""Serving faults, injected for real on a Serve app on 127.0.0.1 (tiny target, untrained
parallel drafter): an engine replica's process SIGKILLed under steady streaming and plain
load, and an application deleted while a long stream runs (graceful drain).

What a client may see: success, or a fast 503 with `Retry-After` in OpenAI's error shape;
a stream cut mid-way ends with an in-band error event and `[DONE]`. Never a hang, a 500,
or a connection dropped mid-body. The recovery and drain times are printed as
`[serve-faults]` lines (past pytest's capture) for the README."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import pytest
import ray
from ray import serve
from ray.exceptions import (
    ActorDiedError,
    ActorUnavailableError,
    RayActorError,
    RayTaskError,
    WorkerCrashedError,
)
from ray.serve._private.common import DeploymentID
from ray.serve.exceptions import (
    BackPressureError,
    DeploymentUnavailableError,
    RayServeException,
    ReplicaUnavailableError,
)

from draftlab.config import SamplingParams, ServeArgs, TargetSpec
from draftlab.decoding.engine import autoregressive_generate
from draftlab.models.target import load_target
from draftlab.serve.app import _as_unavailable, build_app
from serve_support import local_serve, report

pytestmark = pytest.mark.slow
TINY = "tiny-llama"
V8 = "tiny-llama-v8"
LONG_PROMPT, LONG_TOKENS = "abc", 3000
CLIENT_TIMEOUT_S = 60.0  # what "fast" is measured against
QUEUE_TIMEOUT_S = 15.0  # the app's queue_timeout_s: the longest a request may wait for a replica


@pytest.fixture(scope="module")
def base_url():
    with local_serve() as url:
        yield url


def deploy(name: str, target: str = TINY, **kw) -> None:
    kw = {"num_cpus": 0.25, "health_check_timeout_s": 30, "queue_timeout_s": QUEUE_TIMEOUT_S, **kw}
    args = ServeArgs(target=TargetSpec(name=target), drafter="init:parallel", **kw)
    serve.run(build_app(args), name=name, route_prefix=f"/{name}")


def engine_replicas(app: str) -> list[str]:
    """Actor names of the app's live DraftEngine replicas (`SERVE_REPLICA::app#DraftEngine#id`)."""
    prefix = f"SERVE_REPLICA::{app}#DraftEngine#"
    return sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(prefix)
    )


def running(app: str) -> int:
    return (
        serve.status().applications[app].deployments["DraftEngine"].replica_states.get("RUNNING", 0)
    )


def _upstream_crash() -> Exception:
    """What Serve's router raises when an actor a request depended on died."""
    wrapped = RayServeException(
        "Request to deployment 'DraftEngine' failed because an upstream actor died"
    )
    wrapped.__cause__ = ActorDiedError()
    return wrapped


LOSSES = [
    ("actor-died", ActorDiedError(), 503, "replica_unavailable", "2"),
    (
        "actor-unavailable",
        ActorUnavailableError("network partition", None),
        503,
        "replica_unavailable",
        "2",
    ),
    ("ray-actor-error", RayActorError(), 503, "replica_unavailable", "2"),
    ("worker-crashed", WorkerCrashedError(), 503, "replica_unavailable", "2"),
    (
        "deployment-unavailable",
        DeploymentUnavailableError(DeploymentID(name="DraftEngine", app_name="a")),
        503,
        "replica_unavailable",
        "2",
    ),
    ("replica-unavailable", ReplicaUnavailableError("r1"), 503, "replica_unavailable", "2"),
    ("timeout", TimeoutError(), 503, "replica_unavailable", "2"),
    (
        "backpressure",
        BackPressureError(num_queued_requests=9, max_queued_requests=8),
        503,
        "overloaded",
        "2",
    ),
    (
        "backpressure-429",
        BackPressureError(9, 8, status_code=429, retry_after_s=7.5),
        429,
        "overloaded",
        "8",
    ),
    (
        "task-error-from-death",
        RayTaskError("generate", "tb", ActorDiedError()),
        503,
        "replica_unavailable",
        "2",
    ),
    ("upstream-crash", _upstream_crash(), 503, "replica_unavailable", "2"),
    ("a-bug", ValueError("bug"), None, None, None),
    ("a-bug-in-the-replica", RayTaskError("generate", "tb", ValueError("bug")), None, None, None),
]


@pytest.mark.parametrize(
    "exc,status,code,retry_after", [x[1:] for x in LOSSES], ids=[x[0] for x in LOSSES]
)
def test_replica_loss_maps_to_a_retryable_openai_error(exc, status, code, retry_after):
    err = _as_unavailable(exc, retry_after_s=2)
    if status is None:  # anything else stays a 500: a bug must not pass for a retryable blip
        assert err is None
        return
    assert (err.status, err.code, err.type) == (status, code, "server_error")
    assert err.headers == {"Retry-After": retry_after}
    assert set(err.body()["error"]) == {"message", "type", "param", "code"} and err.message


@dataclass
class Outcome:
    """One request as the client saw it."""

    stream: bool
    start: float
    end: float = 0.0
    status: int | None = None
    retry_after: str | None = None
    error: dict | None = None  # the 4xx/5xx body's or the stream's error event's `error`
    done: bool = False  # a stream's last event was [DONE]
    text: str = ""
    exception: str | None = None  # transport failure: timeout, connection dropped mid-body
    events: list = field(default_factory=list)


def send(
    client: httpx.Client, prefix: str, stream: bool, prompt: str, max_tokens: int, model: str = TINY
) -> Outcome:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    out = Outcome(stream, time.monotonic())
    try:
        with client.stream("POST", f"{prefix}/v1/completions", json=body) as r:
            out.status, out.retry_after = r.status_code, r.headers.get("retry-after")
            if r.status_code != 200 or not stream:
                r.read()
                if r.headers.get("content-type", "").startswith("application/json"):
                    data = r.json()
                    out.error = data.get("error")
                    out.text = "" if out.error else data["choices"][0]["text"]
                else:  # Serve's proxy answers in plain text (404 for a deleted route)
                    out.error = {"message": r.text, "type": None, "code": None}
            else:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        out.events.append(line[6:])
                out.done = out.events[-1:] == ["[DONE]"]
                chunks = [json.loads(e) for e in out.events if e != "[DONE]"]
                out.error = next((c["error"] for c in chunks if "error" in c), None)
                out.text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    except httpx.HTTPError as e:
        out.exception = f"{type(e).__name__}: {e}"
    out.end = time.monotonic()
    return out


def failed(o: Outcome) -> bool:
    return o.exception is not None or o.status != 200 or o.error is not None


def assert_retryable(o: Outcome, since: float) -> None:
    """A failure must be an OpenAI-shaped retryable error, and fast."""
    assert o.exception is None, f"transport failure instead of an error response: {o.exception}"
    assert o.status in (200, 503), f"{o.status}: {o.error}"
    assert o.error is not None and o.error["message"] and o.error["type"] == "server_error", o
    assert o.error["code"] in ("replica_unavailable", "queue_timeout", "overloaded"), o.error
    if o.status == 503:
        assert o.retry_after is not None and int(o.retry_after) >= 0
    else:  # a stream cut after its headers: the error is in-band and [DONE] still comes
        assert o.done, o.events[-3:]
    # Fast: no longer after the kill (or after it was sent) than a replica wait may take, plus
    # 15 s for a machine busy with other work (the tests may run two modules at a time)
    assert o.end - max(o.start, since) < QUEUE_TIMEOUT_S + 15 < CLIENT_TIMEOUT_S


def test_killed_replica_under_load_fails_fast_and_recovers(base_url, capsys):
    deploy("faults")
    prefix, outcomes, stop = f"{base_url}/faults", [], threading.Event()
    lock = threading.Lock()
    (victim,) = engine_replicas("faults")

    def client_loop(i: int) -> None:
        with httpx.Client(timeout=CLIENT_TIMEOUT_S) as c:
            n = 0
            while not stop.is_set():
                o = send(c, prefix, stream=(i + n) % 2 == 0, prompt=f"load {i}", max_tokens=200)
                with lock:
                    outcomes.append(o)
                n += 1

    threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(4)  # steady state: every client has finished requests and has one in flight
    with lock:
        assert outcomes and not any(failed(o) for o in outcomes), [
            o for o in outcomes if failed(o)
        ][:2]

    handle = ray.get_actor(victim, namespace="serve")
    pid = ray.get(handle.__ray_call__.remote(lambda self: os.getpid()))
    t_kill = time.monotonic()
    os.kill(pid, signal.SIGKILL)  # a crash: no graceful shutdown, no chance to answer

    replaced = None
    deadline = t_kill + 90
    while time.monotonic() < deadline:
        fresh = [r for r in engine_replicas("faults") if r != victim]
        if fresh and running("faults") == 1:
            replaced = time.monotonic() - t_kill
            break
        time.sleep(0.2)
    assert replaced is not None, (
        f"Serve did not replace the killed replica: {serve.status().applications['faults']}"
    )
    time.sleep(3)  # the recovered endpoint under load again
    stop.set()
    for t in threads:
        t.join(timeout=CLIENT_TIMEOUT_S + 10)
        assert not t.is_alive(), "a client hung"

    after = [o for o in outcomes if o.end > t_kill]
    bad = [o for o in after if failed(o)]
    for o in bad:
        assert_retryable(o, t_kill)
    for o in outcomes:
        assert o.status != 500 and o.exception is None
        if not failed(o) and o.stream:
            assert o.done
    cut = [o for o in bad if o.status == 200]
    assert bad, "no request was in flight on the killed replica: the fault did not hit"
    ok_after = [o.end - t_kill for o in after if o.start > t_kill and not failed(o)]
    assert ok_after, "no request succeeded after the kill"
    recovery = min(ok_after)
    assert recovery < 60
    report(
        capsys,
        "serve-faults",
        f"SIGKILL of the only engine replica under 4 clients: {len(outcomes)} requests, "
        f"{len(bad)} failed with a retryable error ({len(bad) - len(cut)} x 503 + Retry-After, "
        f"{len(cut)} streams cut with an SSE error + [DONE]), 0 x 500, 0 hangs; slowest failure "
        f"{max(o.end - max(o.start, t_kill) for o in bad):.2f} s after the kill; first success "
        f"{recovery:.1f} s after the kill; replacement replica RUNNING after {replaced:.1f} s",
    )
    serve.delete("faults")


@pytest.fixture(scope="module")
def long_reference() -> str:
    """What the drained stream must deliver: the 8-token preset has no EOS, so the stream
    runs its full length (one event per token with speculation off: a few seconds)."""
    v8 = load_target(V8)
    ref = autoregressive_generate(
        v8, v8.encode_prompt(LONG_PROMPT, chat=False), SamplingParams(max_new_tokens=LONG_TOKENS)
    )
    assert len(ref.tokens) == LONG_TOKENS
    return ref.text


@pytest.mark.parametrize("how", ["delete-app", "replace-replicas"])
def test_graceful_shutdown_drains_a_running_stream(base_url, long_reference, how, capsys):
    """A stream running when its replicas are told to stop finishes with every token
    (graceful_shutdown_timeout_s); requests sent meanwhile are answered promptly."""
    app = f"drain-{how}"
    deploy(app, target=V8, graceful_shutdown_timeout_s=240, queue_timeout_s=3)
    prefix, result, first_chunk = f"{base_url}/{app}", {}, threading.Event()

    def long_stream():
        body = {
            "model": V8,
            "prompt": LONG_PROMPT,
            "max_tokens": LONG_TOKENS,
            "temperature": 0,
            "stream": True,
            "speculation": "off",
        }
        events, t0 = [], time.monotonic()
        with (
            httpx.Client(timeout=CLIENT_TIMEOUT_S * 3) as c,
            c.stream("POST", f"{prefix}/v1/completions", json=body) as r,
        ):
            result["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first_chunk.set()
        result["events"], result["seconds"] = events, time.monotonic() - t0

    t = threading.Thread(target=long_stream, daemon=True)
    t.start()
    assert first_chunk.wait(60), "the stream did not start"
    t_stop = time.monotonic()
    if how == "delete-app":  # the whole app drains; Serve's proxy drops the route at once
        stopper = threading.Thread(target=serve.delete, args=(app,), daemon=True)
    else:  # new args = a new version: Serve replaces both replicas, the old ones drain
        stopper = threading.Thread(
            target=deploy,
            args=(app,),
            kwargs=dict(
                target=V8, graceful_shutdown_timeout_s=240, queue_timeout_s=3, retry_after_s=1
            ),
            daemon=True,
        )
    stopper.start()
    time.sleep(0.3)

    during = []
    with httpx.Client(timeout=CLIENT_TIMEOUT_S) as c:
        while t.is_alive() and len(during) < 30:
            during.append(send(c, prefix, stream=False, prompt="ab", max_tokens=4, model=V8))
            time.sleep(0.1)
    t.join(timeout=180)
    assert not t.is_alive(), "the draining stream hung"
    stopper.join(timeout=120)
    stopped = time.monotonic() - t_stop

    events = result["events"]
    assert result["status"] == 200 and events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks), [c for c in chunks if "error" in c]
    assert "".join(c["choices"][0]["text"] for c in chunks) == long_reference, (
        "the drained stream lost tokens"
    )
    assert during, "the stream ended before any request was sent during the drain"
    # promptly, long before the 240 s drain could end: at most a new ingress's start (~30 s
    # seen while another test module trains on the same 2 cores), then queue_timeout_s (3 s)
    for o in during:
        assert o.exception is None and o.end - o.start < 60, o
        if how == "delete-app":  # the route is gone: Serve's proxy answers 404 (plain text)
            assert o.status in (200, 404), o
        else:
            assert o.status in (200, 503), o
        if o.status == 503:
            assert o.retry_after is not None and o.error["type"] == "server_error", o
    if how == "replace-replicas":
        serve.delete(app)
    codes = dict(sorted(Counter(o.status for o in during).items()))
    report(
        capsys,
        "serve-faults",
        f"{how} during a {LONG_TOKENS}-token stream: the stream finished intact "
        f"({result['seconds']:.1f} s in all, {stopped:.1f} s after the stop began); {len(during)} "
        f"requests sent meanwhile got {codes}, slowest {max(o.end - o.start for o in during):.2f} "
        "s",
    )
