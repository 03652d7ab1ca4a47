"""Phase I's tool probability, written once for every backend.

``logit`` mode reads one next-token step: P(tool) = P(yes) / (P(yes) + P(no)), each summed over
the spelling variants below (``Backend.next_token_probs`` counts every token once). ``decode``
mode lets the model write ``JUDGE_DECODE_TOKENS`` greedy tokens and applies the published rule
(:func:`decode_rule_p_tool`): 0.0 or 1.0.

One fallback for every backend: when neither yes nor no is among the probabilities a backend
returns (a server whose top logprobs hold neither word, a tokenizer with no yes/no token), the
judge is undecided, P(tool) = 0.5, and a warning says so.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Literal

import numpy as np

from speceyes.backends.base import Backend, Messages

log = logging.getLogger(__name__)

JudgeMode = Literal["logit", "decode"]
JUDGE_MODES: tuple[str, ...] = ("logit", "decode")

# First-token variants whose probabilities are summed for the one-step judge.
YES_VARIANTS = ("yes", "Yes", "YES", " yes", " Yes", " YES")
NO_VARIANTS = ("no", "No", "NO", " no", " No", " NO")
JUDGE_WORDS = YES_VARIANTS + NO_VARIANTS
# Greedy tokens of a decode-mode judgment (the published judge's short answer).
JUDGE_DECODE_TOKENS = 10
# Top logprobs a server's logit judgment reads (at most the server's own cap).
JUDGE_LOGPROBS = 20
# P(tool) when neither yes nor no is seen: undecided.
UNDECIDED = 0.5


def decode_rule_p_tool(text: str) -> float:
    """The published rule: a judge reply starting with "no" means tool-free (P(tool) = 0)."""
    return 0.0 if text.strip().lower().startswith("no") else 1.0


def p_tool_from_word_probs(probs: np.ndarray) -> list[float]:
    """P(yes) / (P(yes) + P(no)) per row of ``[conversations, JUDGE_WORDS]`` probabilities;
    ``UNDECIDED`` (with a warning) for a row where neither word has any probability."""
    probs = np.asarray(probs)
    n = len(YES_VARIANTS)
    out = []
    for row in probs:
        yes, no = row[:n].sum(), row[n:].sum()  # in the backend's own precision
        if yes + no > 0:
            out.append(float(yes / (yes + no)))
        else:
            log.warning("judge saw neither yes nor no; P(tool)=%s", UNDECIDED)
            out.append(UNDECIDED)
    return out


def tool_probability(
    backend: Backend, batch: Sequence[Messages], mode: JudgeMode = "logit"
) -> list[float]:
    """P(tool) per conversation of ``batch`` (judge prompts), by ``mode``."""
    if mode not in JUDGE_MODES:
        raise ValueError(f"unknown judge mode {mode!r}; use 'logit' or 'decode'")
    if not batch:
        return []
    if mode == "decode":
        turns = backend.chat(batch, max_new_tokens=JUDGE_DECODE_TOKENS)
        return [decode_rule_p_tool(t.text) for t in turns]
    probs = backend.next_token_probs(batch, JUDGE_WORDS, top_logprobs=JUDGE_LOGPROBS)
    return p_tool_from_word_probs(probs)
