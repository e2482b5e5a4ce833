"""``create_app``: the ASGI application (Starlette) over an engine.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/messages``,
``POST /v1/messages/count_tokens``, ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET
/health``, ``GET /metrics``. The engine runs on the ``EngineWorker``'s thread; the event loop
parses, validates, queues and writes.

A generation's answer (``Answer``) is an ASGI response that watches its client while it
works: the moment the client's connection closes (``http.disconnect``: during the prefill,
between tokens, streaming or not) it stops and the worker aborts the requests, instead of
finding out when a write fails; one that leaves while it sends its body is counted as gone
too (499), not as a fault. Every error is an ``APIError`` rendered in the shape of the
API the route speaks; a fault inside a handler is a 500 and the server goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from servecore.client import EngineClient
from servecore.server import _anthropic_api as anthropic_api
from servecore.server import _openai_api as openai_api
from servecore.server._door import Door
from servecore.server._errors import APIError, shaped
from servecore.server._fields import parse_json
from servecore.server._formats import ChatFormat, CompletionFormat, MessagesFormat
from servecore.server._generation import ACCEPTED, KEEPALIVE, Ask, Usage, pieces
from servecore.server._metrics import Metrics
from servecore.server._worker import EngineWorker

__all__ = ["Server", "create_app"]

log = logging.getLogger("servecore.server")


class Server:
    """What the routes share: the engine's worker, its tokenizer and EOS ids, the served
    model's name, the metrics and the options (``max_queue``: requests that may wait for a
    first token; ``keepalive``: seconds between keep-alive comments while a stream waits;
    ``max_body_bytes``: the largest request body taken, 413 past it).

    >>> from servecore.testing import FakeEngine, word_tokenizer
    >>> engine = FakeEngine(tokenizer=word_tokenizer(32))
    >>> Server(engine, model_name="m").check_model({"model": "x"})
    Traceback (most recent call last):
    ...
    servecore.server._errors.APIError: the model 'x' does not exist here: this server serves 'm'
    """

    def __init__(self, engine: EngineClient, *, model_name: str, max_queue: int = 256,
                 keepalive: float = 10.0, max_body_bytes: int = 8 << 20):
        if not isinstance(engine, EngineClient):
            raise TypeError(f"the server serves an engine (a servecore.client.EngineClient: "
                            f"hybridattn.Engine, mlxcache.Engine), got {type(engine).__name__}")
        if engine.tokenizer is None:
            raise ValueError("the server needs an engine with a tokenizer (text in, text out)")
        self.engine, self.tokenizer = engine, engine.tokenizer
        self.vocab_size = engine.vocab_size
        self.eos = engine.eos_ids
        self.model_name, self.keepalive = model_name, keepalive
        self.max_body_bytes = max_body_bytes
        self.worker = EngineWorker(engine, max_waiting=max_queue)
        self.metrics = Metrics()
        self.created = int(time.time())

    def text_of(self, ask: Ask):
        """A token's text, when ``ask`` wants log-probabilities (else None)."""
        if ask.logprobs is None:
            return None
        return lambda token: self.tokenizer.decode([token])

    def check_model(self, body: Any) -> None:
        """404 unless the body asks for the served model."""
        model = body.get("model") if isinstance(body, dict) else None
        if isinstance(model, str) and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist here: this server serves "
                           f"{self.model_name!r}", param="model", code="model_not_found")


