"""The OpenAI-compatible ingress and the typed application builder.

    serving/X.yaml:  import_path: draftlab.serve.app:build_app   args: {ServeArgs fields}
    build_app(ServeArgs) -> Application  =  Ingress(FastAPI) -> DraftEngine (autoscaled)

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (SSE with
`"stream": true`), GET /healthz; GET /openapi.json documents them, request bodies and
error shape included. Every error is OpenAI's JSON shape with a 4xx/5xx code; the engine
turns a request it cannot serve into an error event, never an exception, so a bad request
never costs a replica.

Faults: a body over `max_body_bytes` is a 413 before it is read. A lost engine replica
(killed, crashed, draining), full queues, or no replica taking the request within
`queue_timeout_s` is a fast 503 with `Retry-After` (OpenAI's clients retry it); a stream
cut by one ends with an in-band error event and `[DONE]`. Serve replaces the replica.
"""

# No `from __future__ import annotations`: Serve's class ingress rewrites the route methods'
# signatures, and FastAPI must see `Request` as a class, not a string, to inject it.
import asyncio
import json
import logging
import secrets

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError, WorkerCrashedError
from ray.serve import Application
from ray.serve.exceptions import (
    BackPressureError,
    DeploymentUnavailableError,
    ReplicaUnavailableError,
)
from ray.serve.handle import DeploymentHandle

from draftlab.config import ServeArgs
from draftlab.serve.deployment import DraftEngine
from draftlab.serve.events import Accepted, Delta, Done, Failed
from draftlab.serve.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    ErrorResponse,
    chunk_body,
    completion_body,
    new_id,
    parse_request,
    unavailable,
    usage,
    usage_chunk,
)

log = logging.getLogger(__name__)
_BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatRequest}


class _API(FastAPI):
    def openapi(self) -> dict:
        """FastAPI's schema plus the request bodies: the routes read the body themselves
        (size limit first, OpenAI's error shape for any invalid one), so FastAPI cannot see them."""
        if self.openapi_schema is None:
            schema = super().openapi()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in _BODIES.items():
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
                schema["paths"][path]["post"]["requestBody"] = {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}
                        }
                    },
                }
            self.openapi_schema = schema
        return self.openapi_schema


api = _API(
    title="draftlab", description="OpenAI-compatible speculative decoding (ParallelSpec drafters)"
)


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


_LOST = (
    RayActorError,
    WorkerCrashedError,
    DeploymentUnavailableError,
    ReplicaUnavailableError,
    TimeoutError,
)


def _as_unavailable(e: BaseException, retry_after_s: float) -> APIError | None:
    """A retryable 503 (429 if Serve was configured so) when `e`, or what caused it, says
    no engine replica could serve the request now; None for anything else (a bug: 500)."""
    for _ in range(
        8
    ):  # RayTaskError(cause=ActorDiedError), RayServeException from ActorDiedError, ...
        if isinstance(e, BackPressureError):  # every replica's queue is full
            return unavailable(
                "the server is overloaded: retry later",
                e.retry_after_s or retry_after_s,
                "overloaded",
                e.status_code,
            )
        if isinstance(e, _LOST):  # ActorDiedError and ActorUnavailableError are RayActorErrors
            return unavailable(
                f"the engine replica serving this request became unavailable ({type(e).__name__}):"
                f" retry later",
                retry_after_s,
                "replica_unavailable",
            )
        e = getattr(e, "cause", None) or e.__cause__
        if e is None:
            return None
    return None


@api.exception_handler(APIError)
async def _api_error(request: Request, e: APIError) -> JSONResponse:
    return _error(e)


@api.exception_handler(Exception)
async def _unexpected(request: Request, e: Exception) -> JSONResponse:
    log.exception("unexpected error on %s %s", request.method, request.url.path)
    return _error(
        _as_unavailable(e, 1)
        or APIError(
            500, f"internal error: {type(e).__name__}", code="internal_error", type_="server_error"
        )
    )


@api.exception_handler(404)
async def _not_found(request: Request, e) -> JSONResponse:
    return _error(
        APIError(
            404,
            f"no route {request.method} {request.url.path}: see /v1/models, /v1/completions, "
            f"/v1/chat/completions",
            code="not_found",
        )
    )


@api.exception_handler(405)
async def _bad_method(request: Request, e) -> JSONResponse:
    return _error(
        APIError(
            405,
            f"{request.method} is not allowed on {request.url.path}",
            code="method_not_allowed",
            headers=getattr(e, "headers", None),
        )
    )  # Starlette's `Allow` header


