"""How SpecEyes' released Thyme code runs a code block, rebuilt for speceyes' process sandbox.

github.com/MAC-AutoML/SpecEyes@90d950f ``eval_code_thyme/sandbox.py``
(``execute_code_in_sandbox`` :749-795, ``_sandboxed_execution_target`` :467-746) runs the
model's block with ``exec`` in the evaluation process. Here the same steps run in two places:

* on the host, as text only (nothing of the model's is executed): the blacklist (:766), the
  first line re-indented like the second (:536), ``textwrap.dedent`` + ``strip`` and
  ``autopep8.fix_code(aggressive=2)`` where autopep8 is installed (:537-546), then the three
  AST rewrites, each re-rendered by ``ast.unparse`` only when it changed something
  (:554-623): ``image_path = "<literal>"`` pointed at the image unless the literal names it,
  literal crop boxes clamped with a 64 px minimum (the slice form never fires on Python 3.9+:
  its ``ast.Index`` test is always false), ``cv.``/``cv3.``/``cv4.``/``CV.`` -> ``cv2.``;
* in the sandbox, by :data:`HARNESS` (speceyes' code, run as the sandbox's job): the image
  put at the path the prompt names, the placeholder folder ``/mnt/data/temp_processed_images/``
  replaced by the output folder (:633-656), ``{x:.Nf}`` -> ``{x:.8f}`` (:656), the block
  executed with the published ``__builtins__`` (a fixed list: no ``bool``, ``set``,
  ``getattr``, ``__build_class__`` ...), globals (``os, random, string, math, Image,
  UnidentifiedImageError, numpy, np, json, re`` and ``cv2``) and *separate* locals
  (``image_path``, ``temp_output_dir``): a function it defines does not see the block's
  top-level names, as under ``exec(code, globals, locals)`` (:478-520, :657); printed text is
  captured, then the result is found by the published rules (:659-705) and shown by those of
  ``utils.py`` ``run_evaluation`` (:191-219).

The published output folder is shared by every query of a run and never emptied, and one
rule (:690-699) compares counts against everything in it and may show those files: the agent
keeps the images earlier blocks of the run saved there (:class:`OutputFolder`, the latest
file per name) and passes their names, so counts and shown images are the published ones
(files left by earlier runs on the authors' machine aside). Variables never carry over between
blocks: ``run_evaluation`` resets the context every iteration (:113).
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import tempfile
import textwrap
import threading
from dataclasses import dataclass, field
from typing import Any

from speceyes.agents.code import _DANGEROUS, MIN_CROP, _align_first_line, clamp_crop

try:  # sandbox.py:25 imports it unconditionally; without it the blocks run unformatted
    import autopep8
except ImportError:  # pragma: no cover - depends on the environment
    autopep8 = None

MIN_CROP_DIMENSION = MIN_CROP  # sandbox.py:216 (64)
VALID_IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".gif", ".bmp", ".tiff", ".webp")  # :178
COORD_NAMES = ("x1", "y1", "x2", "y2", "left", "top", "right", "bottom")  # :325
KNOWN_COORD_VARS = (
    "crop_box",
    "bbox",
    "box",
    "coordinates",
    "coords",
    "crop_coords",
    "left_crop_coords",
    "right_crop_coords",
    "top_crop_coords",
    "bottom_crop_coords",
)  # fmt: skip  (sandbox.py:239-243)
CV_PREFIXES = ("cv", "cv4", "cv3", "CV")  # sandbox.py:429
OUTPUT_FOLDER = "temp_processed_images"  # sandbox.py:71, made inside the sandbox's work dir
EXEC_TIME_LIMIT = 10  # sandbox.py:66, seconds
RESULT_MARK = "@@speceyes-published-exec@@"
EARLIER = "earlier:"  # a shown image that is a file of the run's output folder


def is_dangerous(code: str) -> bool:
    """sandbox.py:55-63 check_dangerous_code: a denied block returns nothing (:766-767)."""
    return any(p.search(code) for p in _DANGEROUS)


# ---- host side: text and AST only ------------------------------------------------------------
def _number(node: ast.AST) -> float | None:
    """sandbox.py:245-250: an int or float constant (bools included, as ``isinstance`` says)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    return None


