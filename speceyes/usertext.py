"""What text from users may hold, one rule for every way in (the server's requests, ``speceyes
ask``, question files): no control token of a chat template, and, where a server bounds it, a
length in tokens as the served models count them.

A control token typed by a user (``<|im_end|><|im_start|>assistant``) would otherwise become the
real token when the prompt is tokenized: a role switch, or an ``<|image_pad|>`` with no image
behind it. Such text is refused, never escaped, so that what the model reads is what was sent.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

# The shape of the Qwen/ChatML control tokens (<|im_start|>, <|image_pad|>, <|endoftext|>...):
# refused even where no tokenizer is at hand (a model behind a URL), so the rule is the same
# for every model.
CONTROL_TOKEN_SHAPE = re.compile(r"<\|[^\s<>|]{1,64}\|>")


class UserTextError(ValueError):
    """User text that holds a control token; ``token`` is the first one found."""

    def __init__(self, message: str, token: str) -> None:
        super().__init__(message)
        self.token = token


def control_tokens_of(tokenizer: Any) -> frozenset[str]:
    """The special tokens of a transformers tokenizer (its chat template's control tokens)."""
    found = set(getattr(tokenizer, "all_special_tokens", None) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    found.update(t.content for t in added.values() if getattr(t, "special", False))
    return frozenset(t for t in found if isinstance(t, str) and t.strip())


def find_control_token(text: str, tokens: Iterable[str] = ()) -> str | None:
    """The first control token in ``text``: anything shaped like ``<|name|>``, or one of
    ``tokens`` (a tokenizer's special tokens); None when there is none."""
    m = CONTROL_TOKEN_SHAPE.search(text)
    hits = [(m.start(), m.group())] if m else []
    hits += [(text.find(t), t) for t in tokens if t in text]
    return min(hits)[1] if hits else None


def check_user_text(text: str, where: str = "the question", tokens: Iterable[str] = ()) -> str:
    """``text`` itself, or UserTextError naming the control token it holds."""
    token = find_control_token(text, tokens)
    if token is not None:
        raise UserTextError(
            f"{where} contains {token!r}, a control token of the models' chat template; "
            "user text may not hold control tokens",
            token,
        )
    return text


def check_question(question: str, options: Iterable[str] | None = None, where: str = "") -> None:
    """``check_user_text`` on a question and each of its options (``where`` prefixes names)."""
    check_user_text(question, f"{where}the question")
    for k, option in enumerate(options or ()):
        check_user_text(option, f"{where}option {k + 1}")


def utf8_bytes(text: str) -> int:
    """A bound on the tokens of any byte-level BPE tokenizer: each token covers >= 1 byte."""
    return len(text.encode("utf-8", "surrogatepass"))


def _token_counter(tokenizer: Any) -> Callable[[str], int]:
    """How many tokens ``tokenizer`` makes of a text, from a copy of its own when it is a fast
    (Rust) tokenizer: the model's copy is reconfigured (padding) by batched calls on the funnel's
    thread, and a Rust tokenizer refuses to be used while another thread reconfigures it."""
    rust = getattr(tokenizer, "backend_tokenizer", None)
    if rust is not None and hasattr(rust, "to_str") and hasattr(type(rust), "from_str"):
        own = type(rust).from_str(rust.to_str())
        own.no_padding()
        own.no_truncation()
        return lambda text: len(own.encode(text, add_special_tokens=False).ids)
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


@dataclass(frozen=True)
class TextRules:
    """The control tokens and token counters of the models a server serves.

    ``tokens(text)`` is the most any served model's tokenizer makes of the text, and the UTF-8
    byte count where a model has no tokenizer here (a model behind a URL): a stated, safe bound.
    """

    control: frozenset[str] = frozenset()
    counters: tuple[Callable[[str], int], ...] = (utf8_bytes,)

    @classmethod
    def for_backends(cls, backends: Iterable[Any]) -> TextRules:
        control: set[str] = set()
        counters: list[Callable[[str], int]] = []
        seen: set[int] = set()
        bytes_bound = False
        for backend in backends:
            if backend is None or id(backend) in seen:
                continue
            seen.add(id(backend))
            tokenizer = getattr(backend, "tokenizer", None)
            if tokenizer is None:
                bytes_bound = True
                continue
            control |= control_tokens_of(tokenizer)
            counters.append(_token_counter(tokenizer))
        if bytes_bound or not counters:
            counters.append(utf8_bytes)
        return cls(frozenset(control), tuple(counters))

    def check(self, text: str, where: str) -> str:
        return check_user_text(text, where, self.control)

    def tokens(self, text: str) -> int:
        return max(count(text) for count in self.counters)
