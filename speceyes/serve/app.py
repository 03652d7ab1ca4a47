"""The aiohttp application: the handlers (chat completions, health, models, metrics), the API key
and error middleware, ``create_app`` and ``serve``, all configured by one ``ServeSettings``."""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from aiohttp import web

from speceyes import limits
from speceyes.images import ImageError, load_image
from speceyes.serve.body import Body, ByteBudget, ClientGone, decode_json, read_body
from speceyes.serve.request import (
    ChatRequest,
    RequestError,
    _error_from,
    check_image_size,
    error_response,
    image_bytes,
    internal_error,
    parse_chat_request,
    read_image_size,
    resolve_image,
)
from speceyes.serve.state import ServerClosing, ServerState, _Item
from speceyes.types import Query, Result
from speceyes.usertext import TextRules

if TYPE_CHECKING:
    from speceyes.funnel import Funnel

log = logging.getLogger(__package__)  # one logger for the server: speceyes.serve

CHAT_PATH = "/v1/chat/completions"
API_KEY_ENV = "SPECEYES_API_KEY"
OPEN_PATHS = frozenset({"/health"})  # answered without the API key (load balancer probes)
REQUEST_ID_HEADER = "X-Request-Id"
RID_KEY = web.RequestKey("speceyes_request_id", str)


@dataclass(frozen=True)
class ServeSettings:
    """How ``serve`` listens, batches, bounds and authenticates (the CLI's ``serve`` options)."""

    host: str = "127.0.0.1"
    port: int = 8000
    batch_size: int | None = None  # None: the funnel's own batch size
    max_wait_ms: float = 10.0  # a batch waits at most this long after its oldest request
    max_queue: int = 256  # admitted requests (body in) not yet running; beyond it 429
    model_name: str = "speceyes"
    request_timeout: float | None = 300.0  # end-to-end seconds per request (504); None: none
    allow_local_files: bool = False  # file:// image URLs
    max_body_mb: float = limits.MAX_BODY_MB
    api_key: str | None = None  # every endpoint but /health needs "Authorization: Bearer"
    max_question_chars: int = limits.MAX_QUESTION_CHARS
    max_option_chars: int = limits.MAX_OPTION_CHARS
    max_image_pixels: int = limits.MAX_IMAGE_PIXELS
    max_pixels_in_flight: int = limits.MAX_PIXELS_IN_FLIGHT
    drain_timeout: float = limits.DRAIN_TIMEOUT_S  # after SIGTERM or Ctrl-C
    max_text_tokens: int = limits.MAX_TEXT_TOKENS  # question + options, served tokenizers
    body_timeout: float = limits.BODY_TIMEOUT_S  # seconds to send the whole body (408)
    max_body_mb_in_flight: float = limits.MAX_BODY_MB_IN_FLIGHT  # all bodies being read (429)

    def validate(self) -> None:
        """Raise ValueError on a setting the server cannot run with (the batch size is checked
        once the funnel's is known)."""
        if self.max_queue < 1:
            raise ValueError("max_queue must be at least 1")
        if self.max_wait_ms < 0:
            raise ValueError("max_wait_ms must be >= 0")
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise ValueError("request_timeout must be positive")
        if self.body_timeout <= 0:
            raise ValueError("body_timeout must be positive")
        sizes = (self.max_question_chars, self.max_option_chars, self.max_image_pixels)
        if min(*sizes, self.max_text_tokens) < 1:
            raise ValueError(
                "max_question_chars, max_option_chars, max_image_pixels, max_text_tokens "
                "must be >= 1"
            )
        if self.max_body_mb <= 0 or self.max_body_mb_in_flight < 2 * self.max_body_mb:
            raise ValueError(
                "max_body_mb must be positive and max_body_mb_in_flight at least twice it "
                "(one body and its inflated copy)"
            )
        if self.max_pixels_in_flight < self.max_image_pixels:
            raise ValueError("max_pixels_in_flight must be at least max_image_pixels")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty")


