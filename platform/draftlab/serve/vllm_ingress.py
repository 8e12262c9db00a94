"""Ray Serve LLM's OpenAI ingress with draftlab's API keys and error shape (`build_vllm_app`).

Every route of Ray's `OpenAiIngress` first checks `Authorization: Bearer <key>` exactly as the
draftlab app does (`draftlab.serve.app.authorize`: same keys, same fail-closed rule, same 401
body), then runs Ray's route. FastAPI validates a route's body before calling it, so a body
that does not parse is a 400 even without a key (the draftlab app reads bodies itself: 401).
Ray answers an unknown model with FastAPI's `{"detail": ...}`; here it is OpenAI's error JSON
(404 `model_not_found`, param `model`), like the draftlab app.
Importing this module imports vLLM (through `ray.serve.llm`): only the builder and the
ingress replica do.
"""

# No `from __future__ import annotations`: FastAPI must see `Request` as a class to inject it.
import functools

from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse
from ray.serve.llm.ingress import OpenAiIngress

from draftlab.config import ServingCommon
from draftlab.serve.app import authorize
from draftlab.serve.protocol import APIError


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _checked(route):
    """Ray's `route(self, body, request)` behind the key check, its HTTP errors in OpenAI's
    shape (FastAPI reads the signature through `__wrapped__`: the body model and its
    validation stay Ray's)."""

    @functools.wraps(route)
    async def checked(self, body, request: Request):
        try:
            authorize(request, self.keys, self.auth_enabled)
            return await route(self, body, request)
        except APIError as e:
            return _error(e)
        except HTTPException as e:
            not_found = e.status_code == 404
            return _error(
                APIError(
                    e.status_code,
                    str(e.detail),
                    param="model" if not_found else None,
                    code="model_not_found" if not_found else None,
                )
            )

    return checked


class Ingress(OpenAiIngress):
    def __init__(self, llm_deployments, model_cards, *, auth: dict | None = None, **kwargs):
        super().__init__(llm_deployments, model_cards, **kwargs)
        args = ServingCommon.model_validate(auth or {})
        self.keys, self.auth_enabled = (
            args.accepted_keys(),
            args.auth_enabled,
        )  # read here, on the replica

    async def models(self, request: Request):
        try:
            authorize(request, self.keys, self.auth_enabled)
        except APIError as e:
            return _error(e)
        return await super().models()

    async def model_data(self, model: str, request: Request):
        try:
            authorize(request, self.keys, self.auth_enabled)
        except APIError as e:
            return _error(e)
        return await super().model_data(model)

    completions = _checked(OpenAiIngress.completions)
    chat = _checked(OpenAiIngress.chat)
    embeddings = _checked(OpenAiIngress.embeddings)
    transcriptions = _checked(OpenAiIngress.transcriptions)
    score = _checked(OpenAiIngress.score)
    tokenize = _checked(OpenAiIngress.tokenize)
    detokenize = _checked(OpenAiIngress.detokenize)
