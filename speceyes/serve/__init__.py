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
small thread pool), then queued. The funnel runs in one thread of its own, off the event loop
(``/health`` answers while it works), over a stream of micro-batches: whenever the funnel's
schedule is ready for another batch, the batcher hands it up to ``batch_size`` requests, or what
arrived within ``max_wait_ms`` of the oldest one. On the pipelined schedule (the CLI's default
for ``serve``) a batch is drawn as soon as the previous one passed phases I-III, and an answer
the gate accepted is sent at once instead of waiting for its batch-mates' agent loops.

Limits (defaults in :mod:`speceyes.limits`): question and option length (413), option count
(400), lone surrogates (400), image pixels read from the header before decoding (413), and a
server-wide budget of decoded pixels held by admitted requests (429 when spent).

Backpressure: at most ``max_queue`` requests are admitted and not yet running (their bodies and
images are the memory that grows with load); beyond that a request is answered 429 before its
body is read. Each request has an end-to-end deadline (``request_timeout``, 504).

Security: with ``api_key`` every endpoint but ``/health`` needs ``Authorization: Bearer <key>``
(401 otherwise), as vLLM and SGLang do. A 500 says only "internal error" and a request id; the
details are in the server log under that id (every response carries it as ``X-Request-Id``).
Shutdown (SIGTERM, Ctrl-C): stop accepting, answer what was admitted for up to
``drain_timeout`` seconds, then exit; the funnel thread never keeps the process alive.
"""

from __future__ import annotations

import asyncio
import hmac
import io
import json
import logging
import math
import os
import queue
import signal
import sys
import threading
import time
import urllib.parse
import uuid
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web
from PIL import Image
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from speceyes import limits
from speceyes.images import ImageError, _decode_data_uri, load_image
from speceyes.types import PHASES, ROUTES, Query, Result

if TYPE_CHECKING:
    from speceyes.funnel import Funnel

log = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"
STATUSES: tuple[str, ...] = ("200", "400", "401", "413", "429", "500", "503", "504")
LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
)  # fmt: skip
BATCH_BUCKETS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
API_KEY_ENV = "SPECEYES_API_KEY"
OPEN_PATHS = frozenset({"/health"})  # answered without the API key (load balancer probes)
REQUEST_ID_HEADER = "X-Request-Id"
RID_KEY = web.RequestKey("speceyes_request_id", str)


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


def internal_error(request_id: str) -> web.Response:
    """A 500 that tells the client nothing about the internals, only the id in the server log."""
    return error_response(
        500, f"internal error (request id {request_id})", code="internal_error",
        type="server_error",
    )  # fmt: skip


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


def _check_text(text: str, where: str) -> str:
    # Valid JSON can carry a lone surrogate ("\ud800"); no tokenizer encodes one.
    if limits.lone_surrogate(text):
        raise RequestError(
            f"{where} contains a lone UTF-16 surrogate (not valid Unicode text)",
            code="invalid_text",
            param=where,
        )
    return text


def _too_long(what: str, n: int, cap: int, code: str, param: str) -> RequestError:
    return RequestError(
        f"{what} has {n} characters; this server accepts at most {cap}",
        status=413,
        code=code,
        param=param,
    )


def parse_chat_request(
    body: Any,
    *,
    max_question_chars: int = limits.MAX_QUESTION_CHARS,
    max_option_chars: int = limits.MAX_OPTION_CHARS,
) -> ChatRequest:
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
                texts.append(_check_text(part["text"], f"{where}.content[{j}].text"))
            elif kind == "image_url":
                images.append(_check_text(_image_url_of(part, f"{where}.content[{j}]"), where))
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
    if len(question) > max_question_chars:
        n = len(question)
        raise _too_long("the question", n, max_question_chars, "question_too_long", "messages")
    options = body.get("options")
    if options is not None:
        if not isinstance(options, list) or not all(
            isinstance(o, str) and o.strip() for o in options
        ):
            raise RequestError(
                f"options must be a list of 1 to {limits.MAX_OPTIONS} non-empty strings",
                code="invalid_options",
                param="options",
            )
        if not 1 <= len(options) <= limits.MAX_OPTIONS:
            raise RequestError(
                f"got {len(options)} options; the prompts have letters for 1 to "
                f"{limits.MAX_OPTIONS}",
                code="too_many_options" if options else "invalid_options",
                param="options",
            )
        options = [_check_text(o.strip(), f"options[{k}]") for k, o in enumerate(options)]
        for k, o in enumerate(options):
            if len(o) > max_option_chars:
                where = f"options[{k}]"
                raise _too_long(where, len(o), max_option_chars, "option_too_long", "options")
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
class Metrics:
    """The server's counters and histograms (prometheus-client), in a registry of their own so
    that several apps in one process never share a series."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "speceyes_requests", "Chat completion requests by HTTP status.", ["status"], registry=r
        )
        self.routes = Counter(
            "speceyes_routes", "Answered queries by funnel route.", ["route"], registry=r
        )
        self.batch_errors = Counter(
            "speceyes_batch_errors", "Funnel batches that raised.", registry=r
        )
        self.phases = Histogram(
            "speceyes_phase_seconds",
            "Funnel time per query and phase (a batch's phase time shared among its queries).",
            ["phase"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.request_seconds = Histogram(
            "speceyes_request_seconds",
            "End-to-end latency of answered chat completion requests.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "speceyes_batch_size", "Queries per funnel batch.", buckets=BATCH_BUCKETS, registry=r
        )
        # Known label values start at zero so that rates exist before the first event.
        for status in STATUSES:
            self.requests.labels(status=status)
        for route in ROUTES:
            self.routes.labels(route=route)
        for phase in PHASES:
            self.phases.labels(phase=phase)

    def render(
        self,
        gauges: dict[str, tuple[str, float | None]],
        counters: dict[str, tuple[str, float]] | None = None,
    ) -> bytes:
        """The text exposition: the stored series plus values read now (None is NaN)."""
        now = CollectorRegistry()
        now.register(_Snapshot(gauges, counters or {}))
        return generate_latest(self.registry) + generate_latest(now)


class _Snapshot(Collector):
    """Gauges and counters whose values the server holds elsewhere, read at scrape time."""

    def __init__(
        self, gauges: dict[str, tuple[str, float | None]], counters: dict[str, tuple[str, float]]
    ) -> None:
        self.gauges, self.counters = gauges, counters

    def collect(self) -> Iterator[Metric]:
        for name, (help_, value) in self.counters.items():
            yield CounterMetricFamily(name, help_, value=value)
        for name, (help_, value) in self.gauges.items():
            yield GaugeMetricFamily(name, help_, value=math.nan if value is None else value)


# ---- images: pixels from the header before decoding ---------------------------------------
def _side(pixels: int) -> str:
    side = math.isqrt(pixels)
    return f"{side}x{side}"


def image_bytes(src: str | Path) -> bytes | Path:
    """The encoded image of a data URI (or the local path): nothing decoded yet."""
    return _decode_data_uri(src) if isinstance(src, str) else src


def header_pixels(data: bytes | Path) -> int:
    """Width x height from the image header alone; 0 when PIL cannot read one (load_image then
    says what is wrong). Opening reads the header only: the pixels are never decoded here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            with Image.open(io.BytesIO(data) if isinstance(data, bytes) else data) as img:
                return img.width * img.height
        except Image.DecompressionBombError:
            return sys.maxsize  # past PIL's own hard limit: past ours too
        except Exception:
            return 0


# ---- the server ---------------------------------------------------------------------------
class ServerClosing(Exception):
    pass


@dataclass(eq=False)
class _Item:
    query: Query
    future: asyncio.Future[tuple[Result, int, float]]
    enqueued: float
    pixels: int = 0  # decoded pixels this request holds in the server-wide budget
    started: bool = False  # handed to the funnel
    handed: float = 0.0
    batch_size: int = 0


@dataclass
class ServerState:
    funnel: Funnel
    batch_size: int
    max_wait: float  # seconds
    max_queue: int
    model_name: str
    request_timeout: float | None
    allow_local_files: bool
    api_key: str | None = None
    max_question_chars: int = limits.MAX_QUESTION_CHARS
    max_option_chars: int = limits.MAX_OPTION_CHARS
    max_image_pixels: int = limits.MAX_IMAGE_PIXELS
    max_pixels_in_flight: int = limits.MAX_PIXELS_IN_FLIGHT
    metrics: Metrics = field(default_factory=Metrics)
    waiting: deque[_Item] = field(default_factory=deque)
    pending: dict[str, _Item] = field(default_factory=dict)  # handed to the funnel, unanswered
    admitted: int = 0  # requests holding a queue slot: being read/decoded or waiting
    pixels_in_flight: int = 0
    closing: bool = False  # new requests get 503; admitted ones are still answered
    stopped: bool = False  # past the drain: nothing more is answered
    started_at: float = field(default_factory=time.time)
    decoder: ThreadPoolExecutor | None = None
    arrived: asyncio.Event | None = None
    want: asyncio.Event | None = None  # the funnel is ready for another batch
    handoff: queue.SimpleQueue[list[_Item] | None] = field(default_factory=queue.SimpleQueue)
    batcher: asyncio.Task[None] | None = None
    loop: asyncio.AbstractEventLoop | None = None

    @property
    def inflight(self) -> int:
        """Queries handed to the funnel and not answered yet."""
        return len(self.pending)

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self, _app: web.Application) -> None:
        self.loop = asyncio.get_running_loop()
        self.decoder = ThreadPoolExecutor(
            max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="speceyes-decode"
        )
        self.arrived, self.want = asyncio.Event(), asyncio.Event()
        self.batcher = self.loop.create_task(self._batch_loop())
        # A daemon thread, not an executor: a batch stuck in a model call must not keep the
        # process alive after SIGTERM (executor threads are joined at interpreter exit).
        threading.Thread(target=self._funnel_main, name="speceyes-funnel", daemon=True).start()

    async def drain(self, timeout: float) -> bool:
        """Refuse new requests (503) and wait up to ``timeout`` s for the admitted ones."""
        self.closing = True
        assert self.loop is not None
        deadline = self.loop.time() + timeout
        while self.admitted or self.pending:
            if self.loop.time() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    async def shutdown(self, _app: web.Application) -> None:
        """Stop admitting; requests not answered yet get 503."""
        self.closing = self.stopped = True
        closing = ServerClosing("the server is shutting down")
        while self.waiting:
            item = self.waiting.popleft()
            if not item.future.done():
                item.future.set_exception(closing)
        self._fail_pending(closing, count=False)

    async def cleanup(self, _app: web.Application) -> None:
        if self.batcher is not None:
            self.batcher.cancel()
            try:
                await self.batcher
            except asyncio.CancelledError:
                pass
        self.handoff.put(None)  # the funnel thread ends after its current model call
        if self.decoder is not None:
            self.decoder.shutdown(wait=False, cancel_futures=True)

    # ---- the funnel thread ----------------------------------------------------------------
    def _post(self, fn: Callable[..., None], *args: Any) -> bool:
        """Run ``fn`` on the event loop; False once the loop is gone."""
        assert self.loop is not None
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            return False
        return True

    def _funnel_main(self) -> None:
        want = self.want
        assert want is not None

        def batches() -> Iterator[list[Query]]:
            while self._post(want.set):
                batch = self.handoff.get()
                if batch is None:
                    return
                yield [it.query for it in batch]

        while True:
            try:
                # Looked up each time so that a wrapper installed on the funnel is seen.
                for r in self.funnel.iter_batches(batches()):
                    if not self._post(self._resolve, r):
                        return
                return  # the server closed the stream of batches
            except Exception as e:  # per-query errors are results: this is the funnel's own
                log.exception("speceyes serve: funnel failed; its unanswered queries get 500")
                if not self._post(self._fail_pending, e):
                    return

    # ---- batching (event loop) ------------------------------------------------------------
    async def _batch_loop(self) -> None:
        assert self.arrived is not None and self.want is not None
        loop = asyncio.get_running_loop()
        while True:
            await self.want.wait()
            self.want.clear()
            while not self.waiting:
                self.arrived.clear()
                await self.arrived.wait()
            # Wait for a full batch, but never past max_wait after the oldest request arrived:
            # under load the queue refills while the funnel works and the next batch is ready.
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
            now = loop.time()
            while self.waiting and len(batch) < self.batch_size:
                item = self.waiting.popleft()
                item.started, item.handed = True, now
                self.admitted -= 1
                self.pending[item.query.id] = item
                batch.append(item)
            for item in batch:
                item.batch_size = len(batch)
            self.metrics.batch_size.observe(len(batch))
            self.handoff.put(batch)

    def _release(self, item: _Item) -> None:
        self.pixels_in_flight -= item.pixels
        item.pixels = 0

    def _resolve(self, r: Result) -> None:
        item = self.pending.pop(r.id, None)
        if item is None:
            return
        self._release(item)
        self.metrics.routes.labels(route=r.route).inc()
        for p in PHASES:
            if p in r.timings:
                self.metrics.phases.labels(phase=p).observe(r.timings[p])
        if not item.future.done():  # done: the request timed out or was cancelled
            item.future.set_result((r, item.batch_size, item.handed - item.enqueued))

    def _fail_pending(self, e: BaseException, count: bool = True) -> None:
        if count and self.pending:
            self.metrics.batch_errors.inc()
        items = list(self.pending.values())
        self.pending.clear()
        for item in items:
            self._release(item)
            if not item.future.done():
                item.future.set_exception(e)

    # ---- handlers -------------------------------------------------------------------------
    async def _image(self, url: str) -> tuple[Any, int]:
        """The decoded image and its pixel count, held in the budget (released by the caller)."""
        loop = asyncio.get_running_loop()
        src = resolve_image(url, self.allow_local_files)
        try:
            data = await loop.run_in_executor(self.decoder, image_bytes, src)
            pixels = await loop.run_in_executor(self.decoder, header_pixels, data)
        except ImageError as e:
            raise RequestError(str(e), code="invalid_image", param="messages") from e
        if pixels > self.max_image_pixels:
            size = "too many" if pixels == sys.maxsize else f"{pixels}"
            raise RequestError(
                f"the image has {size} pixels; this server decodes at most "
                f"{self.max_image_pixels} (e.g. {_side(self.max_image_pixels)})",
                status=413,
                code="image_too_large",
                param="messages",
            )
        if self.pixels_in_flight + pixels > self.max_pixels_in_flight:
            raise RequestError(
                "server busy: the images of the requests in flight fill its decoding budget "
                f"({self.max_pixels_in_flight} pixels); retry later",
                status=429,
                code="pixel_budget",
                type="rate_limit_error",
            )
        self.pixels_in_flight += pixels  # reserved before decoding: admitted work is bounded
        try:
            image = await loop.run_in_executor(self.decoder, load_image, data)
        except BaseException as e:
            self.pixels_in_flight -= pixels
            if isinstance(e, ImageError):
                raise RequestError(str(e), code="invalid_image", param="messages") from e
            raise
        return image, pixels

    async def chat(self, request: web.Request) -> web.Response:
        loop = asyncio.get_running_loop()
        t_arrival = loop.time()
        rid = request[RID_KEY]
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
        pixels = 0
        try:
            try:
                body = json.loads(await request.read())
            except RecursionError as e:
                raise RequestError(
                    "the request body is nested too deeply", code="invalid_json"
                ) from e
            except (UnicodeDecodeError, ValueError) as e:
                raise RequestError(
                    f"the request body is not valid JSON ({e})", code="invalid_json"
                ) from e
            parsed = parse_chat_request(
                body,
                max_question_chars=self.max_question_chars,
                max_option_chars=self.max_option_chars,
            )
            image, pixels = await self._image(parsed.image_url)
            if self.stopped:  # admitted before a drain began, but the drain is over
                raise ServerClosing("the server is shutting down")
            query = Query(id=rid, image=image, question=parsed.question, options=parsed.options)
            item = _Item(query, loop.create_future(), loop.time(), pixels=pixels)
            pixels = 0  # the item holds them now
            self.waiting.append(item)
            assert self.arrived is not None
            self.arrived.set()
            timeout = None
            if self.request_timeout is not None:
                timeout = max(0.0, self.request_timeout - (loop.time() - t_arrival))
            try:
                # shield: a timeout must not cancel the shared future the funnel resolves.
                result, batch_size, queued = await asyncio.wait_for(
                    asyncio.shield(item.future), timeout
                )
            except TimeoutError:
                item.future.cancel()  # the funnel's result is then dropped unread
                return error_response(
                    504,
                    f"no answer within the request timeout ({self.request_timeout:g} s)",
                    code="request_timeout",
                    type="timeout_error",
                )
        except RequestError as e:
            headers = {"Retry-After": "1"} if e.status == 429 else None
            return error_response(
                e.status, e.message, code=e.code, type=e.type, param=e.param, headers=headers
            )
        except ServerClosing as e:
            return error_response(503, str(e), code="shutting_down", type="server_error")
        except web.HTTPException:
            raise  # e.g. 413 while reading the body: the middleware answers it as JSON
        except Exception:
            log.exception("speceyes serve: request %s failed", rid)
            return internal_error(rid)
        finally:
            self.pixels_in_flight -= pixels
            if item is None or not item.started:
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
                "judge": self.funnel.config.judge,
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
        body = self.metrics.render(
            {
                "speceyes_queue_depth": (
                    "Requests admitted and not yet in a batch.",
                    self.admitted,
                ),
                "speceyes_inflight": ("Queries handed to the funnel, unanswered.", self.inflight),
                "speceyes_pixels_in_flight": (
                    "Decoded image pixels held by admitted requests.",
                    self.pixels_in_flight,
                ),
                "speceyes_beta": ("Share of judged queries judged tool-free.", stats.beta),
                "speceyes_alpha": ("Gate acceptance among tool-free queries.", stats.alpha),
            },
            {"speceyes_funnel_queries_total": ("Queries the funnel has run.", stats.queries)},
        )
        return web.Response(
            body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
        )

    # ---- authentication, errors as OpenAI JSON, request counting --------------------------
    def _authorize(self, request: web.Request) -> None:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        expected = (self.api_key or "").encode()
        # Constant-time comparison: the time taken says nothing about how much of a guess matched.
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
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
    api_key: str | None = None,
    max_question_chars: int = limits.MAX_QUESTION_CHARS,
    max_option_chars: int = limits.MAX_OPTION_CHARS,
    max_image_pixels: int = limits.MAX_IMAGE_PIXELS,
    max_pixels_in_flight: int = limits.MAX_PIXELS_IN_FLIGHT,
) -> web.Application:
    """The aiohttp application serving ``funnel``; ``batch_size`` defaults to the funnel's.

    ``api_key``: when given, every endpoint but ``/health`` needs ``Authorization: Bearer``.
    """
    bs = funnel.config.batch_size if batch_size is None else batch_size
    if bs < 1:
        raise ValueError("batch_size must be at least 1")
    if max_queue < 1:
        raise ValueError("max_queue must be at least 1")
    if max_wait_ms < 0:
        raise ValueError("max_wait_ms must be >= 0")
    if request_timeout is not None and request_timeout <= 0:
        raise ValueError("request_timeout must be positive")
    if min(max_question_chars, max_option_chars, max_image_pixels) < 1:
        raise ValueError("max_question_chars, max_option_chars, max_image_pixels must be >= 1")
    if max_pixels_in_flight < max_image_pixels:
        raise ValueError("max_pixels_in_flight must be at least max_image_pixels")
    if api_key is not None and not api_key.strip():
        raise ValueError("api_key must not be empty")
    state = ServerState(
        funnel=funnel,
        batch_size=bs,
        max_wait=max_wait_ms / 1000.0,
        max_queue=max_queue,
        model_name=model_name,
        request_timeout=request_timeout,
        allow_local_files=allow_local_files,
        api_key=api_key,
        max_question_chars=max_question_chars,
        max_option_chars=max_option_chars,
        max_image_pixels=max_image_pixels,
        max_pixels_in_flight=max_pixels_in_flight,
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


def serve(
    funnel: Funnel,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    drain_timeout: float = 30.0,
    announce: Callable[[str], None] | None = None,
    **app_options: Any,
) -> int:
    """Serve until Ctrl-C or SIGTERM, then drain and shut down; returns an exit code.

    ``app_options`` are :func:`create_app`'s. On the signal the server stops accepting
    connections, answers 503 to new requests on open ones, gives admitted requests up to
    ``drain_timeout`` seconds to be answered, then exits (those still unanswered get 503).
    """
    app = create_app(funnel, **app_options)
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
