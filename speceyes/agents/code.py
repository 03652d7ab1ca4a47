"""The Thyme agent: the model writes Python, a process sandbox runs it on the image.

Thyme (``Kwai-Keye/Thyme-RL``) thinks in one assistant turn. When it writes
``<code>```python ...```</code>`` generation stops, the code runs on the original
full-resolution image, and the result - the images the code saved, else what it printed, else
the error - is appended to the *same* assistant turn inside ``<sandbox_output>...
</sandbox_output>``; the model then continues that turn. The answer is the last
``<answer>...</answer>``. Protocol facts follow the published repository
(github.com/yfzhang114/Thyme: ``eval/VLMEvalKit/vlmeval/vlm/thyme/{model,utils,sandbox}.py``
and the RL rollout in ``swift/trainers/rlhf_trainer/grpo_trainer.py``), including its code
rewrites (crop boxes clamped to the image with a 64 px minimum, the placeholder output folder,
``image_path``) and its message texts ("Sandbox for <id>: ...").

Backends continue a turn through a message flag: the conversation's last message is
``{"role": "assistant", "content": [...], "continue": True}``.

The published protocol's loop is :class:`~speceyes.agents.published_code.PublishedCodeAgent`.

Unlike Thyme's in-process ``exec``, the code runs in :class:`~speceyes.agents.sandbox.
Sandbox` (a separate, isolated, resource-limited process per run). Variables do not persist
from one code block to the next (Thyme pickled them between blocks). The model's text is never
executed on the host: it is only parsed (``ast``) to apply the rewrites.
"""

from __future__ import annotations

import ast
import io
import os
import re
import shutil
import tempfile
import textwrap
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from speceyes import limits, prompts, protocols
from speceyes.agents.base import AgentOutcome, LoopAgent, fallback_answer, last_answer
from speceyes.agents.sandbox import DEFAULT_ALLOWED_MODULES, Sandbox, SandboxResult
from speceyes.backends.base import Backend, Messages
from speceyes.images import MAX_RATIO, ImageError, load_image, resize_for_model
from speceyes.types import Query

MIN_CROP = 64  # Thyme's MIN_CROP_DIMENSION: literal crop boxes are widened to this
MAX_IMAGES = 11  # Thyme's rollout stops adding images once a conversation holds more than 10
OUTPUT_PREFIX = "/mnt/data/temp_processed_images/"  # where the model was taught to save
# Thyme's code uses os (paths) and uuid (file names); the OS-level sandbox is the boundary.
THYME_MODULES: tuple[str, ...] = (*DEFAULT_ALLOWED_MODULES, "os", "uuid")
# Thyme's check_dangerous_code: the model saw "Execution denied" for these in training.
_DANGEROUS = [
    re.compile(p, re.IGNORECASE)
    for p in (
        r"\bsys\.",
        r"\bsocket\.",
        r"\bsubprocess\.",
        r"\bexec\(",
        r"\beval\(",
        r"\bcompile\(",
        r"\b__import__\(",
        r"\bos\.(remove|unlink|rmdir)\b",
        r"\bshutil\.rmtree\b",
        r"\bshutil\.move\b",
        r"\bos\.(rename|renames)\b",
    )
]
# Thyme's code regex; fences and the "python" tag are optional.
_CODE = re.compile(
    r"<code>\s*(?:```\s*)?(?:python\s*)?([\s\S]*?)\s*(?:```\s*)?</code>", re.IGNORECASE
)
_COORD_NAMES = {"x1", "y1", "x2", "y2", "left", "top", "right", "bottom"}
_BOX_VARS = {
    "crop_box", "bbox", "box", "coordinates", "coords", "crop_coords",
    "left_crop_coords", "right_crop_coords", "top_crop_coords", "bottom_crop_coords",
}  # fmt: skip
_YES_NO_CATEGORIES = ("adversarial", "popular", "random")  # POPE splits: Thyme's Y/N prompt


class CodeBlockError(ValueError):
    """The model's code block cannot be run; the message goes back inside <sandbox_output>."""


