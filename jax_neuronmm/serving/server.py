"""An OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn).

POST /v1/completions and /v1/chat/completions (streamed as server-sent events in OpenAI's chunk format when
`stream` is true), GET /v1/models and /health. Every error is OpenAI's error JSON: 400 for a bad body (malformed
JSON, wrong types, values out of range, a prompt or max_tokens beyond the context), 404 for an unknown model or
route, 503 when the engine's queue is full or it is shutting down. A client that disconnects has its request
cancelled (row and blocks freed at once). On Ctrl-C the engine stops first, so every in-flight request ends with
an error (an error event in a stream) and the server's graceful shutdown never waits on a generation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jax_neuronmm.serving import protocol as api
from jax_neuronmm.serving.chat import ChatTemplate
from jax_neuronmm.serving.engine import (
    SHUTDOWN,
    ContextExceeded,
    Engine,
    EngineStopped,
    Event,
    QueueFull,
    SamplingParams,
)

_DISCONNECT_POLL_S = 0.5  # how often a waiting request checks that its client is still there


class APIError(Exception):
    """An error answered as OpenAI's error JSON with `status`."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code


def _error_response(status: int, message: str, kind: str, param=None, code=None) -> JSONResponse:
    body = api.ErrorResponse(error=api.ErrorBody(message=message, type=kind, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


def _sse(payload) -> str:
    text = payload if isinstance(payload, str) else payload.model_dump_json(exclude_none=False)
    return f"data: {text}\n\n"


@dataclasses.dataclass
class _Prepared:
    prompt_ids: list[int]
    params: SamplingParams


class Service:
    """The HTTP layer's view of one engine and model: name, chat template, request preparation."""

    def __init__(self, engine: Engine, model_name: str, chat_template: ChatTemplate | None):
        self.engine = engine
        self.model_name = model_name
        self.chat_template = chat_template
        self.created = int(time.time())

    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    def _tokenize(self, text: str, *, special: bool) -> list[int]:
        if self.engine.tokenizer is None:
            raise APIError(400, "prompt: this checkpoint has no tokenizer; send token ids", param="prompt")
        return self.engine.tokenizer.encode(text, add_special_tokens=special).ids

    def _params(self, body: api._Sampling, prompt_ids: list[int], max_tokens: int | None) -> _Prepared:
        context = self.engine.max_model_len
        if len(prompt_ids) >= context:
            raise APIError(
                400,
                f"This model's maximum context length is {context} tokens; the prompt has {len(prompt_ids)}.",
                param="prompt",
                code="context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = context - len(prompt_ids)
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        try:
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                seed=body.seed,
                stop=stop,
                stop_token_ids=tuple(body.stop_token_ids),
                ignore_eos=body.ignore_eos,
            )
            prompt_ids = self.engine.check_request(prompt_ids, params)
        except ContextExceeded as error:
            raise APIError(400, str(error), param="max_tokens", code="context_length_exceeded") from error
        except (TypeError, ValueError) as error:
            raise APIError(400, str(error)) from error
        return _Prepared(prompt_ids, params)

    def prepare_completion(self, body: api.CompletionRequest) -> _Prepared:
        self._check_model(body.model)
        ids = self._tokenize(body.prompt, special=True) if isinstance(body.prompt, str) else list(body.prompt)
        return self._params(body, ids, 16 if body.max_tokens is None else body.max_tokens)

    def prepare_chat(self, body: api.ChatCompletionRequest) -> _Prepared:
        self._check_model(body.model)
        if self.chat_template is None:
            raise APIError(400, "messages: this checkpoint has no chat template; use /v1/completions", param="messages")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = self.chat_template.render(messages)
        except ValueError as error:
            raise APIError(400, str(error), param="messages") from error
        return self._params(body, self._tokenize(text, special=False), body.max_completion_tokens or body.max_tokens)

    def submit(self, prepared: _Prepared) -> tuple[str, asyncio.Queue]:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        try:
            request_id = self.engine.submit(
                prepared.prompt_ids, prepared.params, lambda e: loop.call_soon_threadsafe(events.put_nowait, e)
            )
        except QueueFull as error:
            raise APIError(503, f"The server is overloaded: {error}", kind="server_overloaded") from error
        except EngineStopped as error:
            raise APIError(503, "The server is shutting down", kind="server_unavailable") from error
        return request_id, events


def _event_error(event: Event) -> APIError | None:
    if event.finish_reason == "error":
        status = 503 if event.error == SHUTDOWN else 500
        return APIError(status, event.error or "generation failed", kind="server_error")
    return None


async def _collect(service: Service, request: Request, request_id: str, events: asyncio.Queue) -> tuple[str, Event]:
    """Waits for a request's events (cancelling it when the client goes away); returns (text, last event)."""
    text = []
    try:
        while True:
            try:
                event = await asyncio.wait_for(events.get(), _DISCONNECT_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    service.engine.cancel(request_id)
                    raise APIError(499, "client disconnected") from None
                continue
            text.append(event.text)
            if event.finished:
                error = _event_error(event)
                if error is not None:
                    raise error
                return "".join(text), event
    except asyncio.CancelledError:
        service.engine.cancel(request_id)
        raise


class _RequestStream(StreamingResponse):
    """A streamed response that cancels its engine request however the response ends: a client that hangs up
    makes the send fail, and the server then drops the body generator without running its `finally`."""

    def __init__(self, body, engine: Engine, request_id: str):
        super().__init__(body, media_type="text/event-stream")
        self.engine, self.request_id = engine, request_id

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self.engine.cancel(self.request_id)  # a no-op for a request that already finished


def _usage(event: Event) -> api.Usage:
    return api.Usage(
        prompt_tokens=event.prompt_tokens,
        completion_tokens=event.completion_tokens,
        total_tokens=event.prompt_tokens + event.completion_tokens,
    )


async def _stream(service: Service, request: Request, request_id: str, events: asyncio.Queue, chunk, usage: bool):
    """SSE lines: chunk(text, finish_reason) per event, then usage (when asked) and [DONE]; an error event ends
    the stream with OpenAI's error object. Cancels the request when the client goes away (checked at every event
    and every poll interval: writes to a closed socket may still succeed for a while)."""
    finished = False
    try:
        first = chunk(None, None, start=True)
        if first is not None:
            yield _sse(first)
        while not finished:
            try:
                event = await asyncio.wait_for(events.get(), _DISCONNECT_POLL_S)
            except TimeoutError:
                event = None
            if await request.is_disconnected():
                break
            if event is None:
                continue
            finished = event.finished
            error = _event_error(event)
            if error is not None:
                body = api.ErrorResponse(error=api.ErrorBody(message=str(error), type=error.kind, code=None))
                yield _sse(body)
                break
            if event.text or event.finished:
                yield _sse(chunk(event.text, event.finish_reason if event.finished else None))
            if event.finished and usage:
                usage_chunk = chunk(None, None)
                usage_chunk.choices = []
                usage_chunk.usage = _usage(event)
                yield _sse(usage_chunk)
        yield _sse("[DONE]")
    finally:
        if not finished:
            service.engine.cancel(request_id)


def create_app(service: Service) -> FastAPI:
    """The FastAPI application over `service` (the engine is started and stopped by its owner)."""
    app = FastAPI(title="jax_neuronmm", docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    async def api_error(_, error: APIError):
        return _error_response(error.status, str(error), error.kind, error.param, error.code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, error: RequestValidationError):
        problems = error.errors()
        first = problems[0] if problems else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body')}: {e.get('msg')}" for e in problems
        )
        return _error_response(400, message or "invalid request", "invalid_request_error", where or None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, error: StarletteHTTPException):
        return _error_response(error.status_code, str(error.detail), "invalid_request_error")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models", response_model=api.ModelList)
    async def models():
        card = api.ModelCard(id=service.model_name, created=service.created, max_model_len=service.engine.max_model_len)
        return api.ModelList(data=[card])

    @app.post("/v1/completions")
    async def completions(body: api.CompletionRequest, request: Request):
        prepared = service.prepare_completion(body)
        request_id, events = service.submit(prepared)
        response_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text, finish_reason, start=False):
            if start:
                return None
            choice = api.CompletionChoice(text=text or "", finish_reason=finish_reason)
            return api.CompletionResponse(id=response_id, created=created, model=service.model_name, choices=[choice])

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            generator = _stream(service, request, request_id, events, chunk, include_usage)
            return _RequestStream(generator, service.engine, request_id)
        text, last = await _collect(service, request, request_id, events)
        response = chunk(text, last.finish_reason)
        response.usage = _usage(last)
        return response

    @app.post("/v1/chat/completions")
    async def chat_completions(body: api.ChatCompletionRequest, request: Request):
        prepared = service.prepare_chat(body)
        request_id, events = service.submit(prepared)
        response_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text, finish_reason, start=False):
            delta = api.ChatDelta(role="assistant", content="") if start else api.ChatDelta(content=text)
            choice = api.ChatChunkChoice(delta=delta, finish_reason=finish_reason)
            return api.ChatCompletionChunk(id=response_id, created=created, model=service.model_name, choices=[choice])

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            generator = _stream(service, request, request_id, events, chunk, include_usage)
            return _RequestStream(generator, service.engine, request_id)
        text, last = await _collect(service, request, request_id, events)
        choice = api.ChatChoice(message=api.AssistantMessage(content=text), finish_reason=last.finish_reason)
        return api.ChatCompletionResponse(
            id=response_id, created=created, model=service.model_name, choices=[choice], usage=_usage(last)
        )

    return app


class Server(uvicorn.Server):
    """uvicorn's server that stops the engine first on Ctrl-C / SIGTERM: in-flight requests then end with an
    error at once, so the graceful shutdown has nothing to wait for."""

    def __init__(self, config: uvicorn.Config, engine: Engine):
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig, frame):
        self.engine.stop_soon()
        super().handle_exit(sig, frame)


def serve(service: Service, host: str, port: int, log_level: str = "info") -> None:
    """Runs the server until Ctrl-C; starts and stops the engine around it."""
    app = create_app(service)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=10)
    service.engine.start()
    try:
        Server(config, service.engine).run()
    finally:
        service.engine.shutdown()
