"""Bad input over real HTTP on a Serve app on 127.0.0.1 (tiny target).

1. schemathesis fuzzes every operation of the server's own `/openapi.json` (request bodies
   of /v1/completions and /v1/chat/completions included, from the pydantic models), valid
   and invalid data: no 5xx, only documented status codes and content types. Each fuzzed
   body is sent a second time naming the served model, so the engine sees the fuzzed
   prompts, messages, stops and sampling options too.
2. Targeted cases: oversized bodies (Content-Length, chunked), invalid UTF-8, NUL and
   control characters, lone surrogates, deep nesting, extreme sampling values.
Totals are printed as a `[fuzz]` line (past pytest's capture) for the README."""

from __future__ import annotations

import json
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from ray import serve
from schemathesis import checks

from draftlab.config import ServeArgs, TargetSpec
from draftlab.serve.app import api, build_app
from serve_support import local_serve, report

pytestmark = pytest.mark.slow
TINY = "tiny-llama"
MAX_BODY = 64 * 1024  # small, so the 413 tests send little
TOTALS: Counter = Counter()


@pytest.fixture(scope="module")
def base_url():
    with local_serve() as url:
        args = ServeArgs(
            target=TargetSpec(name=TINY),
            drafter="init:parallel",
            num_cpus=0.25,
            health_check_timeout_s=30,
            max_body_bytes=MAX_BODY,
        )
        serve.run(build_app(args), name="fuzz", route_prefix="/")
        yield url


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=60) as c:
        yield c


def test_schema_documents_request_bodies_and_errors(http):
    doc = http.get("/openapi.json").json()
    assert doc == json.loads(json.dumps(api.openapi())), (
        "the fuzzed schema is not the one the server serves"
    )
    for path, model in [
        ("/v1/completions", "CompletionRequest"),
        ("/v1/chat/completions", "ChatRequest"),
    ]:
        op = doc["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{model}"
        assert {"400", "404", "413", "503"} <= set(op["responses"])
    props = doc["components"]["schemas"]["ChatRequest"]["properties"]
    assert {"model", "messages", "max_tokens", "temperature", "stream", "stop"} <= set(props)
    assert doc["components"]["schemas"]["ChatMessage"]["properties"]["role"]["enum"]


# The app's own schema, the one it serves at /openapi.json (checked above), loaded at
# collection: schemathesis' lazy `from_fixture` does not run on pytest 9.
schema = schemathesis.openapi.from_dict(api.openapi())


def _served_model_variant(case) -> dict | None:
    """The fuzzed JSON body naming the served model, with few tokens (keeps it fast)."""
    if case.method != "POST" or not isinstance(case.body, dict):
        return None
    body = {**case.body, "model": TINY}
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int) and not isinstance(body[key], bool) and body[key] > 4:
            body[key] = 4
    body.setdefault("max_tokens", 4)
    return body


@schema.parametrize()
@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_fuzz_the_api_from_its_openapi_schema(case, base_url, http):
    TOTALS["cases"] += 1
    TOTALS[f"{case.method} {case.path}"] += 1
    try:
        # positive_data_acceptance is left out on purpose: schema-valid bodies naming another
        # model (404), or asking for n > 1, logprobs... (400) are refused by design.
        response = case.call_and_validate(
            excluded_checks=[checks.positive_data_acceptance], timeout=60, base_url=base_url
        )
        TOTALS[f"status {response.status_code}"] += 1
        body = _served_model_variant(case)
        if body is not None:
            TOTALS["engine cases"] += 1
            r = http.post(
                case.formatted_path,
                content=json.dumps(body),
                headers={"Content-Type": "application/json"},
            )
            TOTALS[f"engine status {r.status_code}"] += 1
            assert r.status_code < 500, (body, r.text)
            if r.status_code != 200:
                assert r.json()["error"]["message"]
    except Exception:
        TOTALS["failures"] += 1
        raise


# -------------------------------------------------------------------- targeted bad input


def post(
    http: httpx.Client, body: bytes | dict, path: str = "/v1/completions", **kw
) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http.post(path, content=data, headers={"Content-Type": "application/json"}, **kw)