def _clamp(box: list[float], width: int, height: int) -> list[float]:
    """sandbox.py:259-308 _clamp_coordinates: the fair Thyme loop's rule (one copy)."""
    return clamp_crop(box, width, height, MIN_CROP_DIMENSION)


class _ImagePath(ast.NodeTransformer):
    """sandbox.py:181-214: ``image_path = "<str>"`` -> the image, unless the literal is it."""

    def __init__(self, image_path: str) -> None:
        self.image_path, self.changed = image_path, False

    def visit_Assign(self, node: ast.Assign) -> ast.AST:
        target = node.targets[0] if len(node.targets) == 1 else None
        if isinstance(target, ast.Name) and target.id == "image_path":
            value = node.value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                lit = value.value
                # The only file there is the image, at the relative path the prompt names.
                on_disk = os.path.normpath(lit) == os.path.normpath(self.image_path)
                if not (on_disk and lit.lower().endswith(VALID_IMAGE_EXTENSIONS)):
                    node.value = ast.Constant(value=self.image_path)
                    self.changed = True
        return self.generic_visit(node)


class _CropBox(ast.NodeTransformer):
    """sandbox.py:232-421 (cases 1 and 2; case 3, the slice form, tests ``ast.Index`` and never
    matches on Python 3.9+)."""

    def __init__(self, width: int, height: int) -> None:
        self.width, self.height, self.changed = width, height, False

    def _clamp_tuple(self, value: ast.Tuple) -> None:
        raw = [_number(v) for v in value.elts]
        if any(c is None for c in raw):
            return
        clamped = _clamp([float(c) for c in raw], self.width, self.height)  # type: ignore[arg-type]
        if [int(round(c)) for c in clamped] != [int(round(c)) for c in raw]:  # type: ignore[arg-type]
            self.changed = True
            value.elts = [ast.Constant(value=int(round(c))) for c in clamped]

    def visit_Assign(self, node: ast.Assign) -> ast.AST:
        one = len(node.targets) == 1
        target, value = node.targets[0], node.value
        four = isinstance(value, ast.Tuple) and len(value.elts) == 4
        if (
            one
            and isinstance(target, ast.Tuple)
            and len(target.elts) == 4
            and all(isinstance(t, ast.Name) for t in target.elts)
            and four
        ):
            names = [t.id.lower() for t in target.elts]  # type: ignore[attr-defined]
            if any(n in names for n in COORD_NAMES):
                self._clamp_tuple(value)  # type: ignore[arg-type]
        elif one and isinstance(target, ast.Name) and target.id in KNOWN_COORD_VARS and four:
            self._clamp_tuple(value)  # type: ignore[arg-type]
        return self.generic_visit(node)


class _OpenCV(ast.NodeTransformer):
    """sandbox.py:423-455: ``cv.x`` (and cv3, cv4, CV) -> ``cv2.x``."""

    def __init__(self) -> None:
        self.changed = False

    def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
        if isinstance(node.value, ast.Name) and node.value.id in CV_PREFIXES:
            node.value.id = "cv2"
            self.changed = True
        return self.generic_visit(node)


def _transform(code: str, transformer: Any) -> str:
    try:
        tree = transformer.visit(ast.parse(code))
    except Exception:  # SyntaxError and the rest: published prints and goes on
        return code
    return ast.unparse(tree) if transformer.changed else code


