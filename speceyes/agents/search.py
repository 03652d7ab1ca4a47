"""A training-free zoom agent (ZoomEye-style): search the image for the target, then answer.

The large model is not asked to write a box. Instead, at each depth the current region is split
into an overlapping grid; every cell is cropped with the same zoom tool the DeepEyes loop uses
(:func:`speceyes.images.zoom_crop`, always from the ORIGINAL image) and scored by the model's own
probability of "yes" to ``Is there a {target} in the image?``; the agent zooms into the best cell
and repeats, up to ``depth`` times or until the region is shown at native resolution. The answer is
then asked in the DeepEyes conversation shape: the question on the full image, an assistant
``<tool_call>`` with the chosen box (written by the agent, not the model), the crop returned as the
real ``<tool_response>`` turn, and the model's ``<answer>``. ``beam`` keeps several cells per depth
(all their cells compete at the next); ``stay`` scores the current region with its cells and stops
where it wins, so a target that fills the region is not cut apart.

Loops run in lockstep like :class:`speceyes.agents.zoom.ZoomAgent`: one batched scoring call for
every searching loop's cells and one batched answer call for every answering loop per step.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from PIL import Image

from speceyes import prompts
from speceyes.agents.base import (
    FILL_VIEW_HELP,
    AgentOutcome,
    LoopAgent,
    crop_min_pixels,
    fallback_answer,
    last_answer,
)
from speceyes.agents.zoom import MIN_BOX
from speceyes.backends.base import Backend, Messages
from speceyes.images import BoxError, View, load_image, zoom_crop
from speceyes.types import Query

# Mini-world and V*-style templates -> the object to look for.
_PATTERNS = (
    re.compile(r"^is there an? (?P<t>.+?) in the image\??$", re.I),
    re.compile(r"^what shape is the (?P<t>.+?)\??$", re.I),
    re.compile(r"^what is the (?:colou?r|shape|size|material) of the (?P<t>.+?)\??$", re.I),
    re.compile(r"^is the (?P<t>.+?) (?:on|to|at|in) the (?:left|right)", re.I),
    re.compile(r"^(?:where|what colou?r) is the (?P<t>.+?)\??$", re.I),
)


def target_phrase(question: str) -> str | None:
    """The object a question is about, for the templates we know; None otherwise."""
    q = question.strip()
    for pat in _PATTERNS:
        m = pat.match(q)
        if m:
            return m.group("t").strip()
    return None


def score_question(question: str) -> str:
    """The yes/no question a region is scored with (the mini-world's POPE template)."""
    t = target_phrase(question)
    if t is not None:
        return f"Is there a {t} in the image?"
    # Generic fallback: does this region show what the whole question asks about?
    return f"Is there anything in the image that answers this question: {question.strip()}"


def grid_boxes(
    box: Sequence[float], grid: int, overlap: float
) -> list[tuple[float, float, float, float]]:
    """``grid`` x ``grid`` cells covering ``box`` (x1, y1, x2, y2), each side ``(1 + overlap)/grid``
    of the box's (clipped to it), evenly spaced from edge to edge."""
    x1, y1, x2, y2 = box
    w, h = x2 - x1, y2 - y1
    cw, ch = min(w, w * (1 + overlap) / grid), min(h, h * (1 + overlap) / grid)
    out = []
    for j in range(grid):
        for i in range(grid):
            ox = x1 + (0 if grid == 1 else i * (w - cw) / (grid - 1))
            oy = y1 + (0 if grid == 1 else j * (h - ch) / (grid - 1))
            out.append((ox, oy, ox + cw, oy + ch))
    return out


@dataclass
class _Loop:
    query: Query
    image: Image.Image
    view: View
    scorer: str  # the yes/no question each region is scored with
    label: str
    region: tuple[float, float, float, float]  # original pixels
    # Regions searched at the next depth: the best ``beam`` cells of this depth, best first (so
    # ``frontier[0]`` is ``region``); just the whole image before the first zoom.
    frontier: list[tuple[float, float, float, float]]
    depth: int = 0
    crop: Image.Image | None = None
    call_text: str | None = None  # the <tool_call> of the last zoom
    searching: bool = True
    outcome: AgentOutcome = field(default_factory=lambda: AgentOutcome(answer=""))
    done: bool = False
    started: float = field(default_factory=time.perf_counter)


class SearchAgent(LoopAgent):
    """Zoom by search over regions scored with the model's own P(yes); same API as ZoomAgent."""

    name = "search"

    @dataclass
    class Settings:
        """Its keyword arguments, as ``--search K=V,...`` or a manifest's ``agent`` object sets
        them; each field's ``help`` is the text ``--search`` shows."""

        depth: int = field(default=2, metadata={"help": "zoom steps"})
        grid: int = field(default=2, metadata={"help": "cells per side"})
        overlap: float = field(default=0.25, metadata={"help": "0-1"})
        min_region: int | None = field(
            default=None,
            metadata={"help": "stop below this side in px; unset: the model's view side"},
        )
        answer_prompt: str = field(
            default="deepeyes",
            metadata={
                "help": "deepeyes: DeepEyes conversation with the crop; small: the small prompt "
                "on the crop"
            },
        )
        max_new_tokens: int = field(default=64, metadata={"help": "tokens of the answer"})
        min_box: int = field(
            default=MIN_BOX,
            metadata={
                "help": "smallest zoom box side in pixels of the full image's view, as the "
                "DeepEyes check"
            },
        )
        stay: bool = field(
            default=False,
            metadata={
                "help": "1: also score the current region and stop zooming where it beats "
                "every cell"
            },
        )
        beam: int = field(
            default=1,
            metadata={"help": "regions kept per depth; their cells all compete at the next depth"},
        )
        fill_view: bool = field(
            default=False,
            metadata={"help": FILL_VIEW_HELP},
        )

    def __init__(
        self,
        backend: Backend,
        *,
        depth: int = Settings.depth,
        grid: int = Settings.grid,
        overlap: float = Settings.overlap,
        min_region: int | None = Settings.min_region,
        answer_prompt: str = Settings.answer_prompt,
        max_new_tokens: int = Settings.max_new_tokens,
        min_box: int = Settings.min_box,
        stay: bool = Settings.stay,
        beam: int = Settings.beam,
        fill_view: bool = Settings.fill_view,
    ) -> None:
        if answer_prompt not in ("deepeyes", "small"):
            raise ValueError("answer_prompt must be 'deepeyes' or 'small'")
        if depth < 0 or grid < 1 or not 0 <= overlap < 1 or beam < 1:
            raise ValueError("need depth >= 0, grid >= 1, beam >= 1 and 0 <= overlap < 1")
        self.backend = backend
        self.depth, self.grid, self.overlap = depth, grid, overlap
        self.answer_prompt = answer_prompt
        self.max_new_tokens = max_new_tokens
        self.min_box = min_box
        # Score the current region alongside its cells and stop when it wins: a target that
        # fills the region is cut apart by every cell, so zooming further only loses it.
        self.stay = stay
        # Keep the best ``beam`` cells of each depth and compare all their cells at the next:
        # a coarse level that ranks the target's cell second is corrected where it is larger.
        self.beam = beam
        # Show every crop with as many pixels as the full image's view (upscaled), not at its
        # own size: a model trained on crops at that scale reads their objects at the size it
        # learned. Never more than the view: with a real model's large budget that stays bounded.
        self.fill_view = fill_view
        # A region no larger than this is already shown at native resolution: zooming is useless.
        self.min_region = (
            min_region if min_region is not None else int(math.sqrt(backend.max_pixels))
        )

    # ---- geometry ---------------------------------------------------------------------------
    def _model_box(self, loop: _Loop, box: Sequence[float]) -> list[int]:
        """Original-pixel box -> the model's box convention on the original image's view."""
        v = loop.view
        if self.backend.box_coords == "relative1000":
            sx, sy = 1000.0 / v.orig_w, 1000.0 / v.orig_h
        else:
            sx, sy = 1.0 / v.scale_x, 1.0 / v.scale_y
        x1, y1, x2, y2 = box
        return [math.floor(x1 * sx), math.floor(y1 * sy), math.ceil(x2 * sx), math.ceil(y2 * sy)]

    def _crop(
        self, loop: _Loop, model_box: list[int]
    ) -> tuple[Image.Image, tuple[int, int, int, int]]:
        b = self.backend
        crop, _, box = zoom_crop(
            loop.image,
            loop.view,
            model_box,
            coords=b.box_coords,
            factor=b.factor,
            min_pixels=crop_min_pixels(b, loop.view, self.fill_view),
            max_pixels=b.max_pixels,
            min_size=self.min_box,
        )
        return crop, box

    def _can_zoom(self, loop: _Loop) -> bool:
        x1, y1, x2, y2 = loop.region
        return loop.depth < self.depth and max(x2 - x1, y2 - y1) > self.min_region

    # ---- scoring ------------------------------------------------------------------------------
    def _p_yes(self, batch: list[Messages]) -> np.ndarray:
        p = np.asarray(self.backend.next_token_probs(batch, ["yes", "no"]), dtype=np.float64)
        return p[:, 0] / np.maximum(p[:, 0] + p[:, 1], 1e-30)

    def _search_step(self, loops: list[_Loop]) -> None:
        cells: list[tuple[_Loop, list[int], Image.Image, tuple[int, int, int, int]]] = []
        here: dict[int, int] = {}  # loop id -> index of its own region among the scored crops
        for lp in loops:
            boxes = [c for r in lp.frontier for c in grid_boxes(r, self.grid, self.overlap)]
            if self.stay:
                boxes = [lp.region, *boxes]
            for k, c in enumerate(boxes):
                mb = self._model_box(lp, c)
                try:
                    crop, box = self._crop(lp, mb)
                except BoxError as e:
                    lp.outcome.invalid_tool_calls += 1
                    lp.outcome.trace.append({"type": "tool_error", "error": str(e)})
                    continue
                if self.stay and k == 0:
                    here[id(lp)] = len(cells)
                cells.append((lp, mb, crop, box))
        scores = (
            self._p_yes([prompts.small_messages(crop, lp.scorer) for lp, _, crop, _ in cells])
            if cells
            else np.zeros(0)
        )
        for lp in loops:
            own = here.get(id(lp))
            mine = [
                (s, c)
                for i, (s, c) in enumerate(zip(scores.tolist(), cells, strict=True))
                if c[0] is lp and i != own
            ]
            if not mine:
                lp.searching = False
                continue
            ranked = sorted(mine, key=lambda t: -t[0])
            best_s, (_, mb, crop, box) = ranked[0]
            if own is not None and scores[own] >= best_s:
                lp.searching = False
                lp.outcome.trace.append(
                    {
                        "type": "stay",
                        "crop_box": [round(v) for v in lp.region],
                        "depth": lp.depth,
                        "score": round(float(scores[own]), 6),
                        "best_cell": round(float(best_s), 6),
                    }
                )
                continue
            lp.outcome.tool_calls += 1
            lp.outcome.trace.append(
                {
                    "type": "zoom",
                    "bbox_2d": mb,
                    "label": lp.label,
                    "crop_box": list(box),
                    "crop_size": [crop.width, crop.height],
                    "depth": lp.depth + 1,
                    "score": round(float(best_s), 6),
                    "candidates": [
                        {"bbox_2d": c[1], "crop_box": list(c[3]), "score": round(float(s), 6)}
                        for s, c in mine
                    ],
                }
            )
            lp.depth += 1
            lp.region = tuple(float(v) for v in box)  # type: ignore[assignment]
            lp.frontier = [tuple(float(v) for v in c[3]) for _, c in ranked[: self.beam]]
            lp.crop = crop
            args = {"bbox_2d": mb, "label": lp.label}
            lp.call_text = (
                "<tool_call>\n"
                + json.dumps({"name": prompts.ZOOM_TOOL_NAME, "arguments": args})
                + "\n</tool_call>"
            )
            lp.searching = self._can_zoom(lp)

    def search_step(self, loops: Sequence[_Loop]) -> None:
        """One zoom (one batched scoring call) for each of ``loops`` still searching; the
        cascade's speculation (speceyes.cascade) steps a small model's search depth by depth
        with it and answers itself."""
        searching = [lp for lp in loops if lp.searching and not lp.done]
        if searching:
            self._search_step(searching)

    # ---- answering ---------------------------------------------------------------------------
    def _answer_messages(self, lp: _Loop) -> Messages:
        q = lp.query
        if self.answer_prompt == "small":
            return prompts.small_messages(
                lp.crop if lp.crop is not None else lp.image, q.question, q.options
            )
        msgs = prompts.deepeyes_messages(lp.image, q.question, q.options)
        if lp.crop is not None:
            msgs = [
                *msgs,
                {"role": "assistant", "content": lp.call_text},
                prompts.deepeyes_tool_response(lp.crop),
            ]
        return msgs

    def _answer_step(self, loops: list[_Loop]) -> None:
        batch = [self._answer_messages(lp) for lp in loops]
        if self.answer_prompt == "small":
            texts = [a.text for a in self.backend.answer(batch)]
            for lp, text in zip(loops, texts, strict=True):
                lp.outcome.answer = text
                lp.outcome.turns += 1
                lp.outcome.trace.append({"type": "assistant", "text": text, "finish": "stop"})
                lp.done = True
            return
        turns = self.backend.chat(
            batch, stop=prompts.DEEPEYES_STOP, max_new_tokens=self.max_new_tokens
        )
        for lp, turn in zip(loops, turns, strict=True):
            out = lp.outcome
            out.turns += 1
            out.trace.append({"type": "assistant", "text": turn.text, "finish": turn.finish_reason})
            ans = last_answer(turn.text)
            if ans is None:
                ans = fallback_answer(turn.text.split("<tool_call>")[0])
                out.trace.append({"type": "format_error", "error": "no <answer>"})
            out.answer, lp.done = ans, True

    # ---- incremental API ---------------------------------------------------------------------
    def first_messages(self, query: Query) -> Messages:
        """The DeepEyes conversation on the full image: the search's own first calls score
        crops, so the shape its answer turn extends is the prefix that can be shared."""
        image = load_image(query.image, copy=False)
        return prompts.deepeyes_messages(image, query.question, query.options)

    def start_loop(self, query: Query) -> _Loop:
        """Open a loop for ``query``; raises ImageError/ValueError for an unusable image."""
        image = load_image(query.image, copy=False)
        whole = (0.0, 0.0, float(image.width), float(image.height))
        loop = _Loop(
            query=query,
            image=image,
            view=self.backend.view_of(image),
            scorer=score_question(query.question),
            label=target_phrase(query.question) or query.question.strip(),
            region=whole,
            frontier=[whole],
        )
        loop.searching = self._can_zoom(loop)
        return loop

    def _turn(self, active: list[_Loop]) -> None:
        """One search step (one batched scoring call) and/or the answer (one batched call)."""
        searching = [lp for lp in active if lp.searching]
        if searching:
            self._search_step(searching)
        answering = [lp for lp in active if not lp.searching]
        if answering:
            self._answer_step(answering)
