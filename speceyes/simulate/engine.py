"""The event engine: a heap of timed events, and continuous-batching servers that run one batch
step at a time for one model, or two sharing a GPU (the physics in :mod:`speceyes.simulate`)."""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable

from speceyes.simulate.costs import LARGE, SMALL, CostModel

# --- the event engine ------------------------------------------------------------------------

Callback = Callable[[int, float], None]


class _Sim:
    __slots__ = ("heap", "seq")

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, Callable[[int, float], None], int]] = []
        self.seq = 0

    def at(self, t: float, fn: Callable[[int, float], None], arg: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, fn, arg))

    def run(self) -> None:
        heap, pop = self.heap, heapq.heappop
        while heap:
            t, _, fn, arg = pop(heap)
            fn(arg, t)


class _Model:
    """One model's share of an engine: its step costs, limits, queue and running sequences."""

    __slots__ = (
        "table", "max_batch", "kv", "kv_read", "budget", "waiting", "count", "kv_used",
        "request_s", "latency", "warm_block", "text_prefill", "gather",
    )

    def __init__(self, costs: CostModel, cls: int) -> None:
        self.table = costs.step_table(cls)
        self.request_s = costs.request_s(cls)  # serial per request, in the step it joins
        self.latency = costs.request_latency_s(cls)  # beside the engine, before it joins
        # warm_cache: every prompt but its last partial block (of this many tokens) is cached
        warm = costs.warm_prefill_s(cls, 1) is not None
        self.warm_block = costs.cache_block_tokens if warm else 0
        self.text_prefill = costs.prefill_s(cls, 1)  # seconds per text token
        # An idle engine takes every request that arrives at the same instant into its first
        # step, as a real scheduler takes every waiting request. The original engine starts on
        # the first one (the others join a step later); that is kept where none of the CPU
        # terms is used, so the earlier figures stay as they were.
        self.gather = costs.agent_workload == "search" or costs.warm_cache or any(
            (costs.request_s(k), costs.request_latency_s(k)) != (0.0, 0.0) for k in (LARGE, SMALL)
        )
        self.max_batch = costs.large_max_batch if cls == LARGE else costs.small_max_batch
        self.kv = costs.kv_tokens(cls)
        self.kv_read = costs.kv_read(cls)
        self.budget = costs.prefill_budget_tokens
        self.waiting: deque[tuple[int, float, int, int, Callback, int]] = deque()
        self.count = 0
        self.kv_used = 0

    def room(self, ctx: int) -> bool:
        """A new sequence fits: a batch slot and KV space (an empty model takes any request)."""
        return self.count < self.max_batch and (not self.count or self.kv_used + ctx <= self.kv)


