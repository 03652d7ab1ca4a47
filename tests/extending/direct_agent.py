"""A one-turn agent: the large model answers the question itself, shown the whole image once and
given no tools (a baseline for what the tools add)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from speceyes import prompts
from speceyes.agents.base import AgentOutcome, LoopAgent, fallback_answer
from speceyes.backends.base import Backend, Messages
from speceyes.images import load_image
from speceyes.types import Query

DEFAULT_MAX_NEW_TOKENS = 64


@dataclass
class DirectLoop:
    """One query's loop: what the scheduler reads (outcome, done) and what LoopAgent reads
    (messages, to keep a turn inside the context length; started, to time the loop)."""

    messages: Messages
    outcome: AgentOutcome = field(default_factory=lambda: AgentOutcome(answer=""))
    done: bool = False
    started: float = field(default_factory=time.perf_counter)


class DirectAgent(LoopAgent):
    """The large model answers in one turn, asked as the small model is."""

    name = "direct"  # what --agent takes and run.json logs
    default_tau = 0.9  # the gate threshold when no --tau is given

    @dataclass
    class Settings:
        """Its keyword arguments. ``max_new_tokens`` is a loop budget: --agent-max-tokens sets
        it, else the protocol's."""

        max_new_tokens: int | None = None

    def __init__(self, backend: Backend, *, max_new_tokens: int | None = None) -> None:
        self.backend = backend
        self.max_new_tokens = max_new_tokens or DEFAULT_MAX_NEW_TOKENS

    def first_messages(self, query: Query) -> Messages:
        image = load_image(query.image, copy=False)
        return prompts.small_messages(image, query.question, query.options)

    def start_loop(self, query: Query) -> DirectLoop:
        return DirectLoop(self.first_messages(query))

    def _turn(self, active: list[DirectLoop]) -> None:
        """One batched turn: every loop answers and ends."""
        turns = self._chat(self.backend, active, stop=())
        for loop, turn in zip(active, turns, strict=True):
            loop.outcome.answer = fallback_answer(turn.text)
            loop.outcome.turns = 1
            loop.outcome.trace.append(
                {"type": "assistant", "text": turn.text, "finish": turn.finish_reason}
            )
            loop.done = True
