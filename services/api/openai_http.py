"""The OpenAI-compatible HTTP front: `/v1/completions` and `/v1/chat/completions`
(streaming SSE and not), `/v1/models`, `/health` and `/metrics`, for clients and tools
written against `vllm serve`.

A request takes the same path as a gRPC one: the body becomes a `GenerateRequest`
(`openai_schema`), `prepare` validates and renders it, and the `Backend`'s deltas become
OpenAI chunks (`openai_answer`). The front never knows whether the backend is one engine
or a prefill/decode pair. When the client goes away, the backend's stream is cancelled,
which aborts the request in the engine (or on the workers).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import socket
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Generator
from dataclasses import replace
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from pdserve.v1 import generate_pb2 as pb
from services.api.backend import Backend
from services.api.models import ServedModel
from services.api.openai_answer import Answer
from services.api.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_request,
    completion_request,
    error_body,
    openai_error,
    tool_plan,
)
from services.api.prepare import prepare
from services.api.servicer import lora_loaded, lora_unloaded
from services.errors import (
    Aborted,
    InvalidRequest,
    Overloaded,
    PdserveError,
    http_status,
)
from services.messages import Delta, GenerationRequest
from services.observability import tracing
from services.security.apikeys import client_id
from services.security.http_auth import ApiKeyMiddleware
from services.security.policy import PublicAuth

log = logging.getLogger(__name__)
T = TypeVar("T")

TIMEOUT_HEADER = "x-request-timeout"  # seconds the client will wait: gRPC's deadline


def error_response(err: BaseException, chat: bool,
                   structured: str = "response_format") -> JSONResponse:
    status, body = openai_error(err, chat, structured)
    headers = None
    if isinstance(err, Overloaded):
        headers = {"Retry-After": str(max(1, math.ceil(err.retry_after_ms / 1000)))}
    return JSONResponse(body, status_code=status, headers=headers)


def request_timeout(request: Request) -> float | None:
    """The client's deadline from the `X-Request-Timeout` header (seconds), if sent."""
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise InvalidRequest(f"{TIMEOUT_HEADER}: {raw!r} must be a number of seconds > 0")
    return value


