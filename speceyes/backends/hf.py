"""In-process transformers backend: batched, left-padded, greedy.

Loads any Qwen2.5-VL or Qwen3-VL checkpoint (a local folder or a hub id) through
``AutoModelForImageTextToText``. Inputs are built here from the tokenizer, the chat template and
the image processor (the same expansion of ``<|image_pad|>`` the Qwen processors do), so no
video processor and hence no torchvision is needed; ``mm_token_type_ids`` always reaches the
model, without which Qwen2.5-VL silently loses M-RoPE and Qwen3-VL refuses to run.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from speceyes.backends.base import (
    MODEL_FAMILIES,
    BackendError,
    Messages,
    Scores,
    checkpoint_file,
    checkpoint_geometry,
    checkpoint_json,
    cut_at_stop,
    decoding_settings,
    first_token_ids,
    map_images,
)
from speceyes.images import View, load_image, resize_for_model, view_for_model
from speceyes.types import ChatTurn, SpecAnswer

log = logging.getLogger(__name__)


class ModelLoadError(ValueError):
    """A model path or hub id could not be loaded; the message says what was tried."""


def chat_template_file(model: str | Path) -> str | None:
    """The chat template a checkpoint keeps beside its tokenizer config, in its folder or, for
    a hub id, in the HF cache: ``chat_template.jinja``, else ``chat_template.json`` (which
    transformers' tokenizer does not read); None where it has neither."""
    path = checkpoint_file(model, "chat_template.jinja")
    if path is not None:
        return path.read_text(encoding="utf-8")
    template = (checkpoint_json(model, "chat_template.json") or {}).get("chat_template")
    return template if isinstance(template, str) and template else None


def declared_context_length(config: Any, tokenizer: Any) -> int | None:
    """The tokens (prompt and reply) one sequence may hold, as the checkpoint declares it: its
    text model's ``max_position_embeddings`` (the positions it was built for), or the
    tokenizer's ``model_max_length`` where that is smaller; None where neither is declared.
    transformers runs past either without an error, the model's output degrading instead."""
    from transformers.tokenization_utils_base import VERY_LARGE_INTEGER

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limits = [
        getattr(text, "max_position_embeddings", None),
        # The tokenizer's default when its config names no length: not a limit.
        getattr(tokenizer, "model_max_length", None),
    ]
    real = [int(n) for n in limits if isinstance(n, int) and 0 < n < VERY_LARGE_INTEGER]
    return min(real, default=None)


class HFBackend:
    """A Qwen-VL checkpoint run in this process with transformers."""

    def __init__(
        self,
        model: str | Path,
        *,
        dtype: str = "auto",
        device_map: str | dict | None = None,
        attn_implementation: str | None = None,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        decoding: str = "checkpoint",
        name: str | None = None,
    ) -> None:
        import torch
        from transformers import (
            AutoConfig,
            AutoImageProcessor,
            AutoModelForImageTextToText,
            AutoTokenizer,
        )

        self._torch = torch
        source = str(model)
        local = Path(source).expanduser()
        if local.exists():
            if not (local / "config.json").is_file():
                raise ModelLoadError(f"{local} is not a model folder: it has no config.json")
            source = str(local)
        elif source.startswith((".", "/", "~")) or source.count("/") > 1:
            raise ModelLoadError(f"model path {source!r} does not exist")
        self.name = name or Path(source).name
        try:
            config = AutoConfig.from_pretrained(source)
            self.tokenizer = AutoTokenizer.from_pretrained(source)
            self.image_processor = AutoImageProcessor.from_pretrained(source)
        except (OSError, ValueError) as e:
            raise ModelLoadError(
                f"could not load model {source!r}: not a local folder, and not reachable as a hub "
                f"id ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
            ) from e
        if config.model_type not in MODEL_FAMILIES:
            raise ModelLoadError(
                f"{source}: model type {config.model_type!r} is not supported; "
                f"speceyes runs {', '.join(MODEL_FAMILIES)} checkpoints"
            )
        self.family = config.model_type
        kwargs: dict[str, Any] = {"dtype": dtype}
        if device_map is not None:
            kwargs["device_map"] = device_map
        if attn_implementation is not None:
            kwargs["attn_implementation"] = attn_implementation
        self.model = AutoModelForImageTextToText.from_pretrained(source, **kwargs).eval()

        ip = self.image_processor
        # The checkpoint's own processor config sets the geometry (unless limits are given),
        # read as every backend reads it; the loaded processor where the file is not found.
        self.box_coords, self.factor, self.min_pixels, self.max_pixels = checkpoint_geometry(
            self.family, source, processor=ip, min_pixels=min_pixels, max_pixels=max_pixels
        )
        self.merge = int(getattr(ip, "merge_size", 2))
        # The processor resizes with these limits too, so its resize keeps the view exactly.
        self._size = {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels}
        gen = getattr(self.model, "generation_config", None)
        self._decode = decoding_settings(decoding, gen.to_dict() if gen is not None else None)
        self.decoding: dict[str, Any] = {"policy": decoding, **self._decode}
        # In process: whole logit rows, any number of images, top-K over the whole vocabulary.
        self.scores: Scores = "logits"
        self.max_images: int | None = None
        self.max_logprobs: int | None = None
        # Agent loops end a conversation that would outgrow it (``base.context_limit``).
        self.max_model_len = declared_context_length(config, self.tokenizer)

        tok = self.tokenizer
        tok.padding_side = "left"
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        if tok.chat_template is None:
            tok.chat_template = chat_template_file(source)
            if tok.chat_template is None:
                raise ModelLoadError(f"{source}: no chat template found")
        self.image_token = "<|image_pad|>"
        self.image_token_id = tok.convert_tokens_to_ids(self.image_token)
        self.eos_ids = self._eos_ids()
        # Generation is not re-entrant on one model; concurrent callers queue here.
        self._lock = threading.Lock()

    # ---- geometry -------------------------------------------------------------------------
    def view_of(self, image: Any) -> View:
        img = load_image(image, copy=False)
        return view_for_model(img, self.factor, self.min_pixels, self.max_pixels)

    # ---- input building -------------------------------------------------------------------
    def _eos_ids(self) -> set[int]:
        ids = {self.tokenizer.eos_token_id, self.tokenizer.convert_tokens_to_ids("<|im_end|>")}
        gen = getattr(self.model, "generation_config", None)
        extra = getattr(gen, "eos_token_id", None)
        if isinstance(extra, int):
            ids.add(extra)
        elif extra:
            ids.update(extra)
        return {i for i in ids if isinstance(i, int) and i >= 0}

    def _prepare(self, batch: Sequence[Messages], add_generation_prompt: bool = True):
        torch = self._torch
        texts: list[str] = []
        images: list[Any] = []

        def image(src: Any) -> dict[str, Any]:  # the pixels go to the processor, in order
            img, _ = resize_for_model(
                load_image(src, copy=False), self.factor, self.min_pixels, self.max_pixels
            )
            images.append(img)
            return {"type": "image"}

        for messages in batch:
            clean = map_images(messages, image)
            # {"role": "assistant", ..., "continue": True} last: extend that turn (Thyme's
            # code loop) instead of opening a new one.
            cont = bool(messages) and messages[-1].get("continue") is True
            if cont and isinstance(clean[-1]["content"], list):
                if not clean[-1]["content"] or clean[-1]["content"][-1].get("type") != "text":
                    clean[-1]["content"].append({"type": "text", "text": ""})  # keep a last image
            mode = {"continue_final_message": True} if cont else {}
            texts.append(
                self.tokenizer.apply_chat_template(
                    clean,
                    tokenize=False,
                    add_generation_prompt=add_generation_prompt and not cont,
                    **mode,
                )
            )
        extra: dict[str, Any] = {}
        if images:
            pix = self.image_processor(images=images, size=self._size, return_tensors="pt")
            grid = pix["image_grid_thw"]
            counts = (grid.prod(dim=-1) // (self.merge**2)).tolist()
            k = 0
            expanded = []
            for t in texts:
                pieces = t.split(self.image_token)
                out = pieces[0]
                for piece in pieces[1:]:
                    out += "<|placeholder|>" * counts[k] + piece
                    k += 1
                expanded.append(out.replace("<|placeholder|>", self.image_token))
            texts = expanded
            extra = {"pixel_values": pix["pixel_values"], "image_grid_thw": grid}
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        enc["mm_token_type_ids"] = (enc["input_ids"] == self.image_token_id).to(torch.int64)
        enc.update(extra)
        device = self.model.device
        dtype = self.model.dtype
        return {
            k: (v.to(device=device, dtype=dtype) if k == "pixel_values" else v.to(device))
            for k, v in enc.items()
        }

    def _generate(self, inputs: dict, **kwargs):
        torch = self._torch
        with self._lock, torch.inference_mode():
            try:
                return self.model.generate(
                    **inputs,
                    do_sample=False,
                    temperature=None,
                    top_p=None,
                    top_k=None,
                    return_dict_in_generate=True,
                    pad_token_id=self.tokenizer.pad_token_id,
                    eos_token_id=sorted(self.eos_ids),
                    **self._decode,
                    **kwargs,
                )
            except torch.OutOfMemoryError as e:  # pragma: no cover - GPU only
                raise BackendError(f"{self.name}: out of memory; lower --batch-size") from e

    def _trim(self, ids: list[int]) -> list[int]:
        """Generated ids up to (not including) the first EOS or padding."""
        out = []
        for i in ids:
            if i in self.eos_ids or i == self.tokenizer.pad_token_id:
                break
            out.append(i)
        return out

    # ---- protocol -------------------------------------------------------------------------
    def next_token_probs(
        self, batch: Sequence[Messages], words: Sequence[str], top_logprobs: int | None = None
    ) -> np.ndarray:
        """P(first token of each word) at the next position: [conversations, words], one step
        over the whole vocabulary (``top_logprobs`` does not apply)."""
        if not batch:
            return np.zeros((0, len(words)))
        ids = first_token_ids(self.tokenizer, words)
        torch = self._torch
        inputs = self._prepare(batch)
        with self._lock, torch.inference_mode():
            logits = self.model(**inputs).logits[:, -1, :].float()
        kept = [j for j, i in enumerate(ids) if i is not None]
        probs = torch.softmax(logits, dim=-1)[:, [ids[j] for j in kept]].cpu().numpy()
        out = np.zeros((len(batch), len(words)), dtype=probs.dtype)
        out[:, kept] = probs
        return out

    def answer(
        self, batch: Sequence[Messages], max_new_tokens: int = 20, top_k: int = 64
    ) -> list[SpecAnswer]:
        if not batch:
            return []
        torch = self._torch
        inputs = self._prepare(batch)
        out = self._generate(inputs, max_new_tokens=max_new_tokens, output_logits=True)
        # Keep only top-K per step on the device: never hold [tokens, vocabulary] per answer.
        k = min(top_k, out.logits[0].shape[-1])
        topk = torch.stack([step.float().topk(k, dim=-1).values for step in out.logits], dim=1)
        topk = topk.cpu().numpy()
        gen = out.sequences[:, inputs["input_ids"].shape[1] :].tolist()
        answers = []
        for b, ids in enumerate(gen):
            kept = self._trim(ids)
            answers.append(
                SpecAnswer(
                    text=self.tokenizer.decode(kept, skip_special_tokens=True).strip(),
                    topk=np.ascontiguousarray(topk[b, : len(kept)]),
                    token_ids=kept,
                )
            )
        return answers

    def chat(
        self, batch: Sequence[Messages], stop: Sequence[str] = (), max_new_tokens: int = 1024
    ) -> list[ChatTurn]:
        if not batch:
            return []
        inputs = self._prepare(batch)
        kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens}
        if stop:
            kwargs.update(stop_strings=list(stop), tokenizer=self.tokenizer)
        out = self._generate(inputs, **kwargs)
        gen = out.sequences[:, inputs["input_ids"].shape[1] :].tolist()
        turns = []
        for ids in gen:
            kept = self._trim(ids)
            hit_eos = len(kept) < len(ids)
            text = self.tokenizer.decode(kept, skip_special_tokens=True)
            text, which = cut_at_stop(text, stop)
            finish = "stop" if (which or hit_eos) else "length"
            turns.append(ChatTurn(text=text, finish_reason=finish, stop=which, tokens=len(kept)))
        return turns
