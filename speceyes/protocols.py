"""Two evaluation protocols: ``fair`` (the default) and ``published`` (the authors' code).

``fair`` is what the rest of speceyes documents: the DeepEyes eval's question layout, shuffled
V* options, rule parsing, errors counted as wrong. ``published`` reproduces the released
SpecEyes code (github.com/MAC-AutoML/SpecEyes, ``eval_code_deepeyes/`` and
``eval_code_thyme/``) so its numbers can be compared with the paper's Table 1:

* question block of ``init_messages_judge_tc`` (a triple-quoted template that keeps its
  indentation) for DeepEyes, ``question_text.split('Please')[0]`` for Thyme;
* the DeepEyes system prompt of SpecEyes' ``eval_code_deepeyes/prompt.py``;
* judge: greedy, 10 new tokens, tool-free iff ``text.lower().startswith("no")`` (no strip);
* every image shown to the judge and the small model is first resized by SpecEyes' own
  ``smart_resize`` (factor 28, at most 16384*28*28 pixels, bicubic): the cap qwen-vl-utils
  0.0.14 applies before the Qwen3-VL processor sees it;
* batch size 6; ``log`` aggregation over the full vocabulary where the backend has it;
* phase IV one query at a time (the ``serial`` schedule), the agent-only baseline included;
* tau per backbone and benchmark as in Table 1 (:data:`PUBLISHED_TAU`) when none is given;
* the small-only mode (Table 1's draft-only row) as the authors' small-model script: its own
  unindented question block (:func:`published_draft_block`) and batch size 8;
* images as the scripts read them (:meth:`PublishedProtocol.open_image`): the stored pixels,
  EXIF orientation never applied; with Thyme, HR-Bench and POPE images re-encoded as JPEG
  quality 95 first;
* the small model's reply as decoded, not stripped; ``<answer>`` unwrapped only when both tags
  are present (:func:`published_prediction`); a small model whose name holds ``Thinking``
  decodes up to 1024 tokens with DeepEyes (:func:`published_small_tokens`).

Each protocol is one object, :data:`FAIR` or :data:`PUBLISHED` (an :class:`EvalProtocol`),
picked once by name (:func:`get_protocol`); its methods build phase I and II messages, compute
P(tool), the speculative answers and the gate's confidence, and give the loop defaults. The
published agent loops are their own classes (``agents/published_zoom.py``,
``agents/published_code.py``); the scoring rules live in ``bench/published_scoring.py``.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from PIL import Image

from speceyes import gate, prompts
from speceyes.backends.base import Backend
from speceyes.images import View, load_image
from speceyes.judging import JUDGE_DECODE_TOKENS, JudgeMode, tool_probability
from speceyes.limits import OPTION_LETTERS
from speceyes.types import Query, Schedule, SpecAnswer

# The agent families the published code covers.
PUBLISHED_AGENTS: tuple[str, ...] = ("deepeyes", "thyme")

# --- published strings (each pinned by tests/test_protocols.py) --------------------------------
# eval_code_deepeyes/prompt.py SYSTEM_PROMPT: pretty-printed tool JSON, "required":["bbox_2d"],
# its own descriptions, and a trailing newline.
PUBLISHED_DEEPEYES_SYSTEM = (
    "You are a helpful assistant.\n"
    "\n"
    "# Tools\n"
    "You may call one or more functions to assist with the user query.\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n"
    '{"type":"function","function":{\n'
    '    "name":"image_zoom_in_tool",\n'
    '    "description":"Zoom in on a specific region of the input image by cropping it based on '
    'a bounding box (bbox) and an optional object label.",\n'
    '    "parameters":{\n'
    '        "type":"object",\n'
    '        "properties":{\n'
    '            "bbox_2d":{"type":"array","items":{"type":"number"},"minItems":4,"maxItems":4,'
    '"description":"The bounding box to zoom in, format: [x1, y1, x2, y2]."},\n'
    '            "label":{"type":"string","description":"Label of the object (optional)."}\n'
    "        },\n"
    '        "required":["bbox_2d"]\n'
    "    }\n"
    "}}\n"
    "</tools>\n"
    "\n"
    "# How to call a tool\n"
    "Return a json object with function name and arguments within <tool_call></tool_call> XML "
    "tags:\n"
    "<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>\n"
    "\n"
    "**Example**:  \n"
    "<tool_call>  \n"
    '{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [10, 20, 100, 200], "label": '
    '"the apple on the desk"}}  \n'
    "</tool_call>\n"
)
# eval_code_deepeyes/SpecEyes.py init_messages_judge_tc: the templates keep the 8 spaces of
# their indentation inside the triple quotes.
_INDENT = " " * 8
PUBLISHED_BLOCK_OPTIONS = "Question: {question}\n" + _INDENT + "Options: {options}\n" + _INDENT
PUBLISHED_BLOCK_PLAIN = "Question: {question}\n" + _INDENT
PUBLISHED_DEEPEYES_LETTERS = "ABCDEF"  # abc_map in eval_code_deepeyes/utils.py
# eval_code_thyme/SpecEyes.py: build_mc_question_text and load_pope_data_generator.
PUBLISHED_THYME_MCQ = "Question: {question}\nOptions:\n{options}\n" + prompts.THYME_MCQ_EN
PUBLISHED_THYME_YORN = "Question: {question}\nPlease answer 'yes' or 'no'."
PUBLISHED_THYME_SPLIT = "Please"  # the judge/small text is question_text.split('Please')[0]

# eval_code_*/utils.py: IMAGE_FACTOR, MIN_PIXELS, MAX_PIXELS of SpecEyes' own smart_resize.
PUBLISHED_FACTOR = 28
PUBLISHED_MIN_PIXELS = 4 * 28 * 28
PUBLISHED_MAX_PIXELS = 16384 * 28 * 28
PUBLISHED_BATCH_SIZE = 6  # --batch_size default of both eval scripts
# scripts/small_model_batch_inference.py: --batch_size default (:407) and the prompt it builds
# (:379-387): no indentation, unlike the SpecEyes.py block; POPE has no options.
PUBLISHED_DRAFT_BATCH_SIZE = 8
PUBLISHED_DRAFT_OPTIONS = "Question: {question}\nOptions: {options}"
PUBLISHED_DRAFT_PLAIN = "Question: {question}\n"
DRAFT_FAMILY = "draft"  # the published small-only mode: the small-model script's layout

# Table 1's tau per backbone and benchmark. The code states none (the script defaults are
# DeepEyes 0.98, eval_code_deepeyes/SpecEyes.py:29, and Thyme 0.95, eval_code_thyme/SpecEyes.py:
# 36); every Table 1 SpecEyes (min) cell equals the entry for these thresholds in the per-tau
# data of vis/vis_ablation_thres.py:121-217 (matched against figures/result.png).
PUBLISHED_TAU: dict[tuple[str, str], float] = {
    ("deepeyes", "vstar"): 0.98,
    ("deepeyes", "hrbench"): 0.97,
    ("deepeyes", "pope"): 0.97,
    ("thyme", "vstar"): 0.98,
    ("thyme", "hrbench"): 0.98,
    ("thyme", "pope"): 0.97,
}


# eval_code_thyme/SpecEyes.py:71-79 (HR-Bench) and :681-684 (POPE): decoded images are saved
# as JPEG at this quality and every later step reads that file.
PUBLISHED_JPEG_QUALITY = 95
# eval_code_deepeyes/SpecEyes.py:351-352 and :414-417: a small model whose path holds this
# decodes up to 1024 new tokens instead of 20 (the Thyme script has no such branch).
PUBLISHED_THINKING_MARK = "Thinking"
PUBLISHED_THINKING_TOKENS = 1024
_EXIF_KEYS = ("exif", "xmp", "XML:com.adobe.xmp", "Raw profile type exif")


@dataclass(frozen=True)
class LoopSettings:
    """Defaults that depend on the protocol and the agent."""

    batch_size: int
    agent_max_tokens: int
    max_tool_calls: int


def _options_block(options: Sequence[str]) -> str:
    """``"\\nA. x\\nB. y\\n"``: the option string both published scripts build (abc_map)."""
    if len(options) > len(PUBLISHED_DEEPEYES_LETTERS):
        raise ValueError(
            f"the published DeepEyes code letters at most {len(PUBLISHED_DEEPEYES_LETTERS)} "
            f"options, got {len(options)}"
        )
    return "\n" + "".join(f"{PUBLISHED_DEEPEYES_LETTERS[i]}. {o}\n" for i, o in enumerate(options))


_FAIR = LoopSettings(batch_size=8, agent_max_tokens=1024, max_tool_calls=5)
_PUBLISHED = {
    # process_single_large_model: `step_id > 5` ends the row, so 6 generations of 512 tokens.
    "deepeyes": LoopSettings(PUBLISHED_BATCH_SIZE, agent_max_tokens=512, max_tool_calls=6),
    # eval_code_thyme/utils.py: MAX_ITERATIONS = 5, MAX_NEW_TOKENS_PER_STEP = 2048.
    "thyme": LoopSettings(PUBLISHED_BATCH_SIZE, agent_max_tokens=2048, max_tool_calls=5),
}


# --- question text ---------------------------------------------------------------------------
def published_question_block(question: str, options: Sequence[str] | None) -> str:
    """SpecEyes' DeepEyes block: ``"Question: q\\n        Options: \\nA. x\\nB. y\\n\\n        "``."""
    if not options:
        return PUBLISHED_BLOCK_PLAIN.format(question=question)
    return PUBLISHED_BLOCK_OPTIONS.format(question=question, options=_options_block(options))