class Server(ServerState):
    """The HTTP handlers over the server's state."""

    async def _image(self, url: str) -> tuple[Any, int]:
        """The decoded image and its cost, held in the pixel budget (released by the caller)."""
        loop = asyncio.get_running_loop()
        src = resolve_image(url, self.allow_local_files)
        try:
            data = await loop.run_in_executor(self.decoder, image_bytes, src)
            size = await loop.run_in_executor(self.decoder, read_image_size, data)
        except ImageError as e:
            raise RequestError(str(e), code="invalid_image", param="messages") from e
        # Charged by what decoding holds (RGB-equivalent pixels), not by width x height alone.
        # The encoded bytes themselves are the body's, in its own budget.
        cost = 0
        if size is not None:
            check_image_size(size, self.max_image_pixels)
            cost = size.cost
        if self.pixels_in_flight + cost > self.max_pixels_in_flight:
            raise RequestError(
                "server busy: the images of the requests in flight fill its decoding budget "
                f"({self.max_pixels_in_flight} pixels); retry later",
                status=429,
                code="pixel_budget",
                type="rate_limit_error",
            )
        self.pixels_in_flight += cost  # reserved before decoding: admitted work is bounded
        try:
            image = await loop.run_in_executor(self.decoder, load_image, data)
        except BaseException as e:
            self.pixels_in_flight -= cost
            if isinstance(e, ImageError):
                raise RequestError(str(e), code="invalid_image", param="messages") from e
            raise
        return image, cost

    def _parse(self, data: bytearray, encoding: str | None) -> ChatRequest:
        """The body's chat request (a decoder thread: inflating, JSON and tokenizers)."""
        return parse_chat_request(
            decode_json(
                data, encoding, max_bytes=self.max_body_bytes, max_values=limits.MAX_JSON_VALUES
            ),
            max_question_chars=self.max_question_chars,
            max_option_chars=self.max_option_chars,
            max_text_tokens=self.max_text_tokens,
            rules=self.text_rules,
        )

    async def _read(self, request: web.Request) -> Body:
        self.reading += 1
        try:
            return await read_body(
                request,
                max_bytes=self.max_body_bytes,
                timeout=self.body_timeout,
                budget=self.body_budget,
            )
        finally:
            self.reading -= 1

    def _queue_full(self) -> RequestError:
        return RequestError(
            f"server overloaded: {self.admitted} requests already queued "
            f"(max_queue={self.max_queue}); retry later",
            status=429,
            code="queue_full",
            type="rate_limit_error",
        )

    async def chat(self, request: web.Request) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        t_arrival = loop.time()
        rid = request[RID_KEY]
        if self.closing:
            return error_response(
                503, "the server is shutting down", code="shutting_down", type="server_error"
            )
        if self.admitted >= self.max_queue:
            # Refused before the body is read: overload costs neither memory nor decoding.
            return _refused(self._queue_full())
        body: Body | None = None
        admitted = False
        item: _Item | None = None
        pixels = 0
        try:
            # The body first, against its deadline and the byte budget: a slow client holds
            # what it has sent, never a queue slot.
            body = await self._read(request)
            if self.closing:
                raise ServerClosing("the server is shutting down")
            if self.admitted >= self.max_queue:
                raise self._queue_full()
            self.admitted += 1
            admitted = True
            if body.encoding is not None:
                body.charge(self.max_body_bytes)  # the most its inflated copy can hold
            parsed = await loop.run_in_executor(self.decoder, self._parse, body.data, body.encoding)
            image, pixels = await self._image(parsed.image_url)
            body.release()  # what is left of the request is its decoded image and its text
            if self.stopped:  # admitted before a drain began, but the drain is over
                raise ServerClosing("the server is shutting down")
            query = Query(id=rid, image=image, question=parsed.question, options=parsed.options)
            deadline = None
            if self.request_timeout is not None:
                deadline = t_arrival + self.request_timeout
            item = _Item(query, loop.create_future(), loop.time(), t_arrival, deadline,
                         pixels=pixels)
            pixels = 0  # the item holds them now
            self.waiting.append(item)
            assert self.arrived is not None
            self.arrived.set()
            timeout = None if deadline is None else max(0.0, deadline - loop.time())
            try:
                # shield: a timeout must not cancel the shared future the funnel resolves.
                result, batch_size, queued = await asyncio.wait_for(
                    asyncio.shield(item.future), timeout
                )
            except TimeoutError:
                item.abandoned = True  # the funnel drops it if it has not started on it yet
                item.future.cancel()  # a result that still comes is dropped unread
                return error_response(
                    504,
                    f"no answer within the request timeout ({self.request_timeout:g} s)",
                    code="request_timeout",
                    type="timeout_error",
                )
        except RequestError as e:
            if e.code == "body_timeout":
                return await _answer_and_close(request, _refused(e))
            return _refused(e)
        except ClientGone as e:
            # Nobody to answer: one line in the log, no traceback.
            log.info("speceyes serve: request %s: client disconnected mid-body (%s)", rid, e)
            return _refused(RequestError("the client disconnected", code="client_disconnected"))
        except ServerClosing as e:
            return error_response(503, str(e), code="shutting_down", type="server_error")
        except web.HTTPException:
            raise  # the middleware answers it as JSON
        except Exception:
            log.exception("speceyes serve: request %s failed", rid)
            return internal_error(rid)
        finally:
            if body is not None:
                body.release()
            self.pixels_in_flight -= pixels
            if admitted and (item is None or not item.started):
                self.admitted -= 1  # the slot was not handed over to the funnel
                if item is not None:
                    self._release(item)
                    if item in self.waiting:
                        self.waiting.remove(item)
        if result.route == "error" or (result.error and not result.answer):
            log.error("speceyes serve: request %s: no answer: %s", rid, result.error)
            return internal_error(rid)
        total = loop.time() - t_arrival
        self.metrics.request_seconds.observe(total)
        assert item is not None  # an answer came from the funnel, so the query was queued
        intake = item.enqueued - item.arrived  # its body read, parsed and its image decoded
        return web.json_response(self._completion(result, batch_size, queued, total, intake))

    def _completion(
        self, r: Result, batch_size: int, queued: float, total: float, intake: float
    ) -> dict:
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "system_fingerprint": None,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": r.answer},
                    "logprobs": None,
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
            "speceyes": {
                "route": r.route,
                "operating_point": (r.operating_point() or {}).get("point"),
                "load_band": (r.operating_point() or {}).get("load_band"),
                "confidence": r.confidence,
                "p_tool": r.p_tool,
                "tool_calls": r.tool_calls,
                "invalid_tool_calls": r.invalid_tool_calls,
                "small_answer": r.small_answer,
                "agent_answer": r.agent_answer,
                "error": r.error,
                "batch_size": batch_size,
                "timings": {**r.timings, "intake": intake, "queue": queued, "total": total},
            },
        }

    async def health(self, _request: web.Request) -> web.Response:
        stats = self.funnel.stats
        return web.json_response(
            {
                "status": "closing" if self.closing else "ok",
                "model": self.model_name,
                "mode": self.funnel.config.mode,
                "judge": self.funnel.config.judge,
                "tau": self.funnel.config.tau,
                "queue": self.admitted,
                "max_queue": self.max_queue,
                "reading": self.reading,
                "body_bytes_in_flight": self.body_budget.used,
                "inflight": self.inflight,
                "batch_size": self.batch_size,
                "max_wait_ms": self.max_wait * 1000.0,
                "queries": stats.queries,
                "beta": stats.beta,
                "alpha": stats.alpha,
                "uptime_s": time.time() - self.started_at,
            }
        )

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": int(self.started_at),
            "owned_by": "speceyes",
        }

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        if request.match_info["model"] != self.model_name:
            return error_response(
                404,
                f"model {request.match_info['model']!r} does not exist; this server has "
                f"{self.model_name!r}",
                code="model_not_found",
            )
        return web.json_response(self._model_card())

    async def metrics_text(self, _request: web.Request) -> web.Response:
        stats = self.funnel.stats
        body = self.metrics.render(
            {
                "speceyes_queue_depth": (
                    "Requests admitted and not yet in a batch.",
                    self.admitted,
                ),
                "speceyes_inflight": ("Queries handed to the funnel, unanswered.", self.inflight),
                "speceyes_pixels_in_flight": (
                    "Decoded image pixels (RGB-equivalent) held by admitted requests.",
                    self.pixels_in_flight,
                ),
                "speceyes_reading": (
                    "Requests whose body is being read.",
                    self.reading,
                ),
                "speceyes_body_bytes_in_flight": (
                    "Request-body bytes held while bodies are read and parsed.",
                    self.body_budget.used,
                ),
                "speceyes_beta": ("Share of judged queries judged tool-free.", stats.beta),
                "speceyes_alpha": ("Gate acceptance among tool-free queries.", stats.alpha),
            },
            {
                "speceyes_funnel_queries_total": ("Queries the funnel has run.", stats.queries),
                "speceyes_early_agent_loops_total": (
                    "Agent loops started beside phases I-III (--early-agent).",
                    stats.early_agent,
                ),
                "speceyes_early_agent_dropped_total": (
                    "Of those, loops dropped because the gate answered their query.",
                    stats.agent_dropped,
                ),
            },
        )
        return web.Response(
            body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
        )

    # ---- authentication, errors as OpenAI JSON, request counting --------------------------
    def _authorize(self, request: web.Request) -> None:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        expected = (self.api_key or "").encode()
        # aiohttp decodes header bytes with surrogateescape: encoding back the same way gives
        # the bytes that were sent, so a non-UTF-8 token is a wrong key (401), not a 500.
        sent = token.strip().encode("utf-8", "surrogateescape")
        # Constant-time comparison: the time taken says nothing about how much of a guess matched.
        if scheme.lower() != "bearer" or not hmac.compare_digest(sent, expected):
            raise RequestError(
                "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                status=401,
                code="invalid_api_key",
            )

    @web.middleware
    async def middleware(
        self, request: web.Request, handler: Callable[[web.Request], Any]
    ) -> web.StreamResponse:
        rid = uuid.uuid4().hex
        request[RID_KEY] = rid
        try:
            if self.api_key is not None and request.path not in OPEN_PATHS:
                self._authorize(request)
            resp = await handler(request)
        except web.HTTPException as e:  # 404, 405, 413 from aiohttp itself
            code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
            resp = error_response(
                e.status, e.text or e.reason, code=code.get(e.status, "http_error")
            )
        except RequestError as e:
            resp = _error_from(e)
            if e.status == 401:
                resp.headers["WWW-Authenticate"] = "Bearer"
        except Exception:
            log.exception("speceyes serve: request %s failed", rid)
            resp = internal_error(rid)
        resp.headers[REQUEST_ID_HEADER] = rid
        if request.path == CHAT_PATH:
            key = str(resp.status)
            self.metrics.requests.labels(status=key).inc()
        return resp