def extract_code(text: str) -> str:
    """The code of the last ``<code>`` block in ``text``; raises CodeBlockError."""
    start = text.rfind("<code>")
    if start < 0:
        raise CodeBlockError("no <code> block found")
    tail = text[start:]
    if "</code>" not in tail:
        raise CodeBlockError(
            "the code block is not closed with </code>; nothing was run. Write the code as "
            "<code>\n```python\n...\n```\n</code>"
        )
    m = _CODE.match(tail)
    code = m.group(1).strip() if m else ""
    if not code:
        raise CodeBlockError("the <code> block is empty; nothing was run")
    return code


# ---- Thyme's code rewrites (text and AST only; nothing is executed here) --------------------
def _align_first_line(code: str) -> str:
    """Thyme's align_first_line_to_second: the first non-blank line gets the indentation of
    the second."""
    lines = code.splitlines()
    found = [i for i, ln in enumerate(lines) if ln.strip()][:2]
    if len(found) < 2:
        return code
    a, b = (lines[i] for i in found)
    indent_a, indent_b = len(a) - len(a.lstrip(" ")), len(b) - len(b.lstrip(" "))
    if indent_a != indent_b:
        lines[found[0]] = " " * indent_b + a.lstrip(" ")
    return "\n".join(lines)


def clamp_crop(box: Sequence[float], width: int, height: int, min_size: int = MIN_CROP) -> list:
    """Thyme's _clamp_coordinates: order, clamp to the image, widen to ``min_size`` pixels."""
    w, h = float(width), float(height)
    x1, x2 = sorted((box[0], box[2]))
    y1, y2 = sorted((box[1], box[3]))

    def axis(lo: float, hi: float, size: float) -> tuple[float, float]:
        lo = min(max(0.0, lo), size - 1.0 if size > 0 else 0.0)
        hi = min(max(0.0, hi), size)
        if lo >= hi and size > 0:
            lo = max(0.0, hi - 1.0)
            if hi <= lo:
                hi = min(size, lo + 1.0)
        if size > 0 and hi - lo < min_size:
            if size < min_size:
                lo, hi = 0.0, size
            else:
                hi = lo + min_size
                if hi > size:
                    hi = size
                    lo = max(0.0, hi - min_size)
        if size > 0 and lo >= hi:
            hi = min(size, lo + 1.0)
        return lo, hi

    x1, x2 = axis(x1, x2, w)
    y1, y2 = axis(y1, y2, h)
    return [x1, y1, x2, y2]


def _num(node: ast.AST | None) -> float | None:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    return None


class _ThymeRewriter(ast.NodeTransformer):
    """Thyme's ImagePathTransformer, CropCoordinateTransformer and OpenCVNamespaceTransformer."""

    def __init__(self, width: int, height: int, image_name: str) -> None:
        self.width, self.height, self.image_name = width, height, image_name
        self.changed = False

    def _clamped(self, values: list[float | None]) -> list[int] | None:
        """Clamped literal box, or None when it is not all numbers or needs no change."""
        nums = [v for v in values if v is not None]
        if len(nums) != 4:
            return None
        new = [int(round(v)) for v in clamp_crop(nums, self.width, self.height)]
        if new == [int(round(v)) for v in nums]:
            return None
        self.changed = True
        return new

    def visit_Assign(self, node: ast.Assign) -> ast.AST:
        target = node.targets[0] if len(node.targets) == 1 else None
        value = node.value
        # image_path = "<a path that does not exist here>" -> the image's name in the sandbox
        if (
            isinstance(target, ast.Name)
            and target.id == "image_path"
            and isinstance(value, ast.Constant)
            and isinstance(value.value, str)
            and value.value != self.image_name
        ):
            node.value = ast.Constant(self.image_name)
            self.changed = True
        # x1, y1, x2, y2 = (a, b, c, d)   or   crop_box = (a, b, c, d)
        names = [t.id.lower() for t in getattr(target, "elts", []) if isinstance(t, ast.Name)]
        unpack = isinstance(target, ast.Tuple) and len(target.elts) == len(names) == 4
        unpack = unpack and any(n in _COORD_NAMES for n in names)
        named = isinstance(target, ast.Name) and target.id in _BOX_VARS
        if (unpack or named) and isinstance(value, ast.Tuple) and len(value.elts) == 4:
            new = self._clamped([_num(v) for v in value.elts])
            if new is not None:
                value.elts = [ast.Constant(v) for v in new]
        # crop = image[y1:y2, x1:x2] (numpy slicing of the variable "image")
        if (
            isinstance(target, ast.Name)
            and isinstance(value, ast.Subscript)
            and isinstance(value.value, ast.Name)
            and value.value.id == "image"
            and isinstance(value.slice, ast.Tuple)
        ):
            slices = [s for s in value.slice.elts if isinstance(s, ast.Slice)]
            if len(slices) == len(value.slice.elts) == 2:
                ys, xs = slices
                new = self._clamped(
                    [
                        0.0 if xs.lower is None else _num(xs.lower),
                        0.0 if ys.lower is None else _num(ys.lower),
                        float(self.width) if xs.upper is None else _num(xs.upper),
                        float(self.height) if ys.upper is None else _num(ys.upper),
                    ]
                )
                if new is not None:
                    xs.lower, ys.lower, xs.upper, ys.upper = (ast.Constant(v) for v in new)
        return self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
        if isinstance(node.value, ast.Name) and node.value.id in ("cv", "cv4", "cv3", "CV"):
            node.value.id = "cv2"
            self.changed = True
        return self.generic_visit(node)


