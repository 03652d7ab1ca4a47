"""The DeepEyes agent: think, call image_zoom_in_tool on a box, look at the crop, answer.

Many loops run in lockstep: each step sends every unfinished conversation to the backend in one
batch, so an engine can batch their turns. The model's text is parsed as JSON (never eval);
every malformed call gets a clear message back and is recorded, and the loop never raises on
model output. The published protocol's loop is :class:`~speceyes.agents.published_zoom.
PublishedZoomAgent`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from speceyes import prompts, protocols
from speceyes.agents.base import (
    FILL_VIEW_HELP,
    AgentOutcome,
    LoopAgent,
    crop_min_pixels,
    fallback_answer,
    last_answer,
)
from speceyes.backends.base import Backend, Messages
from speceyes.images import BoxError, View, load_image, zoom_crop
from speceyes.types import Query

MIN_BOX = 28


class ToolCallError(ValueError):
    """A tool call the model wrote cannot be run; the message is shown back to the model."""


def parse_tool_call(text: str) -> dict[str, Any]:
    """Arguments of the last <tool_call> in ``text``, validated; raises ToolCallError."""
    start = text.rfind("<tool_call>")
    if start < 0:
        raise ToolCallError("no <tool_call> found")
    body = text[start + len("<tool_call>") :]
    end = body.find("</tool_call>")
    if end < 0:
        raise ToolCallError("the tool call is not closed with </tool_call>")
    body = body[:end].strip()
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        raise ToolCallError(f"the tool call is not valid JSON ({e.msg} at char {e.pos})") from None
    if not isinstance(call, dict):
        raise ToolCallError('the tool call must be a JSON object {"name": ..., "arguments": {...}}')
    name = call.get("name")
    if name != prompts.ZOOM_TOOL_NAME:
        raise ToolCallError(f"unknown tool {name!r}; the only tool is {prompts.ZOOM_TOOL_NAME!r}")
    args = call.get("arguments")
    if isinstance(args, str):  # some models double-encode the arguments
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    if not isinstance(args, dict):
        raise ToolCallError('"arguments" must be a JSON object with "bbox_2d"')
    if "bbox_2d" not in args:
        raise ToolCallError('missing required argument "bbox_2d" = [x1, y1, x2, y2]')
    label = args.get("label")
    return {"bbox_2d": args["bbox_2d"], "label": label if isinstance(label, str) else None}


def _error_turn(message: str) -> dict:
    return {
        "role": "user",
        "content": [
            prompts.text_part("<tool_response>"),
            prompts.text_part(f"Error: {message}"),
            prompts.text_part(prompts.DEEPEYES_USER_SUFFIX),
            prompts.text_part("</tool_response>"),
        ],
    }


@dataclass
class _Loop:
    query: Query
    image: Image.Image
    view: View
    messages: Messages
    outcome: AgentOutcome = field(default_factory=lambda: AgentOutcome(answer=""))
    done: bool = False
    started: float = field(default_factory=time.perf_counter)


class ZoomAgent(LoopAgent):
    """DeepEyes' image_zoom_in_tool loop over any backend."""

    name = "deepeyes"
    protocol = "fair"  # the evaluation protocol whose loop rules and defaults it follows

    @dataclass
    class Settings:
        """Its keyword arguments, as ``K=V`` text or a manifest's ``agent`` object sets them
        (``None`` budgets: the protocol's)."""

        max_tool_calls: int | None = None
        max_new_tokens: int | None = None
        min_box: int = MIN_BOX
        fill_view: bool = field(
            default=False,
            metadata={"help": FILL_VIEW_HELP},
        )

    def __init__(
        self,
        backend: Backend,
        *,
        max_tool_calls: int | None = None,
        max_new_tokens: int | None = None,
        min_box: int = MIN_BOX,
        fill_view: bool = False,
    ) -> None:
        self.backend = backend
        # None: the protocol's loop default (protocols.LoopSettings; published: the authors'
        # generation budget and tokens per turn).
        limits = protocols.get_protocol(self.protocol).loop_settings("deepeyes")
        self.max_tool_calls = limits.max_tool_calls if max_tool_calls is None else max_tool_calls
        self.max_new_tokens = limits.agent_max_tokens if max_new_tokens is None else max_new_tokens
        self.min_box = min_box
        self.fill_view = fill_view

    def _start(self, query: Query) -> _Loop:
        image = load_image(query.image, copy=False)
        return _Loop(
            query=query,
            image=image,
            view=self.backend.view_of(image),
            messages=prompts.deepeyes_messages(image, query.question, query.options),
        )

    def first_messages(self, query: Query) -> Messages:
        """The conversation of the loop's first call (what a prefix-caching server reuses)."""
        return self._start(query).messages

    def _zoom(self, loop: _Loop, args: dict[str, Any]) -> Image.Image:
        b = self.backend
        crop, _, box = zoom_crop(
            loop.image,
            loop.view,
            args["bbox_2d"],
            coords=b.box_coords,
            factor=b.factor,
            min_pixels=crop_min_pixels(b, loop.view, self.fill_view),
            max_pixels=b.max_pixels,
            min_size=self.min_box,
        )
        loop.outcome.trace.append(
            {
                "type": "zoom",
                "bbox_2d": args["bbox_2d"],
                "label": args["label"],
                "crop_box": list(box),
                "crop_size": [crop.width, crop.height],
            }
        )
        return crop

    def _step(self, loop: _Loop, text: str, finish: str) -> None:
        """Consume one assistant turn: finish, run the tool, or report a bad call."""
        out = loop.outcome
        out.turns += 1
        out.trace.append({"type": "assistant", "text": text, "finish": finish})
        loop.messages.append({"role": "assistant", "content": text})
        answer = last_answer(text)
        if answer is not None:
            out.answer, loop.done = answer, True
            return
        if "<tool_call>" not in text:
            # No tool call and no answer: the model broke the format; keep what it said.
            out.answer, loop.done = fallback_answer(text), True
            out.trace.append({"type": "format_error", "error": "no <answer> and no <tool_call>"})
            return
        if out.tool_calls + out.invalid_tool_calls >= self.max_tool_calls:
            out.answer, loop.done = fallback_answer(text.split("<tool_call>")[0]), True
            out.trace.append({"type": "limit", "error": f"over {self.max_tool_calls} tool calls"})
            return
        try:
            args = parse_tool_call(text)
            crop = self._zoom(loop, args)
        except (ToolCallError, BoxError) as e:
            out.invalid_tool_calls += 1
            out.trace.append({"type": "tool_error", "error": str(e)})
            loop.messages.append(_error_turn(str(e)))
            return
        out.tool_calls += 1
        loop.messages.append(prompts.deepeyes_tool_response(crop))

    # ---- incremental API: the funnel's scheduler adds loops as others finish ----------------
    def start_loop(self, query: Query) -> _Loop:
        """Open a loop for ``query``; raises ImageError/ValueError for an unusable image."""
        return self._start(query)

    def _turn(self, active: list[_Loop]) -> None:
        """One batched assistant turn, each consumed by its loop."""
        turns = self._chat(self.backend, active, prompts.DEEPEYES_STOP)
        for lp, turn in zip(active, turns, strict=True):
            self._step(lp, turn.text, turn.finish_reason)