def _refused(e: RequestError) -> web.Response:
    """The JSON error for a refused request (with Retry-After on a 429). A body left unread is
    drained by aiohttp after the answer, for at most its lingering time, so that the client
    reads the answer."""
    headers = {"Retry-After": "1"} if e.status == 429 else None
    return error_response(
        e.status, e.message, code=e.code, type=e.type, param=e.param, headers=headers
    )


async def _answer_and_close(request: web.Request, resp: web.Response) -> web.Response:
    """Send ``resp`` now and close the connection: the rest of a body too slow to arrive is
    not waited for (aiohttp would linger reading it, even after the client has gone)."""
    resp.headers[REQUEST_ID_HEADER] = request[RID_KEY]
    resp.force_close()
    await resp.prepare(request)
    await resp.write_eof()
    if request.protocol is not None:
        request.protocol.force_close()
    return resp


STATE_KEY = web.AppKey("speceyes", Server)


def create_app(
    funnel: Funnel, settings: ServeSettings | None = None, **options: Any
) -> web.Application:
    """The aiohttp application serving ``funnel`` with ``settings``; ``options`` replace single
    fields of it (``create_app(funnel, batch_size=1)``)."""
    s = replace(settings or ServeSettings(), **options)
    bs = funnel.config.batch_size if s.batch_size is None else s.batch_size
    if bs < 1:
        raise ValueError("batch_size must be at least 1")
    s.validate()
    # Tokenizers of every model the funnel serves: question limits in their tokens and their
    # control tokens refused (a model behind a URL counts UTF-8 bytes).
    backends = (
        getattr(funnel, "small", None),
        getattr(funnel, "large", None),
        getattr(getattr(funnel, "agent", None), "backend", None),
    )
    max_body = int(s.max_body_mb * 1024 * 1024)
    state = Server(
        funnel=funnel,
        batch_size=bs,
        max_wait=s.max_wait_ms / 1000.0,
        max_queue=s.max_queue,
        model_name=s.model_name,
        request_timeout=s.request_timeout,
        allow_local_files=s.allow_local_files,
        api_key=s.api_key,
        max_question_chars=s.max_question_chars,
        max_option_chars=s.max_option_chars,
        max_image_pixels=s.max_image_pixels,
        max_pixels_in_flight=s.max_pixels_in_flight,
        max_text_tokens=s.max_text_tokens,
        max_body_bytes=max_body,
        body_timeout=s.body_timeout,
        body_budget=ByteBudget(int(s.max_body_mb_in_flight * 1024 * 1024)),
        text_rules=TextRules.for_backends(backends),
    )
    app = web.Application(
        middlewares=[state.middleware],
        client_max_size=max_body,
        # Bodies are inflated by the handler, in a decoder thread and bounded while inflating,
        # not by the HTTP parser on the event loop.
        handler_args={"auto_decompress": False},
    )
    app[STATE_KEY] = state
    app.router.add_post(CHAT_PATH, state.chat)
    app.router.add_get("/health", state.health)
    app.router.add_get("/v1/models", state.models)
    app.router.add_get("/v1/models/{model}", state.model)
    app.router.add_get("/metrics", state.metrics_text)
    app.on_startup.append(state.start)
    app.on_shutdown.append(state.shutdown)
    app.on_cleanup.append(state.cleanup)
    return app