def published_rewrite(code: str, image_path: str, width: int, height: int) -> tuple[str, bool]:
    """The block as the published sandbox executes it, before the folder replacement (which
    needs the sandbox's folder): (code, whether autopep8 formatted it)."""
    code = _align_first_line(code)
    formatted = False
    code = textwrap.dedent(code).strip()
    if autopep8 is not None:
        try:
            code = autopep8.fix_code(code, options={"aggressive": 2})
            formatted = True
        except Exception:
            pass
    code = _transform(code, _ImagePath(image_path))
    code = _transform(code, _CropBox(width, height))
    code = _transform(code, _OpenCV())
    return code, formatted


class OutputFolder:
    """The images earlier blocks of a run saved in the published output folder: the latest
    file per name, kept on the host (in ``root``, made on first use)."""

    def __init__(self, root: str | None = None) -> None:
        self._root = root
        self._files: dict[str, str] = {}
        self._lock = threading.Lock()

    def snapshot(self) -> list[str]:
        with self._lock:
            return sorted(self._files)

    def path(self, name: str) -> str | None:
        with self._lock:
            return self._files.get(name)

    def keep(self, name: str, src: str) -> None:
        """Keep a copy of ``src`` (a file the sandbox copied out) as the folder's ``name``."""
        with self._lock:
            if self._root is None:
                self._root = tempfile.mkdtemp(prefix="speceyes-published-out-")
            dest = self._files.get(name) or os.path.join(self._root, f"{len(self._files):06d}")
            shutil.copyfile(src, dest)
            self._files[name] = dest

    def clear(self) -> None:
        with self._lock:
            self._files.clear()
            if self._root is not None:
                shutil.rmtree(self._root, ignore_errors=True)
                self._root = None


