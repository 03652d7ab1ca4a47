"""Discrete-event model of serving the SpecEyes funnel: compare schedules at scale, no GPU.

Physics. An engine is a continuous-batching server that runs one batch step at a time. A request
(one model call: a prefill of P tokens, then N decoded tokens) joins the running batch at a step
boundary, if the batch has room (``max_batch``) and the step's prefill token budget allows; its
prefill is paid in the step it joins, which also yields its first token, so it finishes N steps
later. A step with ``b`` sequences takes ``t(b) = t1 * (1 + gamma*(b-1))`` (or a measured curve)
plus ``per_token * P`` for the prefills joining in it: decode is memory-bound, so batching it is
nearly free at small ``b``; prefill is compute-bound, so it is linear in tokens whatever the batch.

Between two events (a request joins or leaves) the batch is constant, so the simulator jumps from
event to event instead of stepping token by token: about two heap events per request.

Schedules (same engines, same cost model, same per-query random draws - common random numbers):

- ``agent-only``: every query runs the agent loop on the large engine; many loops in flight, each
  loop's next turn is submitted when the previous one returns (plus the tool's CPU time).
- ``published``: the authors' code. Queries are taken in batches (``published_batch``, default B =
  the concurrency C): phase I as one batched call, then phase II over the judged tool-free ones,
  the gate, then phase IV's agent loops ONE QUERY AT A TIME, then the next batch.
- ``speceyes`` (ours): phases I and II overlapped (the small model answers while the large model
  judges), instant gate, accepted answers return at once, the rest join the large engine's
  continuous batch as agent loops; everything concurrent, bounded by the C clients.

Workload: a closed loop of C clients; each sends its next query when its previous one returns,
until ``n_queries`` have been sent. Throughput = n_queries / makespan.

The ideal is ``throughput(agent-only, C) / (1 - beta*alpha)``; the analytic batch-1 latency is
``E[L] = c_J + beta*c_S + (1 - beta*alpha)*L_agent`` (DESIGN.md section 1).
"""

from __future__ import annotations

import csv
import heapq
import json
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

SCHEDULES: tuple[str, ...] = ("agent-only", "published", "speceyes")
IDEAL = "ideal"
DEFAULT_CONCURRENCIES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEFAULT_BETA = 0.8
DEFAULT_ALPHA = 0.71
MD_FILE, CSV_FILE, PNG_FILE = "simulate.md", "simulate.csv", "simulate.png"

LARGE, SMALL = 0, 1  # model classes on an engine


