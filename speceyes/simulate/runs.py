"""Schedules on the engines: the per-query random draws every schedule shares, one schedule at one
concurrency (``simulate_one``), and the sweep over schedules, judges and concurrencies
(``simulate``) that gives one ``Row`` per run."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from speceyes.funnel import JUDGES, early_share_allows  # the funnel's variants and rule
from speceyes.operating_points import AGENT_POINT, AUTO, OperatingPoint
from speceyes.simulate.auto import choose_point
from speceyes.simulate.costs import (
    LARGE,
    SMALL,
    CostModel,
    analytic,
    ideal_gain,
    tool_turn_prefill_s,
)
from speceyes.simulate.engine import Callback, _Engine, _Model, _Sim, _stats

SCHEDULES: tuple[str, ...] = ("agent-only", "agent-only-2gpu", "published", "speceyes")
IDEAL = "ideal"
DEFAULT_CONCURRENCIES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEFAULT_BETA = 0.8
DEFAULT_ALPHA = 0.71
# Gate acceptance among the queries the published judge sends to tools, for ``judge="none"``:
# measured on the mini world with the bundled models (docs/throughput.md); a guess elsewhere.
DEFAULT_ALPHA_TOOL = 0.5


# --- per-query random draws ------------------------------------------------------------------


@dataclass
class Draws:
    """What each query will do, drawn once per seed and shared by every schedule and C."""

    tool: np.ndarray  # judge says "tool" (prob 1 - beta)
    accept: np.ndarray  # the gate accepts the small answer (prob alpha)
    turns: np.ndarray  # agent turns = tool calls + 1
    turn_tokens: np.ndarray  # (n, max turns) decoded tokens per turn
    accept_tool: np.ndarray | None = None  # without a judge: the gate accepts a "tool" query

    def subset(self, idx: np.ndarray) -> Draws:
        return Draws(
            self.tool[idx], self.accept[idx], self.turns[idx], self.turn_tokens[idx],
            None if self.accept_tool is None else self.accept_tool[idx],
        )


def draw(
    costs: CostModel, n: int, beta: float, alpha: float, seed: int,
    alpha_tool: float = DEFAULT_ALPHA_TOOL,
) -> Draws:
    if not (0.0 <= beta <= 1.0 and 0.0 <= alpha <= 1.0 and 0.0 <= alpha_tool <= 1.0):
        raise ValueError(f"beta, alpha, alpha_tool must be in [0, 1], got {beta}, {alpha}, "
                         f"{alpha_tool}")
    rng = np.random.default_rng(seed)
    # uniforms first, thresholds after: changing beta/alpha keeps every other draw (fair sweeps)
    u_judge, u_gate = rng.random(n), rng.random(n)
    probs = np.asarray(costs.tool_call_probs, dtype=np.float64)
    k = rng.choice(probs.size, size=n, p=probs / probs.sum())
    tokens = rng.integers(
        costs.turn_tokens_min, costs.turn_tokens_max + 1, size=(n, probs.size)
    )
    return Draws(
        tool=u_judge >= beta, accept=u_gate < alpha, turns=k + 1, turn_tokens=tokens,
        accept_tool=u_gate < alpha_tool,
    )


def agent_latency_b1(costs: CostModel, d: Draws, first_prefill_s: float | None = None) -> np.ndarray:
    """Each query's agent-loop seconds alone on the engine (batch 1): the sum of its turn costs.
    ``first_prefill_s`` replaces the first turn's prefill (a prefix-cache hit). The search
    workload draws nothing: every loop costs :meth:`CostModel.agent_s`."""
    if costs.agent_workload == "search":
        return np.full(len(d.turns), costs.agent_s())
    dec1, r = costs.step_table(LARGE)[1], costs.kv_read(LARGE)
    first = (
        costs.prefill_s(LARGE, costs.agent_text_tokens, costs.image_tokens)
        if first_prefill_s is None else first_prefill_s
    )
    out = np.empty(len(d.turns))
    for q in range(len(d.turns)):
        total, ctx = 0.0, costs.agent_prefill_tokens
        for k in range(int(d.turns[q])):
            tt = int(d.turn_tokens[q, k])
            if k == 0:
                pre = first
            else:
                pre = tool_turn_prefill_s(costs, ctx, k)
                ctx += costs.tool_turn_prefill_tokens
                total += costs.tool_s
            ctx += tt
            total += pre + tt * (dec1 + ctx * r)
        out[q] = total
    return out


# --- schedules -------------------------------------------------------------------------------


@dataclass
class RunResult:
    schedule: str
    concurrency: int
    issued: np.ndarray
    finished: np.ndarray
    engines: dict[str, dict[str, float]]
    judge: str = "-"
    early: np.ndarray | None = None  # per query: answered without the agent loop (the gate's)

    @property
    def latencies(self) -> np.ndarray:
        return self.finished - self.issued

    @property
    def makespan(self) -> float:
        return float(self.finished.max()) if self.finished.size else 0.0


class _Run:
    def __init__(
        self, schedule: str, costs: CostModel, d: Draws, concurrency: int,
        published_batch: int | None, judge: str = "large",
    ) -> None:
        if schedule not in ("agent-only", "published", "speceyes"):
            raise ValueError(f"unknown schedule {schedule!r}; choose from {', '.join(SCHEDULES)}")
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if judge not in JUDGES:
            raise ValueError(f"unknown judge {judge!r}; choose from {', '.join(JUDGES)}")
        if judge == "prefix" and (costs.judge_max_pixels or costs.judge_image_tokens is not None):
            raise ValueError("the prefix-shared judge sees the agent's own view of the image: "
                             "no judge view budget")
        self.schedule, self.c, self.costs, self.judge = schedule, concurrency, costs, judge
        self.sim = sim = _Sim()
        if costs.shared_gpu:
            self.large = self.small = _Engine(
                sim, {LARGE: _Model(costs, LARGE), SMALL: _Model(costs, SMALL)}
            )
        else:
            self.large = _Engine(sim, {LARGE: _Model(costs, LARGE)})
            self.small = _Engine(sim, {SMALL: _Model(costs, SMALL)})
        c = costs
        # the requests of phases I and II: (tokens, prefill seconds, decoded tokens, KV context)
        img = c.judge_view_tokens(LARGE)
        self.req_judge = (
            img + c.judge_text_tokens, c.prefill_s(LARGE, c.judge_text_tokens, img),
            c.judge_decode_tokens, img + c.judge_text_tokens + c.judge_decode_tokens,
        )
        simg = c.judge_view_tokens(SMALL)
        self.req_small_judge = (
            simg + c.judge_text_tokens, c.prefill_s(SMALL, c.judge_text_tokens, simg),
            c.judge_decode_tokens, simg + c.judge_text_tokens + c.judge_decode_tokens,
        )
        self.req_small = (
            c.small_prefill_tokens,
            c.prefill_s(SMALL, c.small_text_tokens, c.small_view_tokens),
            c.small_decode_tokens, c.small_prefill_tokens + c.small_decode_tokens,
        )
        # the judge question after a cached prefix (the agent's prompt, or the small answer's)
        tail = c.prefix_tail_tokens if c.prefix_caching else None
        a = c.agent_prefill_tokens
        self.req_prefix_judge = (
            a + c.prefix_judge_tokens,
            c.prefill_s(LARGE, c.agent_text_tokens + c.prefix_judge_tokens, c.image_tokens),
            c.judge_decode_tokens, a + c.prefix_judge_tokens + c.judge_decode_tokens,
        )
        if tail is not None:
            cont = (tail + c.prefix_judge_tokens, c.prefill_s(SMALL, tail + c.prefix_judge_tokens))
        else:
            cont = (c.small_prefill_tokens + c.prefix_judge_tokens,
                    c.prefill_s(SMALL, c.small_text_tokens + c.prefix_judge_tokens,
                                c.small_view_tokens))
        self.req_small_cont = (
            cont[0], cont[1], c.judge_decode_tokens,
            c.small_prefill_tokens + c.prefix_judge_tokens + c.judge_decode_tokens,
        )
        # the agent's first turn: after a prefix-shared judge, only the tail misses the cache
        full_first = c.prefill_s(LARGE, c.agent_text_tokens, c.image_tokens)
        self.search = c.agent_workload == "search"
        # the search agent's requests score crops, each a fresh conversation: none of them
        # continues the prefix judge's prompt, so its prefill is never reused
        self.first_hit = (
            schedule == "speceyes" and judge == "prefix" and tail is not None and not self.search
        )
        # the funnel's default order: the judge first, the small answer only when tool-free
        self.sequential = not c.phase_overlap and schedule == "speceyes" and judge in (
            "large", "prefix", "small"
        )
        self.req_cell = c.search_cell_request()
        self.req_answer = c.search_answer_request()
        self.large_judged = schedule == "published" or (
            schedule == "speceyes" and judge in ("large", "prefix")
        )
        self.first_tokens = tail if self.first_hit else a
        self.first_s = c.prefill_s(LARGE, tail) if self.first_hit else full_first
        # python lists: scalar indexing is several times faster than numpy's
        self.tool = d.tool.tolist()
        acc_tool = d.accept if d.accept_tool is None else d.accept_tool
        if judge == "none":  # the gate decides for every query
            self.accept = np.where(d.tool, acc_tool, d.accept).tolist()
        else:
            self.accept = d.accept.tolist()
        self.turns = d.turns.tolist()
        self.tt = d.turn_tokens.tolist()
        self.n = len(self.tool)
        self.turn = [0] * self.n
        self.ctx = [0] * self.n
        self.cells_left = [0] * self.n  # search: cell scores of the current round not back yet
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
        # the funnel's pipelined schedule, as the serve app runs it (CostModel.funnel_pipeline)
        self.pipe = c.funnel_pipeline and schedule in ("agent-only", "speceyes")
        if self.pipe:
            if judge == "small-prefix":
                raise ValueError("funnel_pipeline does not model the small-prefix judge")
            self.start_query = self._pipe_arrive
        self.arrived = [0.0] * self.n
        self.front_q: deque[int] = deque()
        self.front_busy = False
        self.front_now: list[int] = []
        self.front_left = 0
        self.agent_q: deque[int] = deque()
        self.loops: list[int] = []  # the driver's active loops
        self.driver_busy = False
        self.step_left = 0
        self.step_answering: list[int] = []
        # early_agent (the funnel's): raced queries' loops start at their front batch's
        # opening; a loop the front answered is dropped, one that ends first waits for it
        self.early_agent = c.early_agent if self.pipe and schedule == "speceyes" else 0
        self.raced = [False] * self.n
        self.decided = [False] * self.n
        self.dropped = [False] * self.n
        self.loop_ended = [False] * self.n
        self.done = 0  # queries finished
        self.settled = [0, 0]  # queries settled, and of them answered without the agent
        self.early = np.zeros(self.n, dtype=bool)  # each query answered without the agent

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
        judge = self.judge if self.schedule == "speceyes" else (
            "large" if self.schedule == "published" else "-"
        )
        return RunResult(self.schedule, self.c, self.issued, self.finished, engines, judge,
                         self.early)

    @property
    def makespan(self) -> float:
        return float(self.finished.max()) if self.n else 0.0

    def _issue(self, t: float) -> None:
        q = self.next_q
        self.next_q += 1
        self.issued[q] = t
        intake = self.costs.app_intake_s
        if intake > 0:  # the app's intake first, in its own threads beside the engines
            self.sim.at(t + intake, self.start_query, q)
        else:
            self.start_query(q, t)

    def _complete(self, q: int, t: float, early: bool = False) -> None:
        """Query ``q`` answered at ``t`` (``early``: by the small model, the agent skipped)."""
        self.finished[q] = t
        self.early[q] = early
        self.done += 1
        if self.next_q < self.n:  # closed loop: this client sends its next query now
            self._issue(t)

    def _submit(
        self, engine: _Engine, t: float, cls: int, req: tuple, cb: Callback, q: int,
        image: bool = False,
    ) -> None:
        """``req`` to ``engine`` at ``t``; one that carries the full image waits first for the
        image's preprocessing (``image_preprocess_s``: the server's, or with
        ``client_cpu_on_engine`` the client's resizing and encoding; see ``_client_cpu``)."""
        pp = self.costs.image_preprocess_s if image else 0.0
        if pp > 0:
            self._client_cpu(engine, t, pp, lambda q_, t_: engine.submit(
                t_, cls, req[0], req[1], req[2], req[3], cb, q_), q)
        else:
            engine.submit(t, cls, req[0], req[1], req[2], req[3], cb, q)

    def _client_cpu(self, engine: _Engine, t: float, seconds: float, cb: Callback, q: int) -> None:
        """The client's ``seconds`` of CPU work for a request to ``engine``, then ``cb(q, t)``:
        beside the servers, or (``client_cpu_on_engine``) serial on ``engine``'s device; with
        ``client_cpu_free_core`` on the other server's device while ``engine``'s is busy and
        the other idle, judged after every other arrival of this instant (the servers' cores
        are taken first by the work that arrives with it, whatever its order here)."""
        c = self.costs
        if not c.client_cpu_on_engine:
            self.sim.at(t + seconds, cb, q)
        elif not c.client_cpu_free_core or self.large is self.small:
            engine.submit_cpu(t, seconds, cb, q)
        else:
            other = self.small if engine is self.large else self.large

            def place(q_: int, t_: float) -> None:
                on = other if not engine.idle and other.idle else engine
                on.submit_cpu(t_, seconds, cb, q_)

            self.sim.at(t, place, q)

    # agent loop (phase IV), shared by all schedules
    def _agent_start(self, q: int, t: float) -> None:
        self.turn[q] = 0
        if self.search:
            self._search_next(q, t)
            return
        n = self.tt[q][0]
        self.ctx[q] = ctx = self.costs.agent_prefill_tokens + n
        req = (self.first_tokens, self.first_s, n, ctx)
        # After a judge on the large server its image is processed already (vLLM's
        # multimodal processor cache); otherwise the first turn waits for it.
        self._submit(self.large, t, LARGE, req, self._agent_turn_done, q,
                     image=not self.large_judged)

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
        c, k = self.costs, self.turn[q]
        before = self.ctx[q]
        n = self.tt[q][k]
        self.ctx[q] = ctx = before + c.tool_turn_prefill_tokens + n
        tokens = c.tool_turn_prefill_tokens if c.prefix_caching else (
            before + c.tool_turn_prefill_tokens
        )
        self.large.submit(
            t, LARGE, tokens, tool_turn_prefill_s(c, before, k), n, ctx,
            self._agent_turn_done, q,
        )

    # the search agent: rounds of cell scores, each round after the last, then the answer
    def _search_next(self, q: int, t: float) -> None:
        if self.turn[q] < self.costs.search_depth:
            if self.costs.tool_s > 0:  # the round's crops are cut on the CPU first
                self._client_cpu(self.large, t, self.costs.tool_s, self._search_round, q)
            else:
                self._search_round(q, t)
            return
        self.large.submit(t, LARGE, *self.req_answer, self._agent_done, q)

    def _search_round(self, q: int, t: float) -> None:
        g = self.costs.search_cells
        self.cells_left[q] = g
        for _ in range(g):
            self.large.submit(t, LARGE, *self.req_cell, self._search_cell_done, q)

    def _search_cell_done(self, q: int, t: float) -> None:
        self.cells_left[q] -= 1
        if self.cells_left[q]:
            return
        self.turn[q] += 1
        self._search_next(q, t)

    def _agent_done(self, q: int, t: float) -> None:
        self._complete(q, t)
        if self.schedule == "published":
            self._pub_next_agent(t)

    # ours: judge and speculative answer at once; the gate is instant
    def _spec_start(self, q: int, t: float) -> None:
        j = self.judge
        self.state[q] = 0
        if self.sequential:
            big = j in ("large", "prefix")
            req = self.req_small_judge if j == "small" else (
                self.req_judge if j == "large" else self.req_prefix_judge
            )
            self._submit(self.large if big else self.small, t, LARGE if big else SMALL, req,
                         self._spec_judged_first, q, image=True)
            return
        if j == "none":
            self.state[q] = 1  # nothing to judge: the gate decides on the answer alone
        elif j == "large":
            self._submit(self.large, t, LARGE, self.req_judge, self._spec_judged, q, image=True)
        elif j == "prefix":
            self._submit(self.large, t, LARGE, self.req_prefix_judge, self._spec_judged, q, image=True)
        elif j == "small":
            self._submit(self.small, t, SMALL, self.req_small_judge, self._spec_judged, q, image=True)
        # the small answer is wasted when the judge says "tool"; it is cheap and on its own GPU
        cb = self._spec_answered_then_judge if j == "small-prefix" else self._spec_answered
        self._submit(self.small, t, SMALL, self.req_small, cb, q, image=True)

    def _spec_judged_first(self, q: int, t: float) -> None:
        if self.tool[q]:
            self._spec_judged(q, t)  # to the agent
            return
        self._submit(self.small, t, SMALL, self.req_small, self._spec_answered_last, q,
                     image=True)

    def _spec_answered_last(self, q: int, t: float) -> None:
        self.state[q] |= 2
        self._spec_judged(q, t)  # tool-free and answered: the gate

    def _spec_answered_then_judge(self, q: int, t: float) -> None:
        # the answer's prompt is cached now: the judge question continues it (one image prefill)
        self.state[q] |= 2
        self._submit(self.small, t, SMALL, self.req_small_cont, self._spec_judged, q)

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
            self._complete(q, t, early=True)
        else:
            self._agent_start(q, t)

    # the funnel's pipelined schedule: one front batch at a time (phases I-III, each phase
    # waiting for the whole batch), and one agent driver stepping every active loop together
    def _pipe_arrive(self, q: int, t: float) -> None:
        self.arrived[q] = t
        self.front_q.append(q)
        if not self.front_busy:
            self._front_next(t)

    def _front_next(self, t: float) -> None:
        if not self.front_q:
            self.front_busy = False
            return
        self.front_busy = True
        # a batch closes when it is full or its oldest request has waited front_wait_s
        start = self.arrived[self.front_q[0]] + self.costs.front_wait_s
        if start > t and len(self.front_q) < self.costs.front_batch:
            self.sim.at(start, self._front_open, 0)
            return
        self._front_open(0, t)

    def _front_open(self, _: int, t: float) -> None:
        k = min(self.costs.front_batch, len(self.front_q))
        batch = [self.front_q.popleft() for _ in range(k)]
        self.front_now = batch
        if self.schedule == "agent-only":  # no phase I-III call: all of it to the agent
            self._front_route(t, [])
            return
        settled, early = self.settled
        if (
            self.early_agent
            and self.next_q - self.done <= self.early_agent
            and early_share_allows(early / settled if settled else None)
        ):
            for q in batch:
                self.raced[q] = True
                self.agent_q.append(q)
            if not self.driver_busy:
                self._driver_step(t)
        if self.judge == "none":
            self._front_answers(t, batch)
            return
        big = self.judge in ("large", "prefix")
        req = self.req_small_judge if self.judge == "small" else (
            self.req_judge if self.judge == "large" else self.req_prefix_judge
        )
        self.front_left = len(batch)
        for q in batch:
            self._submit(self.large if big else self.small, t, LARGE if big else SMALL, req,
                         self._front_judged, q, image=True)

    def _front_judged(self, q: int, t: float) -> None:
        self.front_left -= 1
        if not self.front_left:
            free = [x for x in self.front_now if not self.tool[x]]
            if free:
                self._front_answers(t, free)
            else:
                self._front_route(t, [])

    def _front_answers(self, t: float, which: list[int]) -> None:
        self.front_left = len(which)
        for q in which:
            self._submit(self.small, t, SMALL, self.req_small, self._front_answered, q,
                         image=True)

    def _front_answered(self, q: int, t: float) -> None:
        self.front_left -= 1
        if not self.front_left:
            free = self.front_now if self.judge == "none" else [
                x for x in self.front_now if not self.tool[x]
            ]
            self._front_route(t, [x for x in free if self.accept[x]])

    def _front_route(self, t: float, accepted: list[int]) -> None:
        ok = set(accepted)
        for q in self.front_now:
            if q in ok:
                self.dropped[q] = self.raced[q]
                self.settled[0] += 1
                self.settled[1] += 1
                self._complete(q, t, early=True)
            elif not self.raced[q]:
                self.agent_q.append(q)
            else:
                self.decided[q] = True
                if self.loop_ended[q]:
                    self._agent_settled(q, t)
        if not self.driver_busy:
            self._driver_step(t)
        self._front_next(t)

    def _agent_settled(self, q: int, t: float) -> None:
        self.settled[0] += 1
        self._complete(q, t)

    def _driver_step(self, t: float) -> None:
        self.loops = [q for q in self.loops if not self.dropped[q]]
        while self.agent_q and len(self.loops) < self.costs.max_agent_loops:
            q = self.agent_q.popleft()
            if self.dropped[q]:
                continue
            self.turn[q] = 0
            self.loops.append(q)
        if not self.loops:
            self.driver_busy = False
            return
        self.driver_busy = True
        searching = [q for q in self.loops if self.turn[q] < self.costs.search_depth]
        if not searching:
            self._driver_answers(t)
            return
        # the app cuts and encodes every searching loop's crops, one after another, first
        crop_s = self.costs.tool_s * len(searching)
        if crop_s > 0:
            self._client_cpu(self.large, t, crop_s, self._driver_cells, 0)
        else:
            self.sim.at(t, self._driver_cells, 0)

    def _driver_cells(self, _: int, t: float) -> None:
        searching = [q for q in self.loops if self.turn[q] < self.costs.search_depth]
        g = self.costs.search_cells
        self.step_left = g * len(searching)
        for q in searching:
            for _ in range(g):
                self.large.submit(t, LARGE, *self.req_cell, self._driver_cell_done, q)

    def _driver_cell_done(self, q: int, t: float) -> None:
        self.step_left -= 1
        if self.step_left:
            return
        for x in self.loops:
            if self.turn[x] < self.costs.search_depth:
                self.turn[x] += 1
        self._driver_answers(t)

    def _driver_answers(self, t: float) -> None:
        # a loop the front answered during the step leaves; one whose last round just ended
        # answers in the same step, after the cells
        self.loops = [q for q in self.loops if not self.dropped[q]]
        ans = [q for q in self.loops if self.turn[q] >= self.costs.search_depth]
        self.step_answering = ans
        if not ans:
            self._driver_step(t)
            return
        self.step_left = len(ans)
        for q in ans:
            self.large.submit(t, LARGE, *self.req_answer, self._driver_answered, q)

    def _driver_answered(self, q: int, t: float) -> None:
        self.step_left -= 1
        if self.step_left:
            return
        done = set(self.step_answering)
        self.loops = [x for x in self.loops if x not in done]
        for x in self.step_answering:
            if self.dropped[x]:  # the front answered it while this step ran
                continue
            if self.raced[x] and not self.decided[x]:  # the front still deciding
                self.loop_ended[x] = True
                continue
            self._agent_settled(x, t)
        self._driver_step(t)

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
        for q in self.batch:
            self._submit(self.large, t, LARGE, self.req_judge, self._pub_judged, q, image=True)

    def _pub_judged(self, q: int, t: float) -> None:
        self.outstanding -= 1
        if self.outstanding:
            return
        free = [q for q in self.batch if not self.tool[q]]
        self.outstanding = len(free)
        if not free:
            self._pub_gate(t)
            return
        for q2 in free:
            self._submit(self.small, t, SMALL, self.req_small, self._pub_answered, q2, image=True)

    def _pub_answered(self, q: int, t: float) -> None:
        self.outstanding -= 1
        if not self.outstanding:
            self._pub_gate(t)

    def _pub_gate(self, t: float) -> None:
        batch = self.batch
        self.serial = deque(q for q in batch if self.tool[q] or not self.accept[q])
        for q in batch:
            if not self.tool[q] and self.accept[q]:
                self._complete(q, t, early=True)  # generous: returns before phase IV
        self._pub_next_agent(t)

    def _pub_next_agent(self, t: float) -> None:
        if self.serial:
            self._agent_start(self.serial.popleft(), t)
        else:
            self._pub_batch(t)