# ---- sandbox side ----------------------------------------------------------------------------
# Runs as the sandbox job (the sandbox's own import whitelist and limits apply to all of it);
# the model's block is data here, executed only by the exec() below.
HARNESS_TEMPLATE = r"""
import io, json, os, re, math, random, string, itertools, time, datetime, cmath, collections
import numpy
import PIL
from PIL import Image, UnidentifiedImageError
try:
    import cv2
except ImportError:
    cv2 = None

_JOB = json.loads(__JOB__)
_EXTS = ["jpg", "jpeg", "png", "bmp", "gif", "tiff"]


def _listing(folder, extra=()):
    # sandbox.py:168-176 get_image_paths: glob("*.<ext>") per extension, in that order; the
    # run's earlier files (extra) are in the folder too
    names = sorted(set(n for n in os.listdir(folder) if not n.startswith(".")) | set(extra))
    out = []
    for ext in _EXTS:
        out += [os.path.join(folder, n) for n in names if n.endswith("." + ext)]
    return out


def _copyfile(a, b):
    with open(a, "rb") as src, open(b, "wb") as dst:
        while True:
            chunk = src.read(1 << 20)
            if not chunk:
                break
            dst.write(chunk)


def _run():
    root = os.getcwd()
    image_path = _JOB["image_path"]
    where = os.path.dirname(image_path)
    if where:
        os.makedirs(where, exist_ok=True)
    _copyfile(_JOB["input"], image_path)
    os.chmod(image_path, 0o444)  # ReadOnlyPath (sandbox.py:73-108)
    temp_output_dir = os.path.join(root, "__FOLDER__")
    os.makedirs(temp_output_dir, exist_ok=True)
    earlier = [os.path.join(temp_output_dir, n) for n in _JOB["earlier"]]
    real = __builtins__ if isinstance(__builtins__, dict) else vars(__builtins__)
    captured = io.StringIO()

    def _print(*args, **kw):
        if kw.get("file") is None:
            kw["file"] = captured  # contextlib.redirect_stdout (sandbox.py:632)
        return real["print"](*args, **kw)

    allowed_builtins = {
        "print": _print, "len": len, "str": str, "int": int, "float": float,
        "list": list, "dict": dict, "tuple": tuple, "range": range, "round": round,
        "abs": abs, "min": min, "max": max, "sum": sum, "sorted": sorted,
        "any": any, "all": all, "zip": zip, "map": map, "filter": filter,
        "True": True, "False": False, "None": None, "isinstance": isinstance,
        "issubclass": issubclass, "Exception": Exception, "ValueError": ValueError,
        "TypeError": TypeError, "AttributeError": AttributeError, "IndexError": IndexError,
        "KeyError": KeyError, "NotImplementedError": NotImplementedError,
        "enumerate": enumerate, "pow": pow, "divmod": divmod, "bin": bin,
        "oct": oct, "hex": hex, "complex": complex, "__import__": real["__import__"],
        "globals": globals, "locals": locals, "open": real["open"],
        "os": os, "itertools": itertools, "re": re, "time": time,
        "datetime": datetime, "math": math, "cmath": cmath,
        "collections": collections, "json": json, "PIL": PIL,
        "random": random, "UnidentifiedImageError": UnidentifiedImageError,
    }  # sandbox.py:478-496 (its shutil is not importable in this sandbox)
    g = {"__builtins__": allowed_builtins, "os": os, "random": random, "string": string,
         "math": math, "Image": Image, "UnidentifiedImageError": UnidentifiedImageError,
         "numpy": numpy, "np": numpy, "json": json, "re": re}
    if cv2:
        g["cv2"] = cv2
    loc = {"image_path": image_path, "temp_output_dir": temp_output_dir}
    code = _JOB["code"]
    paths, error, full = [], None, None
    try:
        prefix = "/mnt/data/temp_processed_images/"
        target = temp_output_dir if temp_output_dir.endswith("/") else temp_output_dir + "/"
        quoted = re.compile(r"(['\"])(" + re.escape(prefix) + r"[^'\"]*)\1")
        for found in {m.group(2) for m in quoted.finditer(code)}:
            sub = os.path.dirname(found[len(prefix):].replace(" ", ""))
            if sub:
                os.makedirs(os.path.join(temp_output_dir, sub), exist_ok=True)
        code = code.replace(prefix, target)
        code = re.sub(r":\.\d{1}f}", ":.8f}", code)
        exec(code, g, loc)
        full = captured.getvalue().strip()
        if "processed_path" in loc:
            pp = loc["processed_path"]
            if isinstance(pp, str) and pp.startswith(temp_output_dir) and os.path.isfile(pp):
                paths.append(pp)
            elif isinstance(pp, str) and pp.startswith(temp_output_dir) and not os.path.exists(pp):
                error = f"'processed_path' variable set to '{pp}', but file does not exist."
            elif pp is not None:
                error = f"'processed_path' variable was '{pp}', which is not a valid file path"
        if full:
            pattern = rf"({re.escape(temp_output_dir)}[^\s\'\"]+\.(?:jpg|jpeg|png|bmp|gif|tiff))"
            possible = _listing(temp_output_dir, _JOB["earlier"])
            possible_error, parsed = "", 0
            for m in re.finditer(pattern, full):
                parsed += 1
                if os.path.isfile(m.group(1)):
                    if m.group(1) not in paths:
                        paths.append(m.group(1))
                elif not error:
                    possible_error = f"Path '{m.group(1)}' found in print, but file does not exist."
            if not paths:
                if parsed == len(possible):
                    paths = possible
                else:
                    anywhere = re.findall(r"([^\s\'\"]+\.(?:jpg|jpeg|png|bmp|gif|tiff))", full)
                    if len(anywhere) == len(possible):
                        paths = possible
                    else:
                        error = possible_error
            if not paths and temp_output_dir not in code:
                paths.append(full)
    except ImportError as e:
        error = f"Code execution failed due to ImportError: {e}"
    except MemoryError as e:
        error = f"Code execution failed due to MemoryError: {e}"
    except SyntaxError as e:
        error = f"Code execution failed due to SyntaxError: {e}"
    except Exception as e:
        error = f"Code execution failed: {e}"
    out = {"error": error, "print": (full or "")[:2000] if full is not None else None,
           "kind": "none", "text": None, "images": [], "saved": [], "unshowable": []}
    copied = 0

    def _copy(p, prefix):
        nonlocal copied
        name = f"{prefix}{copied:02d}{os.path.splitext(p)[1].lower()}"
        copied += 1
        _copyfile(p, os.path.join(root, name))
        return name

    if os.path.isdir(temp_output_dir):  # what this block leaves in the folder, for the run
        for p in _listing(temp_output_dir):
            if os.path.isfile(p) and os.path.splitext(p)[1].lower() in __COPYABLE__:
                out["saved"].append([os.path.basename(p), _copy(p, "published_saved_")])
    if paths:
        first = paths[0]
        stale = [p for p in paths if p in earlier and not os.path.exists(p)]
        if os.path.exists(first) or first in stale:  # utils.py:205-213
            out["kind"] = "images"
            for p in paths:
                if p in stale:
                    out["images"].append(__EARLIER__ + os.path.basename(p))
                elif not os.path.exists(p):
                    continue
                elif os.path.isfile(p) and os.path.splitext(p)[1].lower() in __COPYABLE__:
                    out["images"].append(_copy(p, "published_out_"))
                else:
                    out["unshowable"].append(p)
        else:  # utils.py:214-215: shown as text
            out["kind"], out["text"] = "text", first
    real["print"]("\n" + __MARK__ + json.dumps(out))


_run()
"""


