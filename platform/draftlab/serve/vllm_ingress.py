"""Ray Serve LLM's OpenAI ingress with draftlab's API keys and error shape (`build_vllm_app`).

Every route of Ray's `OpenAiIngress` first checks `Authorization: Bearer <key>` exactly as the
draftlab app does (`draftlab.serve.app.authorize`: same keys, same fail-closed rule, same 401
body), then runs Ray's route. FastAPI validates a route's body before calling it, so a body
that does not parse is a 400 even without a key (the draftlab app reads bodies itself: 401).
Ray answers an unknown model with FastAPI's `{"detail": ...}`; here it is OpenAI's error JSON
(404 `model_not_found`, param `model`), like the draftlab app.

**Routing by load** (`VllmServeArgs.speculate_up_to`): the builder binds a second LLMServer,
the target alone under the same model id, as `target_only`. A completion or chat request goes
there when `speculate_up_to` requests are already in flight at this replica (counted from
arrival to the last byte of the answer, streamed or not) or when it asks for no drafts
(`vllm_xargs: {"draftlab_k": 0}`); otherwise to the speculative engine. Ray's route is
unchanged: the choice reaches its handle lookup (`_get_configured_serve_handle`) through a
context variable of the request's task. The answer says where it ran (`ROUTE_HEADER`).
Importing this module imports vLLM (through `ray.serve.llm`): only the builder and the
ingress replica do.
"""

# No `from __future__ import annotations`: FastAPI must see `Request` as a class to inject it.
import contextvars
import functools

from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray.serve.llm.ingress import OpenAiIngress

from draftlab.config import ServingCommon
from draftlab.serve.app import authorize
from draftlab.serve.protocol import APIError
from draftlab.vllm_scheduler import request_k

ROUTE_HEADER = "x-draftlab-engine"  # "speculative" | "target-only"
_TARGET_ONLY = contextvars.ContextVar("draftlab_target_only", default=False)


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _checked(route, routed: bool = False):
    """Ray's `route(self, body, request)` behind the key check, its HTTP errors in OpenAI's
    shape (FastAPI reads the signature through `__wrapped__`: the body model and its
    validation stay Ray's); `routed`: sent to one of the two engines (module doc)."""

    @functools.wraps(route)
    async def checked(self, body, request: Request):
        try:
            authorize(request, self.keys, self.auth_enabled)
            if routed and self.target_only is not None:
                return await self.routed(route, body, request)
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
    def __init__(
        self,
        llm_deployments,
        model_cards,
        *,
        auth: dict | None = None,
        target_only=None,  # DeploymentHandle: the target-only engine (routing by load), or None
        speculate_up_to: int | None = None,
        **kwargs,
    ):
        super().__init__(llm_deployments, model_cards, **kwargs)
        args = ServingCommon.model_validate(auth or {})
        self.keys, self.auth_enabled = (
            args.accepted_keys(),
            args.auth_enabled,
        )  # read here, on the replica
        self.target_only = target_only.options(stream=True) if target_only is not None else None
        self.speculate_up_to = speculate_up_to
        self.in_flight = 0  # completion and chat requests of this replica, not yet answered

    async def routed(self, route, body, request: Request):
        """Ray's `route` on the engine this request's load and draft cap pick (module doc)."""
        try:
            cap = request_k(body.vllm_xargs)
        except ValueError as e:
            raise APIError(400, f"vllm_xargs: {e}", param="vllm_xargs") from None
        target_only = self.in_flight >= self.speculate_up_to or cap == 0
        self.in_flight += 1
        token, streaming = _TARGET_ONLY.set(target_only), False
        try:
            response = await route(self, body, request)
            response.headers[ROUTE_HEADER] = "target-only" if target_only else "speculative"
            if isinstance(response, StreamingResponse):
                response.body_iterator, streaming = self._counted(response.body_iterator), True
            return response
        finally:
            _TARGET_ONLY.reset(token)
            if not streaming:
                self.in_flight -= 1

    async def _counted(self, chunks):
        """A streamed answer's chunks; the request leaves the count with the last (or when the
        client goes away)."""
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            self.in_flight -= 1

    def _get_configured_serve_handle(self, model_id: str):
        handle = super()._get_configured_serve_handle(model_id)  # 404s an unknown model
        base = model_id in self._default_serve_handles  # not a LoRA adapter's id
        return self.target_only if _TARGET_ONLY.get() and base else handle

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

    completions = _checked(OpenAiIngress.completions, routed=True)
    chat = _checked(OpenAiIngress.chat, routed=True)
    embeddings = _checked(OpenAiIngress.embeddings)
    transcriptions = _checked(OpenAiIngress.transcriptions)
    score = _checked(OpenAiIngress.score)
    tokenize = _checked(OpenAiIngress.tokenize)
    detokenize = _checked(OpenAiIngress.detokenize)