@dataclass
class CostModel:
    """Costs of the paper's setting: Qwen2.5-VL-7B agent/judge and Qwen3-VL-2B small model, bf16,
    one A100-80GB each. Assumptions (override any field from JSON, see :meth:`from_json`):

    - large decode step 25 ms at batch 1 (HF-generate-like 25-30 ms/token; a tuned vLLM is ~12 ms:
      every schedule gets the same engine, so only the schedule differs), ``gamma`` 0.06 per extra
      sequence (decode is memory-bound: 64 sequences cost ~4.8x one), at most 64 sequences (KV
      cache for ~3-5k-token multimodal contexts on 80 GB);
    - large prefill 0.12 ms/token (~8k tokens/s incl. the ViT), linear in tokens, at most 8192
      prefill tokens joining per step (a chunked-prefill budget);
    - the 2B small model is ~3x cheaper per decode step and per prefill token;
    - an image is 1,500 visual tokens (V* is ~4.5k, POPE ~0.4k); prompt text 120 (judge), 80
      (small), 350 (DeepEyes tool prompt);
    - judge = one prefill + 1 token (the logit judge); small answer = prefill + 5 tokens;
    - agent = K tool calls (P(K=0..5) below, mean 1.83) + the answer turn, so ~2.8 turns; each turn
      decodes U[100, 300] tokens; a tool turn re-prefills the crop (600 tokens) and 60 tokens of
      tool text (prefix caching keeps the history); each tool call spends 10 ms on the CPU.
    """

    large_decode_s: float = 0.025
    large_gamma: float = 0.06
    large_prefill_s_per_token: float = 1.2e-4
    large_max_batch: int = 64
    large_batch_curve: list[list[float]] | None = None  # [[b, t(b)/t(1)], ...] overrides gamma
    small_decode_s: float = 0.008
    small_gamma: float = 0.06
    small_prefill_s_per_token: float = 4e-5
    small_max_batch: int = 64
    small_batch_curve: list[list[float]] | None = None
    prefill_budget_tokens: int = 8192
    shared_gpu: bool = False  # both models on one GPU: their steps run one after the other

    image_tokens: int = 1500
    judge_image_tokens: int | None = None  # None: the full image; less models a downscaled judge
    judge_text_tokens: int = 120
    small_text_tokens: int = 80
    agent_text_tokens: int = 350
    judge_decode_tokens: int = 1
    small_decode_tokens: int = 5
    tool_call_probs: list[float] = field(
        default_factory=lambda: [0.10, 0.35, 0.30, 0.15, 0.07, 0.03]
    )
    turn_tokens_min: int = 100
    turn_tokens_max: int = 300
    crop_tokens: int = 600
    tool_text_tokens: int = 60
    tool_s: float = 0.01

    def validate(self) -> None:
        p = np.asarray(self.tool_call_probs, dtype=np.float64)
        if p.ndim != 1 or p.size == 0 or (p < 0).any() or abs(p.sum() - 1.0) > 1e-6:
            raise ValueError(f"tool_call_probs must be probabilities summing to 1, got {p}")
        if min(self.large_decode_s, self.small_decode_s) <= 0:
            raise ValueError("decode step times must be positive")
        if min(self.large_prefill_s_per_token, self.small_prefill_s_per_token, self.tool_s) < 0:
            raise ValueError("prefill and tool costs must be non-negative")
        if min(self.large_max_batch, self.small_max_batch, self.prefill_budget_tokens) < 1:
            raise ValueError("max batch and prefill budget must be >= 1")
        if min(self.judge_decode_tokens, self.small_decode_tokens, self.turn_tokens_min) < 1:
            raise ValueError("every model call decodes at least one token")
        if self.turn_tokens_max < self.turn_tokens_min:
            raise ValueError("turn_tokens_max < turn_tokens_min")
        for curve in (self.large_batch_curve, self.small_batch_curve):
            if curve is not None:
                _curve_table(curve, 2)  # raises on a malformed curve

    # --- derived batch-1 costs (seconds) -------------------------------------------------------
    def step_table(self, cls: int) -> list[float]:
        """Decode-step seconds for 0..max_batch sequences of one model class."""
        if cls == LARGE:
            t1, gamma, curve, mb = (
                self.large_decode_s, self.large_gamma, self.large_batch_curve, self.large_max_batch
            )
        else:
            t1, gamma, curve, mb = (
                self.small_decode_s, self.small_gamma, self.small_batch_curve, self.small_max_batch
            )
        mb = max(mb, self.large_max_batch if self.shared_gpu else 0)
        if curve is not None:
            factors = _curve_table(curve, mb)
        else:
            factors = [0.0] + [1.0 + gamma * (b - 1) for b in range(1, mb + 1)]
        return [t1 * f for f in factors]

    def judge_s(self) -> float:
        return self.judge_prefill_tokens * self.large_prefill_s_per_token + (
            self.judge_decode_tokens * self.step_table(LARGE)[1]
        )

    def small_s(self) -> float:
        return self.small_prefill_tokens * self.small_prefill_s_per_token + (
            self.small_decode_tokens * self.step_table(SMALL)[1]
        )

    def mean_tool_calls(self) -> float:
        return float(np.dot(np.arange(len(self.tool_call_probs)), self.tool_call_probs))

    def agent_s(self) -> float:
        """Mean agent-loop seconds at batch 1."""
        k = self.mean_tool_calls()
        tokens = (k + 1) * 0.5 * (self.turn_tokens_min + self.turn_tokens_max)
        prefill = self.agent_prefill_tokens + k * self.tool_turn_prefill_tokens
        return (
            prefill * self.large_prefill_s_per_token
            + tokens * self.step_table(LARGE)[1]
            + k * self.tool_s
        )

    @property
    def judge_prefill_tokens(self) -> int:
        img = self.image_tokens if self.judge_image_tokens is None else self.judge_image_tokens
        return img + self.judge_text_tokens

    @property
    def small_prefill_tokens(self) -> int:
        return self.image_tokens + self.small_text_tokens

    @property
    def agent_prefill_tokens(self) -> int:
        return self.image_tokens + self.agent_text_tokens

    @property
    def tool_turn_prefill_tokens(self) -> int:
        return self.crop_tokens + self.tool_text_tokens

    # --- loading -------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostModel:
        """Field overrides, plus an optional ``measured`` block of per-query mean seconds at batch
        1 from real runs (``judge_s``, ``small_s``, ``agent_s``, e.g. the timings that
        ``speceyes eval`` logs): the large model's per-token prefill and decode step are solved
        from judge_s and agent_s (two linear equations, token counts as modelled), and the small
        model's two costs are scaled together to match small_s."""
        data = dict(data)
        measured = data.pop("measured", None)
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown cost fields: {', '.join(unknown)}")
        costs = cls(**data)
        if measured:
            costs = costs.calibrated(**measured)
        costs.validate()
        return costs

    @classmethod
    def from_json(cls, path: str | Path) -> CostModel:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object of cost fields")
        return cls.from_dict(data)

    def calibrated(
        self,
        judge_s: float | None = None,
        small_s: float | None = None,
        agent_s: float | None = None,
    ) -> CostModel:
        c = replace(self)
        f1 = c.step_table(LARGE)[1] / c.large_decode_s  # curve factor at b=1 (1 for gamma)
        if judge_s is not None and agent_s is not None:
            k = c.mean_tool_calls()
            tokens = (k + 1) * 0.5 * (c.turn_tokens_min + c.turn_tokens_max)
            a = np.array(
                [
                    [c.judge_prefill_tokens, c.judge_decode_tokens * f1],
                    [c.agent_prefill_tokens + k * c.tool_turn_prefill_tokens, tokens * f1],
                ],
                dtype=np.float64,
            )
            rhs = np.array([judge_s, agent_s - k * c.tool_s])
            pp, dec = np.linalg.solve(a, rhs)
            if pp < 0 or dec <= 0:
                raise ValueError(
                    f"measured judge_s={judge_s}, agent_s={agent_s} do not fit the token counts "
                    f"(prefill {pp:.3g} s/token, decode {dec:.3g} s/step): adjust image_tokens "
                    "or turn_tokens_*"
                )
            c.large_prefill_s_per_token, c.large_decode_s = float(pp), float(dec)
        elif judge_s is not None or agent_s is not None:
            # one number: scale both large-model costs together to match it
            target, model = (judge_s, c.judge_s()) if judge_s is not None else (agent_s, c.agent_s())
            s = float(target) / model
            c.large_prefill_s_per_token *= s
            c.large_decode_s *= s
        if small_s is not None:
            s = float(small_s) / c.small_s()
            c.small_prefill_s_per_token *= s
            c.small_decode_s *= s
        return c


