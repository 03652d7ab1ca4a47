"""vLLM offline engine backend (``pip install speceyes[vllm]``; CUDA only).

One ``LLM`` engine runs each model in this process. Every batch of conversations goes to
``LLM.chat`` at once, so vLLM schedules them together with paged attention and continuous
batching. Images are resized here with the model's smart_resize (the exact scale is needed to
map zoom boxes back) and the engine is given the same pixel limits, so its own resize is a
no-op. ``limit_mm_per_prompt`` covers the original image plus one crop per tool call. The
pixel limits come from the checkpoint's ``preprocessor_config.json``, read as every backend
reads it (``checkpoint_geometry``). Greedy decoding follows the decoding policy: an explicit
``SamplingParams`` makes vLLM skip the model's generation_config, so its settings are set here.

The engine's outputs are read by the module-level functions below (``RequestOutput.outputs[0]``
is a ``CompletionOutput``; its ``logprobs`` hold one ``{token id: Logprob}`` dict per generated
token, the sampled token plus the top ``logprobs`` ones), which need no engine and are tested on
CPU against stand-ins of those types.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np

from speceyes.backends.base import (
    GENERATION_CONFIG,
    BackendError,
    Messages,
    Scores,
    checkpoint_geometry,
    checkpoint_json,
    cut_at_stop,
    decoding_settings,
    first_token_ids,
    map_images,
)
from speceyes.images import View, load_image, resize_for_model, view_for_model
from speceyes.types import ChatTurn, SpecAnswer


class EngineStartError(BackendError):
    """A vLLM engine did not start. ``memory`` is True where vLLM said memory was short, None
    where the cause is unknown here (an engine-core process failed; vLLM logs its cause)."""

    def __init__(self, message: str, memory: bool | None) -> None:
        super().__init__(message)
        self.memory = memory


# vLLM's start-up checks that fail for lack of memory (GPU or CPU), matched in their messages.
_MEMORY_MESSAGES = ("memory utilization", "KV cache", "cache blocks", "out of memory")


def start_error(name: str, error: Exception) -> EngineStartError | None:
    """``error`` raised while an engine started, as an ``EngineStartError`` (None: not a
    start-up failure). In-process checks raise ValueError; an engine-core process that fails
    leaves only a RuntimeError here."""
    text = str(error)
    if isinstance(error, ValueError) and any(m in text for m in _MEMORY_MESSAGES):
        return EngineStartError(f"{name}: vLLM engine memory is short: {text}", memory=True)
    if isinstance(error, RuntimeError) and "initialization failed" in text:
        return EngineStartError(
            f"{name}: the vLLM engine did not start ({text}); its cause is logged above",
            memory=None,
        )
    return None


class VLLMBackend:
    """A Qwen-VL checkpoint served by an in-process vLLM engine."""

    def __init__(
        self,
        model: str,
        *,
        family: str | None = None,
        max_logprobs: int = 64,
        max_images: int = 6,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        decoding: str = "checkpoint",
        name: str | None = None,
        **engine_kwargs: Any,
    ) -> None:
        try:
            from vllm import LLM
        except ImportError as e:  # pragma: no cover - depends on the machine
            raise BackendError(
                "vLLM is not installed (pip install 'speceyes[vllm]'; it needs CUDA)"
            ) from e
        if family is None:
            from transformers import AutoConfig

            family = AutoConfig.from_pretrained(model).model_type
        self.box_coords, self.factor, self.min_pixels, self.max_pixels = checkpoint_geometry(
            family, model, min_pixels=min_pixels, max_pixels=max_pixels
        )
        self._decode = decoding_settings(decoding, checkpoint_json(model, GENERATION_CONFIG))
        self.decoding: dict[str, Any] = {"policy": decoding, **self._decode}
        self.name = name or model.rstrip("/").rsplit("/", 1)[-1]
        self.family = family
        self.scores: Scores = "logprobs"  # the engine's top logprobs, full-vocabulary normalised
        self.max_logprobs = max_logprobs
        self.max_images = max_images  # per prompt; agents that add images stay under it
        try:
            self.llm = LLM(
                model=model,
                max_logprobs=max_logprobs,
                limit_mm_per_prompt={"image": max_images},
                mm_processor_kwargs={"min_pixels": self.min_pixels, "max_pixels": self.max_pixels},
                **engine_kwargs,
            )
        except (ValueError, RuntimeError) as e:
            error = start_error(self.name, e)
            if error is None:
                raise
            raise error from e
        # LLM steps its engine in the calling thread and collects every finished request, so
        # two threads in it at once (the pipelined schedule's front and agent loops) would
        # take each other's outputs: one call at a time
        self._lock = threading.Lock()
        self.tokenizer = self.llm.get_tokenizer()
        # The engine's context length (its max_model_len argument, else the model's own):
        # agent loops end a conversation that would outgrow it (``base.context_limit``).
        self.max_model_len: int | None = engine_context_length(self.llm)

    def view_of(self, image: Any) -> View:
        img = load_image(image)
        return view_for_model(img, self.factor, self.min_pixels, self.max_pixels)

    def _convert(self, messages: Messages) -> list[dict]:
        return engine_messages(messages, self.factor, self.min_pixels, self.max_pixels)

    def _chat(self, batch: Sequence[Messages], params) -> list:
        # A last {"role": "assistant", ..., "continue": True} extends that turn (Thyme). vLLM
        # takes that mode per call, so a mixed batch goes as two calls, results in order.
        cont = [bool(m) and m[-1].get("continue") is True for m in batch]
        out: list = [None] * len(batch)
        try:
            for flag in (False, True):
                idx = [i for i, c in enumerate(cont) if c is flag]
                if not idx:
                    continue
                kw = {"add_generation_prompt": False, "continue_final_message": True} if flag else {}
                convs = [self._convert(batch[i]) for i in idx]
                with self._lock:
                    got = self.llm.chat(convs, params, use_tqdm=False, **kw)
                for i, o in zip(idx, got, strict=True):
                    out[i] = o
        except Exception as e:  # pragma: no cover - GPU only
            raise BackendError(f"{self.name}: vLLM generation failed: {e}") from e
        return out

    def next_token_probs(
        self, batch: Sequence[Messages], words: Sequence[str], top_logprobs: int | None = None
    ) -> np.ndarray:
        from vllm import SamplingParams

        if not batch:
            return np.zeros((0, len(words)))
        ids = first_token_ids(self.tokenizer, words)
        k = self.max_logprobs if top_logprobs is None else min(top_logprobs, self.max_logprobs)
        params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=k, **self._decode)
        return np.stack([token_probs(first_step(o), ids) for o in self._chat(batch, params)])

    def answer(
        self, batch: Sequence[Messages], max_new_tokens: int = 20, top_k: int = 64
    ) -> list[SpecAnswer]:
        from vllm import SamplingParams

        if top_k > self.max_logprobs:
            raise ValueError(
                f"top_k={top_k} exceeds the engine's max_logprobs={self.max_logprobs}"
            )
        if not batch:
            return []
        params = SamplingParams(
            temperature=0.0, max_tokens=max_new_tokens, logprobs=top_k, **self._decode
        )
        answers = []
        eos = {self.tokenizer.eos_token_id, *getattr(self.tokenizer, "all_special_ids", [])}
        for o in self._chat(batch, params):
            ids, rows = topk_rows(o.outputs[0], top_k, eos)
            text = self.tokenizer.decode(ids, skip_special_tokens=True).strip()
            answers.append(SpecAnswer(text=text, topk=rows, token_ids=ids))
        return answers

    def chat(
        self, batch: Sequence[Messages], stop: Sequence[str] = (), max_new_tokens: int = 1024
    ) -> list[ChatTurn]:
        from vllm import SamplingParams

        if not batch:
            return []
        params = SamplingParams(
            temperature=0.0,
            max_tokens=max_new_tokens,
            stop=list(stop) or None,
            include_stop_str_in_output=True,
            **self._decode,
        )
        turns = []
        for o in self._chat(batch, params):
            c = o.outputs[0]
            text, which = cut_at_stop(c.text, stop)
            finish = "length" if c.finish_reason == "length" else "stop"
            turns.append(ChatTurn(text=text, finish_reason=finish, stop=which, tokens=len(c.token_ids)))
        return turns


# ---- the engine's outputs, read without the engine ---------------------------------------------
def engine_context_length(llm: Any) -> int | None:
    """The tokens (prompt and reply) one request to an ``LLM`` may hold: its engine's
    ``model_config.max_model_len``; None where the engine does not say."""
    config = getattr(getattr(llm, "llm_engine", None), "model_config", None)
    length = getattr(config, "max_model_len", None)
    return int(length) if isinstance(length, int) and length > 0 else None


def engine_messages(
    messages: Messages, factor: int, min_pixels: int, max_pixels: int
) -> list[dict[str, Any]]:
    """speceyes messages -> ``LLM.chat`` messages: images smart_resized here, as PIL parts."""

    def image(src: Any) -> dict[str, Any]:
        img, _ = resize_for_model(load_image(src), factor, min_pixels, max_pixels)
        return {"type": "image_pil", "image_pil": img}

    return map_images(messages, image)


def first_step(request_output: Any) -> Mapping[int, Any]:
    """The ``{token id: Logprob}`` dict of a request's first generated token ({} if none)."""
    logprobs = request_output.outputs[0].logprobs
    return logprobs[0] if logprobs else {}


def token_probs(step: Mapping[int, Any], ids: Sequence[int | None]) -> np.ndarray:
    """P(token) per id from one step's logprobs; an id outside them (or None) gets 0."""
    return np.array([math.exp(step[i].logprob) if i in step else 0.0 for i in ids])


def topk_rows(
    completion: Any, top_k: int, eos_ids: Collection[int]
) -> tuple[list[int], np.ndarray]:
    """A ``CompletionOutput``'s tokens before the first EOS and their top-K logprobs, each row
    sorted descending and padded with -inf (a step can hold K + 1 entries: the sampled token
    when it ranks below K, which the sort drops)."""
    ids = list(completion.token_ids)
    n = next((j for j, t in enumerate(ids) if t in eos_ids), len(ids))
    rows = np.full((n, top_k), -np.inf)
    for j in range(n):
        vals = sorted((lp.logprob for lp in completion.logprobs[j].values()), reverse=True)[:top_k]
        rows[j, : len(vals)] = vals
    return ids[:n], rows
