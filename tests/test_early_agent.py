"""early_agent: a batch's agent loops start beside phases I-III while the funnel is idle, on
tiny real models; answers stay those of the funnel that waits."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from speceyes import funnel as funnel_module
from speceyes.agents.zoom import ZoomAgent
from speceyes.funnel import Funnel, FunnelConfig
from tests.test_funnel import queries


class Timed:
    """A backend that records when each of its calls starts and ends (and may wait first)."""

    def __init__(self, inner: Any, delay: float = 0.0) -> None:
        self.inner, self.delay = inner, delay
        self.calls: list[tuple[str, float, float]] = []
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _timed(self, name: str, *args: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        time.sleep(self.delay)
        out = getattr(self.inner, name)(*args, **kw)
        with self._lock:
            self.calls.append((name, t0, time.perf_counter()))
        return out

    def answer(self, *args: Any, **kw: Any) -> Any:
        return self._timed("answer", *args, **kw)

    def chat(self, *args: Any, **kw: Any) -> Any:
        return self._timed("chat", *args, **kw)

    def next_token_probs(self, *args: Any, **kw: Any) -> Any:
        return self._timed("next_token_probs", *args, **kw)


def _funnel(q3, q25, **cfg) -> tuple[Funnel, Timed, Timed]:
    small, large = Timed(q3, delay=0.4), Timed(q25)
    agent = ZoomAgent(large, max_new_tokens=16)
    base = {"batch_size": 1, "schedule": "pipelined", "max_agent_loops": 2}
    return Funnel(small, large, agent, FunnelConfig(**{**base, **cfg})), small, large


@pytest.mark.parametrize("early", [0, 1])
def test_a_lone_query_that_needs_the_agent_starts_it_before_the_gate(q3, q25, early):
    """One query, judged tool-free and refused by the gate (tau 1): with early_agent its first
    agent turn begins while the (slowed) small model is still answering; without, after."""
    f, small, large = _funnel(q3, q25, tau=1.0, early_agent=early)
    (r,) = f.run(queries(1))
    assert r.route == "agent_after_gate" and r.answer == r.agent_answer
    small_end = max(end for name, _, end in small.calls if name == "answer")
    first_turn = min(start for name, start, _ in large.calls if name == "chat")
    assert (first_turn < small_end) is bool(early)
    assert f.stats.early_agent == early and f.stats.agent_dropped == 0
    assert any(s["type"] == "early_agent" for s in r.trace) is bool(early)


def test_early_loops_give_the_waiting_funnels_answers(q3, q25, monkeypatch):
    """Every batch raced (early_agent above any load, and at any share answered early): the
    gate's answers drop their loops, the rest keep theirs, and every route and answer equals
    the funnel that waits."""
    monkeypatch.setattr(funnel_module, "EARLY_AGENT_MAX_SHARE", 1.01)
    qs = queries(4)
    ref, _, _ = _funnel(q3, q25, tau=0.0, early_agent=0)
    confidences = sorted(r.confidence for r in ref.run(qs))
    tau = confidences[len(confidences) // 2]  # about half answered early, half by the agent

    def run(early: int) -> tuple[Funnel, dict]:
        f, _, _ = _funnel(q3, q25, tau=tau, early_agent=early)
        return f, {r.id: r for r in f.run(qs)}

    (f0, waited), (f1, raced) = run(0), run(100)
    fields = ("route", "answer", "small_answer", "agent_answer", "tool_calls", "error")
    for i, r in waited.items():
        assert [getattr(raced[i], k) for k in fields] == [getattr(r, k) for k in fields]
    agent_routes = sum(r.route.startswith("agent") for r in waited.values())
    assert 0 < agent_routes < len(qs)
    assert f1.stats.early_agent == len(qs)
    assert f1.stats.agent_dropped == len(qs) - agent_routes
    assert f0.stats.early_agent == f0.stats.agent_dropped == 0
    assert f1._in_agent == 0  # every loop counted out, dropped or settled


def test_a_funnel_that_answers_most_queries_early_stops_starting_the_agent(q3, q25):
    """tau 0: every query is answered early. The first (nothing settled yet) starts its loop and
    drops it; once it has settled, half or more of the settled queries were early, so the next
    ones wait for the gate, and no loop of theirs runs."""
    f, _, large = _funnel(q3, q25, tau=0.0, early_agent=100)
    res = f.run(queries(3))
    assert all(r.route == "small" for r in res)
    assert f.stats.early_agent == f.stats.agent_dropped == 1
    assert f._in_agent == 0


def test_a_busy_funnel_waits(q3, q25):
    """Two queries in one batch are more than early_agent 1: the funnel waits for the gate."""
    f, _, _ = _funnel(q3, q25, tau=1.0, batch_size=2, early_agent=1)
    f.run(queries(2))
    assert f.stats.early_agent == 0


def test_early_agent_must_not_be_negative():
    with pytest.raises(ValueError, match="early_agent"):
        FunnelConfig(early_agent=-1).validate()


@pytest.mark.parametrize("alpha", [0.2, 0.9])
def test_under_auto_the_points_share_decides(q3, q25, alpha):
    """Under --judge auto a point's share answered early is the chooser's (from its calibrated
    rate on): a point calibrated to answer 90% early never starts the agent early, one at 20%
    does, whatever its first queries do (tau 1: none of them is answered early)."""
    point = {"judge": "large", "tau": 1.0, "beta": 1.0, "alpha": alpha}
    f, _, _ = _funnel(q3, q25, judge="auto", points=[point], early_agent=1)
    f.run(queries(1))
    assert f.stats.early_agent == (1 if alpha < 0.5 else 0)