def _curve_table(curve: Sequence[Sequence[float]], max_batch: int) -> list[float]:
    """Step-time factors for 0..max_batch from measured [b, t(b)/t(1)] points: piecewise linear,
    extended past the last point along the last segment (never flat: that would be free batching)."""
    pts = sorted((float(b), float(f)) for b, f in curve)
    if not pts or pts[0][0] > 1 or any(f <= 0 for _, f in pts):
        raise ValueError("batch curve needs positive [b, factor] points starting at b <= 1")
    bs = np.array([b for b, _ in pts])
    fs = np.array([f for _, f in pts])
    out = [0.0]
    slope = (fs[-1] - fs[-2]) / (bs[-1] - bs[-2]) if len(pts) > 1 else 0.0
    for b in range(1, max_batch + 1):
        f = np.interp(b, bs, fs) if b <= bs[-1] else fs[-1] + slope * (b - bs[-1])
        out.append(float(f))
    return out


# --- per-query random draws ------------------------------------------------------------------


@dataclass
class Draws:
    """What each query will do, drawn once per seed and shared by every schedule and C."""

    tool: np.ndarray  # judge says "tool" (prob 1 - beta)
    accept: np.ndarray  # the gate accepts the small answer (prob alpha)
    turns: np.ndarray  # agent turns = tool calls + 1
    turn_tokens: np.ndarray  # (n, max turns) decoded tokens per turn


