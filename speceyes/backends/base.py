"""The protocol every model runtime implements.

Backends know nothing of the funnel. All of them take OpenAI-style chat messages: a list of
``{"role": ..., "content": str | [parts]}`` where a part is ``{"type": "text", "text": ...}`` or
``{"type": "image", "image": <PIL image | path | bytes>}``, so prompts and agents are written once.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple, Protocol

import numpy as np

from speceyes.images import View
from speceyes.types import ChatTurn, SpecAnswer

Messages = list[dict[str, Any]]
BoxCoords = Literal["absolute", "relative1000"]
# What ``answer()``'s top-K values are: raw logits (a whole row when top_k >= the vocabulary)
# or logprobs (already normalised over the full vocabulary; a server's top-K only).
Scores = Literal["logits", "logprobs"]

# Per model family: the box convention of its tool calls and its resize factor (patch x merge).
MODEL_FAMILIES: dict[str, tuple[BoxCoords, int]] = {
    "qwen2_5_vl": ("absolute", 28),
    "qwen3_vl": ("relative1000", 32),
}
# Per model family: the pixel limits (min, max) of its released image processor, the fallback
# where a checkpoint's own processor config is not at hand (a server's model): Qwen2.5-VL and
# DeepEyes 3136..12845056 (4..16384 merged 28-px patches), Qwen3-VL size.shortest_edge 65536,
# longest_edge 16777216.
FAMILY_PIXELS: dict[str, tuple[int, int]] = {
    "qwen2_5_vl": (4 * 28**2, 16384 * 28**2),
    "qwen3_vl": (65536, 16384 * 32**2),
}
PROCESSOR_CONFIG = "preprocessor_config.json"
GENERATION_CONFIG = "generation_config.json"


class BackendError(RuntimeError):
    """A model call failed (timeout, server error, out of memory); the message says which."""


class ViewGeometry(NamedTuple):
    """How a model is shown an image: smart_resize with ``factor`` between ``min_pixels`` and
    ``max_pixels``, and how the boxes it writes are read."""

    box_coords: BoxCoords
    factor: int
    min_pixels: int
    max_pixels: int


def view_geometry(
    family: str,
    processor: Any = None,
    *,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
) -> ViewGeometry:
    """A model family's geometry, read from its image processor where one is given: an image
    processor object (its ``patch_size``, ``merge_size`` and ``size``) or the dict of a
    ``preprocessor_config.json`` (where ``min_pixels``/``max_pixels`` override
    ``size.shortest_edge``/``longest_edge``, as the Qwen processors read it); else, and for
    what the processor leaves out, the family's released limits (``FAMILY_PIXELS``). Explicit
    pixel limits win over both."""
    if family not in MODEL_FAMILIES:
        raise ValueError(
            f"unsupported model family {family!r}; use one of {', '.join(MODEL_FAMILIES)}"
        )
    box_coords, factor = MODEL_FAMILIES[family]
    low, high = FAMILY_PIXELS[family]
    if processor is not None:
        if isinstance(processor, Mapping):
            read = processor.get
        else:
            fields = ("patch_size", "merge_size", "size")  # an object's size is already merged
            read = {k: getattr(processor, k, None) for k in fields}.get
        factor = int(read("patch_size") or factor // 2) * int(read("merge_size") or 2)
        size = read("size") or {}
        get = size.get if isinstance(size, Mapping) else lambda k, d=None: getattr(size, k, d)
        low = read("min_pixels") or get("shortest_edge") or low
        high = read("max_pixels") or get("longest_edge") or high
    return ViewGeometry(box_coords, factor, min_pixels or low, max_pixels or high)


def checkpoint_file(model: str | Path, filename: str) -> Path | None:
    """``filename`` of a checkpoint: in its folder, or for a hub id in the local HF cache
    (fetched when the hub is reachable and offline mode is off); None where it has none."""
    local = Path(str(model)).expanduser()
    if local.is_dir():
        path = local / filename
        return path if path.is_file() else None
    try:
        from transformers.utils import cached_file

        found = cached_file(
            str(model),
            filename,
            _raise_exceptions_for_missing_entries=False,
            _raise_exceptions_for_connection_errors=False,
        )
    except (ImportError, OSError, ValueError):  # no transformers, or not a valid repo id
        return None
    return Path(found) if found else None


def checkpoint_json(model: str | Path, filename: str) -> dict[str, Any] | None:
    """A checkpoint's JSON file as a dict (see ``checkpoint_file``); None where it has none or
    it is not a JSON object."""
    path = checkpoint_file(model, filename)
    if path is None:
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def checkpoint_geometry(
    family: str,
    model: str | Path | None,
    *,
    processor: Any = None,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
) -> ViewGeometry:
    """The view geometry every backend gives the checkpoint ``model`` (a folder or hub id;
    None: a model whose files are not at hand): its ``preprocessor_config.json`` where it has
    one, else ``processor`` (a loaded image processor) if given, else the family's released
    limits (``FAMILY_PIXELS``); explicit limits win (``view_geometry``)."""
    config = None if model is None else checkpoint_json(model, PROCESSOR_CONFIG)
    source = config if config is not None else processor
    return view_geometry(family, source, min_pixels=min_pixels, max_pixels=max_pixels)


# ---- decoding policy ---------------------------------------------------------------------------
# "checkpoint": greedy decoding with the generation_config's settings below, as HF generate and
# a vLLM server apply them; "greedy-plain": greedy with each set to its neutral value.
DECODING_POLICIES: tuple[str, ...] = ("checkpoint", "greedy-plain")
# The generation_config fields that change a greedy decode and that every backend applies the
# same way (HF generate, vLLM SamplingParams, a server request), with their neutral values.
DECODING_FIELDS: dict[str, float] = {"repetition_penalty": 1.0}


def check_decoding(policy: str) -> str:
    if policy not in DECODING_POLICIES:
        raise ValueError(
            f"unknown decoding {policy!r}; choose from {', '.join(DECODING_POLICIES)}"
        )
    return policy


def decoding_settings(policy: str, generation_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The greedy decode's settings under ``policy`` from a checkpoint's generation_config (a
    dict; None: the checkpoint has none): ``DECODING_FIELDS`` by name, every one set."""
    check_decoding(policy)
    config = generation_config if policy == "checkpoint" and generation_config else {}
    return {k: config.get(k) if config.get(k) is not None else v for k, v in DECODING_FIELDS.items()}