def published_draft_block(question: str, options: Sequence[str] | None) -> str:
    """The small-model script's block: ``"Question: q\\nOptions: \\nA. x\\nB. y\\n"``."""
    if not options:
        return PUBLISHED_DRAFT_PLAIN.format(question=question)
    return PUBLISHED_DRAFT_OPTIONS.format(question=question, options=_options_block(options))


def published_thyme_question(
    question: str, options: Sequence[str] | None, kind: str | None = None
) -> str:
    """The question text Thyme's published eval gives the agent (``kind="yorn"``: POPE).
    Free-form questions (no published benchmark has them) keep Thyme's own VQA suffix."""
    if options:
        if len(options) > len(OPTION_LETTERS):
            raise ValueError(f"at most {len(OPTION_LETTERS)} options are supported")
        lines = "\n".join(f"{OPTION_LETTERS[i]}. {o}" for i, o in enumerate(options))
        return PUBLISHED_THYME_MCQ.format(question=question, options=lines)
    if kind == "yorn":
        return PUBLISHED_THYME_YORN.format(question=question)
    return prompts.thyme_question(question, None, kind)


# --- images ----------------------------------------------------------------------------------
def _qwen_to_rgb(img: Image.Image) -> Image.Image:
    """qwen-vl-utils 0.0.14 ``to_rgb``: RGBA composited on white, anything else converted."""
    if img.mode == "RGBA":
        out = Image.new("RGB", img.size, (255, 255, 255))
        out.paste(img, mask=img.split()[3])
        return out
    return img.convert("RGB")