async def deltas_of(backend: Backend, req: GenerationRequest) -> AsyncGenerator[Delta, None]:
    """The backend's deltas up to the finished one; every failure is a PdserveError.
    Closing this generator closes the backend's stream, which aborts the request."""
    stream = backend.generate(req)
    try:
        async for delta in stream:
            yield delta
            if delta.finished:
                return
    except PdserveError:
        raise
    except Exception as e:
        http_status(e)  # logs the traceback of what is a bug
        raise PdserveError(f"internal error: {type(e).__name__}: {e}") from e
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()
    raise Aborted("the request was aborted by the server")


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> tuple[bool, T | None]:
    """Run `work` until it ends or the client disconnects, which cancels it (and so aborts
    the request). Returns (finished, result). uvicorn never cancels a handler itself."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return (False, None) if task.cancelled() else (True, task.result())


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class EventStream(StreamingResponse):
    """Server-sent events whose status waits for the first event, so a request refused
    before its first token (overload, no worker) gets a real HTTP status rather than a
    200 with an error event; a client that goes away stops the stream."""

    def __init__(self, events: AsyncGenerator[str, None], chat: bool,
                 headers: dict[str, str]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", **headers})
        self.events, self.chat = events, chat

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await until_disconnect(receive, self._send_all(scope, receive, send))
        finally:
            await self.events.aclose()

    async def _send_all(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            first = await anext(self.events)
        except PdserveError as e:
            await error_response(e, self.chat)(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": first.encode(), "more_body": True})
        async for event in self.events:
            await send({"type": "http.response.body", "body": event.encode(),
                        "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def stream_events(answer: Answer, deltas: AsyncGenerator[Delta, None],
                        include_usage: bool,
                        continuous_usage: bool = False) -> AsyncGenerator[str, None]:
    """SSE events of one answer, ending with `data: [DONE]`: one per delta, as vLLM sends
    one per engine step; with `include_usage` a last chunk with the usage and no choices,
    and with `continuous_usage` the usage so far on every chunk too (vLLM's
    `continuous_usage_stats`, which tells a client how many tokens each chunk carried).
    An error before the first delta propagates (EventStream answers it with a status);
    later ones become an error event, as in vLLM. Closing this generator closes
    `deltas`, aborting the request."""
    started = False

    def running(index: int | None = 0) -> dict[str, Any]:
        return {"usage": answer.running_usage(index)} if continuous_usage else {}

    try:
        async for delta in deltas:
            if not started and answer.chat:
                yield sse(answer.chunk(answer.role_choices(), **running()))
            elif not started and answer.echo:
                yield sse(answer.chunk(answer.echo_choices(), **running()))
            started = True
            choice = answer.add(delta)
            # The timing anatomy rides on the usage chunk, or else on the last chunk.
            last = delta.finished and not include_usage
            if choice is None and not last:
                continue  # the end of n > 1 choices, each of which ended on its own
            yield sse(answer.chunk([choice] if choice else [],
                                   **running(choice["index"] if choice else None),
                                   **({"pdserve": answer.extension()} if last else {})))
        if include_usage:
            yield sse(answer.chunk([], usage=answer.usage(), pdserve=answer.extension()))
    except PdserveError as e:
        if not started:
            raise
        yield sse(openai_error(e, answer.chat)[1])
    finally:
        await deltas.aclose()
    yield "data: [DONE]\n\n"


class OpenAIFront:
    """The endpoints' logic over one backend."""

    def __init__(self, backend: Backend, tool_parser: str | None = None) -> None:
        self.backend = backend
        self.created = int(time.time())
        self.tool_parser = tool_parser  # `tool_choice: auto`'s parser; None: auto is off

    async def generate(self, request: Request,
                       body: CompletionRequest | ChatCompletionRequest) -> Response:
        started, chat = time.monotonic(), isinstance(body, ChatCompletionRequest)
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        tools = None
        try:
            if isinstance(body, ChatCompletionRequest):
                tools = tool_plan(body, self.tool_parser)
                public = chat_request(body, request_id, tools)
            else:
                public = completion_request(body, request_id)
            req, served = prepare(public, self.backend.served_models(),
                                  request_timeout(request),
                                  client_id(request.headers.get("x-client-id", "")))
            if tracing.enabled():  # the client's traceparent header: its trace continues
                req = replace(req, trace_headers=tracing.carried(request.headers.items()))
        except PdserveError as e:
            return error_response(e, chat, body.structured_param)
        answer = Answer(chat=chat, request_id=request_id,
                        model=served.name,
                        started=started, prompt_tokens=len(req.prompt_token_ids),
                        tokenizer=served.model.tokenizer, n=req.sampling.n,
                        top_logprobs=public.sampling.logprobs
                        if public.sampling.HasField("logprobs") else None, tools=tools,
                        echo=self._echo(body, public, req, served.model))
        deltas = deltas_of(self.backend, req)
        headers = {"X-Request-Id": request_id}
        if body.stream:
            return EventStream(stream_events(answer, deltas, body.include_usage,
                                             body.continuous_usage), chat, headers)
        try:
            finished, _ = await until_disconnect(request.receive, answer.collect(deltas))
        except PdserveError as e:
            return error_response(e, chat)
        finally:
            await deltas.aclose()
        if not finished:  # nobody is listening any more
            return Response(status_code=499)
        headers["x-pdserve-timings"] = json.dumps(answer.timings(), separators=(",", ":"))
        return JSONResponse(answer.response(), headers=headers)

    def _echo(self, body: CompletionRequest | ChatCompletionRequest,
              public: pb.GenerateRequest, req: GenerationRequest, model: ServedModel) -> str:
        """Completions' `echo`: the prompt as sent, or its token ids' text."""
        if not isinstance(body, CompletionRequest) or not body.echo:
            return ""
        if public.WhichOneof("input") == "text":
            return public.text
        return str(model.tokenizer.decode(req.prompt_token_ids))

    def models(self) -> dict[str, Any]:
        # Every base model, the default first, each followed by its LoRA adapters as vLLM
        # lists them: root = their folder, parent = the base model.
        data = []
        for m in self.backend.served_models():
            base, max_len = m.name, m.facts.max_model_len
            data += [{"id": name, "object": "model", "created": self.created,
                      "owned_by": "pdserve", "root": root, "parent": parent,
                      "max_model_len": max_len}
                     for name, root, parent in [(base, base, None), *(
                         (name, path, base) for name, path in m.adapters.items())]]
        return {"object": "list", "data": data}

    async def load_adapter(self, body: LoadLoraAdapterBody) -> Response:
        """POST /v1/load_lora_adapter, as vLLM: 200 with its text, or an error body."""
        try:
            if not body.lora_name or not body.lora_path:
                raise InvalidRequest("Both 'lora_name' and 'lora_path' must be provided.")
            await self.backend.load_adapter(body.lora_name, body.lora_path)
        except PdserveError as e:
            return error_response(e, chat=False)
        return Response(lora_loaded(body.lora_name), status_code=200)

    async def unload_adapter(self, body: UnloadLoraAdapterBody) -> Response:
        """POST /v1/unload_lora_adapter, as vLLM: 200 with its text, 404 when unknown."""
        try:
            if not body.lora_name:
                raise InvalidRequest("'lora_name' needs to be provided to unload a LoRA "
                                     "adapter.")
            await self.backend.unload_adapter(body.lora_name)
        except PdserveError as e:
            return error_response(e, chat=False)
        return Response(lora_unloaded(body.lora_name), status_code=200)