def draw(costs: CostModel, n: int, beta: float, alpha: float, seed: int) -> Draws:
    if not (0.0 <= beta <= 1.0 and 0.0 <= alpha <= 1.0):
        raise ValueError(f"beta and alpha must be in [0, 1], got {beta}, {alpha}")
    rng = np.random.default_rng(seed)
    # uniforms first, thresholds after: changing beta/alpha keeps every other draw (fair sweeps)
    u_judge, u_gate = rng.random(n), rng.random(n)
    probs = np.asarray(costs.tool_call_probs, dtype=np.float64)
    k = rng.choice(probs.size, size=n, p=probs / probs.sum())
    tokens = rng.integers(
        costs.turn_tokens_min, costs.turn_tokens_max + 1, size=(n, probs.size)
    )
    return Draws(tool=u_judge >= beta, accept=u_gate < alpha, turns=k + 1, turn_tokens=tokens)


def agent_latency_b1(costs: CostModel, d: Draws) -> np.ndarray:
    """Each query's agent-loop seconds alone on the engine (batch 1): the sum of its turn costs."""
    dec1 = costs.step_table(LARGE)[1]
    mask = np.arange(d.turn_tokens.shape[1])[None, :] < d.turns[:, None]
    tokens = (d.turn_tokens * mask).sum(axis=1)
    k = d.turns - 1
    prefill = costs.agent_prefill_tokens + k * costs.tool_turn_prefill_tokens
    return prefill * costs.large_prefill_s_per_token + tokens * dec1 + k * costs.tool_s


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


class _Engine:
    """A continuous-batching server for one or two model classes (two = a shared GPU: each step
    runs both models' decode steps, so its time is the sum)."""

    def __init__(
        self, sim: _Sim, tables: dict[int, list[float]], prefill: dict[int, float],
        max_batch: int, budget: int,
    ) -> None:
        self.sim = sim
        self.single = len(tables) == 1
        self.tables = tables
        self.table = next(iter(tables.values()))
        self.pp = prefill
        self.max_batch = max_batch
        self.budget = budget
        self.active: list[tuple[int, int, int, Callback, int]] = []  # (finish step, seq, cls, ...)
        self.waiting: deque[tuple[int, int, int, Callback, int]] = deque()
        self.counts = dict.fromkeys(tables, 0)
        self.n = 0
        self.step = 0  # completed steps at the current segment's start
        self.busy = False
        self.in_event = False
        self.version = 0
        self.seq = 0
        self.t0 = self.first = self.dec = 0.0
        self.end_step = 0
        self.busy_time = 0.0
        self.batch_time = 0.0
        self.jobs = 0

    def submit(self, t: float, cls: int, tokens: int, n_decode: int, cb: Callback, q: int) -> None:
        self.waiting.append((cls, tokens, n_decode, cb, q))
        self.jobs += 1
        if self.in_event:  # the boundary being processed admits it
            return
        if not self.busy:
            self._plan(t)
            return
        if self.n >= self.max_batch:
            return  # joins when a sequence leaves
        # join at the first step boundary at or after t: cut the current segment there
        rel = t - self.t0
        j = 1 if rel <= self.first else 1 + math.ceil((rel - self.first) / self.dec)
        if self.step + j < self.end_step:
            self.end_step = self.step + j
            self.version += 1
            self.sim.at(max(t, self.t0 + self.first + (j - 1) * self.dec), self._boundary,
                        self.version)

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
            _, _, cls, cb, q = heapq.heappop(act)
            self.counts[cls] -= 1
            self.n -= 1
            done.append((cb, q))
        self.in_event = True
        for cb, q in done:
            cb(q, t)
        self.in_event = False
        self._plan(t)

    def _plan(self, t: float) -> None:
        w, act = self.waiting, self.active
        budget, pre, admitted = self.budget, 0.0, 0
        while w and self.n < self.max_batch:
            if admitted and w[0][1] > budget:
                break  # the rest waits for the next step (chunked-prefill budget)
            cls, tokens, n_decode, cb, q = w.popleft()
            budget -= tokens
            pre += tokens * self.pp[cls]
            admitted += 1
            self.seq += 1
            heapq.heappush(act, (self.step + n_decode, self.seq, cls, cb, q))
            self.counts[cls] += 1
            self.n += 1
        if not self.n:
            self.busy = False
            return
        self.busy = True
        if self.single:
            dec = self.table[self.n]
        else:
            dec = sum(self.tables[c][k] for c, k in self.counts.items() if k)
        self.t0, self.dec, self.first = t, dec, dec + pre
        end = act[0][0]
        if w and self.n < self.max_batch:
            end = self.step + 1  # admit the rest at the next boundary
        self.end_step = end
        self.version += 1
        self.sim.at(t + self.first + (end - self.step - 1) * dec, self._boundary, self.version)


