"""Optional LLM judge for free-form answers, over any OpenAI-compatible endpoint (off by default).

Multiple-choice and yes/no questions are always scored by the deterministic parsers in
``scoring``; the judge is asked only about free-form answers that do not match the reference
exactly, so a run's score never depends on a model where a rule can decide.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from speceyes.bench import scoring

JUDGE_PROMPT = (
    "You are grading an answer to a question about an image.\n"
    "Question: {question}\n"
    "Reference answer: {reference}\n"
    "Candidate answer: {candidate}\n"
    "Does the candidate answer mean the same as the reference answer? Answer only yes or no."
)


class LLMJudge:
    """Asks a chat model whether a free-form prediction matches the reference (greedy, 3 tokens)."""

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        *,
        api_key: str = "EMPTY",
        timeout: float = 60.0,
        max_retries: int = 2,
    ) -> None:
        import openai

        # Loopback judges must not be routed through a proxy named in the environment.
        self._client = openai.OpenAI(
            base_url=base_url,
            api_key=api_key,
            timeout=timeout,
            max_retries=max_retries,
            http_client=openai.DefaultHttpxClient(trust_env=False),
        )
        self.base_url = base_url
        self.model = model or self._client.models.list().data[0].id
        self.calls = 0
        self._cache: dict[tuple[str, str, str], bool] = {}
        self._lock = threading.Lock()

    def __call__(self, question: str, reference: str, candidate: str) -> bool:
        key = (question, reference, candidate)
        with self._lock:
            if key in self._cache:
                return self._cache[key]
        prompt = JUDGE_PROMPT.format(question=question, reference=reference, candidate=candidate)
        resp = self._client.chat.completions.create(
            model=self.model,
            messages=[{"role": "user", "content": prompt}],
            temperature=0.0,
            max_tokens=3,
        )
        verdict = scoring.parse_yes_no(resp.choices[0].message.content or "") == "yes"
        with self._lock:
            self.calls += 1
            self._cache[key] = verdict
        return verdict

    def close(self) -> None:
        self._client.close()


def make_scorer(judge: LLMJudge | None) -> Callable[[Any, str | None], bool]:
    """``is_correct`` that falls back to the judge for free-form answers without an exact match."""

    def score(query: Any, prediction: str | None) -> bool:
        if scoring.is_correct(query, prediction):
            return True
        gold = getattr(query, "answer", None)
        free_form = (
            judge is not None
            and gold is not None
            and prediction
            and not getattr(query, "options", None)
            and str(gold).strip().lower() not in ("yes", "no")
        )
        if not free_form:
            return False
        return judge(query.question, str(gold), prediction)

    return score
