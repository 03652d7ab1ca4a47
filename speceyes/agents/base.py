"""What every agent loop returns, and the small pieces of text handling they share."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

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