class _Engine:
    """A continuous-batching server for one or two models (two = a shared GPU: each step runs
    both models' parts, so its time is the sum; each model keeps its own queue and limits)."""

    def __init__(self, sim: _Sim, models: dict[int, _Model]) -> None:
        self.sim = sim
        self.models = models
        self.active: list[tuple[int, int, int, int, Callback, int]] = []  # (finish step, seq, ...)
        self.n = 0
        self.step = 0  # completed steps at the current segment's start
        self.busy = False
        self.in_event = False
        self.gather = any(m.gather for m in models.values())
        self.kick = False  # a start at the current instant is scheduled (gather)
        self.cpu_waiting: deque[tuple[float, Callback, int]] = deque()
        self.version = 0
        self.seq = 0
        self.t0 = self.first = self.dec = 0.0
        self.end_step = 0
        self.busy_time = 0.0
        self.batch_time = 0.0
        self.jobs = 0

    def submit(
        self, t: float, cls: int, tokens: int, prefill_s: float, n_decode: int, ctx: int,
        cb: Callback, q: int,
    ) -> None:
        """A request of ``tokens`` prefill tokens (``prefill_s`` seconds), ``n_decode`` decoded
        tokens and ``ctx`` tokens of KV cache while it runs; ``cb(q, t)`` when it is done. A
        model with a per-request latency (client, HTTP) holds it that long before it joins."""
        lat = self.models[cls].latency
        if lat > 0:
            self.sim.at(t + lat, lambda q_, t_: self._enqueue(
                t_, cls, tokens, prefill_s, n_decode, ctx, cb, q_), q)
            return
        self._enqueue(t, cls, tokens, prefill_s, n_decode, ctx, cb, q)

    def _enqueue(
        self, t: float, cls: int, tokens: int, prefill_s: float, n_decode: int, ctx: int,
        cb: Callback, q: int,
    ) -> None:
        m = self.models[cls]
        m.waiting.append((tokens, prefill_s, n_decode, ctx, cb, q))
        self.jobs += 1
        if self.in_event:  # the boundary being processed admits it
            return
        if not self.busy:
            if not self.gather:
                self._plan(t)
            elif not self.kick:  # start after the other arrivals of this instant
                self.kick = True
                self.sim.at(t, self._start, 0)
            return
        if len(m.waiting) > 1 or not m.room(ctx):
            return  # joins when a sequence leaves (or after the ones queued before it)
        self._join_next(t)

    @property
    def idle(self) -> bool:
        """No step running and none about to start at this instant."""
        return not self.busy and not self.kick

    def submit_cpu(self, t: float, seconds: float, cb: Callback, q: int) -> None:
        """``seconds`` of CPU work on this engine's device that is no model call (a CPU
        server's clients share its cores): paid serially in the next step, as a prefill is,
        without a sequence; ``cb(q, t)`` when that step's first token would be out."""
        self.cpu_waiting.append((seconds, cb, q))
        if self.in_event:
            return
        if not self.busy:
            if not self.kick:
                self.kick = True
                self.sim.at(t, self._start, 0)
            return
        if len(self.cpu_waiting) == 1:
            self._join_next(t)

    def _join_next(self, t: float) -> None:
        """Work waiting joins at the first step boundary at or after t: cut the segment."""
        rel = t - self.t0
        j = 1 if rel <= self.first else 1 + math.ceil((rel - self.first) / self.dec)
        if self.step + j < self.end_step:
            self.end_step = self.step + j
            self.version += 1
            self.sim.at(max(t, self.t0 + self.first + (j - 1) * self.dec), self._boundary,
                        self.version)

    def _start(self, _: int, t: float) -> None:
        self.kick = False
        if not self.busy:
            self._plan(t)

    def _boundary(self, version: int, t: float) -> None:
        if version != self.version:
            return  # a segment that was cut short
        dt = t - self.t0
        self.busy_time += dt
        self.batch_time += self.n * dt
        self.step = step = self.end_step
        act = self.active
        done = []
        while act and act[0][0] <= step:
            _, _, cls, ctx, cb, q = heapq.heappop(act)
            m = self.models[cls]
            m.count -= 1
            m.kv_used -= ctx
            self.n -= 1
            done.append((cb, q))
        self.in_event = True
        for cb, q in done:
            cb(q, t)
        self.in_event = False
        self._plan(t)

    def _plan(self, t: float) -> None:
        act = self.active
        pre, more = 0.0, False
        for cls, m in self.models.items():
            w, budget, admitted = m.waiting, m.budget, 0
            while w:
                tokens, prefill_s, n_decode, ctx, cb, q = w[0]
                if not m.room(ctx):
                    break  # waits for a sequence of this model to leave
                if admitted and tokens > budget:
                    more = True  # the rest waits for the next step (chunked-prefill budget)
                    break
                w.popleft()
                budget -= tokens
                if m.warm_block:
                    prefill_s = (tokens % m.warm_block or 1) * m.text_prefill
                pre += prefill_s + m.request_s
                admitted += 1
                self.seq += 1
                heapq.heappush(act, (self.step + n_decode, self.seq, cls, ctx, cb, q))
                m.count += 1
                m.kv_used += ctx
                self.n += 1
        cpu: list[tuple[Callback, int]] = []
        while self.cpu_waiting:
            seconds, cb, q = self.cpu_waiting.popleft()
            pre += seconds
            cpu.append((cb, q))
        if not self.n and not cpu:
            self.busy = False
            return
        self.busy = True
        dec = 0.0
        for m in self.models.values():
            if m.count:
                dec += m.table[m.count] + m.kv_used * m.kv_read
        self.t0, self.dec, self.first = t, dec, dec + pre
        end = act[0][0] if self.n else self.step + 1  # CPU work alone: one step of it
        if more:
            end = self.step + 1  # admit the rest at the next boundary
        self.end_step = end
        self.version += 1
        self.sim.at(t + self.first + (end - self.step - 1) * dec, self._boundary, self.version)
        for cb, q in cpu:
            self.sim.at(t + self.first, cb, q)


def _stats(e: _Engine, makespan: float) -> dict[str, float]:
    return {
        "mean_batch": e.batch_time / e.busy_time if e.busy_time > 0 else 0.0,
        "utilisation": e.busy_time / makespan if makespan > 0 else 0.0,
        "busy_s": e.busy_time,
        "jobs": float(e.jobs),
    }
