"""The DeepEyes loop as SpecEyes' released code runs it (the ``published`` protocol).

``eval_code_deepeyes/SpecEyes.py`` (``process_single_large_model`` and
``process_messages_to_tc``): 6 generations, then the row is an error; a turn with neither a
call nor an answer gets the user prompt again as a user turn; a call that is not JSON gets it as
an assistant turn; a call that cannot be run (missing bbox_2d, a box that crops nothing) ends
the row as an error; no minimum box size; the answer is the first ``<answer>`` of the turn that
has one (the whole turn when it is not closed). The image is shown resized by SpecEyes' own
smart_resize, with its system prompt and question block; it is the stored pixels, never
EXIF-rotated (``init_messages_judge_tc`` crops and resizes what ``Image.open`` returns:
:func:`~speceyes.protocols.published_image`).
"""

from __future__ import annotations

import json

from PIL import Image

from speceyes import prompts, protocols
from speceyes.agents.zoom import ZoomAgent, _Loop
from speceyes.types import Query


class PublishedZoomAgent(ZoomAgent):
    """:class:`ZoomAgent` with the published loop's prompt, crop and turn rules."""

    protocol = "published"

    def _start(self, query: Query) -> _Loop:
        image = protocols.published_image(query.image)
        shown, view = protocols.published_view(image)
        text = protocols.published_question_block(query.question, query.options)
        messages = [
            {"role": "system", "content": protocols.PUBLISHED_DEEPEYES_SYSTEM},
            {
                "role": "user",
                "content": [
                    prompts.image_part(shown),
                    prompts.text_part(text + prompts.DEEPEYES_USER_SUFFIX),
                ],
            },
        ]
        return _Loop(query=query, image=image, view=view, messages=messages)

    def _crop(self, loop: _Loop, text: str) -> Image.Image:
        """SpecEyes' crop: box in view pixels, each coordinate scaled and truncated to int,
        clamped, cropped from the original and resized by SpecEyes' smart_resize. Raises what
        the published code raises (KeyError, TypeError, ValueError, ZeroDivisionError)."""
        call = json.loads(text.split("<tool_call>")[1].split("</tool_call>")[0].strip())
        left, top, right, bottom = call["arguments"]["bbox_2d"]
        v = loop.view
        left, top = max(int(left * v.scale_x), 0), max(int(top * v.scale_y), 0)
        right, bottom = (
            min(int(right * v.scale_x), v.orig_w),
            min(int(bottom * v.scale_y), v.orig_h),
        )
        crop = loop.image.crop((left, top, right, bottom))  # ValueError when inverted
        w, h = protocols.published_smart_resize(right - left, bottom - top)  # 0 px: ZeroDivision
        loop.outcome.trace.append(
            {"type": "zoom", "bbox_2d": call["arguments"]["bbox_2d"],
             "label": call["arguments"].get("label"),
             "crop_box": [left, top, right, bottom], "crop_size": [w, h]}
        )  # fmt: skip
        return crop.resize((w, h), Image.Resampling.BICUBIC)

    def _step(self, loop: _Loop, text: str, finish: str) -> None:
        out = loop.outcome
        out.turns += 1
        out.trace.append({"type": "assistant", "text": text, "finish": finish})
        loop.messages.append({"role": "assistant", "content": text})
        if "<answer>" in text:
            if "</answer>" in text:
                text = text.split("<answer>")[1].split("</answer>")[0].strip()
            out.answer, loop.done = text, True
            return
        out.answer = text  # what the row holds if it ends here
        if "<tool_call>" in text:
            try:
                crop = self._crop(loop, text)
            except json.JSONDecodeError as e:
                out.invalid_tool_calls += 1
                out.trace.append({"type": "tool_error", "error": f"not JSON: {e.msg}"})
                loop.messages.append({"role": "assistant", "content": prompts.DEEPEYES_USER_SUFFIX})
            except Exception as e:  # the published loop marks the row an error
                out.invalid_tool_calls += 1
                out.error, loop.done = f"{type(e).__name__}: {e}", True
                out.trace.append({"type": "tool_error", "error": out.error})
                return
            else:
                out.tool_calls += 1
                loop.messages.append(prompts.deepeyes_tool_response(crop))
        else:
            loop.messages.append({"role": "user", "content": prompts.DEEPEYES_USER_SUFFIX})
        if out.turns >= self.max_tool_calls:
            out.error, loop.done = "Step exceeds maximum number of steps", True