# --- schedules -------------------------------------------------------------------------------


@dataclass
class RunResult:
    schedule: str
    concurrency: int
    issued: np.ndarray
    finished: np.ndarray
    engines: dict[str, dict[str, float]]

    @property
    def latencies(self) -> np.ndarray:
        return self.finished - self.issued

    @property
    def makespan(self) -> float:
        return float(self.finished.max()) if self.finished.size else 0.0


class _Run:
    def __init__(
        self, schedule: str, costs: CostModel, d: Draws, concurrency: int,
        published_batch: int | None,
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}; choose from {', '.join(SCHEDULES)}")
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        self.schedule, self.c, self.costs = schedule, concurrency, costs
        self.sim = sim = _Sim()
        lt, st = costs.step_table(LARGE), costs.step_table(SMALL)
        lp, sp = costs.large_prefill_s_per_token, costs.small_prefill_s_per_token
        if costs.shared_gpu:
            self.large = self.small = _Engine(
                sim, {LARGE: lt, SMALL: st}, {LARGE: lp, SMALL: sp},
                costs.large_max_batch, costs.prefill_budget_tokens,
            )
        else:
            self.large = _Engine(
                sim, {LARGE: lt}, {LARGE: lp}, costs.large_max_batch, costs.prefill_budget_tokens
            )
            self.small = _Engine(
                sim, {SMALL: st}, {SMALL: sp}, costs.small_max_batch, costs.prefill_budget_tokens
            )
        # python lists: scalar indexing is several times faster than numpy's
        self.tool = d.tool.tolist()
        self.accept = d.accept.tolist()
        self.turns = d.turns.tolist()
        self.tt = d.turn_tokens.tolist()
        self.n = len(self.tool)
        self.turn = [0] * self.n
        self.state = [0] * self.n
        self.issued = np.zeros(self.n)
        self.finished = np.zeros(self.n)
        self.next_q = 0
        self.pub_batch = published_batch or concurrency
        self.pending: list[int] = []
        self.pub_busy = False
        self.batch: list[int] = []
        self.outstanding = 0
        self.serial: deque[int] = deque()
        self.start_query: Callable[[int, float], None] = {
            "agent-only": self._agent_start,
            "published": self._pub_enqueue,
            "speceyes": self._spec_start,
        }[schedule]

    def run(self) -> RunResult:
        if self.schedule == "published":
            self.pub_busy = True  # collect the first C queries before the first batch
        for _ in range(min(self.c, self.n)):
            self._issue(0.0)
        if self.schedule == "published":
            self._pub_batch(0.0)
        self.sim.run()
        engines = {"large": _stats(self.large, self.makespan)}
        engines["small"] = _stats(self.small, self.makespan)
        return RunResult(self.schedule, self.c, self.issued, self.finished, engines)

    @property
    def makespan(self) -> float:
        return float(self.finished.max()) if self.n else 0.0

    def _issue(self, t: float) -> None:
        q = self.next_q
        self.next_q += 1
        self.issued[q] = t
        self.start_query(q, t)

    def _complete(self, q: int, t: float) -> None:
        self.finished[q] = t
        if self.next_q < self.n:  # closed loop: this client sends its next query now
            self._issue(t)

    # agent loop (phase IV), shared by all schedules
    def _agent_start(self, q: int, t: float) -> None:
        self.turn[q] = 0
        self.large.submit(
            t, LARGE, self.costs.agent_prefill_tokens, self.tt[q][0], self._agent_turn_done, q
        )

    def _agent_turn_done(self, q: int, t: float) -> None:
        k = self.turn[q] + 1
        if k >= self.turns[q]:
            self._agent_done(q, t)
            return
        self.turn[q] = k
        if self.costs.tool_s > 0:
            self.sim.at(t + self.costs.tool_s, self._agent_next, q)  # the crop runs on the CPU
        else:
            self._agent_next(q, t)

    def _agent_next(self, q: int, t: float) -> None:
        self.large.submit(
            t, LARGE, self.costs.tool_turn_prefill_tokens, self.tt[q][self.turn[q]],
            self._agent_turn_done, q,
        )

    def _agent_done(self, q: int, t: float) -> None:
        self._complete(q, t)
        if self.schedule == "published":
            self._pub_next_agent(t)

    # ours: judge and speculative answer at once; the gate is instant
    def _spec_start(self, q: int, t: float) -> None:
        c = self.costs
        self.state[q] = 0
        self.large.submit(
            t, LARGE, c.judge_prefill_tokens, c.judge_decode_tokens, self._spec_judged, q
        )
        # the small answer is wasted when the judge says "tool"; it is cheap and on its own GPU
        self.small.submit(
            t, SMALL, c.small_prefill_tokens, c.small_decode_tokens, self._spec_answered, q
        )

    def _spec_judged(self, q: int, t: float) -> None:
        if self.tool[q]:
            self._agent_start(q, t)
            return
        self.state[q] |= 1
        if self.state[q] == 3:
            self._gate(q, t)

    def _spec_answered(self, q: int, t: float) -> None:
        self.state[q] |= 2
        if self.state[q] == 3:
            self._gate(q, t)

    def _gate(self, q: int, t: float) -> None:
        if self.accept[q]:
            self._complete(q, t)
        else:
            self._agent_start(q, t)

    # published: batch phases I, II, III, then phase IV serially, then the next batch
    def _pub_enqueue(self, q: int, t: float) -> None:
        self.pending.append(q)
        if not self.pub_busy:
            self._pub_batch(t)

    def _pub_batch(self, t: float) -> None:
        if not self.pending:
            self.pub_busy = False
            return
        self.pub_busy = True
        self.batch = self.pending[: self.pub_batch]
        del self.pending[: self.pub_batch]
        self.outstanding = len(self.batch)
        c = self.costs
        for q in self.batch:
            self.large.submit(
                t, LARGE, c.judge_prefill_tokens, c.judge_decode_tokens, self._pub_judged, q
            )

    def _pub_judged(self, q: int, t: float) -> None:
        self.outstanding -= 1
        if self.outstanding:
            return
        free = [q for q in self.batch if not self.tool[q]]
        self.outstanding = len(free)
        if not free:
            self._pub_gate(t)
            return
        c = self.costs
        for q2 in free:
            self.small.submit(
                t, SMALL, c.small_prefill_tokens, c.small_decode_tokens, self._pub_answered, q2
            )

    def _pub_answered(self, q: int, t: float) -> None:
        self.outstanding -= 1
        if not self.outstanding:
            self._pub_gate(t)

    def _pub_gate(self, t: float) -> None:
        batch = self.batch
        self.serial = deque(q for q in batch if self.tool[q] or not self.accept[q])
        for q in batch:
            if not self.tool[q] and self.accept[q]:
                self._complete(q, t)  # generous: an accepted answer returns before phase IV
        self._pub_next_agent(t)

    def _pub_next_agent(self, t: float) -> None:
        if self.serial:
            self._agent_start(self.serial.popleft(), t)
        else:
            self._pub_batch(t)