_ERRORS = {
    status: {"model": ErrorResponse, "description": what}
    for status, what in [
        (400, "Invalid request (type, range, unsupported option, context length)"),
        (401, "Missing or wrong API key"),
        (404, "Unknown model"),
        (413, "Body over `max_body_bytes`"),
        (
            503,
            "No engine replica could take the request now (lost, draining, overloaded): retry "
            "after `Retry-After` s",
        ),
    ]
}


_RESPONSES = {
    200: {
        "description": 'A completion, or with `"stream": true` its chunks as server-sent events',
        "content": {"text/event-stream": {}},
    },
    **_ERRORS,
}


def _too_large(size: int, limit: int, at_least: bool = False) -> APIError:
    return APIError(
        413,
        f"the request body is {'over ' if at_least else ''}{size} bytes; this server takes at most "
        f"{limit} (max_body_bytes)",
        code="request_too_large",
    )


def authorize(request: Request, keys: list[str], enabled: bool) -> None:
    """401 unless the request's `Authorization: Bearer` key is one of `keys`. Fails closed:
    auth configured (`enabled`) but no key found (empty env var or file) refuses everyone."""
    if not keys and not enabled:
        return
    got = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
    if not any(secrets.compare_digest(got, k) for k in keys):
        raise APIError(
            401,
            "invalid or missing API key (Authorization: Bearer <key>)",
            code="invalid_api_key",
            type_="authentication_error",
        )


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