class Answer:
    """The ASGI response of one generation (see the module docstring)."""

    def __init__(self, server: Server, route: str, ask: Ask, fmt: Any):
        self.server, self.route, self.ask, self.fmt = server, route, ask, fmt
        self.usage = Usage()
        self.t0 = time.perf_counter()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        producer = asyncio.ensure_future(self._produce(send))
        watcher = asyncio.ensure_future(_disconnect(receive))
        try:
            done, _ = await asyncio.wait({producer, watcher},
                                         return_when=asyncio.FIRST_COMPLETED)
            if producer in done:
                producer.result()
                return
            # the client left: the generation's cleanup cancels its requests
            while not producer.done():
                producer.cancel()
                await asyncio.wait({producer}, timeout=1.0)
            self.server.metrics.disconnected()
            self.server.metrics.request(self.route, 499)
        finally:  # (this call itself cancelled: at shutdown, say)
            for task in (producer, watcher):
                task.cancel()

    def _pieces(self):
        s = self.server
        return pieces(s.worker, self.ask, s.tokenizer, s.eos, self.usage, s.keepalive)

    async def _produce(self, send: Any) -> None:
        if self.ask.stream:
            await self._stream(send)
            return
        n = self.ask.num_choices
        texts, finish, stops = [""] * n, [None] * n, [None] * n
        entries: list[list] = [[] for _ in range(n)]
        try:
            async with contextlib.aclosing(self._pieces()) as answer:
                async for batch in answer:
                    for p in batch:
                        if p is ACCEPTED or p is KEEPALIVE:
                            continue
                        texts[p.index] += p.text
                        entries[p.index] += p.logprobs
                        if p.finish_reason is not None:
                            finish[p.index], stops[p.index] = p.finish_reason, p.stop
        except APIError as e:
            await self._send_json(send, e.status, self.fmt.error(e))
            return
        await self._send_json(send, 200, self.fmt.complete(texts, finish, stops, self.usage,
                                                           entries))
        self._done()

    async def _stream(self, send: Any) -> None:
        it = self._pieces().__aiter__()
        early: list = []  # what came with the acceptance (tokens, when it was quick)
        try:
            while ACCEPTED not in early:
                early = [p for p in early if p is not KEEPALIVE] + await it.__anext__()
        except APIError as e:
            await it.aclose()
            await self._send_json(send, e.status, self.fmt.error(e))
            return
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})
        try:
            await self._write(send, self.fmt.head() + self._events(early))
            async for batch in it:  # one write for all that came together
                await self._write(send, self._events(batch))
            await self._write(send, self.fmt.tail(self.usage))
            self._done()
        except APIError as e:  # after the headers: an error event ends the stream
            self.server.metrics.request(self.route, e.status)
            await self._write(send, self.fmt.stream_error(e))
        finally:
            await it.aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _events(self, batch: list) -> list[bytes]:
        out = []
        for p in batch:
            if p is KEEPALIVE:
                out.append(self.fmt.keepalive)
            elif p is not ACCEPTED:
                out += self.fmt.piece(p, self.usage)
        return out

    async def _write(self, send: Any, events: list[bytes]) -> None:
        if events:
            await send({"type": "http.response.body", "body": b"".join(events),
                        "more_body": True})

    async def _send_json(self, send: Any, status: int, body: Any) -> None:
        raw = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]})
        await send({"type": "http.response.body", "body": raw, "more_body": False})
        if status != 200:
            self.server.metrics.request(self.route, status)

    def _done(self) -> None:
        m, u = self.server.metrics, self.usage
        m.request(self.route, 200)
        m.add_tokens(u.prompt_tokens, u.cached_tokens, u.completion_tokens)
        if u.ttft is not None:
            m.observe_ttft(u.ttft)
        m.observe_latency(time.perf_counter() - self.t0)


async def _disconnect(receive: Any) -> None:
    """Return when the client's connection closes."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _body(server: Server, request: Request) -> Any:
    """The request's JSON (a JSON content type, or none: 415 for any other, so that a web
    page's form or ``text/plain`` POST is never read; at most ``server.max_body_bytes``:
    413 past it), its model checked."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind and kind != "application/json" and not kind.endswith("+json"):
        raise APIError(415, f"the request body must be JSON (Content-Type: application/json), "
                       f"not {kind!r}", param="content-type")
    limit = server.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body has {declared} bytes, more than this server "
                       f"takes ({limit}, --max-body-bytes)")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"the request body is more than this server takes ({limit} "
                               "bytes, --max-body-bytes)")
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(499, "the client left before its request was read") from None
    body = parse_json(b"".join(chunks))
    server.check_model(body)
    return body


async def _parsed(parse, body: Any, server: Server, **kw: Any) -> Any:
    """``parse(body, tokenizer, vocab_size=..., **kw)`` on a thread: a long prompt's chat
    template and tokenization do not stop the event loop (every other stream)."""
    return await asyncio.to_thread(parse, body, server.tokenizer, vocab_size=server.vocab_size,
                                   **kw)