def _stats(e: _Engine, makespan: float) -> dict[str, float]:
    return {
        "mean_batch": e.batch_time / e.busy_time if e.busy_time > 0 else 0.0,
        "utilisation": e.busy_time / makespan if makespan > 0 else 0.0,
        "busy_s": e.busy_time,
        "jobs": float(e.jobs),
    }


def simulate_one(
    schedule: str, costs: CostModel, draws: Draws, concurrency: int,
    published_batch: int | None = None,
) -> RunResult:
    """One schedule at one concurrency; per-query issue and finish times."""
    return _Run(schedule, costs, draws, concurrency, published_batch).run()


# --- rows, analytic, outputs -----------------------------------------------------------------


@dataclass
class Row:
    schedule: str
    concurrency: int
    throughput: float  # queries per second
    p50_s: float
    p95_s: float
    mean_s: float
    large_batch: float  # time-weighted mean sequences per step while the engine is busy
    small_batch: float  # with shared_gpu both columns describe the one shared engine
    large_util: float  # busy share of the makespan
    small_util: float
    vs_agent_only: float  # throughput / agent-only throughput at the same C
    of_ideal: float  # throughput / (agent-only throughput / (1 - beta*alpha))


@dataclass
class Analytic:
    c_judge: float
    c_small: float
    l_agent: float
    expected_latency: float  # E[L] = c_J + beta*c_S + (1 - beta*alpha)*L_agent (sequential)
    expected_latency_overlap: float  # ours at batch 1: judge and small answer run at once
    ideal_gain: float  # 1 / (1 - beta*alpha)


