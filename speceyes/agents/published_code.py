"""The Thyme loop as SpecEyes' released code runs it (the ``published`` protocol).

github.com/MAC-AutoML/SpecEyes@90d950f ``eval_code_thyme/utils.py`` ``run_evaluation``
(:73-298):

* 5 generations of up to 2048 tokens (:22-23), greedy, stopped at ``</code>``/``</answer>``;
* the first generation opens the assistant turn (``add_generation_prompt`` only at iteration
  0, :117-121); every later one is the rendered conversation with its last ``<|im_end|>\\n``
  cut off (:123-125). After a segment is kept that continues the assistant turn; while none is
  kept (the first block failed) the last message is the *user* turn, so the model goes on
  writing the user's text after ``...goes here.</answer>\\n``, with no assistant header
  (:class:`_PublishedLoop`); the segment written so is then kept as the assistant turn (:242);
* a block that shows nothing (an error, a denied pattern, no result found) is dropped, the
  generation still counts (:191-194); the model is never told why;
* a kept block adds ``segment, <sandbox_output>, images or text, </sandbox_output>`` to the
  turn (:196-219);
* a segment with neither code nor ``</answer>`` ends the loop (:225-235); the answer is the
  first ``<answer>...</answer>`` of the assistant turn, stripped; none makes the row an error
  (:286-297);
* the block runs as ``eval_code_thyme/sandbox.py`` runs it (``published_thyme_exec``), here
  inside speceyes' process sandbox, never in this process;
* the prompt names the image by the path the scripts use (:func:`published_image_path`) and
  its size, as read from that file; HR-Bench and POPE images are the JPEG the script wrote
  (quality 95); POPE is asked as ``Question: {q}\\nPlease answer 'yes' or 'no'.``
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from speceyes import limits, prompts, protocols
from speceyes.agents import published_thyme_exec as pexec
from speceyes.agents.code import _CODE, CodeAgent, _Loop, _question_kind
from speceyes.agents.sandbox import Sandbox, SandboxResult
from speceyes.backends.base import Messages
from speceyes.images import resize_for_model
from speceyes.types import Query

# eval_code_thyme/SpecEyes.py: --vstar_path default (:42), the folders HR-Bench and POPE images
# are written to (:620, :626, :669, :681), and their file names ({idx:08d}.jpg).
VSTAR_ROOT = "data/vstar"
HR_IMAGE_DIR = "./eval_code_thyme/_tmp_hr_images"
POPE_IMAGE_DIR = "./eval_code_thyme/_tmp_pope_images"
HR_8K_MIN_SIDE = 6000  # HR-Bench 8K images are 7680 px wide, 4K ones at most ~4000
NO_ANSWER = "No answer tag found in the final output."  # utils.py:294
QWEN_MAX_RATIO = 200  # qwen-vl-utils smart_resize raises past this (fetch_image of an output)


def published_image_path(query: Query, image: Image.Image) -> str:
    """The path Thyme's script puts in the prompt and binds to ``image_path``:
    ``data/vstar/<split>/<file>`` (SpecEyes.py:587), ``./eval_code_thyme/_tmp_hr_images/
    <hr_bench_4k|8k>/<row:08d>.jpg`` (:626, :77) and ``./eval_code_thyme/_tmp_pope_images/
    <split>/<row:08d>.jpg`` (:681). ``meta["row"]`` (the row's position in its file) and
    ``meta["split"]`` are used where a loader gives them; else the HR-Bench ``index`` column
    and the POPE ``question_id`` - 1 stand for the row, and an HR-Bench image at least 6000 px
    wide is taken as 8K. Another benchmark's image keeps its file name."""
    meta = query.meta
    if protocols.is_pope(query):
        row = meta.get("row")
        if row is None:
            row = _int(meta.get("question_id"), 1) - 1
        return f"{POPE_IMAGE_DIR}/{meta.get('split') or query.category}/{int(row):08d}.jpg"
    if protocols.is_hrbench(query):
        row = meta.get("row", _int(meta.get("index"), 0))
        split = meta.get("split") or (
            "hr_bench_8k" if max(image.size) >= HR_8K_MIN_SIDE else "hr_bench_4k"
        )
        return f"{HR_IMAGE_DIR}/{split}/{int(row):08d}.jpg"
    name = meta.get("file") or _file_name(query)
    if query.category in ("direct_attributes", "relative_position"):
        return f"{VSTAR_ROOT}/{query.category}/{name}"
    return name


def _int(value: Any, default: int) -> int:
    try:
        return int(str(value).strip())
    except (TypeError, ValueError):
        return default


def _file_name(query: Query) -> str:
    if isinstance(query.image, (str, os.PathLike)) and not str(query.image).startswith("data:"):
        return Path(query.image).name
    stem = str(query.meta.get("name") or query.id).replace("/", "_")
    return f"{stem}.jpg"


@dataclass
class _PublishedLoop(_Loop):
    """While no segment has been kept, a later generation continues the user turn."""

    @property
    def messages(self) -> Messages:
        if self.parts or self.outcome.turns == 0:
            return _Loop.messages.fget(self)  # type: ignore[attr-defined]
        *head, user = self.base
        return [*head, {**user, "continue": True}]


class PublishedCodeAgent(CodeAgent):
    """:class:`CodeAgent` with the published loop's question text, turn rules and execution."""

    protocol = "published"

    def __init__(self, backend: Any, **kwargs: Any) -> None:
        given = kwargs.pop("sandbox_kwargs", None) or {}
        # sandbox.py:66 EXEC_TIME_LIMIT; printed text comes back whole, as there.
        sandbox_kwargs = {
            "cpu_seconds": pexec.EXEC_TIME_LIMIT,
            "wall_seconds": pexec.EXEC_TIME_LIMIT + 2,
            "max_output_bytes": 1 << 20,
            **given,
        }
        super().__init__(backend, sandbox_kwargs=sandbox_kwargs, **kwargs)
        self.folder = pexec.OutputFolder()  # the run's shared output folder

    # ---- the image and the prompt --------------------------------------------------------
    def _image(self, query: Query) -> Image.Image:
        return protocols.published_image(query.image, jpeg=protocols.reencodes_jpeg("thyme", query))

    def _start(self, query: Query) -> _PublishedLoop:
        image = self._image(query)
        name = published_image_path(query, image)
        # A lossless copy of the pixels the script's code reads (the JPEG's decode for HR-Bench
        # and POPE); the harness puts it at ``name`` inside the sandbox.
        tmpdir = tempfile.mkdtemp(dir=self._tmpdir())
        path = os.path.join(tmpdir, "input.png")
        image.save(path, format="PNG", compress_level=1)
        return _PublishedLoop(
            query, image, path, name, self._messages(query, image, name), tmpdir=tmpdir
        )

    def first_messages(self, query: Query) -> Messages:
        image = self._image(query)
        return self._messages(query, image, published_image_path(query, image))

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

    # ---- turns ------------------------------------------------------------------------------
    def close(self) -> None:
        super().close()
        self.folder.clear()

    def _finish(self, loop: _Loop) -> None:
        """The answer is the first <answer> of the assistant turn; none makes the row an error."""
        found = re.search(r"<answer>(.*?)</answer>", loop.text, re.DOTALL)
        loop.done = True
        if found:
            loop.outcome.answer = found.group(1).strip()
        else:
            loop.outcome.answer = NO_ANSWER
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
        if pexec.is_dangerous(code):
            self._drop(loop, code, "Execution denied (dangerous pattern)")
            return None
        w, h = loop.image.size
        ran, formatted = pexec.published_rewrite(code, loop.image_name, w, h)
        loop.pending = text
        out.trace.append({"type": "rewrite", "autopep8": formatted, "changed": ran != code})
        return code, ran

    def _drop(self, loop: _Loop, code: str, why: str) -> None:
        """A failed block is discarded; the generation counts against the budget."""
        loop.outcome.invalid_tool_calls += 1
        loop.outcome.trace.append({"type": "tool_error", "error": why, "code": code})
        loop.pending = None
        if loop.outcome.turns >= self.max_tool_calls:
            self._finish(loop)

    # ---- execution ----------------------------------------------------------------------------
    def _execute(self, jobs: list[tuple[_Loop, str, str]]) -> None:
        for loop, code, ran in jobs:  # the published loop runs one query at a time
            job = pexec.harness(
                ran,
                image_path=loop.image_name,
                input_name=Sandbox.image_name_in_sandbox(loop.input_path),
                earlier=self.folder.snapshot(),
            )
            try:
                res = self.sandbox.run(job, loop.input_path, var_name="")
            except Exception as e:  # infrastructure, not the model's code
                loop.outcome.error = f"sandbox: {type(e).__name__}: {e}"
                loop.outcome.answer = NO_ANSWER
                loop.done = True
                continue
            try:
                self._deliver(loop, code, ran, res)
            finally:
                res.discard()

    def _deliver(self, loop: _Loop, code: str, ran: str, res: SandboxResult) -> None:
        got = pexec.parse_result(res.stdout) if res.ok else None
        step: dict[str, Any] = {
            "type": "code", "code": code, "ran": ran,
            "ok": res.ok and got is not None and got.kind != "none",
            "error": (got.error if got else res.error), "elapsed": round(res.elapsed, 6),
            "isolation": res.isolation,
        }  # fmt: skip
        loop.outcome.trace.append(step)
        by_name = {os.path.basename(p): p for p in res.images}
        # What the block saved stays in the run's output folder, shown or not (a name this
        # block saved is never one of the earlier files it may show: those are absent here).
        for name, copy in got.saved if got else ():
            if copy in by_name:
                self.folder.keep(name, by_name[copy])
        if got is None or got.kind == "none":  # utils.py:191-194: regenerate, say nothing
            self._drop(loop, code, step["error"] or "no result")
            return
        step.update(printed=got.printed, kind=got.kind)
        if got.kind == "text":
            shown = [prompts.text_part(got.text or "")]
            images: list[Image.Image] = []
        else:
            paths = [self._resolve(n, by_name) for n in got.images]
            step["earlier_images"] = sum(n.startswith(pexec.EARLIER) for n in got.images)
            images, problem = self._published_images([p for p in paths if p is not None])
            if got.unshowable or None in paths or problem:
                # fetch_image raises on a file that is not an image: the row ends as an error
                loop.outcome.error = problem or f"cannot show {got.unshowable or got.images}"
                loop.outcome.answer = NO_ANSWER
                loop.done = True
                return
            room = max(0, self.max_images - loop.images_shown)  # an engine's per-prompt cap
            if len(images) > room:
                step["images_not_shown"] = len(images) - room
                images = images[:room]
            shown = [prompts.image_part(im) for im in images]
            step["image_sizes"] = [list(im.size) for im in images]
        loop.outcome.tool_calls += 1
        loop.images_shown += len(images)
        self._append(loop, prompts.text_part(loop.pending or ""))
        loop.pending = None
        self._output(loop, *shown)
        if loop.outcome.turns >= self.max_tool_calls:
            self._finish(loop)

    def _resolve(self, name: str, by_name: dict[str, str]) -> str | None:
        """A shown image's host path: this block's copy, or the run's earlier file."""
        if name.startswith(pexec.EARLIER):
            return self.folder.path(name.removeprefix(pexec.EARLIER))
        return by_name.get(name)

    def _published_images(self, paths: list[str]) -> tuple[list[Image.Image], str | None]:
        """The saved images as qwen-vl-utils' ``fetch_image`` reads them (no EXIF orientation),
        sized for the model; a ratio qwen-vl-utils refuses, or an unreadable file, is a problem."""
        b = self.backend
        out = []
        for path in paths:
            try:
                with Image.open(path) as head:  # the header first: no decompression bombs
                    if head.width * head.height > limits.MAX_IMAGE_PIXELS:
                        return [], f"the saved image is too large ({head.width}x{head.height})"
                img = protocols.published_image(path)
            except (OSError, ValueError) as e:
                return [], f"the saved image is unreadable ({e})"
            if max(img.size) / max(1, min(img.size)) > QWEN_MAX_RATIO:
                return [], "absolute aspect ratio must be smaller than 200"
            out.append(resize_for_model(img, b.factor, b.min_pixels, b.max_pixels)[0])
        return out, None