@serve.deployment(name="Ingress", max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0})
@serve.ingress(api)
class Ingress:
    def __init__(self, engine: DeploymentHandle, args: dict):
        self.engine = engine
        self.args = ServeArgs.model_validate(args)
        self.keys = self.args.accepted_keys()
        self._info: dict | None = None

    async def info(self) -> dict:
        if self._info is None:
            self._info = await self.engine.info.remote()
        return self._info

    def _authorize(self, request: Request) -> None:
        authorize(request, self.keys, self.args.auth_enabled)

    @api.get("/healthz", responses={503: _ERRORS[503]})
    async def healthz(self) -> dict:
        return {"status": "ok", "model": (await self._engine(self.info()))["model"]}

    async def _body(self, request: Request) -> bytes:
        """The body, or 413 once it is known to exceed `max_body_bytes`: from Content-Length
        before reading, else (chunked) as soon as the bytes read pass it."""
        limit = self.args.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _too_large(int(declared), limit)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise _too_large(len(body), limit, at_least=True)
        return bytes(body)

    async def _engine(self, awaitable):
        """Await an engine call; a lost replica or no replica within `queue_timeout_s` is a 503."""
        try:
            return await asyncio.wait_for(awaitable, self.args.queue_timeout_s)
        except APIError:
            raise
        except TimeoutError:
            raise unavailable(
                f"no engine replica took the request within {self.args.queue_timeout_s:g} s: retry "
                "later",
                self.args.retry_after_s,
                "queue_timeout",
            ) from None
        except Exception as e:
            err = self._lost(e)
            if err is None:
                raise
            raise err from e

    def _lost(self, e: Exception) -> APIError | None:
        """The retryable error for an engine failure, or None (not a replica loss)."""
        err = _as_unavailable(e, self.args.retry_after_s)
        if err is not None:
            log.warning(
                "engine request failed, answering %d: %s: %s", err.status, type(e).__name__, e
            )
        return err

    def _event_error(self, event: Failed) -> APIError:
        """An engine error event after the request was accepted: 503 if the replica was
        shutting down (retryable), else 500 (a decoding failure)."""
        if event.status == 503:
            return unavailable(
                f"the engine replica stopped: {event.message}",
                self.args.retry_after_s,
                "replica_unavailable",
            )
        return APIError(
            500, f"generation failed: {event.message}", code="engine_error", type_="server_error"
        )

    @api.get("/v1/models", responses={401: _ERRORS[401], 503: _ERRORS[503]})
    async def models(self, request: Request) -> dict:
        self._authorize(request)
        info = await self._engine(self.info())
        return {
            "object": "list",
            "data": [
                {
                    "id": info["model"],
                    "object": "model",
                    "created": 0,
                    "owned_by": "draftlab",
                    "draftlab": {k: v for k, v in info.items() if k != "model"},
                }
            ],
        }

    @api.post("/v1/completions", responses=_RESPONSES)
    async def completions(self, request: Request):
        return await self._serve(request, chat=False)

    @api.post("/v1/chat/completions", responses=_RESPONSES)
    async def chat_completions(self, request: Request):
        return await self._serve(request, chat=True)

    async def _serve(self, request: Request, chat: bool):
        self._authorize(request)
        req = parse_request(ChatRequest if chat else CompletionRequest, await self._body(request))
        info = await self._engine(self.info())
        if req.model != info["model"]:
            raise APIError(
                404,
                f"the model '{req.model}' does not exist; this server serves '{info['model']}'",
                param="model",
                code="model_not_found",
            )
        payload = {
            "max_tokens": req.requested_max_tokens,
            "speculation": req.speculation,
            "sampling": req.sampling(1).model_dump(exclude={"max_new_tokens"}),
        }
        if chat:
            payload["messages"] = [{"role": m.role, "content": m.text()} for m in req.messages]
        else:
            payload["prompt"] = req.prompt
        stream = self.engine.options(stream=True).generate.remote(payload)
        try:
            first = await self._engine(stream.__anext__())
        except BaseException:
            stream.cancel()
            raise
        match first:
            case Failed(status=503):
                raise self._event_error(first)
            case Failed():
                raise APIError(
                    first.status or 400, first.message, param=first.param, code=first.code
                )
            case Accepted():
                prompt_tokens = first.prompt_tokens
            case _:
                raise TypeError(
                    f"the engine's first event must be Accepted or Failed, got {first!r}"
                )
        rid, model = new_id("chatcmpl" if chat else "cmpl"), info["model"]
        if req.stream:
            return StreamingResponse(
                self._events(stream, rid, model, chat, prompt_tokens, req.include_usage),
                media_type="text/event-stream",
            )
        text, done = [], None
        try:
            async for event in stream:
                match event:
                    case Failed():
                        raise self._event_error(event)
                    case Delta():
                        text.append(event.text)
                    case Done():
                        done = event
        except APIError:
            raise
        except Exception as e:
            stream.cancel()
            err = self._lost(e)
            if err is None:
                raise
            raise err from e
        except BaseException:  # the client went away: free its decoding slot
            stream.cancel()
            raise
        use = usage(prompt_tokens, done.completion_tokens, done.stats)
        return completion_body(rid, model, chat, "".join(text), done.finish_reason, use)

    async def _events(
        self, stream, rid: str, model: str, chat: bool, prompt_tokens: int, include_usage: bool
    ):
        """SSE chunks. Headers are sent: a failure is reported in-band, as OpenAI does
        (`data: {"error": ...}`, which its clients raise), then `[DONE]`."""
        if chat:  # OpenAI's first chat chunk carries the role
            yield _sse(chunk_body(rid, model, chat, "", None, first=True))
        try:
            async for event in stream:
                match event:
                    case Failed():
                        yield _sse(self._event_error(event).body())
                        break
                    case Delta(text=text) if text:
                        yield _sse(chunk_body(rid, model, chat, text, None))
                    case Done():
                        yield _sse(
                            chunk_body(rid, model, chat, None if chat else "", event.finish_reason)
                        )
                        if include_usage:
                            yield _sse(
                                usage_chunk(
                                    rid,
                                    model,
                                    chat,
                                    usage(prompt_tokens, event.completion_tokens, event.stats),
                                )
                            )
        except Exception as e:  # the replica was lost mid-stream
            err = self._lost(e)
            if err is None:
                log.exception("stream %s failed", rid)
                err = APIError(
                    500,
                    f"internal error: {type(e).__name__}",
                    code="internal_error",
                    type_="server_error",
                )
            yield _sse(err.body())
        finally:
            stream.cancel()  # a client that went away frees its decoding slot
        yield _sse("[DONE]")


def engine_options(args: ServeArgs) -> dict:
    """Serve options of the engine deployment from the typed args."""
    return {
        "autoscaling_config": args.autoscaling.model_dump(),
        "max_ongoing_requests": args.max_ongoing_requests,
        "max_queued_requests": args.max_queued_requests,
        "ray_actor_options": {"num_cpus": args.num_cpus, "num_gpus": args.num_gpus},
        "health_check_timeout_s": args.health_check_timeout_s,
        "health_check_period_s": args.health_check_period_s,
        "graceful_shutdown_timeout_s": args.graceful_shutdown_timeout_s,
    }


def build_app(args: ServeArgs) -> Application:
    """The application `serving/*.yaml` name (`import_path: draftlab.serve.app:build_app`)."""
    raw = args.model_dump(
        mode="json", exclude_unset=True
    )  # unset fields stay unset: the drafter names its target
    engine = DraftEngine.options(**engine_options(args)).bind(raw)
    # The ingress relays the engine's streams: it drains as long as the engine does.
    return Ingress.options(graceful_shutdown_timeout_s=args.graceful_shutdown_timeout_s).bind(
        engine, raw
    )