def simulate_one(
    schedule: str, costs: CostModel, draws: Draws, concurrency: int,
    published_batch: int | None = None, judge: str = "large",
) -> RunResult:
    """One schedule at one concurrency; per-query issue and finish times."""
    if schedule.startswith("agent-only"):
        costs = replace(costs, shared_gpu=False)  # the large model alone on its GPU(s)
    if schedule == "agent-only-2gpu":
        return _agent_only_2gpu(costs, draws, concurrency)
    return _Run(schedule, costs, draws, concurrency, published_batch, judge).run()


def _agent_only_2gpu(costs: CostModel, d: Draws, concurrency: int) -> RunResult:
    """Agent-only on two GPUs, data parallel: two replicas, each with half the clients and the
    queries alternating between them (one replica when there is one client)."""
    n = len(d.turns)
    if concurrency < 2:
        r = _Run("agent-only", costs, d, concurrency, None).run()
        r.schedule = "agent-only-2gpu"
        return r
    issued, finished = np.zeros(n), np.zeros(n)
    engines: dict[str, dict[str, float]] = {}
    for part, c in ((0, concurrency // 2 + concurrency % 2), (1, concurrency // 2)):
        idx = np.arange(part, n, 2)
        r = _Run("agent-only", costs, d.subset(idx), c, None).run()
        issued[idx], finished[idx] = r.issued, r.finished
        engines[("large", "small")[part]] = r.engines["large"]  # replica 1, replica 2
    return RunResult("agent-only-2gpu", concurrency, issued, finished, engines)


# --- rows ------------------------------------------------------------------------------------


@dataclass
class Row:
    schedule: str
    concurrency: int
    throughput: float  # queries per second
    p50_s: float
    p95_s: float
    mean_s: float
    large_batch: float  # time-weighted mean sequences per step while the engine is busy
    small_batch: float  # shared_gpu: both columns describe the one engine; 2gpu: the replicas
    large_util: float  # busy share of the makespan
    small_util: float
    vs_agent_only: float  # throughput / agent-only throughput (one GPU) at the same C
    # throughput / (agent-only throughput / (1 - share that skips the agent)): beta*alpha, and
    # without a judge also (1 - beta)*alpha_tool, accepted among the queries it sends to tools
    of_ideal: float
    judge: str = "-"  # ours: the judge variant; published: "large"
    gpus: int = 1
    per_gpu_vs_agent_only: float = math.nan  # (throughput / gpus) / agent-only throughput
    vs_agent_only_2gpu: float = math.nan  # throughput / agent-only on two GPUs (data parallel)
    skipped: float = math.nan  # expected share that never reaches the agent (the ideal's)


def simulate(
    costs: CostModel | None = None,
    schedules: Sequence[str] = SCHEDULES,
    concurrencies: Sequence[int] = DEFAULT_CONCURRENCIES,
    n_queries: int = 10_000,
    beta: float = DEFAULT_BETA,
    alpha: float = DEFAULT_ALPHA,
    seed: int = 0,
    published_batch: int | None = None,
    judges: Sequence[str] = ("large",),
    alpha_tool: float = DEFAULT_ALPHA_TOOL,
    points: Sequence[OperatingPoint] | None = None,
) -> list[Row]:
    """Every schedule at every concurrency (ours once per judge variant), plus an ``ideal`` row
    per C when agent-only is run. The same seeded draws serve every run, so differences come
    from the schedule alone.

    ``points``: operating points (each judge variant with its own tau and the rates measured
    at it, :func:`speceyes.operating_points.read_points`); a static variant then runs at its point's rates,
    and ``auto`` picks among them per C (:func:`speceyes.simulate.auto.choose_point`). Without
    them every variant shares ``beta``, ``alpha`` and, for ``none``, ``alpha_tool``."""
    costs = costs or CostModel()
    costs.validate()
    if n_queries < 1:
        raise ValueError("n_queries must be >= 1")
    unknown = [s for s in schedules if s not in SCHEDULES]
    if unknown:
        raise ValueError(f"unknown schedule {unknown[0]!r}; choose from {', '.join(SCHEDULES)}")
    bad = [j for j in judges if j not in (*JUDGES, AUTO)]
    if bad or not judges:
        choices = ", ".join((*JUDGES, AUTO))
        raise ValueError(f"unknown judge {bad[0] if bad else ''!r}; choose from {choices}")
    if points is None:
        points = [OperatingPoint(j, None, beta, alpha, alpha_tool if j == "none" else 0.0)
                  for j in JUDGES]
    point_of = {}
    for p in points:
        point_of.setdefault(p.judge, p)  # a static variant runs at its first point
    missing = [j for j in judges if j != AUTO and j not in point_of]
    if missing:
        raise ValueError(f"judge {missing[0]!r} has no operating point in the points given")
    # the schedules without a judge variant (agent-only, published) run on the global rates
    d = draw(costs, n_queries, beta, alpha, seed, alpha_tool)
    draws: dict[tuple[float, float, float], Draws] = {(beta, alpha, alpha_tool): d}

    def draws_of(p: OperatingPoint) -> Draws:  # one seed: the same uniforms for every point
        key = (p.beta, p.alpha, p.alpha_tool)
        if key not in draws:
            draws[key] = draw(costs, n_queries, p.beta, p.alpha, seed, p.alpha_tool)
        return draws[key]

    gain = analytic(costs, beta, alpha).ideal_gain
    pair = 1 if costs.shared_gpu else 2  # GPUs of the two-model schedules
    runs: list[tuple[str, str]] = []
    for s in sorted(dict.fromkeys(schedules), key=SCHEDULES.index):
        runs.extend((s, j) for j in (judges if s == "speceyes" else ("-",)))
    rows: list[Row] = []
    for c in concurrencies:
        here: list[Row] = []
        for s, j in runs:
            point = None
            if j != "-":
                point = choose_point(costs, points, int(c)) if j == AUTO else point_of[j]
                run_costs = costs if point.judge_max_pixels is None else replace(
                    costs, judge_max_pixels=point.judge_max_pixels
                )
                if point.judge == AGENT_POINT:  # auto chose to skip phases I-III
                    r = simulate_one("agent-only", costs, d, int(c), published_batch, "large")
                    r.schedule = s
                else:
                    r = simulate_one(s, run_costs, draws_of(point), int(c), published_batch,
                                     point.judge)
                if j == AUTO:
                    r.judge = f"{AUTO}:{point.name}"
            else:
                r = simulate_one(s, costs, d, int(c), published_batch, "large")
            lat = r.latencies
            thr = n_queries / r.makespan if r.makespan > 0 else math.inf
            gpus = {"agent-only": 1, "agent-only-2gpu": 2}.get(s, pair)
            here.append(
                Row(
                    schedule=s, concurrency=int(c), throughput=thr,
                    p50_s=float(np.percentile(lat, 50)), p95_s=float(np.percentile(lat, 95)),
                    mean_s=float(lat.mean()),
                    large_batch=r.engines["large"]["mean_batch"],
                    small_batch=r.engines["small"]["mean_batch"],
                    large_util=r.engines["large"]["utilisation"],
                    small_util=r.engines["small"]["utilisation"],
                    vs_agent_only=math.nan, of_ideal=math.nan, judge=r.judge, gpus=gpus,
                    skipped=point.skipped if point is not None else beta * alpha,
                )
            )
        base = next((r.throughput for r in here if r.schedule == "agent-only"), None)
        base2 = next((r.throughput for r in here if r.schedule == "agent-only-2gpu"), None)
        for row in here:
            if base is not None:
                row.vs_agent_only = row.throughput / base
                ideal = base * ideal_gain(row.skipped)
                row.of_ideal = row.throughput / ideal
                row.per_gpu_vs_agent_only = row.throughput / row.gpus / base
            if base2 is not None:
                row.vs_agent_only_2gpu = row.throughput / base2
        if base is not None:
            nan = math.nan
            here.append(
                Row(IDEAL, int(c), base * gain, nan, nan, nan, nan, nan, nan, nan, gain, 1.0,
                    judge="-", gpus=1, per_gpu_vs_agent_only=gain,
                    vs_agent_only_2gpu=base * gain / base2 if base2 else nan)
            )
        rows.extend(here)
    return rows