def analytic(costs: CostModel, beta: float, alpha: float) -> Analytic:
    cj, cs, la = costs.judge_s(), costs.small_s(), costs.agent_s()
    both = max(cj, cs)
    overlap = (1 - beta) * (cj + la) + beta * (both + (1 - alpha) * la)
    gain = 1.0 / (1.0 - beta * alpha) if beta * alpha < 1 else math.inf
    return Analytic(cj, cs, la, cj + beta * cs + (1 - beta * alpha) * la, overlap, gain)


def simulate(
    costs: CostModel | None = None,
    schedules: Sequence[str] = SCHEDULES,
    concurrencies: Sequence[int] = DEFAULT_CONCURRENCIES,
    n_queries: int = 10_000,
    beta: float = DEFAULT_BETA,
    alpha: float = DEFAULT_ALPHA,
    seed: int = 0,
    published_batch: int | None = None,
) -> list[Row]:
    """Every schedule at every concurrency, plus an ``ideal`` row per C when agent-only is run.
    The same seeded draws serve every run, so differences come from the schedule alone."""
    costs = costs or CostModel()
    costs.validate()
    if n_queries < 1:
        raise ValueError("n_queries must be >= 1")
    d = draw(costs, n_queries, beta, alpha, seed)
    gain = analytic(costs, beta, alpha).ideal_gain
    rows: list[Row] = []
    for c in concurrencies:
        base: float | None = None
        here: list[Row] = []
        order = sorted(schedules, key=lambda s: s != "agent-only")  # agent-only first: the base
        for s in order:
            r = simulate_one(s, costs, d, int(c), published_batch)
            lat = r.latencies
            thr = n_queries / r.makespan if r.makespan > 0 else math.inf
            if s == "agent-only":
                base = thr
            here.append(
                Row(
                    schedule=s, concurrency=int(c), throughput=thr,
                    p50_s=float(np.percentile(lat, 50)), p95_s=float(np.percentile(lat, 95)),
                    mean_s=float(lat.mean()),
                    large_batch=r.engines["large"]["mean_batch"],
                    small_batch=r.engines["small"]["mean_batch"],
                    large_util=r.engines["large"]["utilisation"],
                    small_util=r.engines["small"]["utilisation"],
                    vs_agent_only=math.nan, of_ideal=math.nan,
                )
            )
        if base is not None:
            for row in here:
                row.vs_agent_only = row.throughput / base
                row.of_ideal = row.throughput / (base * gain)
            nan = math.nan
            here.append(
                Row(IDEAL, int(c), base * gain, nan, nan, nan, nan, nan, nan, nan, gain, 1.0)
            )
        here.sort(key=lambda r: (SCHEDULES + (IDEAL,)).index(r.schedule))
        rows.extend(here)
    return rows