def _without_orientation(img: Image.Image) -> Image.Image:
    """``img`` with its EXIF/XMP metadata dropped, so no later ``exif_transpose`` rotates it."""
    for key in _EXIF_KEYS:
        img.info.pop(key, None)
    img.getexif().clear()  # the cached Exif object, if one was read already
    return img


def _open_raw(src: Any) -> Image.Image:
    if isinstance(src, (bytes, bytearray, memoryview)):
        fp: Any = io.BytesIO(bytes(src))
    elif isinstance(src, (str, os.PathLike)) and not os.fspath(src).startswith("data:"):
        fp = os.fspath(src).removeprefix("file://")
    else:
        return load_image(src)  # a data URI: decoded the usual way
    img = Image.open(fp)
    img.load()
    return img


def published_jpeg(img: Image.Image) -> Image.Image:
    """The image as Thyme's script stores a decoded one (SpecEyes.py:75-78, :682-684): RGBA and
    P converted to RGB, saved as JPEG quality 95 and read back."""
    if img.mode in ("RGBA", "P"):
        img = img.convert("RGB")
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=PUBLISHED_JPEG_QUALITY)
    buf.seek(0)
    out = Image.open(buf)
    out.load()
    return out


def published_image(src: Any, *, jpeg: bool = False) -> Image.Image:
    """The image as the published scripts hand it to a model: ``Image.open`` of the stored
    pixels, no EXIF orientation (neither the scripts nor qwen-vl-utils' ``fetch_image`` apply
    it), converted by qwen-vl-utils' ``to_rgb``; ``jpeg``: re-encoded by :func:`published_jpeg`
    first. A PIL image is taken as already decoded; it is returned as it is when it is RGB."""
    if isinstance(src, Image.Image):
        img = src
        if jpeg and not img.info.get(_REENCODED):
            img = published_jpeg(img)
        elif img.mode == "RGB" and getattr(img, "im", None) is not None:
            return _without_orientation(img)
    else:
        img = _open_raw(src)
        if jpeg:
            img = published_jpeg(img)
    out = _without_orientation(_qwen_to_rgb(img))
    if jpeg:
        out.info[_REENCODED] = True
    return out


