"""The one loop driver (agents.base.drive_loops) and the advance/end shape LoopAgent gives
every agent: continuous batching, failures that stay with their query, the end of each loop."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from speceyes.agents.base import AgentOutcome, LoopAgent
from speceyes.backends.base import BackendError


@dataclass
class _Loop:
    n: int
    outcome: AgentOutcome = field(default_factory=lambda: AgentOutcome(answer=""))
    done: bool = False
    started: float = field(default_factory=time.perf_counter)


class _Counter(LoopAgent):
    """Query n ends after n turns; n < 0 cannot start; n == 99 breaks the turn it is in;
    n == 50 makes the backend fail its batch."""

    name = "counter"
    max_new_tokens = 1

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def start_loop(self, query: int) -> _Loop:
        if query < 0:
            raise ValueError("bad input")
        return _Loop(query)

    def _turn(self, active: list[_Loop]) -> None:
        self.batches.append([lp.n for lp in active])
        if any(lp.n == 99 for lp in active):
            raise KeyError("broken turn")
        if any(lp.n == 50 for lp in active):
            raise BackendError("server down")
        for lp in active:
            lp.outcome.turns += 1
            if lp.outcome.turns >= lp.n:
                lp.outcome.answer, lp.done = str(lp.n), True


def test_continuous_batching_in_input_order():
    agent = _Counter()
    outs = agent.run([3, 1, 2], max_active=2)
    assert [o.answer for o in outs] == ["3", "1", "2"] and all(o.error is None for o in outs)
    assert agent.batches == [[3, 1], [3, 2], [3, 2]]  # 1 ended: 2 took its place at once
    assert all(o.trace[-1]["type"] == "end" for o in outs)


def test_failures_stay_with_their_query():
    outs = _Counter().run([-1, 99, 2, 50])
    assert outs[0].error == "ValueError: bad input"
    assert outs[1].error == "KeyError: 'broken turn'"  # its batch-mates go on without it
    assert outs[2].answer == "2" and outs[2].error is None
    assert outs[3].error == "server down" and outs[3].trace[-1]["type"] == "end"