class Backend(Protocol):
    """Everything the funnel and the agents use of a model runtime: four methods and the
    capabilities below, declared as plain attributes (callers read them, never the class name).

    Geometry: every image a backend is given is smart_resized with ``factor``, ``min_pixels``
    and ``max_pixels`` before the model sees it; agents crop and resize with the same numbers
    so that the boxes a model writes map back to the original exactly (see ``view_geometry``).

    A backend whose requests have a context length may also declare ``max_model_len`` (int or
    None); agent loops read it through ``context_limit`` and end a loop whose next turn would
    not fit (see ``estimate_prompt_tokens``).
    """

    name: str
    # "absolute" pixels of the resized view (Qwen2.5-VL) or "relative1000" (Qwen3-VL).
    box_coords: BoxCoords
    factor: int  # side of one merged visual token in pixels (patch size x merge size)
    min_pixels: int
    max_pixels: int
    # What answer()'s top-K values are: "logits" (in process, the whole vocabulary) or
    # "logprobs" (an engine's or server's top logprobs).
    scores: Scores
    # Images one conversation may hold (an engine's per-prompt limit); None: no limit.
    max_images: int | None
    # Top logprobs one generated token can return (a server's cap); None: the whole vocabulary.
    max_logprobs: int | None
    # The decoding policy and the settings greedy decoding uses under it, e.g.
    # {"policy": "checkpoint", "repetition_penalty": 1.05} (see ``decoding_settings``).
    decoding: dict[str, Any]

    def view_of(self, image: Any) -> View:
        """The geometry of ``image`` as this model sees it (after its smart_resize)."""
        ...

    def next_token_probs(
        self, batch: Sequence[Messages], words: Sequence[str], top_logprobs: int | None = None
    ) -> np.ndarray:
        """P(first token of each word) at the next position, ``[conversations, words]``.

        One step per conversation. Each token counts once: a word whose first token is a bare
        space, is missing, or is an earlier word's first token gets 0, so a sum over words
        (spelling variants) is a sum over distinct tokens. Backends that see only the top
        logprobs (servers) read at most ``top_logprobs`` of them (None: ``max_logprobs``) and
        give 0 to a word outside them: rows may sum to less than one, so callers normalise
        over the words. A full-vocabulary backend ignores ``top_logprobs``.
        """
        ...

    def answer(
        self, batch: Sequence[Messages], max_new_tokens: int = 20, top_k: int = 64
    ) -> list[SpecAnswer]:
        """Greedy answers with the top-K ``scores`` of every generated token before EOS."""
        ...

    def chat(
        self, batch: Sequence[Messages], stop: Sequence[str] = (), max_new_tokens: int = 1024
    ) -> list[ChatTurn]:
        """One greedy assistant turn per conversation, ended by EOS or the first stop string."""
        ...


