"""The OpenAI-compatible HTTP API of a router, with ``/health`` and ``/metrics``: a
Starlette app over the same engine as the gRPC API.

| route | answers |
| --- | --- |
| ``POST /v1/completions`` | a text completion, whole or streamed (server-sent events) |
| ``POST /v1/chat/completions`` | a chat completion through the checkpoint's chat template |
| ``GET /v1/models``, ``/v1/models/{model}`` | the one model this router serves |
| ``GET /health`` | readiness (``readiness``): 200 when ready, else 503 with the reasons |
| ``GET /health/live`` | 200 while the process answers (liveness) |
| ``POST /health/weights`` | check the router's own weights now: 200 unchanged since load, else 503 naming them |
| ``GET /metrics`` | Prometheus text of this process's OpenTelemetry meters |

A generation asks for its routing trace with the body field ``routing_trace: true`` or the header
``X-Expertmesh-Routing-Trace: 1``: the response then carries ``routing_trace`` beside ``usage`` (each
choice's tokens, by index), and each streamed chunk the routing of its tokens.

Bodies are read up to a size limit (413 past it) and parsed by the pydantic
models of ``openai_schema``. A streamed response waits for the engine's first
event before it commits to 200, so an error before the first token keeps its
HTTP status; a later one arrives as an ``{"error": ...}`` event before
``data: [DONE]``. A client that hangs up, streaming or not, cancels its engine
sequence.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from expertmesh.config.settings import ServingConfig
from expertmesh.infra.telemetry.setup import meter, tracer
from expertmesh.serving.async_events import ChoiceEvents
from expertmesh.serving.canary import CANARY_KEY
from expertmesh.serving.events import ErrorEvent, Event, FinishEvent, PromptLogprobsEvent, TokenEvent, TokenLogprob
from expertmesh.serving.openai_adapter import (
    ChatShapes,
    ChoiceResult,
    CompletionShapes,
    OpenAIAdapter,
    Shapes,
    ToolReading,
    request_id,
    usage,
)
from expertmesh.serving.openai_errors import ApiError
from expertmesh.serving.openai_responses import (
    DetokenizeRequest,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from expertmesh.serving.openai_schema import MAX_TOKENS_CAP, ChatCompletionRequest, CompletionRequest, GenerationFields
from expertmesh.serving.readiness import Readiness
from expertmesh.serving.routing_trace import TokenRouting

log = logging.getLogger(__name__)

R = TypeVar("R", bound=BaseModel)
T = TypeVar("T")

#: the status logged for a request whose client hung up first (nginx's "client closed request")
CLIENT_CLOSED = 499
#: the header that asks for a routing trace, as the body's ``routing_trace`` does
TRACE_HEADER = "X-Expertmesh-Routing-Trace"


def wants_trace(body: GenerationFields, header: str | None) -> bool:
    """Whether a generation asks for its routing trace: the body's field, else the header ("1" / "true";
    "0" / "false" / absent: no). Another header value is a 400 naming the header."""
    if body.routing_trace is not None:
        return body.routing_trace
    value = (header or "").strip().lower()
    if value in ("1", "true"):
        return True
    if value in ("", "0", "false"):
        return False
    raise ApiError.bad_request(f"{TRACE_HEADER} takes 1 or 0, got {header[:32]!r}", param=TRACE_HEADER)


class ClientGone(Exception):
    """The client hung up before its answer was ready."""


class HttpApi:
    def __init__(self, adapter: OpenAIAdapter, readiness: Readiness, config: ServingConfig):
        self._adapter = adapter
        self._readiness = readiness
        self._config = config
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self._completions, methods=["POST"]),
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/tokenize", self._tokenize, methods=["POST"]),
                Route("/detokenize", self._detokenize, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/v1/models/{model:path}", self._model, methods=["GET"]),
                Route("/health", self._health, methods=["GET"]),
                Route("/health/live", self._live, methods=["GET"]),
                Route("/health/weights", self._check_weights, methods=["POST"]),
                Route("/metrics", self._metrics, methods=["GET"]),
            ],
            middleware=[Middleware(ResponseCounter)],
            exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _internal_error},
        )

    # -- generation ----------------------------------------------------------------------

    async def _completions(self, request: Request) -> Response:
        body = await self._parse(request, CompletionRequest)
        self._adapter.check_model(body.model)
        ids = await run_in_threadpool(self._adapter.completion_prompt, body.prompt)
        return await self._generate(
            request, body, ids, CompletionShapes(request_id("cmpl"), body.model, self._adapter.token_text)
        )

    async def _chat(self, request: Request) -> Response:
        body = await self._parse(request, ChatCompletionRequest)
        self._adapter.check_model(body.model)
        ids = await run_in_threadpool(self._adapter.chat_prompt, body)
        shapes = ChatShapes(request_id("chatcmpl"), body.model, self._adapter.token_text, ToolReading.of(body))
        return await self._generate(request, body, ids, shapes)

    async def _generate(self, request: Request, body: GenerationFields, ids: list[int], shapes: Shapes) -> Response:
        started = time.monotonic()
        # The request's span joins the caller's trace (W3C traceparent), and the engine's step spans
        # join the request's span, as on the gRPC API; it ends when the answer (or the stream) does.
        span = tracer().start_span(
            "expertmesh.http.generate",
            context=propagate.extract(request.headers),
            kind=SpanKind.SERVER,
            attributes={
                "expertmesh.request_id": shapes.id,
                "http.route": request.url.path,
                "expertmesh.prompt_tokens": len(ids),
                "expertmesh.choices": body.choices,
            },
        )
        choices = ChoiceEvents()
        streaming = False
        try:
            traced = wants_trace(body, request.headers.get(TRACE_HEADER))
            client = request.client.host if request.client is not None else ""
            canary_key = request.headers.get(CANARY_KEY, "")
            # Off the event loop: building may tokenize, classify and compile a grammar, and no stream, no
            # /health/live may wait for it.
            generations = await run_in_threadpool(
                self._in_span,
                span,
                self._adapter.generation_requests,
                body,
                ids,
                shapes.id,
                traced,
                client,
                canary_key,
            )
            with trace.use_span(span, end_on_exit=False):
                echo = Echo(self._adapter.echo_text(body, ids), []) if body.echoes else None
                choices.add(self._adapter.submit(generations[0]))
            try:
                first = await _unless_disconnected(request, anext(choices))
                if isinstance(first[1], PromptLogprobsEvent):  # an echo's log-probabilities come first
                    echo = Echo(echo.text, list(first[1].logprobs))
                    first = await _unless_disconnected(request, anext(choices))
                if isinstance(first[1], ErrorEvent):  # nothing sent yet: the error keeps its HTTP status
                    raise ApiError.from_event(first[1])
                # The other choices join now: the first's prompt went through its step, whose end offers the
                # prompt's KV blocks to the prefix cache before the next step admits anyone, so they share them.
                with trace.use_span(span, end_on_exit=False):
                    for generation in generations[1:]:
                        choices.add(self._adapter.submit(generation))
                if not body.streaming:
                    results, finals = await _unless_disconnected(request, _collect(first, choices, len(generations)))
                    self._log_finished(shapes.id, finals, started)
                    if echo is not None:
                        results = [
                            ChoiceResult(echo.text + r.text, r.reason, [*echo.logprobs, *r.logprobs], r.routing)
                            for r in results
                        ]
                    return _json(shapes.whole(results, usage(finals), traced))
            except ClientGone:
                log.info("request %s cancelled: the client went away", shapes.id)
                return Response(status_code=CLIENT_CLOSED)
            streaming = True
            return StreamingResponse(
                self._stream(first, choices, len(generations), shapes, body.include_usage, started, span, echo),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},  # no proxy may hold tokens back
            )
        except Exception as err:
            span.set_status(Status(StatusCode.ERROR, str(err)))
            raise
        finally:
            if not streaming:
                await choices.aclose()  # cancels the sequences that did not end
                span.end()

    async def _stream(
        self,
        first: tuple[int, Event],
        choices: ChoiceEvents,
        count: int,
        shapes: Shapes,
        include_usage: bool,
        started: float,
        span: Span,
        echo: Echo | None = None,
    ) -> AsyncIterator[bytes]:
        """Server-sent events of ``count`` choices, each chunk naming its choice (``index``), in the order the
        engine's steps produce them."""
        (index, event), finals = first, {}
        try:
            for chunk in shapes.opening(count):
                yield _sse(chunk)
            if echo is not None:
                for i in range(count):
                    for chunk in shapes.delta(i, echo.text, echo.logprobs):
                        yield _sse(chunk)
            while True:
                if isinstance(event, TokenEvent) and (event.text or event.logprobs or event.routing):
                    chunks = shapes.delta(index, event.text, event.logprobs) if event.text or event.logprobs else []
                    for chunk in shapes.routed(chunks, index, event.routing):
                        yield _sse(chunk)
                elif isinstance(event, FinishEvent):
                    finals[index] = event
                    for chunk in shapes.delta(index, "", event.final_logprobs) if event.final_logprobs else ():
                        yield _sse(chunk)
                    for chunk in shapes.routed(shapes.closing(index, event.reason), index, event.final_routing):
                        yield _sse(chunk)
                elif isinstance(event, ErrorEvent):
                    yield _sse(ApiError.from_event(event).body())
                    break
                if len(finals) == count:
                    break
                index, event = await anext(choices)
            if len(finals) == count:
                if include_usage:
                    yield _sse(shapes.usage_only(usage([finals[i] for i in range(count)])))
                self._log_finished(shapes.id, [finals[i] for i in range(count)], started)
            yield b"data: [DONE]\n\n"
        finally:
            if isinstance(event, ErrorEvent):
                span.set_status(Status(StatusCode.ERROR, event.message))
            elif len(finals) < count:
                log.info("request %s cancelled: the client went away mid-stream", shapes.id)
            span.end()
            await choices.aclose()  # cancels the sequences that did not end

    @staticmethod
    def _in_span(span: Span, work, *args):
        """``work(*args)`` with ``span`` current (on a pool thread: the classifier's span joins the request's)."""
        with trace.use_span(span, end_on_exit=False):
            return work(*args)

    @staticmethod
    def _log_finished(rid: str, events: list[FinishEvent], started: float) -> None:
        elapsed = time.monotonic() - started
        event = FinishEvent(
            ",".join(e.reason for e in events), events[0].prompt_tokens, sum(e.completion_tokens for e in events)
        )
        log.info(
            "request %s finished (%s): %d prompt + %d completion tokens in %.3fs",
            rid,
            event.reason,
            event.prompt_tokens,
            event.completion_tokens,
            elapsed,
            extra={
                "request_id": rid,
                "finish_reason": event.reason,
                "prompt_tokens": event.prompt_tokens,
                "completion_tokens": event.completion_tokens,
                "duration_s": round(elapsed, 6),
            },
        )

    async def _parse(self, request: Request, model: type[R]) -> R:
        raw = await self._body(request)
        try:
            return model.model_validate_json(raw, context={MAX_TOKENS_CAP: self._config.max_new_tokens_cap})
        except ValidationError as err:
            raise ApiError.from_validation(err) from None

    async def _body(self, request: Request) -> bytes:
        """The request body, refused with 413 as soon as it is known to pass the limit."""
        limit = self._config.http_max_body_bytes
        too_large = ApiError(
            413, f"the request body is larger than this server's limit of {limit} bytes", code="request_too_large"
        )
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    # -- the tokenizer ------------------------------------------------------------------------

    async def _tokenize(self, request: Request) -> Response:
        raw = await self._body(request)
        try:  # vLLM's two shapes: messages (the chat template) or a prompt
            shape = TokenizeChatRequest if b'"messages"' in raw else TokenizeCompletionRequest
            body = shape.model_validate_json(raw)
        except ValidationError as err:
            raise ApiError.from_validation(err) from None
        return _json(await run_in_threadpool(self._adapter.tokenize, body))

    async def _detokenize(self, request: Request) -> Response:
        return _json(self._adapter.detokenize(await self._parse(request, DetokenizeRequest)))

    # -- models, health, metrics -------------------------------------------------------------

    async def _models(self, request: Request) -> Response:
        return _json(ModelList(data=[self._adapter.model.card()]))

    async def _model(self, request: Request) -> Response:
        self._adapter.check_model(request.path_params["model"])
        return _json(self._adapter.model.card())

    async def _health(self, request: Request) -> Response:
        report = await run_in_threadpool(self._readiness.report)  # store and group checks block
        return JSONResponse(report.model_dump(mode="json"), status_code=200 if report.ready else 503)

    async def _check_weights(self, request: Request) -> Response:
        """Check the router's own weights now (``Readiness.check_weights``); 200 when they match their
        fingerprints at load, 503 naming the changed tensors."""
        check = await run_in_threadpool(self._readiness.check_weights)
        if check is None:
            return JSONResponse({"status": "not_checked", "changed": []})
        body = {
            "status": "unchanged" if check.ok else "changed",
            "changed": list(check.changed),
            "tensors": check.tensors,
        }
        return JSONResponse({**body, "seconds": check.seconds}, status_code=200 if check.ok else 503)

    async def _live(self, request: Request) -> Response:
        return JSONResponse({"status": "alive"})

    async def _metrics(self, request: Request) -> Response:
        return Response(await run_in_threadpool(generate_latest), media_type=CONTENT_TYPE_LATEST)