def harness(code: str, *, image_path: str, input_name: str, earlier: list[str]) -> str:
    """The sandbox job that runs ``code`` (already :func:`published_rewrite`-ed) as the
    published sandbox does; the image the sandbox copied in as ``input_name`` is put at
    ``image_path`` first."""
    from speceyes.agents.sandbox import IMAGE_EXTENSIONS

    job = {"code": code, "image_path": image_path, "input": input_name, "earlier": earlier}
    return (
        HARNESS_TEMPLATE.replace("__JOB__", repr(json.dumps(job)))
        .replace("__FOLDER__", OUTPUT_FOLDER)
        .replace("__COPYABLE__", repr(tuple(IMAGE_EXTENSIONS)))
        .replace("__MARK__", repr(RESULT_MARK))
        .replace("__EARLIER__", repr(EARLIER))
    )


@dataclass
class ExecResult:
    """What the published loop gets from one block: ``kind`` "images" (names in the sandbox's
    work dir, in order; ``earlier:<name>`` for a file of the run's output folder), "text"
    (shown as it is) or "none" (the block is dropped). ``saved``: (folder name, work-dir name)
    of every image the folder holds after the block."""

    kind: str
    images: list[str]
    text: str | None
    error: str | None
    printed: str | None
    saved: list[tuple[str, str]] = field(default_factory=list)
    unshowable: list[str] = field(default_factory=list)


def parse_result(stdout: str) -> ExecResult | None:
    """The harness's report from the sandbox's stdout (None: it did not get to report)."""
    at = stdout.rfind(RESULT_MARK)
    if at < 0:
        return None
    try:
        raw = json.loads(stdout[at + len(RESULT_MARK) :].splitlines()[0])
    except (ValueError, IndexError):
        return None
    if not isinstance(raw, dict):
        return None

    def strs(key: str) -> list[str]:
        v = raw.get(key)
        return [x for x in v if isinstance(x, str)] if isinstance(v, list) else []

    def opt(key: str) -> str | None:
        v = raw.get(key)
        return v if isinstance(v, str) else None

    saved = raw.get("saved") if isinstance(raw.get("saved"), list) else []
    pairs = [
        (a, b)
        for a, b in (x for x in saved if isinstance(x, list) and len(x) == 2)
        if isinstance(a, str) and isinstance(b, str)
    ]
    kind = raw.get("kind") if raw.get("kind") in ("images", "text", "none") else "none"
    return ExecResult(
        kind, strs("images"), opt("text"), opt("error"), opt("print"), pairs, strs("unshowable")
    )