def _f(x: float, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def format_table(rows: Sequence[Row]) -> str:
    head = (
        "| schedule | C | queries/s | x agent-only | of ideal | p50 s | p95 s | "
        "large batch | large util | small batch | small util |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        lines.append(
            f"| {r.schedule} | {r.concurrency} | {_f(r.throughput, '.3f')} | "
            f"{_f(r.vs_agent_only, '.2f')} | {_f(r.of_ideal, '.0%')} | {_f(r.p50_s, '.2f')} | "
            f"{_f(r.p95_s, '.2f')} | {_f(r.large_batch, '.1f')} | {_f(r.large_util, '.0%')} | "
            f"{_f(r.small_batch, '.1f')} | {_f(r.small_util, '.0%')} |"
        )
    return "\n".join(lines)


def plot(rows: Sequence[Row], path: str | Path, title: str = "") -> Path:
    """Throughput vs concurrency (log2 x) per schedule plus the ideal; p50/p95 latency."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    colors = {"agent-only": "tab:gray", "published": "tab:red", "speceyes": "tab:blue",
              IDEAL: "black"}
    for s in [*SCHEDULES, IDEAL]:
        rs = sorted((r for r in rows if r.schedule == s), key=lambda r: r.concurrency)
        if not rs:
            continue
        cs = [r.concurrency for r in rs]
        style = "--" if s == IDEAL else "-"
        label = "ideal: agent-only / (1 - beta*alpha)" if s == IDEAL else s
        ax1.plot(cs, [r.throughput for r in rs], style, marker="o", ms=3, color=colors[s],
                 label=label)
        if s != IDEAL:
            ax2.plot(cs, [r.p50_s for r in rs], "-", marker="o", ms=3, color=colors[s],
                     label=f"{s} p50")
            ax2.plot(cs, [r.p95_s for r in rs], ":", marker="^", ms=3, color=colors[s],
                     label=f"{s} p95")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (clients in a closed loop)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    ax1.set_yscale("log")
    ax1.set_ylabel("throughput (queries/s)")
    ax2.set_yscale("log")
    ax2.set_ylabel("latency (s)")
    ax1.set_title("throughput")
    ax2.set_title("latency (p50 solid, p95 dotted)")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_outputs(
    rows: Sequence[Row], out_dir: str | Path, costs: CostModel, beta: float, alpha: float,
    n_queries: int, seed: int,
) -> list[Path]:
    """simulate.md (settings, analytic check, table), simulate.csv and simulate.png."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    a = analytic(costs, beta, alpha)
    md = [
        "# speceyes simulate",
        "",
        f"{n_queries} queries per run, closed loop, beta={beta}, alpha={alpha}, seed={seed}.",
        "",
        f"Batch-1 costs: judge c_J={a.c_judge:.3f} s, small answer c_S={a.c_small:.3f} s, "
        f"agent loop L_agent={a.l_agent:.2f} s.",
        f"E[L] = c_J + beta*c_S + (1 - beta*alpha)*L_agent = {a.expected_latency:.3f} s "
        f"(overlapped phases I+II: {a.expected_latency_overlap:.3f} s); "
        f"ideal gain 1/(1 - beta*alpha) = {a.ideal_gain:.3f}.",
        "",
        format_table(rows),
        "",
        "## Cost model",
        "",
        "```json",
        json.dumps(asdict(costs), indent=2),
        "```",
        "",
    ]
    paths = [out / MD_FILE, out / CSV_FILE, out / PNG_FILE]
    paths[0].write_text("\n".join(md))
    with paths[1].open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=[f.name for f in fields(Row)])
        w.writeheader()
        for r in rows:
            w.writerow(asdict(r))
    plot(rows, paths[2], title=f"beta={beta}, alpha={alpha}, {n_queries} queries")
    return paths
