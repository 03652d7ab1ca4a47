"""The server's state and its machinery off the HTTP handlers: the admission queue, the batcher
on the event loop that hands micro-batches to the funnel, the funnel's own thread, and the
start, drain and shutdown of all three.

A request that timed out is not computed unread: its query is dropped from a batch not yet
started, and an agent loop is not started for it (the funnel's agent is wrapped while the
server runs). Work already under way in a model call finishes and is discarded."""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from aiohttp import web

from speceyes import limits
from speceyes.serve.body import ByteBudget
from speceyes.serve.metrics import Metrics
from speceyes.types import PHASES, Query, Result
from speceyes.usertext import TextRules

if TYPE_CHECKING:
    from speceyes.funnel import Funnel

log = logging.getLogger(__package__)  # one logger for the server: speceyes.serve


class ServerClosing(Exception):
    pass


class Abandoned(Exception):
    """The query's request timed out before the funnel started its agent loop."""


@dataclass(eq=False)
class _Item:
    query: Query
    future: asyncio.Future[tuple[Result, int, float]]
    enqueued: float
    # loop time its request reached the handler, before its body was read and decoded: the
    # query's time before the funnel counts from here (under --judge auto that time is part of
    # its time in the system, and the app's own decoding competes with the funnel's front)
    arrived: float
    deadline: float | None = None  # loop time past which nobody waits for the answer
    pixels: int = 0  # decoded pixels this request holds in the server-wide budget
    started: bool = False  # handed to the funnel
    handed: float = 0.0
    batch_size: int = 0
    abandoned: bool = False  # the request timed out: the answer would go unread
    skipped: bool = False  # and the funnel dropped the query before computing it (all of it)

    def gone(self, now: float) -> bool:
        return self.abandoned or (self.deadline is not None and now >= self.deadline)


class _SkipAbandoned:
    """The funnel's agent, except that no loop is started for a query whose request is gone:
    that loop ends at once with an error nobody reads."""

    def __init__(self, agent: Any, gone: Callable[[str], bool]) -> None:
        self._agent, self._gone = agent, gone

    def start_loop(self, query: Query) -> Any:
        if self._gone(query.id):
            raise Abandoned("the request timed out before its agent loop started")
        return self._agent.start_loop(query)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)


@dataclass
class ServerState:
    """What the server holds while it runs: its limits, the requests admitted, waiting and handed
    to the funnel, the decoded-pixel budget, and the batcher and funnel thread that serve them."""

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
    max_text_tokens: int = limits.MAX_TEXT_TOKENS
    max_body_bytes: int = int(limits.MAX_BODY_MB * (1 << 20))
    body_timeout: float = limits.BODY_TIMEOUT_S
    body_budget: ByteBudget = field(
        default_factory=lambda: ByteBudget(int(limits.MAX_BODY_MB_IN_FLIGHT * (1 << 20)))
    )
    text_rules: TextRules = field(default_factory=TextRules)  # the served models' tokenizers
    metrics: Metrics = field(default_factory=Metrics)
    waiting: deque[_Item] = field(default_factory=deque)
    pending: dict[str, _Item] = field(default_factory=dict)  # handed to the funnel, unanswered
    admitted: int = 0  # requests holding a queue slot: body in, being parsed/decoded or waiting
    reading: int = 0  # requests whose body is being read (they hold bytes, not a slot)
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
    _agent_wrap: _SkipAbandoned | None = None
    _funnel_thread: threading.Thread | None = None

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
        agent = getattr(self.funnel, "agent", None)
        if agent is not None and hasattr(agent, "start_loop"):
            self._agent_wrap = _SkipAbandoned(agent, self._query_gone)
            self.funnel.agent = self._agent_wrap
        self.batcher = self.loop.create_task(self._batch_loop())
        if hasattr(self.funnel, "waiting"):  # --judge auto's load: the queue counts in it
            self.funnel.waiting = lambda: self.admitted
        # A daemon thread, not an executor: a batch stuck in a model call must not keep the
        # process alive after SIGTERM (executor threads are joined at interpreter exit).
        self._funnel_thread = threading.Thread(
            target=self._funnel_main, name="speceyes-funnel", daemon=True
        )
        self._funnel_thread.start()

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
        if self._funnel_thread is not None:
            # Wait for it, up to a bound: a daemon thread still inside a model call when the
            # interpreter finalises can abort the process (SIGABRT) instead of a clean exit,
            # while one stuck past the bound must not keep the server from stopping.
            await asyncio.to_thread(self._funnel_thread.join, limits.FUNNEL_JOIN_S)
        if self.decoder is not None:
            self.decoder.shutdown(wait=False, cancel_futures=True)
        wrap = self._agent_wrap
        if wrap is not None and getattr(self.funnel, "agent", None) is wrap:
            self.funnel.agent = wrap._agent  # the funnel as it was given

    # ---- the funnel thread ----------------------------------------------------------------
    def _post(self, fn: Callable[..., None], *args: Any) -> bool:
        """Run ``fn`` on the event loop; False once the loop is gone."""
        assert self.loop is not None
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            return False
        return True

    def _query_gone(self, query_id: str) -> bool:
        """Whether nobody waits for this query's answer any more (called from the funnel's
        threads: a dict lookup, the monotonic clock and the item's own flag)."""
        item = self.pending.get(query_id)
        assert self.loop is not None
        if item is None or not item.gone(self.loop.time()):
            return False
        item.skipped = True
        return True

    def _funnel_main(self) -> None:
        want = self.want
        assert want is not None and self.loop is not None
        loop = self.loop

        def batches() -> Iterator[list[Query]]:
            while self._post(want.set):
                batch = self.handoff.get()
                if batch is None:
                    return
                now = loop.time()
                dropped = [it for it in batch if it.gone(now)]
                if dropped and not self._post(self._drop, dropped):
                    return
                if len(dropped) < len(batch):
                    yield [
                        replace(it.query, queued_s=max(0.0, now - it.arrived))
                        for it in batch
                        if it not in dropped
                    ]

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

    def _drop(self, items: list[_Item]) -> None:
        """Forget queries the funnel will not compute (their requests timed out)."""
        for item in items:
            if self.pending.pop(item.query.id, None) is not None:
                self._release(item)
                self.metrics.abandoned.inc()

    def _release(self, item: _Item) -> None:
        self.pixels_in_flight -= item.pixels
        item.pixels = 0

    def _resolve(self, r: Result) -> None:
        item = self.pending.pop(r.id, None)
        if item is None:
            return
        self._release(item)
        if item.skipped and r.error and not r.answer:  # no agent loop ran: nothing to count
            self.metrics.abandoned.inc()
            return
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