class ResponseCounter:
    """ASGI middleware: counts responses by route template and status (``expertmesh.http.responses``)."""

    def __init__(self, app: ASGIApp):
        self._app = app
        self._responses = meter().create_counter(
            "expertmesh.http.responses", description="HTTP API responses, by route and status"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        status = 500  # unless a response starts: an exception escaped

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self._app(scope, receive, sending)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")  # templates, not paths: bounded labels
            self._responses.add(1, {"route": route, "status": status})


@dataclass(frozen=True)
class Echo:
    """What an echoing completion starts with: the prompt's text, and its tokens' log-probabilities when asked."""

    text: str
    logprobs: list[TokenLogprob]


async def _collect(
    first: tuple[int, Event], choices: ChoiceEvents, count: int
) -> tuple[list[ChoiceResult], list[FinishEvent]]:
    """Each of ``count`` choices' whole text, log-probabilities (when asked for) and finish event, from the
    first event on; an error event raises its ApiError."""
    texts: list[list[str]] = [[] for _ in range(count)]
    logprobs: list[list[TokenLogprob]] = [[] for _ in range(count)]
    routing: list[list[TokenRouting]] = [[] for _ in range(count)]
    finals: dict[int, FinishEvent] = {}
    index, event = first
    while True:
        if isinstance(event, TokenEvent):
            texts[index].append(event.text)
            logprobs[index] += event.logprobs
            routing[index] += event.routing
        elif isinstance(event, ErrorEvent):
            raise ApiError.from_event(event)
        elif isinstance(event, FinishEvent):
            logprobs[index] += event.final_logprobs  # an ending token's (EOS, a stop token id): OpenAI lists it
            routing[index] += event.final_routing
            finals[index] = event
        if len(finals) == count:
            break
        index, event = await anext(choices)
    ordered = [finals[i] for i in range(count)]
    results = [ChoiceResult("".join(texts[i]), ordered[i].reason, logprobs[i], routing[i]) for i in range(count)]
    return results, ordered


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result, or ClientGone when the client hangs up first (``work`` is cancelled,
    which cancels its engine sequence)."""
    task = asyncio.ensure_future(work)
    hangup = asyncio.ensure_future(_hung_up(request))
    try:
        done, _ = await asyncio.wait((task, hangup), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        hangup.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientGone


async def _hung_up(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: nothing else can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _json(model: BaseModel) -> JSONResponse:
    return JSONResponse(model.model_dump(mode="json"))


#: characters JSON leaves raw in a string that ``str.splitlines`` ends a line at: a client reading the stream by
#: lines that way (httpx's ``aiter_lines``, so guidellm) would cut an event in two at a generated U+2028
_LINE_BREAKS_JSON_KEEPS = str.maketrans({"\u0085": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _sse(model: BaseModel) -> bytes:
    """One server-sent event; its JSON on one line for every line splitter (the three characters escaped)."""
    return b"data: " + model.model_dump_json().translate(_LINE_BREAKS_JSON_KEEPS).encode() + b"\n\n"


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 (no such route) and 405 (wrong method), in OpenAI's shape."""
    assert isinstance(exc, HTTPException)
    code = {404: "unknown_url", 405: "method_not_allowed"}.get(exc.status_code)
    message = f"{request.method} {request.url.path}: {exc.detail}"
    response = ApiError(exc.status_code, message, code=code).response()
    response.headers.update(exc.headers or {})
    return response


async def _internal_error(request: Request, exc: Exception) -> Response:
    """A bug must not answer in a shape SDKs cannot read; Starlette logs the traceback after this."""
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal").response()
