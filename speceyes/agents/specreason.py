"""SpecReason baseline: speculation at the level of each agent step.

The small model proposes every assistant turn of the DeepEyes loop; the large model scores the
proposal 0-9 in one forward step (the probability-weighted digit, from its next-token
distribution), and keeps it at a score of 7 or more, else writes that turn itself. Tool calls,
crops and answers then go through the same parser and cropper as the plain agent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from speceyes import prompts
from speceyes.agents.zoom import ZoomAgent, _Loop
from speceyes.backends.base import Backend

DIGITS = tuple(str(d) for d in range(10))
ACCEPT_SCORE = 7.0


class SpecReasonAgent(ZoomAgent):
    name = "specreason"
    needs_small = True  # built with the small model as well: chosen by --mode specreason

    @dataclass
    class Settings(ZoomAgent.Settings):
        accept_score: float = ACCEPT_SCORE

    def __init__(self, small: Backend, large: Backend, *, accept_score: float = ACCEPT_SCORE, **kw):
        super().__init__(large, **kw)
        self.small = small
        self.accept_score = accept_score

    def _scores(self, loops: Sequence[_Loop], proposals: Sequence[str]) -> np.ndarray:
        batch = [
            [
                *lp.messages,
                {"role": "assistant", "content": text},
                {"role": "user", "content": prompts.STEP_SCORE_PROMPT},
            ]
            for lp, text in zip(loops, proposals, strict=True)
        ]
        probs = self.backend.next_token_probs(batch, DIGITS)
        mass = probs.sum(axis=1)
        return (probs * np.arange(10)).sum(axis=1) / np.maximum(mass, 1e-30)

    def _turn(self, active: list[_Loop]) -> None:
        proposals = self._chat(self.small, active, prompts.DEEPEYES_STOP)
        scores = self._scores(active, [t.text for t in proposals])
        redo = [j for j, s in enumerate(scores) if s < self.accept_score]
        rewritten = self._chat(self.backend, [active[j] for j in redo], prompts.DEEPEYES_STOP)
        turns = list(proposals)
        for j, t in zip(redo, rewritten, strict=True):
            turns[j] = t
        for j, (lp, turn) in enumerate(zip(active, turns, strict=True)):
            lp.outcome.trace.append(
                {"type": "step_score", "score": float(scores[j]), "accepted": j not in redo}
            )
            self._step(lp, turn.text, turn.finish_reason)
