"""Phase I's tool probability (speceyes.judging) over any backend: its one fallback, its modes.

Every real backend is checked against it in tests/tools/backend_contract.py; here a backend that
returns fixed word probabilities shows the rule itself.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from speceyes.judging import (
    JUDGE_DECODE_TOKENS,
    JUDGE_LOGPROBS,
    JUDGE_WORDS,
    NO_VARIANTS,
    UNDECIDED,
    YES_VARIANTS,
    decode_rule_p_tool,
    tool_probability,
)
from speceyes.types import ChatTurn


class FixedWords:
    """A backend whose next-token probabilities and replies are given."""

    def __init__(self, rows, replies=()):
        self.rows, self.replies, self.calls = np.asarray(rows, dtype=float), list(replies), []

    def next_token_probs(self, batch, words, top_logprobs=None):
        self.calls.append(("next_token_probs", tuple(words), top_logprobs))
        return self.rows[: len(batch)]

    def chat(self, batch, stop=(), max_new_tokens=1024):
        self.calls.append(("chat", tuple(stop), max_new_tokens))
        return [ChatTurn(text=t, finish_reason="stop") for t in self.replies[: len(batch)]]


def _row(yes: float, no: float) -> list[float]:
    """yes and no mass spread over the first two variants of each word."""
    row = [0.0] * len(JUDGE_WORDS)
    row[0], row[1] = yes / 2, yes / 2
    row[len(YES_VARIANTS)], row[len(YES_VARIANTS) + 1] = no / 2, no / 2
    return row


def test_logit_mode_is_yes_over_yes_plus_no(caplog):
    be = FixedWords([_row(0.3, 0.1), _row(0.02, 0.18)])
    with caplog.at_level(logging.WARNING, logger="speceyes.judging"):
        p = tool_probability(be, [[], []])
    assert p == [pytest.approx(0.75), pytest.approx(0.1)]
    assert caplog.text == ""
    assert be.calls == [("next_token_probs", JUDGE_WORDS, JUDGE_LOGPROBS)]
    assert JUDGE_WORDS == YES_VARIANTS + NO_VARIANTS


def test_neither_word_seen_is_undecided_and_says_so(caplog):
    be = FixedWords([_row(0.0, 0.0), _row(0.0, 0.4)])
    with caplog.at_level(logging.WARNING, logger="speceyes.judging"):
        p = tool_probability(be, [[], []])
    assert p == [UNDECIDED, 0.0] and UNDECIDED == 0.5
    assert caplog.text.count("neither yes nor no") == 1


def test_decode_mode_and_errors():
    be = FixedWords([], replies=["No, it is fine", " no", "yes", ""])
    assert tool_probability(be, [[]] * 4, "decode") == [0.0, 0.0, 1.0, 1.0]
    assert be.calls == [("chat", (), JUDGE_DECODE_TOKENS)]
    assert [decode_rule_p_tool(t) for t in ("NO", "\nno", "nope", "yes no")] == [0.0, 0.0, 0.0, 1.0]
    assert tool_probability(be, []) == [] and len(be.calls) == 1  # nothing asked of the model
    with pytest.raises(ValueError, match="judge mode"):
        tool_probability(be, [[]], "vote")  # type: ignore[arg-type]