_REENCODED = "speceyes_published_jpeg"  # info key: re-encoded once, never twice


def reencodes_jpeg(family: str, query: Query) -> bool:
    """Whether Thyme's script stores ``query``'s image as JPEG first: HR-Bench and POPE rows
    (decoded from the TSV / parquet), not V* (a file opened where it is)."""
    return family == "thyme" and (is_pope(query) or is_hrbench(query))


def is_pope(query: Query) -> bool:
    return not query.options and query.category in POPE_SPLITS


def is_hrbench(query: Query) -> bool:
    return "cycle_category" in query.meta


POPE_SPLITS = ("adversarial", "popular", "random")


def published_smart_resize(width: int, height: int) -> tuple[int, int]:
    """SpecEyes' own smart_resize (utils.py) as it is called: (width, height) in, out.

    It has no aspect-ratio check and, unlike qwen-vl-utils, no ``max(factor, ...)`` after the
    floor; the two sides are treated alike, so the swapped argument order is harmless.
    """
    f = PUBLISHED_FACTOR

    def side(x: float, fn: Any) -> int:
        return fn(x / f) * f

    w_bar = max(f, round(width / f) * f)
    h_bar = max(f, round(height / f) * f)
    if w_bar * h_bar > PUBLISHED_MAX_PIXELS:
        beta = math.sqrt(width * height / PUBLISHED_MAX_PIXELS)
        w_bar, h_bar = side(width / beta, math.floor), side(height / beta, math.floor)
    elif w_bar * h_bar < PUBLISHED_MIN_PIXELS:
        beta = math.sqrt(PUBLISHED_MIN_PIXELS / (width * height))
        w_bar, h_bar = side(width * beta, math.ceil), side(height * beta, math.ceil)
    return w_bar, h_bar


def published_view(image: Any) -> tuple[Image.Image, View]:
    """The image as the published code hands it to both models (resized, bicubic) and its view
    (:func:`published_image`: no EXIF orientation)."""
    img = published_image(image)
    w, h = published_smart_resize(img.width, img.height)
    view = View(img.width, img.height, w, h)
    if (w, h) == img.size:
        return img, view
    return img.resize((w, h), Image.Resampling.BICUBIC), view


def published_judge_tool(text: str) -> bool:
    """The published routing: tool-free iff the decoded reply, lower-cased, starts with "no"
    (a leading space or newline therefore means tools)."""
    return not text.lower().startswith("no")


