"""``speceyes serve``: an OpenAI-compatible HTTP server that answers through the funnel.

Endpoints:

* ``POST /v1/chat/completions`` - an OpenAI chat request whose user message holds one image part
  (``image_url`` with a ``data:image/...;base64,`` URI, or ``file://`` with --allow-local-files)
  and a text part (the question). Multiple-choice options go in the extra body field
  ``"options": [...]``. The reply is a standard ``chat.completion`` plus a top-level
  ``"speceyes"`` object (route, confidence, p_tool, tool calls, small answer, timings).
  System prompts, sampling parameters and ``max_tokens`` are ignored: the funnel uses its own
  prompts and greedy decoding, as the method requires.
* ``GET /health``, ``GET /v1/models``, ``GET /metrics`` (Prometheus text format).

Scheduling: requests are parsed and their images decoded on the event loop's side (decoding in a
small thread pool), then queued. One batcher task collects up to ``batch_size`` requests, or what
arrived within ``max_wait_ms`` of the oldest one, and runs ``Funnel.run_batch`` in a single
worker thread: the funnel and its models are synchronous and not thread-safe, so at most one
batch runs at a time, and requests that arrive meanwhile form the next batch.

Backpressure: at most ``max_queue`` requests are admitted and not yet running (their bodies and
images are the memory that grows with load); beyond that a request is answered 429 before its
body is read. Requests in the running batch are bounded by ``batch_size``. Each request has an
end-to-end deadline (``request_timeout``, 504).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import signal
import threading
import time
import urllib.parse
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from speceyes.images import ImageError, load_image
from speceyes.types import Query, Result

if TYPE_CHECKING:
    from speceyes.funnel import Funnel

log = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"
PHASES: tuple[str, ...] = ("judge", "small", "gate", "agent")
ROUTES: tuple[str, ...] = (
    "small",
    "agent_after_judge",
    "agent_after_gate",
    "agent_only",
    "small_only",
    "error",
)
STATUSES: tuple[str, ...] = ("200", "400", "413", "429", "500", "503", "504")
LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
)  # fmt: skip
BATCH_BUCKETS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_OPTIONS = 26  # letters A..Z


# ---- errors -------------------------------------------------------------------------------
class RequestError(Exception):
    """A request we answer with an OpenAI-style error body instead of a result."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        code: str = "invalid_request",
        param: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.code, self.param, self.type = (
            message,
            status,
            code,
            param,
            type,
        )


def error_response(
    status: int,
    message: str,
    *,
    code: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return web.json_response(body, status=status, headers=headers)


def _error_from(e: RequestError) -> web.Response:
    return error_response(e.status, e.message, code=e.code, type=e.type, param=e.param)


# ---- request parsing ----------------------------------------------------------------------
@dataclass
class ChatRequest:
    question: str
    image_url: str
    options: list[str] | None = None


def _content_parts(content: Any, where: str) -> list[dict[str, Any]]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        return content
    raise RequestError(
        f"{where}.content must be a string or a list of content parts",
        code="invalid_content",
        param=where,
    )


def _image_url_of(part: dict[str, Any], where: str) -> str:
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, dict) else ref
    if not isinstance(url, str) or not url:
        raise RequestError(
            f"{where}: an image_url part needs "
            '{"image_url": {"url": "data:image/...;base64,..."}}',
            code="invalid_image_url",
            param=where,
        )
    return url


