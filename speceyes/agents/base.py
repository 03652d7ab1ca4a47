"""What every agent loop returns, the one driver that runs loops in continuous batches, the
shape of an agent step, and the small pieces of text handling the agents share."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from speceyes.backends.base import BackendError, context_limit, estimate_prompt_tokens, per_item

if TYPE_CHECKING:
    from speceyes.backends.base import Backend
    from speceyes.images import View
    from speceyes.types import ChatTurn

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_THINK_END = "</think>"
CONTEXT_BUDGET = "context budget"  # why a loop ended before a turn that would not fit


# the help of both zoom agents' ``fill_view`` setting (what crop_min_pixels reads)
FILL_VIEW_HELP = (
    "1: show each crop with as many pixels as the full image's view, upscaled, as the "
    "mini-world models were trained; 0: at the processor's own floor, as DeepEyes runs"
)


def crop_min_pixels(backend: Backend, view: View, fill_view: bool) -> int:
    """The pixel floor a zoom crop is resized to: the backend's own (the processor's, as the
    published agents run), or with ``fill_view`` as many pixels as the full image's view, never
    more than the budget, so that a model trained on crops at its view's scale (the mini world's)
    reads them at that scale."""
    if fill_view:
        return min(backend.max_pixels, view.view_w * view.view_h)
    return backend.min_pixels


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
    """One query's agent loop: its outcome so far and whether it has ended."""

    outcome: AgentOutcome
    done: bool


class Agent(Protocol):
    """What the schedulers need of an agent: open loops and advance many by one batched turn."""

    name: str  # the one name it is registered and chosen under
    default_tau: float  # the gate threshold used when none is given
    # whether its first prompt can be shared with the prefix judge (a prefix cache then serves
    # the agent's first turn from the judge's prefill)
    shares_first_prompt: bool

    def start_loop(self, query: Any) -> Loop: ...

    def advance(self, loops: Sequence[Any]) -> None: ...

    def first_messages(self, query: Any) -> list[dict]:
        """The conversation its first model call sends for ``query``, with no side effects
        (the prefix judge puts its question after it, so a server's prefix cache is shared)."""
        ...


EMPTY = object()  # ``take`` of drive_loops: nothing to take right now
END = object()  # ``take`` of drive_loops: nothing more will come


def drive_loops(
    agent: Agent,
    take: Callable[[bool], Any],
    max_active: int | None,
    dropped: Callable[[Any], bool] | None = None,
) -> Iterator[tuple[Any, AgentOutcome, float]]:
    """Run agent loops with continuous batching; yields (key, outcome, seconds) as each ends.

    ``take(block)`` returns the next ``(key, query)``, ``EMPTY`` when none is ready (only when
    not blocking) or ``END``. It blocks only when no loop is active, so running loops never
    wait for new work. With ``max_active`` at most that many loops are in flight and a finished
    loop's place goes to the next query. ``seconds`` is the loop's share of the batched turns it
    took part in, so the per-query agent times of a batch add up to the batch's wall time. A
    query whose input or turn breaks the agent ends alone, with the error.
    """
    active: list[tuple[Any, Loop]] = []
    cost: dict[int, float] = {}
    exhausted = False
    while True:
        while not exhausted and (max_active is None or len(active) < max_active):
            nxt = take(not active)
            if nxt is EMPTY:
                break
            if nxt is END:
                exhausted = True
                break
            key, q = nxt
            try:
                loop = agent.start_loop(q)
            except Exception as e:  # this query's input broke the agent: only this one
                yield key, AgentOutcome(answer="", error=f"{type(e).__name__}: {e}"), 0.0
                continue
            active.append((key, loop))
            cost[id(loop)] = 0.0
        if dropped is not None:
            for key, lp in active:
                if dropped(key):
                    cost.pop(id(lp))
            active = [(key, lp) for key, lp in active if id(lp) in cost]
        if not active:
            if exhausted:
                return
            continue
        t0 = time.perf_counter()
        loops = [lp for _, lp in active]
        errors = per_item(lambda ls: (agent.advance(ls), [None] * len(ls))[1], loops)
        share = (time.perf_counter() - t0) / len(active)
        still = []
        for (key, lp), e in zip(active, errors, strict=True):
            cost[id(lp)] += share
            if e is not None:
                err = AgentOutcome(answer="", error=f"{type(e).__name__}: {e}")
                yield key, err, cost.pop(id(lp))
            elif lp.done:
                yield key, lp.outcome, cost.pop(id(lp))
            else:
                still.append((key, lp))
        active = still