def published_prediction(text: str) -> str:
    """What the scripts store as the prediction (eval_code_deepeyes/SpecEyes.py:635-638,
    :696-699; eval_code_thyme/SpecEyes.py:430-433): the span inside ``<answer>...</answer>``,
    stripped, when both tags are there; else the reply as decoded, not stripped (a Thinking
    model's reasoning and ``</think>`` included: nothing is cut after it)."""
    if "</answer>" in text and "<answer>" in text:
        return text.split("<answer>")[1].split("</answer>")[0].strip()
    return text


def published_small_tokens(family: str | None, small_name: str, max_new_tokens: int) -> int:
    """The small model's token budget: 1024 for a Thinking model with DeepEyes
    (eval_code_deepeyes/SpecEyes.py:351-352, :414), else ``max_new_tokens`` (20)."""
    if family == "deepeyes" and PUBLISHED_THINKING_MARK in small_name:
        return PUBLISHED_THINKING_TOKENS
    return max_new_tokens


def _raw_text(backend: Backend, answer: SpecAnswer) -> str:
    """The reply decoded as the scripts decode it (``skip_special_tokens=True``,
    ``clean_up_tokenization_spaces=False``, no strip) where the backend has its tokenizer and
    the token ids; else the backend's text."""
    tok = getattr(backend, "tokenizer", None)
    if tok is None or not answer.token_ids:
        return answer.text
    return tok.decode(
        answer.token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
    )


# --- phase II answers in whole rows ---------------------------------------------------------
_WHOLE_VOCAB = 1 << 30  # top_k that asks a full-vocabulary backend for every logit


def to_logprobs(rows: np.ndarray, top_k: int) -> np.ndarray:
    """Whole logit rows [tokens, V] -> their top-K as logprobs (full-vocabulary softmax).

    A per-token shift, so separability is unchanged; ``exp`` of the first column is then the
    full-vocabulary max-softmax probability."""
    rows = np.asarray(rows, dtype=np.float64)
    if rows.ndim != 2 or rows.shape[0] == 0:
        return np.asarray(rows, dtype=np.float32)
    top = rows.max(axis=1, keepdims=True)
    lse = top + np.log(np.exp(rows - top).sum(axis=1, keepdims=True))
    k = min(top_k, rows.shape[1])
    best = -np.sort(-rows, axis=1)[:, :k]
    return np.ascontiguousarray(best - lse, dtype=np.float32)


# --- the two protocols ----------------------------------------------------------------------
def _messages(system: str, image: Any, text: str) -> list[dict]:
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": [prompts.image_part(image), prompts.text_part(text)]},
    ]