def _routes(server: Server) -> list[Route]:
    s = server

    async def chat(request: Request) -> Any:
        body = await _body(s, request)
        ask = await _parsed(openai_api.parse_chat, body, s)
        return Answer(s, "/v1/chat/completions", ask,
                      ChatFormat(s.model_name, ask.n, ask.include_usage, s.text_of(ask)))

    async def completions(request: Request) -> Any:
        body = await _body(s, request)
        ask = await _parsed(openai_api.parse_completion, body, s)
        return Answer(s, "/v1/completions", ask,
                      CompletionFormat(s.model_name, ask.n, ask.include_usage, s.text_of(ask)))

    async def messages(request: Request) -> Any:
        body = await _body(s, request)
        ask = await _parsed(anthropic_api.parse_messages, body, s)
        return Answer(s, "/v1/messages", ask, MessagesFormat(s.model_name))

    async def count_tokens(request: Request) -> Response:
        body = await _body(s, request)
        n = await _parsed(anthropic_api.parse_count_tokens, body, s)
        s.metrics.request("/v1/messages/count_tokens", 200)
        return JSONResponse({"input_tokens": n})

    def model_card() -> dict[str, Any]:
        return {"id": s.model_name, "object": "model", "created": s.created,
                "owned_by": "servecore"}

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def model(request: Request) -> Response:
        name = request.path_params["model"]
        s.check_model({"model": name})
        return JSONResponse(model_card())

    async def health(request: Request) -> Response:
        alive = s.worker.alive
        return JSONResponse({"status": "ok" if alive else "engine thread stopped",
                             "waiting": s.worker.waiting, "running": s.worker.running},
                            status_code=200 if alive else 503)

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(s.metrics.render(
            waiting=s.worker.waiting, running=s.worker.running,
            engine_stats=s.engine.stats),
            media_type="text/plain; version=0.0.4")

    return [Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/messages", messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{model:path}", model, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"])]


def create_app(engine: EngineClient, *, model_name: str, max_queue: int = 256,
               keepalive: float = 10.0, max_body_bytes: int = 8 << 20,
               close_engine: bool = False, api_key: str | None = None,
               allowed_origins: Sequence[str] = ()) -> Starlette:
    """The server's ASGI application over ``engine`` (a ``servecore.client.EngineClient``
    with a tokenizer: ``hybridattn.Engine``, ``mlxcache.Engine``). Its
    lifespan starts the engine's worker thread and stops it (``uvicorn`` runs both), then,
    with ``close_engine``, closes the engine (an engine with a disk tier spills its prefixes
    there: on SIGTERM uvicorn ends the process by the signal right after the lifespan, so
    the serve commands close it here); ``app.state.server`` is the ``Server``. ``api_key``
    and ``allowed_origins`` are the door's (``servecore.server._door``: who may call).

    >>> from servecore.testing import FakeEngine, word_tokenizer
    >>> app = create_app(FakeEngine(tokenizer=word_tokenizer(32)), model_name="m")
    >>> app.state.server.model_name, [r.path for r in app.routes][:2]
    ('m', ['/v1/chat/completions', '/v1/completions'])
    """
    if api_key is not None and not api_key.strip():
        raise ValueError("api_key is empty: give a key, or None (no key needed)")
    server = Server(engine, model_name=model_name, max_queue=max_queue, keepalive=keepalive,
                    max_body_bytes=max_body_bytes)

    table = _routes(server)
    routes = {r.path for r in table}

    async def api_error(request: Request, e: APIError) -> Response:
        if e.status >= 500:
            log.error("%s %s: %s", request.method, request.url.path, e.message)
        path = request.url.path  # (a label per route, not per path a client made up)
        server.metrics.request(path if path in routes else "other", e.status)
        if e.status == 499:  # the client left (while it sent its body): no fault
            server.metrics.disconnected()
        return Response(json.dumps(shaped(request.url.path, e)), status_code=e.status,
                        media_type="application/json")

    async def http_error(request: Request, e: HTTPException) -> Response:
        what = ("no route" if e.status_code == 404 else "method not allowed")
        return await api_error(request, APIError(
            e.status_code, f"{what}: {request.method} {request.url.path}"))

    async def fault(request: Request, e: Exception) -> Response:
        log.exception("a fault serving %s %s", request.method, request.url.path)
        return await api_error(request, APIError(500, f"internal error: {e!r}"))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        server.worker.start()
        try:
            yield
        finally:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, server.worker.stop)
            if close_engine:
                await loop.run_in_executor(None, engine.close)

    app = Starlette(routes=table, lifespan=lifespan, exception_handlers={
        APIError: api_error, HTTPException: http_error, Exception: fault},
        middleware=[Middleware(Door, api_key=api_key, allowed_origins=allowed_origins)])
    app.state.server = server
    return app