# ---- running it ---------------------------------------------------------------------------
def _urls(runner: web.AppRunner) -> list[str]:
    out = []
    for addr in runner.addresses:
        host, port = addr[0], addr[1]
        out.append(f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}")
    return out


def serve(
    funnel: Funnel,
    settings: ServeSettings | None = None,
    *,
    announce: Callable[[str], None] | None = None,
    **options: Any,
) -> int:
    """Serve until Ctrl-C or SIGTERM, then drain and shut down; returns an exit code.

    ``options`` replace single fields of ``settings``, as in :func:`create_app`. On the signal
    the server stops accepting connections, answers 503 to new requests on open ones, gives
    admitted requests up to ``drain_timeout`` seconds to be answered, then exits (those still
    unanswered get 503).
    """
    settings = replace(settings or ServeSettings(), **options)
    host, port, drain_timeout = settings.host, settings.port, settings.drain_timeout
    app = create_app(funnel, settings)
    state = app[STATE_KEY]
    say = announce or (lambda line: print(line, flush=True))

    async def main() -> None:
        runner = web.AppRunner(app, shutdown_timeout=5.0, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                try:
                    loop.add_signal_handler(sig, stop.set)
                except (NotImplementedError, RuntimeError):  # not on this platform/thread
                    pass
            cfg = funnel.config
            for url in _urls(runner):
                say(f"speceyes serve: listening on {url}  (POST {url}{CHAT_PATH})")
            say(
                f"model {state.model_name!r}, mode {cfg.mode}, judge {cfg.judge}, schedule "
                f"{cfg.schedule}, tau {cfg.tau}, batch {state.batch_size}, max wait {state.max_wait * 1e3:g} ms, "
                f"max queue {state.max_queue}, API key {'on' if state.api_key else 'off'}; "
                "GET /health /v1/models /metrics; Ctrl-C to stop"
            )
            await stop.wait()
            say(
                f"speceyes serve: shutting down: draining {state.admitted + state.inflight} "
                f"requests (up to {drain_timeout:g} s)"
            )
            for site in list(runner.sites):
                await site.stop()  # no new connections
            drained = await state.drain(drain_timeout)
            if not drained:
                say("speceyes serve: drain timeout; unanswered requests get 503")
        finally:
            await runner.cleanup()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:  # a platform without signal handlers
        pass
    return 0
