"""One lmms-eval request as a speceyes query, and the funnel's answer as the task scores it.

The funnel asks its own prompts (judge, small model, agent) from a question and its options, so
the query takes them from the task's raw document, by the layouts lmms-eval's image tasks use:

* ``A``, ``B``, ... columns beside ``question`` (HR-Bench): those options;
* an ``options`` or ``choices`` list (MMBench-style documents): those options;
* options inline in the question, ``... (A) red (B) blue`` (V*, field ``text``): split off;
* a plain ``question`` or ``text`` (POPE): no options.

A document of none of these layouts is asked with the task's own prompt text. The image is the
first image of the request's messages (the task's ``doc_to_visual``); a request without one
cannot be asked.

lmms-eval's tasks score strictly: POPE compares the lowered answer with ``yes``/``no`` exactly,
and V*'s letter extraction reads the first letter of an upper-cased answer (``black`` is ``B``).
So with ``answer=auto`` a multiple-choice answer becomes its bare letter, by speceyes' own
parser (an answer that names no option becomes empty: wrong, as speceyes scores it), and an
answer that starts with yes or no becomes that bare word; ``answer=raw`` passes the funnel's
answer as it is.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping, Sequence
from typing import Any

from speceyes.bench.scoring import parse_choice, parse_yes_no
from speceyes.types import Query

ANSWER_FORMATS = ("auto", "raw")
_LETTERS = string.ascii_uppercase
# "(A) red (B) blue": V*'s inline options (its lmms-eval doc_to_text splits them the same way).
_INLINE_OPTION = re.compile(r"\(([A-Z])\)\s*([^()]+?)(?=\s*\([A-Z]\)|$)", re.S)


def query_id(task: str, split: str, doc_id: int) -> str:
    """A request's id, unique across the tasks and splits of one run."""
    return f"{task}/{split}/{doc_id}"


def _column_options(doc: Mapping[str, Any]) -> list[str] | None:
    """Options as consecutive letter columns A, B, ... (at least two)."""
    options = []
    for letter in _LETTERS:
        value = doc.get(letter)
        if not isinstance(value, str) or not value.strip():
            break
        options.append(value.strip())
    return options if len(options) >= 2 else None


def _list_options(doc: Mapping[str, Any]) -> list[str] | None:
    for key in ("options", "choices"):
        value = doc.get(key)
        if isinstance(value, Sequence) and not isinstance(value, str) and len(value) >= 2:
            return [str(v).strip() for v in value]
    return None


def split_inline_options(text: str) -> tuple[str, list[str] | None]:
    """``"Q? (A) x (B) y"`` -> ``("Q?", ["x", "y"])``; text without options -> ``(text, None)``.

    Only options lettered A, B, C, ... in order count, so "(a) note" or a lone "(B)" in a
    question does not."""
    found = _INLINE_OPTION.findall(text)
    letters = [letter for letter, _ in found]
    if len(found) < 2 or letters != list(_LETTERS[: len(found)]):
        return text.strip(), None
    head = text[: text.index("(A)")].strip()
    return head, [option.strip() for _, option in found]


def question_and_options(doc: Mapping[str, Any], task_text: str) -> tuple[str, list[str] | None]:
    """The question and options speceyes asks for ``doc`` (see the module docstring)."""
    question = doc.get("question")
    text = question if isinstance(question, str) and question.strip() else doc.get("text")
    if not isinstance(text, str) or not text.strip():
        return task_text.strip(), None
    options = _column_options(doc) or _list_options(doc)
    if options is not None:
        return text.strip(), options
    return split_inline_options(text)


def first_image(messages: Sequence[Mapping[str, Any]]) -> Any:
    """The first image of a chat request's messages (a PIL image or a path), or None."""
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "image":
                return part.get("url", part.get("image"))
    return None


def message_text(messages: Sequence[Mapping[str, Any]]) -> str:
    """The text parts of the user turns, in order (the task's prompt)."""
    texts = []
    for message in messages:
        if message.get("role") != "user":
            continue
        content = message.get("content")
        if isinstance(content, str):
            texts.append(content)
            continue
        for part in content or []:
            if isinstance(part, Mapping) and part.get("type") == "text":
                texts.append(str(part.get("text", "")))
    return "\n".join(texts)


def request_query(doc: Mapping[str, Any], messages: Sequence[Mapping[str, Any]], qid: str) -> Query:
    """The speceyes query for one request (no gold answer: lmms-eval scores); a request
    without an image raises ValueError."""
    image = first_image(messages)
    if image is None:
        raise ValueError("the request has no image (speceyes answers visual questions)")
    question, options = question_and_options(doc, message_text(messages))
    category = doc.get("category")
    return Query(
        id=qid,
        image=image,
        question=question,
        options=options,
        category=category if isinstance(category, str) else None,
    )


def task_answer(answer: str | None, options: list[str] | None, answer_format: str = "auto") -> str:
    """The funnel's answer in the form lmms-eval's tasks score (see the module docstring)."""
    text = (answer or "").strip()
    if answer_format == "raw":
        return text
    if options:
        return parse_choice(text, options) or ""
    return parse_yes_no(text) or text