def parse_chat_request(body: Any) -> ChatRequest:
    """The question, the one image URL and the options of an OpenAI chat request."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", code="invalid_body")
    if body.get("stream"):
        raise RequestError(
            "streaming is not supported: send stream=false",
            code="unsupported_stream",
            param="stream",
        )
    if body.get("n") not in (None, 1):
        raise RequestError("only n=1 is supported", code="unsupported_n", param="n")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(
            "messages must be a non-empty list", code="missing_messages", param="messages"
        )
    images: list[str] = []
    question = ""
    for k, m in enumerate(messages):
        where = f"messages[{k}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(
                f"{where} must be an object with a role", code="invalid_message", param=where
            )
        if m["role"] != "user":
            continue  # the funnel uses its own system prompts; earlier assistant turns do not apply
        texts = []
        for j, part in enumerate(_content_parts(m.get("content"), where)):
            kind = part.get("type")
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise RequestError(
                        f"{where}.content[{j}].text must be a string",
                        code="invalid_content",
                        param=where,
                    )
                texts.append(part["text"])
            elif kind == "image_url":
                images.append(_image_url_of(part, f"{where}.content[{j}]"))
            else:
                raise RequestError(
                    f"{where}.content[{j}]: unsupported content part type {kind!r} "
                    "(use 'text' and 'image_url')",
                    code="invalid_content",
                    param=where,
                )
        text = "\n".join(t for t in texts if t.strip()).strip()
        if text:
            question = text  # the last user message with text is the question
    if not images:
        raise RequestError(
            "the user message needs an image part: "
            '{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}',
            code="missing_image",
            param="messages",
        )
    if len(images) > 1:
        raise RequestError(
            f"exactly one image per request is supported, got {len(images)}",
            code="too_many_images",
            param="messages",
        )
    if not question:
        raise RequestError(
            "the user message needs a text part with the question",
            code="missing_text",
            param="messages",
        )
    options = body.get("options")
    if options is not None:
        if (
            not isinstance(options, list)
            or not 1 <= len(options) <= MAX_OPTIONS
            or not all(isinstance(o, str) and o.strip() for o in options)
        ):
            raise RequestError(
                f"options must be a list of 1 to {MAX_OPTIONS} non-empty strings",
                code="invalid_options",
                param="options",
            )
        options = [o.strip() for o in options]
    return ChatRequest(question=question, image_url=images[0], options=options or None)


def resolve_image(url: str, allow_local_files: bool) -> str | Path:
    """What load_image should open: the data URI itself, or a local path (when allowed)."""
    if url.startswith("data:"):
        return url
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme == "file":
        if not allow_local_files:
            raise RequestError(
                "file:// image URLs are disabled on this server (start it with "
                "--allow-local-files); send the image as a data:image/...;base64 URI",
                code="local_files_disabled",
                param="messages",
            )
        parts = urllib.parse.urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise RequestError(
                f"file URL must name a local file (file:///path), got host {parts.netloc!r}",
                code="invalid_image_url",
                param="messages",
            )
        return Path(urllib.parse.unquote(parts.path))
    if scheme in ("http", "https"):
        # Fetching URLs from a server would let any client make it request arbitrary hosts.
        raise RequestError(
            "remote image URLs are not fetched by this server; send the image as a "
            "data:image/...;base64 URI",
            code="unsupported_image_url",
            param="messages",
        )
    raise RequestError(
        "image_url.url must be a data:image/...;base64 URI"
        + (" or a file:// URL" if allow_local_files else ""),
        code="invalid_image_url",
        param="messages",
    )


# ---- metrics ------------------------------------------------------------------------------
class Histogram:
    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)  # non-cumulative; summed on exposition
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.total += 1
        self.sum += value
        for k, b in enumerate(self.buckets):
            if value <= b:
                self.counts[k] += 1
                break


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "NaN"
    if isinstance(x, float) and math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x)) if isinstance(x, float) else str(x)


class Metrics:
    """Counters and histograms of the server; rendered in the Prometheus text format 0.0.4."""

    def __init__(self) -> None:
        # Known label values start at zero so that rates exist before the first event.
        self.requests: dict[str, int] = dict.fromkeys(STATUSES, 0)
        self.routes: dict[str, int] = dict.fromkeys(ROUTES, 0)
        self.phases = {p: Histogram(LATENCY_BUCKETS) for p in PHASES}
        self.request_seconds = Histogram(LATENCY_BUCKETS)
        self.batch_size = Histogram(BATCH_BUCKETS)
        self.batch_errors = 0

    def render(
        self,
        gauges: dict[str, tuple[str, float | None]],
        counters: dict[str, tuple[str, float]] | None = None,
    ) -> str:
        out: list[str] = []

        def head(name: str, kind: str, help_: str) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")

        def hist(name: str, h: Histogram, labels: str = "") -> None:
            sep = "," if labels else ""
            cum = 0
            for b, c in zip(h.buckets, h.counts, strict=True):
                cum += c
                out.append(f'{name}_bucket{{{labels}{sep}le="{_num(float(b))}"}} {cum}')
            out.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {h.total}')
            lab = f"{{{labels}}}" if labels else ""
            out.append(f"{name}_sum{lab} {_num(h.sum)}")
            out.append(f"{name}_count{lab} {h.total}")

        head("speceyes_requests_total", "counter", "Chat completion requests by HTTP status.")
        for status, n in self.requests.items():
            out.append(f'speceyes_requests_total{{status="{_label(status)}"}} {n}')
        head("speceyes_routes_total", "counter", "Answered queries by funnel route.")
        for route, n in self.routes.items():
            out.append(f'speceyes_routes_total{{route="{_label(route)}"}} {n}')
        head("speceyes_batch_errors_total", "counter", "Funnel batches that raised.")
        out.append(f"speceyes_batch_errors_total {self.batch_errors}")
        for name, (help_, value) in (counters or {}).items():
            head(name, "counter", help_)
            out.append(f"{name} {_num(value)}")
        for name, (help_, value) in gauges.items():
            head(name, "gauge", help_)
            out.append(f"{name} {_num(value)}")
        head(
            "speceyes_phase_seconds",
            "histogram",
            "Funnel time per query and phase (a batch's phase time shared among its queries).",
        )
        for p, h in self.phases.items():
            hist("speceyes_phase_seconds", h, f'phase="{p}"')
        head(
            "speceyes_request_seconds",
            "histogram",
            "End-to-end latency of answered chat completion requests.",
        )
        hist("speceyes_request_seconds", self.request_seconds)
        head("speceyes_batch_size", "histogram", "Queries per funnel batch.")
        hist("speceyes_batch_size", self.batch_size)
        return "\n".join(out) + "\n"


# ---- the server ---------------------------------------------------------------------------
class ServerClosing(Exception):
    pass


@dataclass(eq=False)
class _Item:
    query: Query
    future: asyncio.Future[tuple[Result, int, float]]
    enqueued: float
    started: bool = False


@dataclass
class ServerState:
    funnel: Funnel
    batch_size: int
    max_wait: float  # seconds
    max_queue: int
    model_name: str
    request_timeout: float | None
    allow_local_files: bool
    metrics: Metrics = field(default_factory=Metrics)
    waiting: deque[_Item] = field(default_factory=deque)
    admitted: int = 0  # requests holding a queue slot: being read/decoded or waiting
    inflight: int = 0  # queries in the running funnel batch
    closing: bool = False
    started_at: float = field(default_factory=time.time)
    worker: ThreadPoolExecutor | None = None
    decoder: ThreadPoolExecutor | None = None
    arrived: asyncio.Event | None = None
    batcher: asyncio.Task[None] | None = None

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self, _app: web.Application) -> None:
        # One worker thread: the funnel is synchronous and runs one batch at a time.
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="speceyes-funnel")
        self.decoder = ThreadPoolExecutor(
            max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="speceyes-decode"
        )
        self.arrived = asyncio.Event()
        self.batcher = asyncio.get_running_loop().create_task(self._batch_loop())

    async def shutdown(self, _app: web.Application) -> None:
        """Stop admitting; requests still waiting get 503, the running batch may finish."""
        self.closing = True
        while self.waiting:
            item = self.waiting.popleft()
            if not item.future.done():
                item.future.set_exception(ServerClosing("the server is shutting down"))

    async def cleanup(self, _app: web.Application) -> None:
        if self.batcher is not None:
            self.batcher.cancel()
            try:
                await self.batcher
            except asyncio.CancelledError:
                pass
        for pool in (self.worker, self.decoder):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)

    # ---- batching -------------------------------------------------------------------------
    async def _batch_loop(self) -> None:
        assert self.arrived is not None
        loop = asyncio.get_running_loop()
        while True:
            while not self.waiting:
                self.arrived.clear()
                await self.arrived.wait()
            # Wait for a full batch, but never past max_wait after the oldest request arrived:
            # under load the queue refills while a batch runs and the next one starts at once.
            deadline = self.waiting[0].enqueued + self.max_wait
            while len(self.waiting) < self.batch_size:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                self.arrived.clear()
                try:
                    await asyncio.wait_for(self.arrived.wait(), remaining)
                except TimeoutError:
                    break
            batch: list[_Item] = []
            while self.waiting and len(batch) < self.batch_size:
                item = self.waiting.popleft()
                item.started = True
                self.admitted -= 1
                batch.append(item)
            if batch:
                try:
                    await self._run(batch)
                except asyncio.CancelledError:
                    raise
                except Exception:  # never let the batcher die: later requests still need it
                    log.exception("speceyes serve: batch bookkeeping failed")

    async def _run(self, batch: list[_Item]) -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        self.inflight = len(batch)
        self.metrics.batch_size.observe(len(batch))
        try:
            # Looked up per batch so that a wrapper installed on the funnel is seen.
            results = await loop.run_in_executor(
                self.worker, self.funnel.run_batch, [it.query for it in batch]
            )
            if len(results) != len(batch):
                raise RuntimeError(f"funnel returned {len(results)} results for {len(batch)}")
        except Exception as e:
            self.metrics.batch_errors += 1
            log.exception("speceyes serve: funnel batch of %d failed", len(batch))
            for it in batch:
                if not it.future.done():
                    it.future.set_exception(e)
            return
        finally:
            self.inflight = 0
        for it, r in zip(batch, results, strict=True):
            self.metrics.routes[r.route] = self.metrics.routes.get(r.route, 0) + 1
            for p in PHASES:
                if p in r.timings:
                    self.metrics.phases[p].observe(r.timings[p])
            if not it.future.done():  # done: the request timed out or was cancelled
                it.future.set_result((r, len(batch), t0 - it.enqueued))

    # ---- handlers -------------------------------------------------------------------------
    async def chat(self, request: web.Request) -> web.Response:
        loop = asyncio.get_running_loop()
        t_arrival = loop.time()
        if self.closing:
            return error_response(
                503, "the server is shutting down", code="shutting_down", type="server_error"
            )
        if self.admitted >= self.max_queue:
            # Refused before the body is read: overload costs neither memory nor decoding.
            return error_response(
                429,
                f"server overloaded: {self.admitted} requests already queued "
                f"(max_queue={self.max_queue}); retry later",
                code="queue_full",
                type="rate_limit_error",
                headers={"Retry-After": "1"},
            )
        self.admitted += 1
        item: _Item | None = None
        try:
            try:
                body = json.loads(await request.read())
            except (UnicodeDecodeError, ValueError) as e:
                raise RequestError(
                    f"the request body is not valid JSON ({e})", code="invalid_json"
                ) from e
            parsed = parse_chat_request(body)
            src = resolve_image(parsed.image_url, self.allow_local_files)
            try:
                image = await loop.run_in_executor(self.decoder, load_image, src)
            except ImageError as e:
                raise RequestError(str(e), code="invalid_image", param="messages") from e
            if self.closing:
                raise ServerClosing("the server is shutting down")
            query = Query(
                id=uuid.uuid4().hex, image=image, question=parsed.question, options=parsed.options
            )
            item = _Item(query, loop.create_future(), loop.time())
            self.waiting.append(item)
            assert self.arrived is not None
            self.arrived.set()
            timeout = None
            if self.request_timeout is not None:
                timeout = max(0.0, self.request_timeout - (loop.time() - t_arrival))
            try:
                # shield: a timeout must not cancel the shared future the batcher resolves.
                result, batch_size, queued = await asyncio.wait_for(
                    asyncio.shield(item.future), timeout
                )
            except TimeoutError:
                item.future.cancel()  # the batcher then drops its result unread
                return error_response(
                    504,
                    f"no answer within the request timeout ({self.request_timeout:g} s)",
                    code="request_timeout",
                    type="timeout_error",
                )
        except RequestError as e:
            return _error_from(e)
        except ServerClosing as e:
            return error_response(503, str(e), code="shutting_down", type="server_error")
        except web.HTTPException:
            raise  # e.g. 413 while reading the body: the middleware answers it as JSON
        except Exception as e:
            log.exception("speceyes serve: request failed")
            return error_response(
                500, f"internal error: {type(e).__name__}: {e}", code="internal_error",
                type="server_error",
            )  # fmt: skip
        finally:
            if item is None or not item.started:
                self.admitted -= 1  # the slot was not handed over to a batch
                if item is not None and item in self.waiting:
                    self.waiting.remove(item)
        if result.route == "error":
            return error_response(
                500, result.error or "the funnel could not answer", code="funnel_error",
                type="server_error",
            )  # fmt: skip
        total = loop.time() - t_arrival
        self.metrics.request_seconds.observe(total)
        return web.json_response(self._completion(result, batch_size, queued, total))

    def _completion(self, r: Result, batch_size: int, queued: float, total: float) -> dict:
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
                "confidence": r.confidence,
                "p_tool": r.p_tool,
                "tool_calls": r.tool_calls,
                "invalid_tool_calls": r.invalid_tool_calls,
                "small_answer": r.small_answer,
                "agent_answer": r.agent_answer,
                "error": r.error,
                "batch_size": batch_size,
                "timings": {**r.timings, "queue": queued, "total": total},
            },
        }

    async def health(self, _request: web.Request) -> web.Response:
        stats = self.funnel.stats
        return web.json_response(
            {
                "status": "closing" if self.closing else "ok",
                "model": self.model_name,
                "mode": self.funnel.config.mode,
                "tau": self.funnel.config.tau,
                "queue": self.admitted,
                "max_queue": self.max_queue,
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
        text = self.metrics.render(
            {
                "speceyes_queue_depth": (
                    "Requests admitted and not yet in a batch.",
                    self.admitted,
                ),
                "speceyes_inflight": ("Queries in the running funnel batch.", self.inflight),
                "speceyes_beta": ("Share of judged queries judged tool-free.", stats.beta),
                "speceyes_alpha": ("Gate acceptance among tool-free queries.", stats.alpha),
            },
            {"speceyes_funnel_queries_total": ("Queries the funnel has run.", stats.queries)},
        )
        return web.Response(
            body=text.encode(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
        )

    # ---- errors as OpenAI JSON, request counting ----------------------------------------
    @web.middleware
    async def middleware(
        self, request: web.Request, handler: Callable[[web.Request], Any]
    ) -> web.StreamResponse:
        try:
            resp = await handler(request)
        except web.HTTPException as e:  # 404, 405, 413 from aiohttp itself
            code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
            resp = error_response(
                e.status, e.text or e.reason, code=code.get(e.status, "http_error")
            )
        except Exception as e:
            log.exception("speceyes serve: unhandled error")
            resp = error_response(
                500,
                f"internal error: {type(e).__name__}",
                code="internal_error",
                type="server_error",
            )
        if request.path == CHAT_PATH:
            key = str(resp.status)
            self.metrics.requests[key] = self.metrics.requests.get(key, 0) + 1
        return resp


STATE_KEY = web.AppKey("speceyes", ServerState)


def create_app(
    funnel: Funnel,
    *,
    batch_size: int | None = None,
    max_wait_ms: float = 10.0,
    max_queue: int = 256,
    model_name: str = "speceyes",
    request_timeout: float | None = 300.0,
    allow_local_files: bool = False,
    max_body_mb: float = 32.0,
) -> web.Application:
    """The aiohttp application serving ``funnel``; ``batch_size`` defaults to the funnel's."""
    bs = funnel.config.batch_size if batch_size is None else batch_size
    if bs < 1:
        raise ValueError("batch_size must be at least 1")
    if max_queue < 1:
        raise ValueError("max_queue must be at least 1")
    if max_wait_ms < 0:
        raise ValueError("max_wait_ms must be >= 0")
    if request_timeout is not None and request_timeout <= 0:
        raise ValueError("request_timeout must be positive")
    state = ServerState(
        funnel=funnel,
        batch_size=bs,
        max_wait=max_wait_ms / 1000.0,
        max_queue=max_queue,
        model_name=model_name,
        request_timeout=request_timeout,
        allow_local_files=allow_local_files,
    )
    app = web.Application(
        middlewares=[state.middleware], client_max_size=int(max_body_mb * 1024 * 1024)
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


class ServerThread:
    """An app served on its own event loop in a background thread (tests, benchmarks)."""

    def __init__(self, app: web.Application, host: str = "127.0.0.1", port: int = 0) -> None:
        self.app, self.host, self.port = app, host, port
        self.loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()

        async def up() -> None:
            self._runner = web.AppRunner(self.app, shutdown_timeout=5.0, access_log=None)
            await self._runner.setup()
            await web.TCPSite(self._runner, self.host, self.port).start()
            self.port = self._runner.addresses[0][1]

        asyncio.run_coroutine_threadsafe(up(), self.loop).result(timeout)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(timeout)
            self._runner = None
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(
    funnel: Funnel,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    batch_size: int | None = None,
    max_wait_ms: float = 10.0,
    max_queue: int = 256,
    model_name: str = "speceyes",
    request_timeout: float | None = 300.0,
    allow_local_files: bool = False,
    max_body_mb: float = 32.0,
    announce: Callable[[str], None] | None = None,
) -> int:
    """Serve until Ctrl-C or SIGTERM, then shut down cleanly; returns an exit code."""
    app = create_app(
        funnel,
        batch_size=batch_size,
        max_wait_ms=max_wait_ms,
        max_queue=max_queue,
        model_name=model_name,
        request_timeout=request_timeout,
        allow_local_files=allow_local_files,
        max_body_mb=max_body_mb,
    )
    state = app[STATE_KEY]
    say = announce or (lambda line: print(line, flush=True))

    async def main() -> None:
        runner = web.AppRunner(app, shutdown_timeout=10.0, access_log=None)
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
                f"model {model_name!r}, mode {cfg.mode}, tau {cfg.tau}, batch {state.batch_size}, "
                f"max wait {max_wait_ms:g} ms, max queue {max_queue}; "
                "GET /health /v1/models /metrics; Ctrl-C to stop"
            )
            await stop.wait()
            say("speceyes serve: shutting down (queued requests get 503)")
        finally:
            await runner.cleanup()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:  # a platform without signal handlers
        pass
    return 0