class LoopAgent:
    """The shape every agent shares: ``advance`` runs one batched turn of the agent's own
    (``_turn``) for the unfinished loops, ends them all with a backend's failure, and closes
    each loop that finished (``_end``); ``run`` drives whole queries through ``drive_loops``."""

    name: str
    default_tau: float = 0.98
    shares_first_prompt: bool = True
    max_new_tokens: int
    context_budget_ends: int = 0  # loops ended by the context budget (see _fit_context)

    def start_loop(self, query: Any) -> Any:  # pragma: no cover - implemented by agents
        raise NotImplementedError

    def _turn(self, active: list[Any]) -> None:  # pragma: no cover - implemented by agents
        """One batched turn for ``active`` (no loop done); sets ``done`` on those that end."""
        raise NotImplementedError

    def advance(self, loops: Sequence[Any]) -> None:
        """One batched turn for every given unfinished loop."""
        active = [lp for lp in loops if not lp.done]
        if not active:
            return
        try:
            self._fit_context(active)
            turn = [lp for lp in active if not lp.done]
            if turn:
                self._turn(turn)
        except BackendError as e:
            for lp in active:
                if not lp.done:
                    lp.outcome.error, lp.done = str(e), True
        for lp in active:
            if lp.done:
                self._end(lp)

    def _fit_context(self, active: Sequence[Any]) -> None:
        """End each loop whose next turn would pass the backend's context length: its
        conversation (estimated, ``estimate_prompt_tokens``) plus ``max_new_tokens`` is more
        than ``max_model_len``. The loop keeps the answer its last turn gave, and its trace says
        why; a server would refuse the turn instead (vLLM: 400). Loops without a growing
        conversation (``messages``) are left alone."""
        backend = getattr(self, "backend", None)
        limit = None if backend is None else context_limit(backend)
        if limit is None:
            return
        for lp in active:
            messages = getattr(lp, "messages", None)
            if not messages:
                continue
            prompt = estimate_prompt_tokens(backend, messages)
            if prompt + self.max_new_tokens <= limit:
                continue
            last = next((m for m in reversed(messages) if m["role"] == "assistant"), None)
            said = last["content"] if last is not None and isinstance(last["content"], str) else ""
            lp.outcome.answer = fallback_answer(said.split("<tool_call>")[0]) if said else ""
            lp.outcome.trace.append(
                {
                    "type": "limit",
                    "reason": CONTEXT_BUDGET,
                    "error": f"{CONTEXT_BUDGET}: ~{prompt} prompt tokens + {self.max_new_tokens} "
                    f"new > max_model_len {limit}",
                }
            )
            lp.done = True
            self.context_budget_ends += 1

    def _end(self, loop: Any) -> None:
        loop.outcome.trace.append(
            {"type": "end", "seconds": round(time.perf_counter() - loop.started, 6)}
        )

    def _chat(self, backend: Backend, loops: Sequence[Any], stop: Sequence[str]) -> list[ChatTurn]:
        """One assistant turn per loop's conversation, ended by ``stop``."""
        return backend.chat(
            [lp.messages for lp in loops], stop=stop, max_new_tokens=self.max_new_tokens
        )

    def run(self, queries: Sequence[Any], max_active: int | None = None) -> list[AgentOutcome]:
        """Every query's loop run to its end (continuous batching, at most ``max_active`` in
        flight); outcomes in input order."""
        pending = iter(enumerate(queries))
        outcomes: list[AgentOutcome | None] = [None] * len(queries)
        for i, outcome, _ in drive_loops(self, lambda block: next(pending, END), max_active):
            outcomes[i] = outcome
        return [o if o is not None else AgentOutcome(answer="", error="not run") for o in outcomes]
