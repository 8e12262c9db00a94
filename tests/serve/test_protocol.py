"""Request validation: every bad input becomes an APIError naming the parameter (the HTTP
tests check the same errors end to end)."""

from __future__ import annotations

import json

import pytest

from draftlab.serve.protocol import APIError, ChatRequest, CompletionRequest, parse_request

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def body(**kw) -> bytes:
    return json.dumps(CHAT | kw).encode()


@pytest.mark.parametrize(
    "raw,param,code",
    [
        (b"{not json", None, "invalid_json"),
        (b"[1, 2]", None, "invalid_json"),
        (
            json.dumps({"messages": CHAT["messages"]}).encode(),
            "model",
            "missing_required_parameter",
        ),
        (body(max_tokens="ten"), "max_tokens", "invalid_type"),
        (body(max_tokens=-3), "max_tokens", "invalid_type"),
        (body(max_tokens=True), "max_tokens", "invalid_type"),
        (body(temperature=-1), "temperature", "invalid_type"),
        (body(top_p=0), "top_p", "invalid_type"),
        (body(messages=[]), "messages", "invalid_type"),
        (body(messages=[{"role": "wizard", "content": "x"}]), "messages.0.role", "invalid_type"),
        (body(stop=["a", "b", "c", "d", "e"]), "stop", "invalid_type"),
        (body(n=2), "n", "unsupported_value"),
        (body(logprobs=True), "logprobs", "unsupported_parameter"),
        (body(speculation="maybe"), "speculation", "invalid_type"),
    ],
)
def test_bad_chat_requests_name_the_parameter(raw, param, code):
    with pytest.raises(APIError) as e:
        parse_request(ChatRequest, raw)
    assert e.value.status == 400 and e.value.param == param and e.value.code == code
    assert e.value.body()["error"]["type"] == "invalid_request_error"


def test_good_requests_and_defaults():
    req = parse_request(
        ChatRequest,
        body(temperature=1, stop="\n", seed=3, user="u", stream_options={"include_usage": True}),
    )
    assert req.temperature == 1.0 and req.stop == ["\n"] and req.include_usage
    params = req.sampling(12)
    assert (
        params.max_new_tokens == 12
        and params.stop == ["\n"]
        and params.seed == 3
        and not params.greedy
    )
    comp = parse_request(
        CompletionRequest, json.dumps({"model": "m", "prompt": [1, 2, 3], "max_tokens": 5}).encode()
    )
    assert comp.prompt == [1, 2, 3] and comp.requested_max_tokens == 5
    with pytest.raises(APIError, match="several prompts"):
        parse_request(CompletionRequest, json.dumps({"model": "m", "prompt": ["a", "b"]}).encode())


def test_api_error_takes_its_details_by_keyword():
    """Status and message positional, the rest named: `APIError(400, msg, None, "x")` is refused."""
    e = APIError(400, "bad", param="prompt", code="invalid_type")
    assert e.status == 400 and e.body() == {
        "error": {
            "message": "bad",
            "type": "invalid_request_error",
            "param": "prompt",
            "code": "invalid_type",
        }
    }
    with pytest.raises(TypeError):
        APIError(400, "bad", "prompt", "invalid_type")
