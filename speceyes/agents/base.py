"""What every agent loop returns, and the small pieces of text handling they share."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from speceyes.backends.base import BackendError

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_THINK_END = "</think>"


@dataclass
class AgentOutcome:
    answer: str
    tool_calls: int = 0
    invalid_tool_calls: int = 0
    turns: int = 0
    trace: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None


def last_answer(text: str) -> str | None:
    """The content of the last complete <answer>...</answer>, stripped; None if there is none."""
    found = _ANSWER.findall(text)
    return found[-1].strip() if found else None


def fallback_answer(text: str) -> str:
    """Best effort when the model never closed an <answer>: the text after its reasoning."""
    if "<answer>" in text:
        return text.rsplit("<answer>", 1)[1].strip()
    if _THINK_END in text:
        text = text.rsplit(_THINK_END, 1)[1]
    return text.strip()


class Loop(Protocol):
    outcome: AgentOutcome
    done: bool


class LoopAgent:
    """Continuous batching over an agent's incremental API (``start_loop`` and ``advance``)."""

    def start_loop(self, query: Any) -> Loop:  # pragma: no cover - implemented by agents
        raise NotImplementedError

    def advance(self, loops: Sequence[Any]) -> None:  # pragma: no cover
        raise NotImplementedError

    def _turns(self, backend: Any, active: Sequence[Any], stop: Sequence[str]) -> list | None:
        """One batched turn for ``active``; a backend failure ends those loops with its message."""
        try:
            return backend.chat(
                [lp.messages for lp in active], stop=stop, max_new_tokens=self.max_new_tokens
            )
        except BackendError as e:
            for lp in active:
                lp.outcome.error, lp.done = str(e), True
            return None

    def run(self, queries: Sequence[Any], max_active: int | None = None) -> list[AgentOutcome]:
        """Run every query's loop to its end.

        Loops advance together, one batched turn per step; with ``max_active`` at most that many
        are in flight and a finished loop's place goes to the next query (continuous batching).
        """
        outcomes: list[AgentOutcome | None] = [None] * len(queries)
        pending = list(enumerate(queries))[::-1]
        active: list[tuple[int, Any]] = []
        while pending or active:
            while pending and (max_active is None or len(active) < max_active):
                i, q = pending.pop()
                try:
                    active.append((i, self.start_loop(q)))
                except (OSError, ValueError) as e:
                    outcomes[i] = AgentOutcome(answer="", error=f"{type(e).__name__}: {e}")
            self.advance([lp for _, lp in active])
            for i, lp in active:
                if lp.done:
                    outcomes[i] = lp.outcome
            active = [(i, lp) for i, lp in active if not lp.done]
        return [o if o is not None else AgentOutcome(answer="", error="not run") for o in outcomes]
