"""The four phases of SpecEyes over a batch of queries.

I   tool-need judgment on the large model: P(tool) per query; "yes" goes straight to IV.
II  speculative answers from the small model, keeping the top-K logits of every token.
III the cognitive gate: accept iff sigmoid(alpha * separability) > tau.
IV  the agent loop on the large model for everything not accepted.

The baselines are modes of the same funnel: ``agent`` (IV for all), ``small`` (II for all) and
``both`` (every phase for every query, routed as ``speceyes`` would, so that any gate setting can
be replayed offline from the logs).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Literal

import numpy as np

from speceyes import gate, prompts
from speceyes.agents.base import AgentOutcome
from speceyes.backends.base import Backend, BackendError, JudgeMode
from speceyes.images import load_image
from speceyes.types import Query, Result

Mode = Literal["speceyes", "agent", "small", "both"]
MODES: tuple[str, ...] = ("speceyes", "agent", "small", "both")


class Agent:
    """What the funnel needs of an agent: run loops for a batch of queries."""

    name: str

    def run(self, queries: Sequence[Query]) -> list[AgentOutcome]:  # pragma: no cover
        raise NotImplementedError


@dataclass
class FunnelConfig:
    mode: Mode = "speceyes"
    tau: float = 0.98
    top_k: int = gate.DEFAULT_TOP_K
    agg: gate.Aggregation = "min"
    alpha: float = gate.DEFAULT_ALPHA
    judge_mode: JudgeMode = "logit"
    judge_threshold: float = 0.5  # tool iff P(tool) >= threshold; 0.5 equals greedy yes-vs-no
    batch_size: int = 8
    max_new_tokens: int = 20

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose from {', '.join(MODES)}")
        if self.agg not in gate.AGGREGATIONS:
            raise ValueError(f"unknown aggregation {self.agg!r}")
        if not 0.0 <= self.tau <= 1.0:
            raise ValueError(f"tau must be in [0, 1], got {self.tau}")
        if self.top_k < 2:
            raise ValueError("top_k must be at least 2")
        if self.batch_size < 1:
            raise ValueError("batch_size must be at least 1")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class FunnelStats:
    """Running counts: beta = judged tool-free / judged, alpha = accepted / judged tool-free."""

    queries: int = 0
    judged: int = 0
    tool_free: int = 0
    accepted: int = 0
    errors: int = 0

    @property
    def beta(self) -> float | None:
        return self.tool_free / self.judged if self.judged else None

    @property
    def alpha(self) -> float | None:
        return self.accepted / self.tool_free if self.tool_free else None


class Funnel:
    def __init__(
        self,
        small: Backend | None,
        large: Backend | None,
        agent: Agent | None,
        config: FunnelConfig | None = None,
    ) -> None:
        self.config = config or FunnelConfig()
        self.config.validate()
        mode = self.config.mode
        if mode in ("speceyes", "both", "agent") and (large is None or agent is None):
            raise ValueError(f"mode {mode!r} needs the large model and its agent")
        if mode in ("speceyes", "both", "small") and small is None:
            raise ValueError(f"mode {mode!r} needs the small model")
        self.small, self.large, self.agent = small, large, agent
        self.stats = FunnelStats()

    # ---- public ---------------------------------------------------------------------------
    def run(
        self, queries: Iterable[Query], on_result: Callable[[Result], None] | None = None
    ) -> list[Result]:
        results = []
        for r in self.iter_results(queries):
            if on_result is not None:
                on_result(r)
            results.append(r)
        return results

    def iter_results(self, queries: Iterable[Query]) -> Iterator[Result]:
        """Results in input order, one batch at a time, as soon as each batch is finished."""
        batch: list[Query] = []
        for q in queries:
            batch.append(q)
            if len(batch) == self.config.batch_size:
                yield from self.run_batch(batch)
                batch = []
        if batch:
            yield from self.run_batch(batch)

    def run_batch(self, queries: Sequence[Query]) -> list[Result]:
        cfg = self.config
        results: dict[int, Result] = {}
        loaded: list[tuple[int, Query]] = []
        for i, q in enumerate(queries):
            try:
                loaded.append((i, replace(q, image=load_image(q.image))))
            except (OSError, ValueError) as e:
                results[i] = Result(id=q.id, answer="", route="error", error=str(e))
        self.stats.queries += len(queries)
        self.stats.errors += len(results)
        live = dict(loaded)

        if cfg.mode == "agent":
            self._phase_agent(live, list(live), results, route="agent_only")
        elif cfg.mode == "small":
            self._phase_small(live, list(live), results)
            for i in live:
                r = results[i]
                r.route, r.answer = "small_only", r.small_answer or ""
        else:
            to_small = self._phase_judge(live, results)
            self._phase_small(live, to_small, results)
            accepted = [i for i in to_small if gate.accept(results[i].confidence, cfg.tau)]
            self.stats.tool_free += len(to_small)
            self.stats.accepted += len(accepted)
            for i in accepted:
                results[i].route, results[i].answer = "small", results[i].small_answer or ""
            taken = set(accepted)
            rest = [i for i in live if i not in taken]
            # In "both" mode every query also runs the agent; routing is unchanged.
            self._phase_agent(live, list(live) if cfg.mode == "both" else rest, results, None)
            for i in rest:
                r = results[i]
                r.answer = r.agent_answer or ""
                r.route = "agent_after_judge" if r.judge_tool else "agent_after_gate"
        return [results[i] for i in range(len(queries))]

    # ---- phases ---------------------------------------------------------------------------
    def _chunks(self, idx: Sequence[int]) -> Iterator[list[int]]:
        bs = self.config.batch_size
        for s in range(0, len(idx), bs):
            yield list(idx[s : s + bs])

    def _result(self, results: dict[int, Result], i: int, q: Query) -> Result:
        if i not in results:
            results[i] = Result(id=q.id, answer="", route="error")
        return results[i]

    def _phase_judge(self, live: dict[int, Query], results: dict[int, Result]) -> list[int]:
        """Phase I: returns the indices judged tool-free."""
        cfg = self.config
        to_small = []
        for chunk in self._chunks(list(live)):
            msgs = [
                prompts.judge_messages(live[i].image, live[i].question, live[i].options)
                for i in chunk
            ]
            t0 = time.perf_counter()
            try:
                p_tools = self.large.judge(msgs, mode=cfg.judge_mode)
            except BackendError as e:
                # A failed judgment is treated as "tools needed": correctness first.
                p_tools = [1.0] * len(chunk)
                for i in chunk:
                    self._result(results, i, live[i]).trace.append(
                        {"type": "judge_error", "error": str(e)}
                    )
            per = (time.perf_counter() - t0) / len(chunk)
            for i, p in zip(chunk, p_tools, strict=True):
                r = self._result(results, i, live[i])
                r.p_tool = float(p)
                r.judge_tool = bool(p >= cfg.judge_threshold)
                r.timings["judge"] = per
                if not r.judge_tool:
                    to_small.append(i)
            self.stats.judged += len(chunk)
        return to_small

    def _phase_small(
        self, live: dict[int, Query], idx: Sequence[int], results: dict[int, Result]
    ) -> None:
        """Phases II and III: speculative answers and their confidence."""
        cfg = self.config
        for chunk in self._chunks(idx):
            msgs = [
                prompts.small_messages(live[i].image, live[i].question, live[i].options)
                for i in chunk
            ]
            t0 = time.perf_counter()
            try:
                answers = self.small.answer(msgs, max_new_tokens=cfg.max_new_tokens, top_k=cfg.top_k)
            except BackendError as e:
                answers = None
                err = str(e)
            per = (time.perf_counter() - t0) / len(chunk)
            if answers is None:
                for i in chunk:
                    r = self._result(results, i, live[i])
                    r.timings["small"] = per
                    r.trace.append({"type": "small_error", "error": err})
                continue
            t1 = time.perf_counter()
            conf = gate.batch_confidence(
                [a.topk for a in answers], top_k=cfg.top_k, agg=cfg.agg, alpha=cfg.alpha
            )
            per_gate = (time.perf_counter() - t1) / len(chunk)
            for i, a, c in zip(chunk, answers, conf, strict=True):
                r = self._result(results, i, live[i])
                r.small_answer = a.text
                r.small_topk = a.topk
                r.confidence = None if np.isnan(c) else float(c)
                r.timings["small"] = per
                r.timings["gate"] = per_gate
                r.trace.append({"type": "small", "text": a.text, "tokens": len(a.token_ids)})

    def _phase_agent(
        self,
        live: dict[int, Query],
        idx: Sequence[int],
        results: dict[int, Result],
        route: str | None,
    ) -> None:
        """Phase IV: the agent loop for the given queries, many loops per batch."""
        for chunk in self._chunks(idx):
            t0 = time.perf_counter()
            outcomes = self.agent.run([live[i] for i in chunk])
            per = (time.perf_counter() - t0) / len(chunk)
            for i, out in zip(chunk, outcomes, strict=True):
                r = self._result(results, i, live[i])
                r.agent_answer = out.answer
                r.tool_calls = out.tool_calls
                r.invalid_tool_calls = out.invalid_tool_calls
                r.timings["agent"] = per
                r.trace.extend(out.trace)
                if out.error:
                    r.error = out.error
                if route is not None:
                    r.route, r.answer = route, out.answer  # type: ignore[assignment]