def assert_error(r: httpx.Response, status: int, code: str | None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["code"] == code, err


def test_oversized_bodies_are_rejected_early(http):
    big = json.dumps({"model": TINY, "prompt": "x" * MAX_BODY}).encode()
    assert_error(post(http, big), 413, "request_too_large")  # from Content-Length, before reading

    def chunks():  # no Content-Length: Transfer-Encoding: chunked
        yield b'{"model": "tiny-llama", "prompt": "'
        for _ in range(MAX_BODY // 1024 + 8):
            yield b"y" * 1024
        yield b'"}'

    r = http.post(
        "/v1/chat/completions", content=chunks(), headers={"Content-Type": "application/json"}
    )
    assert r.request.headers.get("transfer-encoding") == "chunked"
    assert_error(r, 413, "request_too_large")
    # just under the limit is read and judged on its merits
    fits = {"model": TINY, "prompt": "x" * (MAX_BODY - 100), "max_tokens": 1}
    assert_error(post(http, fits), 400, "context_length_exceeded")


BAD_BYTES = [
    ("invalid-utf8", b'{"model": "tiny-llama", "prompt": "\xff\xfe\xfd"}', 400, "invalid_json"),
    ("utf8-overlong", b'{"model": "tiny-llama", "prompt": "\xc0\xaf"}', 400, "invalid_json"),
    ("raw-nul-in-string", b'{"model": "tiny-llama", "prompt": "a\x00b"}', 400, "invalid_json"),
    ("lone-surrogate", b'{"model": "tiny-llama", "prompt": "\\ud800"}', 400, "invalid_unicode"),
    (
        "lone-surrogate-key",
        b'{"model": "tiny-llama", "prompt": "a", "\\udfff": 1}',
        400,
        "invalid_unicode",
    ),
    (
        "surrogate-in-chat",
        b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "\\udc80"}]}',
        400,
        "invalid_unicode",
    ),
    ("deep-array", b"[" * 50_000, 400, "invalid_json"),
    (
        "deep-value",
        b'{"model": "tiny-llama", "prompt": "a", "logit_bias": '
        + b'{"a": ' * 5000
        + b"1"
        + b"}" * 5001,
        400,
        "invalid_json",
    ),
    ("empty", b"", 400, "invalid_json"),
    ("not-an-object", b'"hello"', 400, "invalid_json"),
    (
        "huge-seed",
        b'{"model": "tiny-llama", "prompt": "a", "seed": 1180591620717411303424}',
        400,
        "invalid_type",
    ),
    (
        "nan-temperature",
        b'{"model": "tiny-llama", "prompt": "a", "temperature": NaN}',
        400,
        "invalid_type",
    ),
]


@pytest.mark.parametrize(
    "body,status,code", [b[1:] for b in BAD_BYTES], ids=[b[0] for b in BAD_BYTES]
)
def test_malformed_bodies_get_400_and_the_server_lives_on(http, body, status, code):
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    assert_error(post(http, body, path), status, code)
    ok = post(http, {"model": TINY, "prompt": "alive", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


SANE = [
    ("nul-and-controls", {"prompt": "a\u0000b\u0001c\u001f\u007f\u0085\u2028d"}),
    ("controls-in-chat", {"messages": [{"role": "user", "content": "hi\u0000\u0007\u001b[31m"}]}),
    ("controls-in-stop", {"prompt": "abc", "stop": ["\u0000", "\u001b"]}),
    ("non-bmp", {"prompt": "\U0001f600\U00010348 \u200d\ufeff"}),
    ("tiny-temperature", {"prompt": "abc", "temperature": 1e-300, "seed": 3}),
    ("tiny-top-p", {"prompt": "abc", "temperature": 1.0, "top_p": 5e-324}),
    ("max-temperature", {"prompt": "abc", "temperature": 2.0, "seed": 2**64 - 1}),
    ("negative-seed", {"prompt": "abc", "temperature": 0.7, "seed": -(2**63)}),
]


@pytest.mark.parametrize("extra", [s[1] for s in SANE], ids=[s[0] for s in SANE])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_odd_but_valid_text_and_sampling_are_served(http, extra, stream):
    path = "/v1/chat/completions" if "messages" in extra else "/v1/completions"
    r = post(http, {"model": TINY, "max_tokens": 6, "stream": stream, **extra}, path)
    assert r.status_code == 200, r.text
    if stream:
        events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events


def test_fuzz_totals(request, capsys):
    """Runs after the fuzz test (file order): the numbers the lead reports."""
    if not any(
        item.originalname == "test_fuzz_the_api_from_its_openapi_schema"
        for item in request.session.items
    ):
        pytest.skip("the schemathesis test was deselected")
    assert TOTALS["cases"] > 0, "the schemathesis test did not run"
    ops = {k: v for k, v in TOTALS.items() if k.startswith(("GET ", "POST "))}
    statuses = {k: v for k, v in sorted(TOTALS.items()) if "status" in k}
    report(
        capsys,
        "fuzz",
        f"schemathesis: {TOTALS['cases']} cases over {len(ops)} operations {ops}, "
        f"{TOTALS['engine cases']} re-sent to the engine; failures: {TOTALS['failures']}; "
        f"{statuses}",
    )
    assert TOTALS["failures"] == 0