class EvalProtocol:
    """An evaluation protocol: what phases I-III send and compute, and the agent loops'
    defaults. This class holds the ``fair`` rules; :class:`PublishedProtocol` overrides them
    where the released code differs. ``family`` is an agent family (:meth:`family_of`)."""

    name = "fair"
    schedule: Schedule = "batched"  # phase IV's schedule unless one is given (funnel.py)

    def family_of(self, agent_name: str | None) -> str:
        """The agent family whose layout applies (the small-only mode, no agent, uses the
        DeepEyes layout)."""
        name = agent_name or "deepeyes"
        return name if name in PUBLISHED_AGENTS else "deepeyes"

    def loop_settings(self, agent: str = "deepeyes", mode: str = "speceyes") -> LoopSettings:
        return _FAIR

    def default_tau(self, agent: str, bench: str | None) -> float | None:
        """The gate threshold for ``agent`` on benchmark ``bench`` (a registry name) when none
        is given; None: the agent's own ``default_tau``."""
        return None

    def question_text(self, family: str, question: str, options: Sequence[str] | None) -> str:
        """The text phases I and II put before their suffix."""
        return prompts.question_block(question, options)

    def judge_messages(
        self, family: str, image: Any, question: str, options: Sequence[str] | None = None
    ) -> list[dict]:
        return prompts.judge_messages(image, question, options)

    def small_messages(
        self, family: str, image: Any, question: str, options: Sequence[str] | None = None
    ) -> list[dict]:
        return prompts.small_messages(image, question, options)

    def tool_probability(
        self, backend: Backend, batch: Sequence[list[dict]], mode: JudgeMode, family: str
    ) -> list[float]:
        """P(tool) per judge conversation (:func:`speceyes.judging.tool_probability`)."""
        return tool_probability(backend, batch, mode)

    def open_image(self, query: Query, family: str) -> Image.Image:
        """``query``'s image, loaded once for every phase (upright: EXIF orientation applied)."""
        return load_image(query.image, copy=False)

    def answers(
        self,
        backend: Backend,
        batch: Sequence[list[dict]],
        *,
        max_new_tokens: int,
        top_k: int,
        agg: str,
        family: str | None = None,
    ) -> list[SpecAnswer]:
        """Speculative answers with their top-K values per token."""
        return backend.answer(batch, max_new_tokens=max_new_tokens, top_k=top_k)

    def confidence(
        self,
        backend: Backend,
        answers: Sequence[SpecAnswer],
        *,
        top_k: int,
        agg: str,
        scale: float,
    ) -> np.ndarray:
        """The gate's confidence per answer (NaN where it has none): :meth:`answer_scores`,
        with a blank answer's set to ``gate.BLANK_CONFIDENCE`` under every protocol."""
        scores = self.answer_scores(backend, answers, top_k=top_k, agg=agg, scale=scale)
        return gate.without_blank(scores, [a.text for a in answers])

    def answer_scores(
        self,
        backend: Backend,
        answers: Sequence[SpecAnswer],
        *,
        top_k: int,
        agg: str,
        scale: float,
    ) -> np.ndarray:
        """The score of each answer's logits: the max-softmax over the top-K, aggregated by
        ``agg``."""
        return gate.batch_confidence([a.topk for a in answers], top_k=top_k, agg=agg, scale=scale)


