"""The OpenAI-compatible endpoint on a real Ray Serve instance on 127.0.0.1, spoken to over
real HTTP by the official `openai` client (and httpx for malformed requests): a tiny
target with an untrained parallel drafter, a pair loaded from a real MLflow server's
`champion` alias, and an autoscaled app driven from 1 to 2 replicas and back."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from ray import serve

from draftlab.config import LoadtestConfig, SamplingParams, ServeArgs, TargetSpec
from draftlab.data.prompts import load_prompts
from draftlab.decoding.engine import autoregressive_generate
from draftlab.models.drafters.build import init_drafter
from draftlab.serve.app import build_app
from draftlab.serve.loadtest import run_loadtest
from draftlab.serve.pair import resolve_pair
from draftlab.storage import mirror_dir
from serve_support import local_serve

pytestmark = pytest.mark.slow
TINY = "tiny-llama"
ENGINE = {"num_cpus": 0.25, "health_check_timeout_s": 30}


@pytest.fixture(scope="module")
def base_url():
    with local_serve() as url:
        args = ServeArgs(
            target=TargetSpec(name=TINY),
            drafter="init:parallel",
            engine={"tree": "small-6"},
            **ENGINE,
        )
        serve.run(build_app(args), name="tiny", route_prefix="/")
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def reference(tiny, text: str, max_tokens: int, chat: bool = True) -> str:
    ids = tiny.encode_prompt(text, chat=chat)
    return autoregressive_generate(tiny, ids, SamplingParams(max_new_tokens=max_tokens)).text


def test_models_and_health(client, base_url):
    models = client.models.list().data
    assert [m.id for m in models] == [TINY]
    assert models[0].model_extra["draftlab"]["drafter"]["family"] == "parallel"
    assert httpx.get(f"{base_url}/healthz").json() == {"status": "ok", "model": TINY}


def test_greedy_completion_and_chat_equal_target_only(client, tiny):
    comp = client.completions.create(
        model=TINY, prompt="The quick brown fox", max_tokens=24, temperature=0
    )
    assert comp.choices[0].text == reference(tiny, "The quick brown fox", 24, chat=False)
    assert comp.usage.completion_tokens <= 24 and comp.usage.prompt_tokens > 0
    spec = comp.usage.model_extra["speculative"]
    assert spec["target_forwards"] >= 1 and spec["tau"] == pytest.approx(
        (spec["accepted"] + spec["target_forwards"]) / spec["target_forwards"]
    )

    chat = client.chat.completions.create(
        model=TINY,
        messages=[{"role": "user", "content": "Hello world"}],
        max_tokens=30,
        temperature=0,
    )
    assert chat.choices[0].message.content == reference(tiny, "Hello world", 30)
    assert chat.choices[0].finish_reason in ("stop", "length")


def test_streaming_chat_and_completion(client, tiny):
    stream = client.chat.completions.create(
        model=TINY,
        messages=[{"role": "user", "content": "1 + 1 ="}],
        max_tokens=30,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference(tiny, "1 + 1 =", 30)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)

    parts = list(
        client.completions.create(model=TINY, prompt="Write a poem", max_tokens=20, stream=True)
    )
    assert "".join(p.choices[0].text for p in parts) == reference(
        tiny, "Write a poem", 20, chat=False
    )


def test_stop_seed_and_sampling(client, tiny):
    free = reference(tiny, "Hello world", 40)
    stop = free[12:14]
    out = client.chat.completions.create(
        model=TINY,
        messages=[{"role": "user", "content": "Hello world"}],
        max_tokens=40,
        stop=[stop],
    )
    assert (
        out.choices[0].message.content == free[: free.find(stop)]
        and out.choices[0].finish_reason == "stop"
    )
    kw = dict(model=TINY, prompt="abc", max_tokens=20, temperature=1.0, top_p=0.9)
    a = client.completions.create(seed=7, **kw).choices[0].text
    assert (
        a == client.completions.create(seed=7, **kw).choices[0].text
    )  # a seed reproduces the sample


BAD = [
    ("/v1/chat/completions", b"{oops", 400, "invalid_json"),
    ("/v1/chat/completions", {"model": TINY, "messages": "hi"}, 400, "invalid_type"),
    (
        "/v1/chat/completions",
        {"model": TINY, "messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
        400,
        "invalid_type",
    ),
    (
        "/v1/chat/completions",
        {"model": TINY, "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**7},
        400,
        "context_length_exceeded",
    ),
    (
        "/v1/completions",
        {"model": TINY, "prompt": "x" * 5000, "max_tokens": 4},
        400,
        "context_length_exceeded",
    ),
    ("/v1/completions", {"model": TINY, "prompt": [1, 2, 10**6]}, 400, None),
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model_not_found"),
    ("/v1/completions", {"model": TINY, "prompt": "hi", "n": 3}, 400, "unsupported_value"),
    ("/v1/completions", {"model": TINY, "prompt": "hi", "temperature": "hot"}, 400, "invalid_type"),
    ("/v1/nothing", {}, 404, "not_found"),
]


@pytest.mark.parametrize(
    "path,payload,status,code", BAD, ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)]
)
def test_bad_input_gets_an_openai_error_and_the_server_lives_on(
    base_url, client, path, payload, status, code
):
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    r = httpx.post(
        f"{base_url}{path}", content=data, headers={"Content-Type": "application/json"}, timeout=60
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["code"] == code
    ok = client.completions.create(model=TINY, prompt="still alive?", max_tokens=3)
    assert ok.choices[0].text is not None and ok.usage.completion_tokens >= 1


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=TINY, prompt="hi", max_tokens=100000)


def test_32_concurrent_streaming_and_plain_requests(base_url, tiny):
    texts = [f"request {i}: {'abcdefgh'[i % 8] * (1 + i % 5)}" for i in range(32)]
    aclient = openai.AsyncOpenAI(
        base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300
    )

    async def one(i: int) -> str:
        messages = [{"role": "user", "content": texts[i]}]
        if i % 2:
            stream = await aclient.chat.completions.create(
                model=TINY, messages=messages, max_tokens=24, stream=True
            )
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        out = await aclient.chat.completions.create(model=TINY, messages=messages, max_tokens=24)
        return out.choices[0].message.content

    async def run_all():
        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await aclient.close()

    outs = asyncio.run(run_all())
    for text, out in zip(texts, outs, strict=True):
        assert out == reference(tiny, text, 24)


def test_loadtest_reports_every_level_and_mode(base_url):
    report = run_loadtest(
        LoadtestConfig(
            url=f"{base_url}/v1",
            concurrency=[1, 3],
            requests=3,
            max_tokens=16,
            speculation=["on", "off"],
            warmup=0,
        ),
        progress=False,
    )
    assert report["model"] == TINY
    rows = {(r["concurrency"], r["speculation"]): r for r in report["levels"]}
    assert set(rows) == {(1, "on"), (1, "off"), (3, "on"), (3, "off")}
    for (_c, mode), r in rows.items():
        # 3 requests in 2 rounds (2 + 1), the modes taking turns, pooled per mode
        assert r["errors"] == 0 and r["requests"] == 3 and r["rounds"] == 2
        assert r["output_tokens_per_s"] > 0 and r["ttft_p50_s"] <= r["latency_p95_s"]
        assert r["tau"] == 1.0 if mode == "off" else r["tau"] >= 1.0
        assert (r["drafted"] > 0) == (mode == "on"), (
            mode,
            r["drafted"],
        )  # `on` drafts every round, `off` never
        # the default prompts' first 3 (cycled in order), each request's own speed by its kind
        kinds = [p.category for p in load_prompts(None)[:3]]
        assert {k: v["requests"] for k, v in r["by_kind"].items()} == {
            k: kinds.count(k) for k in kinds
        }
        assert all(v["request_tokens_per_s"] > 0 for v in r["by_kind"].values())


def test_serve_status_lists_the_app():
    from draftlab.serve.control import status

    st = status()
    assert st["applications"]["tiny"]["deployments"]["DraftEngine"]["replicas"].get("RUNNING") == 1


# ----------------------------------------------------------------- MLflow champion


def test_serves_the_champion_from_the_mlflow_registry(
    base_url, tiny, mlflow_uri, tmp_path, monkeypatch
):
    from mlflow import MlflowClient

    from draftlab.tracking import promote

    client = MlflowClient(mlflow_uri)
    drafter_dir = init_drafter("parallel", tiny, k=3, depth=1, seed=5).save(tmp_path / "drafter")
    (drafter_dir / "tree.json").write_text("[[0], [1], [0, 0]]")
    exp = client.create_experiment("serve-test")
    run = client.create_run(exp, tags={"draftlab.target": TINY})
    client.log_artifacts(run.info.run_id, str(drafter_dir), "drafter")
    client.set_terminated(run.info.run_id)
    champ = promote(run.info.run_id, tracking_uri=mlflow_uri)
    assert champ["model"] == "draftlab-tiny-llama-drafter"

    args = ServeArgs(
        model_uri=f"models:/{champ['model']}@champion",
        tracking_uri=mlflow_uri,
        api_keys=["sekret"],
        **ENGINE,
    )
    serve.run(build_app(args), name="champ", route_prefix="/champ")
    try:
        secured = openai.OpenAI(
            base_url=f"{base_url}/champ/v1", api_key="sekret", max_retries=0, timeout=120
        )
        info = secured.models.list().data[0]
        assert info.id == TINY  # the drafter's config named its target
        extra = info.model_extra["draftlab"]
        assert extra["source"]["version"] == champ["version"] and extra["tree"] == [
            [0],
            [1],
            [0, 0],
        ]
        out = secured.chat.completions.create(
            model=TINY, messages=[{"role": "user", "content": "Hi"}], max_tokens=20
        )
        assert out.choices[0].message.content == reference(tiny, "Hi", 20)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(
                base_url=f"{base_url}/champ/v1", api_key="wrong", max_retries=0
            ).models.list()
    finally:
        serve.delete("champ")

    # One local copy per machine, reused by every replica and restart; fetched again
    # when the stored files change.
    monkeypatch.setenv("DRAFTLAB_CACHE", str(tmp_path / "cache"))
    first = Path(resolve_pair(args).drafter)
    assert first == mirror_dir(f"runs:/{run.info.run_id}/drafter") and first.is_relative_to(
        tmp_path / "cache"
    )
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert (
        Path(resolve_pair(args).drafter) == first
        and (first / "model.safetensors").stat().st_mtime_ns == stamp
    )
    (drafter_dir / "tree.json").write_text("[[0], [0, 0], [0, 0, 0]]")
    client.log_artifact(run.info.run_id, str(drafter_dir / "tree.json"), "drafter")
    assert json.loads((Path(resolve_pair(args).drafter) / "tree.json").read_text()) == [
        [0],
        [0, 0],
        [0, 0, 0],
    ]
    assert not list(first.rglob(".download-*"))  # no partial download left behind


# ----------------------------------------------------------------- autoscaling


def _replicas(app: str) -> int:
    st = serve.status().applications[app].deployments["DraftEngine"]
    return st.replica_states.get("RUNNING", 0)


def test_sustained_load_scales_out_and_back(base_url):
    args = ServeArgs(
        target=TargetSpec(name=TINY),
        drafter="init:parallel",
        **ENGINE,
        autoscaling={
            "min_replicas": 1,
            "max_replicas": 2,
            "target_ongoing_requests": 1,
            "upscale_delay_s": 0.5,
            "downscale_delay_s": 3,
            "look_back_period_s": 1,
            "metrics_interval_s": 0.5,
        },
    )
    serve.run(build_app(args), name="auto", route_prefix="/auto")
    assert _replicas("auto") == 1
    stop = threading.Event()
    errors: list[str] = []

    def load():
        with httpx.Client(base_url=f"{base_url}/auto/v1", timeout=120) as c:
            while not stop.is_set():
                r = c.post(
                    "/completions", json={"model": TINY, "prompt": "load", "max_tokens": 200}
                )
                if r.status_code != 200:
                    errors.append(r.text)

    threads = [threading.Thread(target=load, daemon=True) for _ in range(6)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 90
        while _replicas("auto") < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _replicas("auto") == 2, (
            "6 concurrent clients against target_ongoing_requests=1 did not scale out"
        )
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    assert not errors
    deadline = time.monotonic() + 90
    while _replicas("auto") > 1 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _replicas("auto") == 1, "the deployment did not scale back after the load stopped"
    serve.delete("auto")