def rewrite_code(code: str, width: int, height: int, image_name: str) -> str:
    """Apply Thyme's pre-execution rewrites; code that does not parse is left to fail in the
    sandbox (its SyntaxError goes back to the model)."""
    code = textwrap.dedent(code).strip()
    try:
        try:
            tree = ast.parse(code)
        except SyntaxError:
            # Thyme re-indents the first line like the second (the code regex strips its
            # indentation); only where that makes the code parse, as it breaks `def f():`.
            aligned = textwrap.dedent(_align_first_line(code)).strip()
            tree = ast.parse(aligned)
            code = aligned
        rw = _ThymeRewriter(width, height, image_name)
        tree = rw.visit(tree)
        if rw.changed:
            code = ast.unparse(ast.fix_missing_locations(tree))
    except Exception:  # SyntaxError, RecursionError, MemoryError, ValueError (NUL bytes)
        pass
    # Files saved under Thyme's placeholder folder land in the sandbox's work dir.
    code = code.replace(OUTPUT_PREFIX, "./")
    return re.sub(r":\.\d{1}f}", ":.8f}", code)  # Thyme prints numbers with 8 decimals


# ---- the loop --------------------------------------------------------------------------------
@dataclass
class _Loop:
    query: Query
    image: Image.Image
    input_path: str  # the file the sandbox copies in (the original, full resolution)
    image_name: str  # its name inside the sandbox, as given to the model
    base: Messages  # system + user turn
    parts: list[dict[str, Any]] = field(default_factory=list)  # the assistant turn so far
    tmpdir: str | None = None
    images_shown: int = 1
    pending: str | None = None  # PublishedCodeAgent: the segment whose code is running
    outcome: AgentOutcome = field(default_factory=lambda: AgentOutcome(answer=""))
    done: bool = False
    started: float = field(default_factory=time.perf_counter)

    @property
    def messages(self) -> Messages:
        if not self.parts:
            return list(self.base)
        return [*self.base, {"role": "assistant", "content": list(self.parts), "continue": True}]

    @property
    def text(self) -> str:
        """The assistant turn so far as text (images left out)."""
        return "".join(p["text"] for p in self.parts if p.get("type") == "text")

    @property
    def case_id(self) -> str:
        return Path(self.image_name).stem


def _question_kind(query: Query) -> str | None:
    if query.options:
        return "mcq"
    return "yorn" if query.category in _YES_NO_CATEGORIES else None


_EXT = {"JPEG": ".jpg", "PNG": ".png", "WEBP": ".webp", "BMP": ".bmp", "GIF": ".gif"}


