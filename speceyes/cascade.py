"""The cascade's speculation: the small model's own short tool loop, one tool call at a time.

Between the paper's gate (stage ``small@0``) and the large agent loop the funnel may try more
stages (docs/cascade.md): ``small@d``, the small model after ``d`` tool calls of its own loop,
and ``large_direct``, the large model's answer without tools. This module holds what the
funnel's ``_deepen`` step needs to run the small model's loop depth by depth: a
:class:`Speculation` opens a loop per query, advances every loop by one tool call, and says what
each loop last looked at, so that the funnel asks the small model its speculative question on
that view (keeping the top-K logits the gate reads) after every call.

Two loops can speculate (:data:`SMALL_AGENTS`):

- ``search``: the training-free search agent (:mod:`speceyes.agents.search`) on the small
  backend: it scores grid cells with the small model's own P(yes) and zooms into the best; it
  needs no tool-call writing, so it runs on a small model that cannot write tool calls (the
  bundled mini-world's).
- ``deepeyes``: the DeepEyes zoom loop (:mod:`speceyes.agents.zoom`) on the small backend, for
  a small model that writes ``<tool_call>`` itself (e.g. Qwen3-VL-2B). A loop whose model
  answers instead of calling the tool ends there: it has seen nothing new.

By default the small loop is the large agent's kind when that is ``search`` and else
``deepeyes`` (:func:`default_small_agent`), with the large agent's own settings where the kinds
match (:func:`make_speculation`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Any, Protocol

from speceyes.agents.search import SearchAgent
from speceyes.agents.zoom import ZoomAgent
from speceyes.backends.base import Backend, BackendError
from speceyes.types import Query

SMALL_AGENTS: tuple[str, ...] = (SearchAgent.name, ZoomAgent.name)  # --small-agent choices


def default_small_agent(large_agent: str | None) -> str:
    """The small model's loop when none is chosen: the search agent beside a search agent
    (a model pair that may not write tool calls), else the DeepEyes loop."""
    return SearchAgent.name if large_agent == SearchAgent.name else ZoomAgent.name


class Speculation(Protocol):
    """The small model's tool loop, stepped one tool call at a time."""

    name: str  # the loop's kind (one of SMALL_AGENTS)

    def start(self, query: Query) -> Any:
        """A loop for ``query``; raises for an unusable image."""
        ...

    def step(self, loops: Sequence[Any]) -> None:
        """One more tool call for each loop that can go on (one batched model call per turn);
        a backend failure raises BackendError."""
        ...

    def tool_calls(self, loop: Any) -> int:
        """The loop's tool calls so far."""
        ...

    def can_go(self, loop: Any) -> bool:
        """Whether another step may make another call."""
        ...

    def seen(self, loop: Any) -> Any:
        """The image the loop last looked at (its last crop; the full image before one)."""
        ...


class SearchSpeculation:
    """The search agent on the small model: each step is one zoom into the best-scored cell."""

    name = SearchAgent.name

    def __init__(self, agent: SearchAgent) -> None:
        self.agent = agent

    def start(self, query: Query) -> Any:
        return self.agent.start_loop(query)

    def step(self, loops: Sequence[Any]) -> None:
        self.agent.search_step(loops)

    def tool_calls(self, loop: Any) -> int:
        return loop.outcome.tool_calls

    def can_go(self, loop: Any) -> bool:
        return loop.searching

    def seen(self, loop: Any) -> Any:
        return loop.crop if loop.crop is not None else loop.image


class ZoomSpeculation:
    """The DeepEyes loop on the small model: each step runs turns until the loop's next valid
    zoom (or its end: an answer, a broken format, its tool-call budget)."""

    name = ZoomAgent.name

    def __init__(self, agent: ZoomAgent) -> None:
        self.agent = agent

    def start(self, query: Query) -> Any:
        return self.agent.start_loop(query)

    def step(self, loops: Sequence[Any]) -> None:
        before = {id(lp): lp.outcome.tool_calls for lp in loops}
        pending = [lp for lp in loops if not lp.done]
        # Each turn ends a loop, zooms, or spends one of its budgeted calls on an invalid
        # one, so this ends within the budget.
        while pending:
            self.agent.advance(pending)
            pending = [
                lp for lp in pending if not lp.done and lp.outcome.tool_calls == before[id(lp)]
            ]
        for lp in loops:
            if lp.outcome.error is not None:  # advance ends every loop of a failed turn
                raise BackendError(lp.outcome.error)

    def tool_calls(self, loop: Any) -> int:
        return loop.outcome.tool_calls

    def can_go(self, loop: Any) -> bool:
        return not loop.done

    def seen(self, loop: Any) -> Any:
        return last_image(loop.messages)


def last_image(messages: Sequence[dict]) -> Any:
    """The last image part of a conversation (a tool response's crop, else the question's)."""
    for m in reversed(messages):
        content = m["content"]
        if isinstance(content, list):
            for part in reversed(content):
                if part.get("type") == "image":
                    return part["image"]
    raise ValueError("the conversation holds no image")


def make_speculation(kind: str, small: Backend, depth: int, like: Any | None = None) -> Speculation:
    """The small model's loop ``kind`` on ``small``, making at most ``depth`` tool calls; when
    ``like`` (the large agent) is of the same kind, with its settings."""
    if kind == SearchAgent.name:
        kw = _settings_of(like, SearchAgent)
        kw["depth"] = depth
        return SearchSpeculation(SearchAgent(small, **kw))
    if kind == ZoomAgent.name:
        kw = _settings_of(like, ZoomAgent)
        kw["max_tool_calls"] = depth
        return ZoomSpeculation(ZoomAgent(small, **kw))
    raise ValueError(f"unknown small agent {kind!r}; choose from {', '.join(SMALL_AGENTS)}")


def _settings_of(agent: Any | None, cls: type) -> dict[str, Any]:
    """The settings ``agent`` was built with, when it is a ``cls`` (its fields are attributes
    of the same names); else none (the class's defaults)."""
    if not isinstance(agent, cls):
        return {}
    return {f.name: getattr(agent, f.name) for f in fields(cls.Settings) if hasattr(agent, f.name)}


def stage_record(
    stage: str,
    answer: str | None,
    confidence: float | None,
    accepted: bool,
    tau: float,
    seconds: float,
    tool_calls: int = 0,
    *,
    error: str | None = None,
) -> dict[str, Any]:
    """One stage of one query, as ``Result.stages`` logs it. ``accepted``: the stage's gate
    passed (confidence > tau; ``small@0`` only for a query judged tool-free); the query's
    answer is that of its first accepted stage. A stage whose model call failed has no answer
    and its ``error``."""
    record: dict[str, Any] = {
        "stage": stage,
        "answer": answer,
        "confidence": confidence,
        "accepted": accepted,
        "tau": tau,
        "seconds": round(seconds, 6),
        "tool_calls": tool_calls,
    }
    if error is not None:
        record["error"] = error
    return record