def first_token_ids(tokenizer: Any, words: Sequence[str]) -> list[int | None]:
    """The first-token id of each word, as ``next_token_probs`` counts it: None for a word with
    no first token that itself starts the word (empty, or a bare space) and for a word whose
    first token an earlier word already has."""
    out: list[int | None] = []
    seen: set[int] = set()
    for w in words:
        ids = tokenizer.encode(w, add_special_tokens=False)
        first = ids[0] if ids and tokenizer.decode(ids[:1]).strip() else None
        if first in seen:
            first = None
        if first is not None:
            seen.add(first)
        out.append(first)
    return out


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


# ---- a prompt's length, estimated before it is sent -------------------------------------------
# Text tokens are estimated, not counted (a server's tokenizer is not at hand). The text is split
# as Qwen's tokenizer splits it before BPE (words with one leading symbol or space, single
# digits, runs of symbols, whitespace); a word of up to 8 ASCII letters is one token and a longer
# one takes one more per 8, other letters (CJK) one per 1.5 characters, symbols one per 2, and
# each digit and whitespace run one. Against the real Qwen vocabulary on the project's prompts,
# tool calls, code and sandbox output this errs high by 0-30 %; runs of rare symbols and long
# rare words can fall short by up to 30 %. Image tokens are exact: one per factor x factor block
# of the view the backend sends.
_PRETOKEN = re.compile(
    r"'(?:s|t|re|ve|m|ll|d)|[^\r\n\w]?[^\W\d_]+|\d| ?[^\s\w]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+|_+",
    re.IGNORECASE,
)
ASCII_WORD_LETTERS = 8  # letters one ASCII word token holds
OTHER_LETTERS_PER_TOKEN = 1.5  # CJK and other non-ASCII letters
SYMBOLS_PER_TOKEN = 2
TEMPLATE_TOKENS_PER_MESSAGE = 5  # <|im_start|>role\n ... <|im_end|>\n
IMAGE_WRAP_TOKENS = 2  # <|vision_start|> and <|vision_end|> around an image's pad tokens
GENERATION_PROMPT_TOKENS = 3  # <|im_start|>assistant\n before the reply


def estimate_text_tokens(text: str) -> int:
    """The tokens ``text`` takes, by the stated estimate above."""
    n = 0
    for piece in _PRETOKEN.findall(text):
        word = piece.strip()
        if not word or word.isdigit():
            n += 1
        elif word[-1].isalpha():  # a word, perhaps after one symbol
            if word.isascii():
                n += 1 + (len(word) - 1) // ASCII_WORD_LETTERS
            else:
                n += math.ceil(len(word) / OTHER_LETTERS_PER_TOKEN)
        else:
            n += math.ceil(len(word) / SYMBOLS_PER_TOKEN)
    return n


def image_tokens(backend: Backend, image: Any) -> int:
    """The tokens one image takes in a prompt to ``backend``: its view in merged patches."""
    v = backend.view_of(image)
    return (v.view_w // backend.factor) * (v.view_h // backend.factor) + IMAGE_WRAP_TOKENS


def estimate_prompt_tokens(backend: Backend, messages: Messages) -> int:
    """The prompt tokens ``messages`` take on ``backend``: text by the stated estimate above,
    images exactly from the backend's view geometry, plus the chat template's own tokens."""
    tokens = TEMPLATE_TOKENS_PER_MESSAGE * len(messages) + GENERATION_PROMPT_TOKENS
    for m in messages:
        content = m["content"]
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        for p in parts:
            if p.get("type") in ("image", "image_url"):
                src = p.get("image")
                if src is None:
                    url = p.get("image_url")
                    src = url.get("url") if isinstance(url, dict) else url
                tokens += image_tokens(backend, src)
            else:
                tokens += estimate_text_tokens(str(p.get("text", "")))
    return tokens


def context_limit(backend: Backend) -> int | None:
    """The tokens (prompt and reply) one request to ``backend`` may hold, where the backend
    declares it (``max_model_len``, e.g. a server's); None: no limit known."""
    return getattr(backend, "max_model_len", None)