def _raw_file(src: Any, image: Image.Image) -> tuple[str | None, bytes | None, str]:
    """How to hand the original to the sandbox unchanged: (path, None, "") for an image file,
    (None, data, ext) for encoded bytes, (None, None, "") when a decoded copy is needed (an
    in-memory image, EXIF rotation, an unusual format)."""
    data = bytes(src) if isinstance(src, (bytes, bytearray)) else None
    if data is None and not isinstance(src, (str, os.PathLike)):
        return None, None, ""
    try:
        with Image.open(io.BytesIO(data) if data is not None else os.fspath(src)) as raw:
            upright = raw.size == image.size and raw.getexif().get(0x0112, 1) == 1
            ext = _EXT.get(raw.format or "", "")
    except Exception:
        return None, None, ""
    if not upright or not ext:
        return None, None, ""
    return (None, data, ext) if data is not None else (os.fspath(src), None, "")


def _staged_name(query: Query, ext: str) -> str:
    """File name of an image the loop writes out for the code (no file of its own to hand over)."""
    stem = Sandbox.image_name_in_sandbox(str(query.id)).rsplit(".", 1)[0]
    return stem + (ext or ".png")


class CodeAgent(LoopAgent):
    """Thyme's code-writing loop over any backend, with a process sandbox."""

    name = "thyme"
    protocol = "fair"  # the evaluation protocol whose loop rules and defaults it follows
    default_tau = 0.95
    # its first prompt names a per-run sandbox file, so no judge can share it
    shares_first_prompt = False

    @dataclass
    class Settings:
        """Its keyword arguments, as ``K=V`` text sets them (``None`` budgets: the protocol's)."""

        max_tool_calls: int | None = None
        max_new_tokens: int | None = None

    def __init__(
        self,
        backend: Backend,
        *,
        sandbox: Sandbox | None = None,
        max_tool_calls: int | None = None,
        max_new_tokens: int | None = None,
        max_images: int = MAX_IMAGES,
        workers: int = 4,
        sandbox_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.backend = backend
        # None: the protocol's loop default (protocols.LoopSettings; published: the authors'
        # generation budget and tokens per turn).
        limits = protocols.get_protocol(self.protocol).loop_settings("thyme")
        self.max_tool_calls = limits.max_tool_calls if max_tool_calls is None else max_tool_calls
        self.max_new_tokens = limits.agent_max_tokens if max_new_tokens is None else max_new_tokens
        # An engine's own per-prompt image limit (vLLM) must not fail the whole batch.
        cap = backend.max_images
        self.max_images = max_images if cap is None else min(max_images, cap)
        self.workers = max(1, workers)
        self._sandbox = sandbox
        self._owns_sandbox = sandbox is None
        self._sandbox_kwargs = {
            "pool_size": self.workers,
            "allowed_modules": THYME_MODULES,
            "disk_mb": 512,  # room for a lossless copy of an 8K original
            **(sandbox_kwargs or {}),
        }
        self._lock = threading.Lock()
        self._tmp: str | None = None
        self._tmp_cleanup: weakref.finalize | None = None

    # ---- resources ----------------------------------------------------------------------------
    @property
    def sandbox(self) -> Sandbox:
        with self._lock:
            if self._sandbox is None:
                self._sandbox = Sandbox(**self._sandbox_kwargs)
            return self._sandbox

    def _tmpdir(self) -> str:
        with self._lock:
            if self._tmp is None:
                self._tmp = tempfile.mkdtemp(prefix="speceyes-thyme-")
                self._tmp_cleanup = weakref.finalize(
                    self, shutil.rmtree, self._tmp, ignore_errors=True
                )
            return self._tmp

    def close(self) -> None:
        """Stop the sandbox (if this agent created it) and remove the temporary files."""
        with self._lock:
            sandbox = self._sandbox if self._owns_sandbox else None
            if self._owns_sandbox:
                self._sandbox = None
            cleanup, self._tmp, self._tmp_cleanup = self._tmp_cleanup, None, None
        if sandbox is not None:
            sandbox.close()
        if cleanup is not None:
            cleanup()

    def __enter__(self) -> CodeAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- one loop -----------------------------------------------------------------------------
    def _start(self, query: Query) -> _Loop:
        image = load_image(query.image, copy=False)
        path, data, ext = _raw_file(query.image, image)
        tmpdir = None
        if path is None:
            # The code gets the original pixels: the encoded bytes, else a lossless upright copy.
            tmpdir = tempfile.mkdtemp(dir=self._tmpdir())
            path = os.path.join(tmpdir, _staged_name(query, ext))
            if data is not None:
                Path(path).write_bytes(data)
            else:
                image.save(path, format="PNG", compress_level=1)
        name = Sandbox.image_name_in_sandbox(path)
        return _Loop(query, image, path, name, self._messages(query, image, name), tmpdir=tmpdir)

    def first_messages(self, query: Query) -> Messages:
        """The conversation of the loop's first call, without staging the image for the code."""
        image = load_image(query.image, copy=False)
        path, _, ext = _raw_file(query.image, image)
        name = Sandbox.image_name_in_sandbox(path or _staged_name(query, ext))
        return self._messages(query, image, name)

    def _messages(self, query: Query, image: Image.Image, name: str) -> Messages:
        return prompts.thyme_messages(
            image, query.question, query.options, name, image.size, _question_kind(query)
        )

    def _append(self, loop: _Loop, *parts: dict[str, Any]) -> None:
        loop.parts.extend(parts)

    def _output(self, loop: _Loop, *content: dict[str, Any]) -> None:
        """Close the code block's result into the assistant turn, as Thyme does."""
        self._append(
            loop,
            prompts.text_part(prompts.SANDBOX_OPEN),
            *content,
            prompts.text_part(prompts.SANDBOX_CLOSE),
        )

    def _reject(self, loop: _Loop, message: str, code: str | None = None) -> None:
        loop.outcome.invalid_tool_calls += 1
        loop.outcome.trace.append({"type": "tool_error", "error": message, "code": code})
        self._output(loop, prompts.text_part(message))

    def _step(self, loop: _Loop, text: str, finish: str) -> tuple[str, str] | None:
        """Consume one generated segment; returns (code, code to run) when a block must run."""
        out = loop.outcome
        out.turns += 1
        out.trace.append({"type": "assistant", "text": text, "finish": finish})
        if text:
            self._append(loop, prompts.text_part(text))
        answer = last_answer(text)
        if answer is not None:
            out.answer, loop.done = answer, True
            return None
        if "<code>" not in text:
            # Neither code nor an answer: the model broke the format; keep what it said.
            out.answer, loop.done = fallback_answer(text), True
            out.trace.append({"type": "format_error", "error": "no <answer> and no <code>"})
            return None
        if out.tool_calls + out.invalid_tool_calls >= self.max_tool_calls:
            out.answer, loop.done = fallback_answer(text.split("<code>")[0]), True
            out.trace.append(
                {"type": "limit", "error": f"over {self.max_tool_calls} code executions"}
            )
            return None
        try:
            code = extract_code(text)
        except CodeBlockError as e:
            self._reject(loop, f"Sandbox for {loop.case_id}: {e}")
            return None
        if any(p.search(code) for p in _DANGEROUS):
            self._reject(
                loop,
                f"Sandbox for {loop.case_id}: Code contains potentially dangerous system "
                "operations such as remove. Execution denied.",
                code,
            )
            return None
        w, h = loop.image.size
        return code, rewrite_code(code, w, h, loop.image_name)

    def _error_text(self, loop: _Loop, error: str) -> str:
        """The sandbox's error in the words Thyme's sandbox used (its last traceback line)."""
        head = f"Sandbox for {loop.case_id}: "
        if error.startswith("Sandbox error:"):
            return head + error.removeprefix("Sandbox error:").strip()
        last = error.strip().splitlines()[-1] if error.strip() else "unknown error"
        if last.startswith(("ImportError", "ModuleNotFoundError")):
            return (
                head + "Code execution failed due to ImportError. Ensure all required modules "
                f"are available and correctly named: {last}"
            )
        if last.startswith(("SyntaxError", "IndentationError", "TabError")):
            return head + f"Code execution failed due to SyntaxError: {last}"
        return head + f"Code execution failed: {last}"

    def _images(self, loop: _Loop, paths: Sequence[str]) -> tuple[list[Image.Image], str | None]:
        """Saved images, validated and sized for the model; or a message for the model."""
        b = self.backend
        images = []
        for path in paths[: max(0, self.max_images - loop.images_shown)]:  # only what may show
            try:
                img = load_image(path, max_pixels=limits.MAX_IMAGE_PIXELS, max_ratio=None)
            except ImageError as e:
                return [], f"Sandbox for {loop.case_id}: the saved image is unreadable ({e})"
            if max(img.size) / min(img.size) > MAX_RATIO:
                return [], f"Sandbox for {loop.case_id}: The Generated img has invalid aspect_ratio"
            # smart_resize now: at least min_pixels, at most max_pixels, kept in memory small.
            images.append(resize_for_model(img, b.factor, b.min_pixels, b.max_pixels)[0])
        room = self.max_images - loop.images_shown
        if len(paths) > room:
            if room <= 0:
                return [], (
                    f"Sandbox for {loop.case_id}: image limit reached ({self.max_images} images "
                    "per conversation); the new image was not shown."
                )
            images = images[:room]
        return images, None

    def _deliver(self, loop: _Loop, code: str, ran: str, res: SandboxResult) -> None:
        """Put one execution's result into the assistant turn and the trace."""
        out = loop.outcome
        step: dict[str, Any] = {
            "type": "code",
            "code": code,
            "ok": res.ok,
            "stdout": res.stdout,
            "error": res.error,
            "images": len(res.images),
            "elapsed": round(res.elapsed, 6),
            "isolation": res.isolation,
        }
        if ran != code:
            step["ran"] = ran
        out.trace.append(step)
        if not res.ok:
            self._reject(loop, self._error_text(loop, res.error or "Sandbox error: failed"))
            return
        images, problem = self._images(loop, res.images) if res.images else ([], None)
        if problem is not None:
            self._reject(loop, problem)
            return
        out.tool_calls += 1
        if images:
            loop.images_shown += len(images)
            step["image_sizes"] = [list(im.size) for im in images]
            self._output(loop, *(prompts.image_part(im) for im in images))
        elif res.stdout.strip():
            self._output(loop, prompts.text_part(res.stdout.strip()))
        else:
            self._output(
                loop, prompts.text_part(f"Sandbox for {loop.case_id}: No output captured.")
            )

    def _execute(self, jobs: list[tuple[_Loop, str, str]]) -> None:
        def run(job: tuple[_Loop, str, str]) -> SandboxResult | Exception:
            loop, _, ran = job
            try:
                return self.sandbox.run(ran, loop.input_path, var_name="image_path")
            except Exception as e:  # infrastructure, not the model's code
                return e

        if len(jobs) == 1:
            results = [run(jobs[0])]
        else:
            with ThreadPoolExecutor(min(self.workers, len(jobs))) as pool:
                results = list(pool.map(run, jobs))
        for (loop, code, ran), res in zip(jobs, results, strict=True):
            if isinstance(res, Exception):
                loop.outcome.error = f"sandbox: {type(res).__name__}: {res}"
                loop.outcome.answer = fallback_answer(loop.text.split("<code>")[0])
                loop.done = True
            else:
                try:
                    self._deliver(loop, code, ran, res)
                finally:
                    res.discard()  # the images are in memory now: no copies pile up on disk

    def _end(self, loop: _Loop) -> None:
        super()._end(loop)
        if loop.tmpdir is not None:
            shutil.rmtree(loop.tmpdir, ignore_errors=True)
            loop.tmpdir = None

    # ---- incremental API: the funnel's scheduler adds loops as others finish ----------------
    def start_loop(self, query: Query) -> _Loop:
        """Open a loop for ``query``; raises ImageError/ValueError for an unusable image."""
        return self._start(query)

    def _turn(self, active: list[_Loop]) -> None:
        """One batched generation step, then the code the loops wrote runs."""
        turns = self._chat(self.backend, active, prompts.THYME_STOP)
        jobs = []
        for lp, turn in zip(active, turns, strict=True):
            job = self._step(lp, turn.text, turn.finish_reason)
            if job is not None:
                jobs.append((lp, *job))
        if jobs:
            self._execute(jobs)
