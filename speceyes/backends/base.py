"""The protocol every model runtime implements.

Backends know nothing of the funnel. All of them take OpenAI-style chat messages: a list of
``{"role": ..., "content": str | [parts]}`` where a part is ``{"type": "text", "text": ...}`` or
``{"type": "image", "image": <PIL image | path | bytes>}``, so prompts and agents are written once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

import numpy as np

from speceyes.images import View
from speceyes.types import ChatTurn, SpecAnswer

Messages = list[dict[str, Any]]
JudgeMode = Literal["logit", "decode"]

# Per model family: the box convention of its tool calls and its resize factor (patch x merge).
FAMILIES: dict[str, tuple[Literal["absolute", "relative1000"], int]] = {
    "qwen2_5_vl": ("absolute", 28),
    "qwen3_vl": ("relative1000", 32),
}

# First-token variants whose probabilities are summed for the one-step judge.
YES_VARIANTS = ("yes", "Yes", "YES", " yes", " Yes", " YES")
NO_VARIANTS = ("no", "No", "NO", " no", " No", " NO")


class BackendError(RuntimeError):
    """A model call failed (timeout, server error, out of memory); the message says which."""


class Backend(Protocol):
    """Everything the funnel and the agents use of a model runtime.

    Geometry: every image a backend is given is smart_resized with ``factor``, ``min_pixels``
    and ``max_pixels`` before the model sees it; agents crop and resize with the same numbers
    so that the boxes a model writes map back to the original exactly.
    """

    name: str
    # "absolute" pixels of the resized view (Qwen2.5-VL) or "relative1000" (Qwen3-VL).
    box_coords: Literal["absolute", "relative1000"]
    factor: int  # side of one merged visual token in pixels (patch size x merge size)
    min_pixels: int
    max_pixels: int
    # Images one conversation may hold (an engine's per-prompt limit); None: no limit.
    max_images: int | None
    # Top logprobs one generated token can return (a server's cap); None: the whole vocabulary.
    max_logprobs: int | None

    def view_of(self, image: Any) -> View:
        """The geometry of ``image`` as this model sees it (after its smart_resize)."""
        ...

    def next_token_probs(self, batch: Sequence[Messages], words: Sequence[str]) -> np.ndarray:
        """P(first token of each word) at the next position, ``[conversations, words]``.

        One step per conversation. Backends that see only the top logprobs (servers) give 0 to
        a word outside them: rows may sum to less than one, so callers normalise over the words.
        """
        ...

    def judge(self, batch: Sequence[Messages], mode: JudgeMode = "logit") -> list[float]:
        """P(tool) per conversation. ``decode`` mode returns 0.0 or 1.0 (published rule)."""
        ...

    def answer(
        self, batch: Sequence[Messages], max_new_tokens: int = 20, top_k: int = 64
    ) -> list[SpecAnswer]:
        """Greedy answers with the top-K logits of every generated token before EOS."""
        ...

    def chat(
        self, batch: Sequence[Messages], stop: Sequence[str] = (), max_new_tokens: int = 1024
    ) -> list[ChatTurn]:
        """One greedy assistant turn per conversation, ended by EOS or the first stop string."""
        ...


def answer_token_ids(tokenizer: Any) -> tuple[list[int], list[int]]:
    """First-token ids of the yes and the no variants; an id in both counts for neither."""

    def first_ids(words: Sequence[str]) -> set[int]:
        out = set()
        for w in words:
            ids = tokenizer.encode(w, add_special_tokens=False)
            # Only a first token that itself starts the word counts (not a bare space).
            if ids and tokenizer.decode(ids[:1]).strip():
                out.add(ids[0])
        return out

    yes, no = first_ids(YES_VARIANTS), first_ids(NO_VARIANTS)
    shared = yes & no
    return sorted(yes - shared), sorted(no - shared)


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, str | None]:
    """Truncate ``text`` after the earliest stop string (kept, as the model wrote it)."""
    best: tuple[int, str] | None = None
    for s in stop:
        i = text.find(s)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    if best is None:
        return text, None
    i, s = best
    return text[: i + len(s)], s


def decode_rule_p_tool(text: str) -> float:
    """The published rule: a judge reply starting with "no" means tool-free (P(tool) = 0)."""
    return 0.0 if text.strip().lower().startswith("no") else 1.0


def per_item(call: Callable[[list], Sequence[Any]], items: list) -> list[Any]:
    """``call`` over the whole batch; if it raises anything but a ``BackendError`` (a server
    that failed the batch as a whole), over each item alone, so that an item that breaks a
    tokenizer, a prompt or a backend fails alone. Its slot then holds the exception."""
    try:
        return list(call(items))
    except BackendError:
        raise
    except Exception as e:
        if len(items) == 1:
            return [e]
    out: list[Any] = []
    for item in items:
        try:
            out.extend(call([item]))
        except Exception as e:  # BackendError included: this item's own failure now
            out.append(e)
    return out


def map_images(messages: Messages, image: Callable[[Any], dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` as ``{"role", "content"}`` dicts in which every image part (``image`` with
    its source, or OpenAI's ``image_url``) is replaced by ``image(source)``, in order; text
    parts and plain-string contents stay as they are. Each backend gives its own image part."""
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            parts = []
            for p in content:
                if p.get("type") not in ("image", "image_url"):
                    parts.append(p)
                    continue
                src = p.get("image")
                if src is None:
                    url = p.get("image_url")
                    src = url.get("url") if isinstance(url, dict) else url
                parts.append(image(src))
            content = parts
        out.append({"role": m["role"], "content": content})
    return out
