"""The OpenAI-compatible ingress and the typed application builder.

    serving/X.yaml:  import_path: draftlab.serve.app:build_app   args: {ServeArgs fields}
    build_app(ServeArgs) -> Application  =  Ingress(FastAPI) -> DraftEngine (autoscaled)

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (SSE with
`"stream": true`), GET /healthz. Every error is OpenAI's JSON shape with a 4xx/5xx code;
the engine turns a request it cannot serve into an error event, never an exception, so a
bad request never costs a replica.
"""

# No `from __future__ import annotations`: Serve's class ingress rewrites the route methods'
# signatures, and FastAPI must see `Request` as a class, not a string, to inject it.
import json
import secrets

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle

from draftlab.config import ServeArgs
from draftlab.serve.engine import DraftEngine
from draftlab.serve.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    chunk_body,
    completion_body,
    new_id,
    parse_request,
    usage,
    usage_chunk,
)

api = FastAPI(title="draftlab", description="OpenAI-compatible speculative decoding (ParallelSpec drafters)")


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


@api.exception_handler(APIError)
async def _api_error(request: Request, e: APIError) -> JSONResponse:
    return _error(e)


@api.exception_handler(Exception)
async def _unexpected(request: Request, e: Exception) -> JSONResponse:
    from ray.serve.exceptions import BackPressureError

    if isinstance(e, BackPressureError):  # every replica's queue is full
        return _error(APIError(503, "the server is overloaded: retry later", None, "overloaded", "server_error"))
    return _error(APIError(500, f"internal error: {type(e).__name__}", None, "internal_error", "server_error"))


@api.exception_handler(404)
async def _not_found(request: Request, e) -> JSONResponse:
    return _error(APIError(404, f"no route {request.method} {request.url.path}: see /v1/models, /v1/completions, "
                                f"/v1/chat/completions", None, "not_found"))


@api.exception_handler(405)
async def _bad_method(request: Request, e) -> JSONResponse:
    return _error(APIError(405, f"{request.method} is not allowed on {request.url.path}", None, "method_not_allowed"))


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
        if not self.keys:
            return
        got = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not any(secrets.compare_digest(got, k) for k in self.keys):
            raise APIError(401, "invalid or missing API key (Authorization: Bearer <key>)", None, "invalid_api_key",
                           "authentication_error")

    @api.get("/healthz")
    async def healthz(self) -> dict:
        return {"status": "ok", "model": (await self.info())["model"]}

    @api.get("/v1/models")
    async def models(self, request: Request) -> dict:
        self._authorize(request)
        info = await self.info()
        return {"object": "list", "data": [{"id": info["model"], "object": "model", "created": 0, "owned_by": "draftlab",
                                            "draftlab": {k: v for k, v in info.items() if k != "model"}}]}

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._serve(request, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._serve(request, chat=True)

    async def _serve(self, request: Request, chat: bool):
        self._authorize(request)
        req = parse_request(ChatRequest if chat else CompletionRequest, await request.body())
        info = await self.info()
        if req.model != info["model"]:
            raise APIError(404, f"the model '{req.model}' does not exist; this server serves '{info['model']}'",
                           "model", "model_not_found")
        payload = {"max_tokens": req.requested_max_tokens, "speculation": req.speculation,
                   "sampling": req.sampling(1).model_dump(exclude={"max_new_tokens"})}
        if chat:
            payload["messages"] = [{"role": m.role, "content": m.text()} for m in req.messages]
        else:
            payload["prompt"] = req.prompt
        stream = self.engine.options(stream=True).generate.remote(payload)
        first = await stream.__anext__()
        if "error" in first:
            raise APIError(first.get("status", 400), first["error"], first.get("param"), first.get("code"))
        rid, model, prompt_tokens = new_id("chatcmpl" if chat else "cmpl"), info["model"], first["prompt_tokens"]
        if req.stream:
            return StreamingResponse(self._events(stream, rid, model, chat, prompt_tokens, req.include_usage),
                                     media_type="text/event-stream")
        text, done = [], None
        async for event in stream:
            if "error" in event:
                raise APIError(500, f"generation failed: {event['error']}", None, "engine_error", "server_error")
            text.append(event.get("delta", ""))
            done = event if "done" in event else done
        use = usage(prompt_tokens, done["completion_tokens"], done["stats"])
        return completion_body(rid, model, chat, "".join(text), done["finish_reason"], use)

    async def _events(self, stream, rid: str, model: str, chat: bool, prompt_tokens: int, include_usage: bool):
        if chat:  # OpenAI's first chat chunk carries the role
            yield _sse(chunk_body(rid, model, chat, "", None, first=True))
        try:
            async for event in stream:
                if "error" in event:  # headers are sent: report in-band, as OpenAI does
                    yield _sse(APIError(500, f"generation failed: {event['error']}", None, "engine_error",
                                        "server_error").body())
                    break
                if event.get("delta"):
                    yield _sse(chunk_body(rid, model, chat, event["delta"], None))
                if "done" in event:
                    yield _sse(chunk_body(rid, model, chat, None if chat else "", event["finish_reason"]))
                    if include_usage:
                        yield _sse(usage_chunk(rid, model, chat, usage(prompt_tokens, event["completion_tokens"],
                                                                       event["stats"])))
            yield _sse("[DONE]")
        finally:
            stream.cancel()  # a client that went away frees its decoding slot


def engine_options(args: ServeArgs) -> dict:
    """Serve options of the engine deployment from the typed args."""
    return {
        "autoscaling_config": args.autoscaling.model_dump(),
        "max_ongoing_requests": args.max_ongoing_requests,
        "max_queued_requests": args.max_queued_requests,
        "ray_actor_options": {"num_cpus": args.num_cpus, "num_gpus": args.num_gpus},
        "health_check_timeout_s": args.health_check_timeout_s,
        "graceful_shutdown_timeout_s": args.graceful_shutdown_timeout_s,
    }


def build_app(args: ServeArgs) -> Application:
    """The application `serving/*.yaml` name (`import_path: draftlab.serve.app:build_app`)."""
    raw = args.model_dump(mode="json", exclude_unset=True)  # unset fields stay unset: the drafter names its target
    engine = DraftEngine.options(**engine_options(args)).bind(raw)
    return Ingress.bind(engine, raw)
