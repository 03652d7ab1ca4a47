"""The Thyme loop as SpecEyes' released code runs it (the ``published`` protocol).

``eval_code_thyme/utils.py`` ``run_evaluation`` and ``eval_code_thyme/sandbox.py``: 5
generations of up to 2048 tokens; a code block that fails or shows nothing is dropped from the
turn and the model generates again (the generation still counts); a segment with neither code
nor an answer ends the loop, and no ``<answer>`` in the turn makes the row an error; the code
starts with ``os, math, Image, np/numpy, json, re, cv2, string, random`` and
``temp_output_dir`` defined, as the published sandbox's globals do; POPE is asked as
``Question: {q}\\nPlease answer 'yes' or 'no'.``
"""

from __future__ import annotations

import re

from PIL import Image

from speceyes import prompts, protocols
from speceyes.agents.code import _CODE, _DANGEROUS, CodeAgent, _Loop, _question_kind, rewrite_code
from speceyes.agents.sandbox import SandboxResult
from speceyes.backends.base import Messages
from speceyes.types import Query

# The published sandbox's globals and locals (sandbox.py _sandboxed_execution_target): names
# its code could use without importing them. cv2 only where it is installed, as there.
PUBLISHED_PRELUDE = (
    "import os, math, json, re, string, random\n"
    "import numpy\n"
    "import numpy as np\n"
    "from PIL import Image\n"
    "try:\n"
    "    import cv2\n"
    "except ImportError:\n"
    "    pass\n"
    'temp_output_dir = "./"\n'
)


class PublishedCodeAgent(CodeAgent):
    """:class:`CodeAgent` with the published loop's question text and turn rules."""

    protocol = "published"

    def _messages(self, query: Query, image: Image.Image, name: str) -> Messages:
        kind = "yorn" if _question_kind(query) == "yorn" else None
        question = protocols.published_thyme_question(query.question, query.options, kind)
        text = prompts.THYME_USER_TEMPLATE.format(
            question=question, image_path=name, image_size=f"{image.width}x{image.height}"
        )
        return [
            {"role": "system", "content": prompts.THYME_SYSTEM},
            {"role": "user", "content": [prompts.image_part(image), prompts.text_part(text)]},
        ]

    def _finish(self, loop: _Loop) -> None:
        """The answer is the first <answer> of the assistant turn; none makes the row an error."""
        found = re.search(r"<answer>(.*?)</answer>", loop.text, re.DOTALL)
        loop.done = True
        if found:
            loop.outcome.answer = found.group(1).strip()
        else:
            loop.outcome.answer = "No answer tag found in the final output."
            loop.outcome.error = "no <answer> in the final output"

    def _step(self, loop: _Loop, text: str, finish: str) -> tuple[str, str] | None:
        out = loop.outcome
        out.turns += 1
        out.trace.append({"type": "assistant", "text": text, "finish": finish})
        if "</answer>" in text:
            self._append(loop, prompts.text_part(text))
            self._finish(loop)
            return None
        found = _CODE.search(text)
        if found is None:
            self._finish(loop)  # the segment itself is not kept, as published
            return None
        code = found.group(1).strip()
        if any(p.search(code) for p in _DANGEROUS):
            self._drop(loop, code, "Execution denied (dangerous pattern)")
            return None
        w, h = loop.image.size
        loop.pending = text
        return code, PUBLISHED_PRELUDE + rewrite_code(code, w, h, loop.image_name)

    def _drop(self, loop: _Loop, code: str, why: str) -> None:
        """A failed block is discarded; the generation counts against the budget."""
        loop.outcome.invalid_tool_calls += 1
        loop.outcome.trace.append({"type": "tool_error", "error": why, "code": code})
        loop.pending = None
        if loop.outcome.turns >= self.max_tool_calls:
            self._finish(loop)

    def _deliver(self, loop: _Loop, code: str, ran: str, res: SandboxResult) -> None:
        images, problem = self._images(loop, res.images) if res.ok and res.images else ([], None)
        loop.outcome.trace.append(
            {"type": "code", "code": code, "ran": ran, "ok": res.ok, "stdout": res.stdout,
             "error": res.error, "images": len(res.images), "elapsed": round(res.elapsed, 6)}
        )  # fmt: skip
        shown = [prompts.image_part(im) for im in images]
        if not shown and res.ok and not problem and res.stdout.strip():
            shown = [prompts.text_part(res.stdout.strip())]
        if not shown:  # an error, or nothing to show: the published loop regenerates
            self._drop(loop, code, problem or res.error or "no output")
            return
        loop.outcome.tool_calls += 1
        loop.images_shown += len(images)
        self._append(loop, prompts.text_part(loop.pending or ""))
        loop.pending = None
        self._output(loop, *shown)
        if loop.outcome.turns >= self.max_tool_calls:
            self._finish(loop)