class LoadLoraAdapterBody(BaseModel):
    lora_name: str = ""
    lora_path: str = ""


class UnloadLoraAdapterBody(BaseModel):
    lora_name: str = ""


def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    """Malformed bodies get 400 in OpenAI's shape (FastAPI's default is a 422)."""
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []
    loc: tuple[Any, ...] = tuple(errors[0].get("loc", ())) if errors else ()
    param = loc[1] if len(loc) > 1 and isinstance(loc[1], str) else None  # ("body", field)
    detail = "; ".join(str(e.get("msg", "")) for e in errors[:3]) or "invalid request body"
    return JSONResponse(error_body(400, f"{param or 'body'}: {detail}", param), status_code=400)


def _http_error(_: Request, exc: Exception) -> JSONResponse:
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    detail = exc.detail if isinstance(exc, HTTPException) else "internal error"
    return JSONResponse(error_body(status, str(detail)), status_code=status)


def create_app(backend: Backend, tool_parser: str | None = None) -> FastAPI:
    """The OpenAI-compatible app over `backend` (which must be ready: its facts known);
    `tool_parser`: the parser `tool_choice: auto` reads calls with (None: auto is off)."""
    from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

    front = OpenAIFront(backend, tool_parser)
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await front.generate(request, body)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await front.generate(request, body)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return front.models()

    @app.post("/v1/load_lora_adapter", response_model=None)
    async def load_lora_adapter(body: LoadLoraAdapterBody) -> Response:
        return await front.load_adapter(body)

    @app.post("/v1/unload_lora_adapter", response_model=None)
    async def unload_lora_adapter(body: UnloadLoraAdapterBody) -> Response:
        return await front.unload_adapter(body)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        # The process's registry: vLLM's own `vllm:*` metrics and pdserve's live there.
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    return app


class _EmbeddedServer(uvicorn.Server):
    # The host process owns SIGTERM/SIGINT (it drains gRPC and HTTP together); uvicorn's
    # own handlers would replace them and restore the defaults when it stops.
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class HttpServer:
    """uvicorn serving `create_app(backend)` inside the running event loop."""

    def __init__(self, backend: Backend, host: str, port: int, grace_s: float,
                 auth: PublicAuth | None = None, tool_parser: str | None = None) -> None:
        self.host, self.port = host, port
        app: Any = create_app(backend, tool_parser)
        if auth is not None and auth.keys is not None:
            # 401 in OpenAI's error shape; /health stays open.
            app = ApiKeyMiddleware(app, auth.keys,
                                   error_body=lambda e: openai_error(e, chat=False))
        tls = auth.uvicorn_options() if auth is not None else {}
        config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                                lifespan="off", timeout_graceful_shutdown=math.ceil(grace_s),
                                **tls)  # type: ignore[arg-type]
        self.server = _EmbeddedServer(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Listen; a port already taken raises OSError here rather than exiting."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.create_server((self.host.strip("[]"), self.port), family=family)
        self._task = asyncio.create_task(self.server.serve(sockets=[sock]))
        while not self.server.started:  # startup takes a few ms
            if self._task.done():
                self._task.result()
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.02)
        log.info("OpenAI-compatible HTTP API on %s:%d", self.host, self.port)

    async def stop(self) -> None:
        """Stop accepting, let running requests finish (up to the grace time), stop."""
        if self._task is not None:
            self.server.should_exit = True
            await self._task