class PublishedProtocol(EvalProtocol):
    """The released SpecEyes code's rules (module docstring); DeepEyes and Thyme only."""

    name = "published"
    # eval_code_deepeyes/SpecEyes.py:687-692, eval_code_thyme/SpecEyes.py:482: every routed
    # query's loop runs alone, the --baseline run's too.
    schedule: Schedule = "serial"

    def family_of(self, agent_name: str | None) -> str:
        """The agent's family; no agent (the small-only mode) is :data:`DRAFT_FAMILY`."""
        if agent_name is None:
            return DRAFT_FAMILY
        if agent_name not in PUBLISHED_AGENTS:
            raise ValueError(
                f"the published protocol covers the deepeyes and thyme agents, not {agent_name!r}"
            )
        return agent_name

    def loop_settings(self, agent: str = "deepeyes", mode: str = "speceyes") -> LoopSettings:
        """The agent's budgets; the small-only mode batches as the small-model script does."""
        settings = _PUBLISHED[self.family_of(agent)]
        if mode == "small":
            return replace(settings, batch_size=PUBLISHED_DRAFT_BATCH_SIZE)
        return settings

    def default_tau(self, agent: str, bench: str | None) -> float | None:
        """Table 1's threshold (:data:`PUBLISHED_TAU`) for a published benchmark."""
        return PUBLISHED_TAU.get((self.family_of(agent), bench or ""))

    def question_text(self, family: str, question: str, options: Sequence[str] | None) -> str:
        """With Thyme a question without options is taken as POPE's (the only such published
        benchmark)."""
        if family == DRAFT_FAMILY:
            return published_draft_block(question, options)
        if family == "thyme":
            kind = "mcq" if options else "yorn"
            full = published_thyme_question(question, options, kind)
            return full.split(PUBLISHED_THYME_SPLIT)[0]
        return published_question_block(question, options)

    def judge_messages(
        self, family: str, image: Any, question: str, options: Sequence[str] | None = None
    ) -> list[dict]:
        text = self.question_text(family, question, options) + prompts.JUDGE_SUFFIX
        return _messages(prompts.JUDGE_SYSTEM, published_view(image)[0], text)

    def small_messages(
        self, family: str, image: Any, question: str, options: Sequence[str] | None = None
    ) -> list[dict]:
        text = self.question_text(family, question, options) + prompts.SMALL_SUFFIX
        return _messages(prompts.SMALL_SYSTEM, published_view(image)[0], text)

    def tool_probability(
        self, backend: Backend, batch: Sequence[list[dict]], mode: JudgeMode, family: str
    ) -> list[float]:
        """A greedy decode of ``JUDGE_DECODE_TOKENS`` tokens with the agent's stop strings and
        the published rule (0.0 or 1.0), whatever ``mode`` says."""
        stop = prompts.THYME_STOP if family == "thyme" else prompts.DEEPEYES_STOP
        turns = backend.chat(batch, stop=stop, max_new_tokens=JUDGE_DECODE_TOKENS)
        return [1.0 if published_judge_tool(t.text) else 0.0 for t in turns]

    def open_image(self, query: Query, family: str) -> Image.Image:
        """The image as the scripts read it (:func:`published_image`): never EXIF-rotated;
        re-encoded as JPEG first where Thyme's script stores it so (:func:`reencodes_jpeg`)."""
        return published_image(query.image, jpeg=reencodes_jpeg(family, query))

    def answers(
        self,
        backend: Backend,
        batch: Sequence[list[dict]],
        *,
        max_new_tokens: int,
        top_k: int,
        agg: str,
        family: str | None = None,
    ) -> list[SpecAnswer]:
        """With ``agg="log"`` a backend that has whole logit rows (``scores == "logits"``) is
        asked for them, and they are turned into top-K logprobs (see :func:`to_logprobs`).
        The token budget follows :func:`published_small_tokens` (``family``: the funnel's);
        each text is the published prediction of the unstripped reply
        (:func:`published_prediction`)."""
        name = str(getattr(backend, "name", "") or "")
        max_new_tokens = published_small_tokens(family, name, max_new_tokens)
        if agg == "log" and backend.scores == "logits":
            answers = backend.answer(batch, max_new_tokens=max_new_tokens, top_k=_WHOLE_VOCAB)
            for a in answers:
                a.topk = to_logprobs(a.topk, top_k)
        else:
            answers = backend.answer(batch, max_new_tokens=max_new_tokens, top_k=top_k)
        for a in answers:
            a.text = published_prediction(_raw_text(backend, a))
        return answers

    def answer_scores(
        self,
        backend: Backend,
        answers: Sequence[SpecAnswer],
        *,
        top_k: int,
        agg: str,
        scale: float,
    ) -> np.ndarray:
        """``log``: ``exp(mean log p_max)`` with p_max over the full vocabulary, as the released
        code computes it (the values are logprobs: a server's, or whole rows turned into them
        by :meth:`answers`); other aggregations as ``fair``."""
        if agg != "log":
            return super().answer_scores(backend, answers, top_k=top_k, agg=agg, scale=scale)
        out = np.full(len(answers), np.nan)
        for j, a in enumerate(answers):
            rows = np.asarray(a.topk, dtype=np.float64)
            if rows.ndim == 2 and rows.shape[0] and np.isfinite(rows[:, 0]).all():
                out[j] = float(np.exp(rows[:, 0].mean()))
        return out


FAIR = EvalProtocol()
PUBLISHED = PublishedProtocol()
PROTOCOLS: dict[str, EvalProtocol] = {p.name: p for p in (FAIR, PUBLISHED)}


def check_protocol(protocol: str) -> str:
    """``protocol`` if it names one of :data:`PROTOCOLS`, else a ValueError."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; choose from {', '.join(PROTOCOLS)}")
    return protocol


def get_protocol(protocol: str) -> EvalProtocol:
    """The protocol object named ``protocol`` (``"fair"`` or ``"published"``)."""
    return PROTOCOLS[check_protocol(protocol)]
