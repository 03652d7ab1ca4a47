"""Loaders for the evaluation benchmarks, each yielding :class:`speceyes.types.Query` lazily.

Supported layouts (the README's "Evaluating on the benchmarks" says how each is scored):

* **V\\* Bench** (``craigwu/vstar_bench``): ``direct_attributes/`` and ``relative_position/``
  folders of ``name.jpg`` + ``name.json``. The first option is correct in the published files, so
  options are shuffled with a per-sample seed by default (``shuffle=False`` keeps parity: gold "A").
* **HR-Bench** (``DreamMr/HR-Bench``): one multi-GB TSV with a base64 image column, streamed line
  by line; only the current row's image is ever decoded.
* **POPE** (``lmms-lab/POPE``): parquet files (one per split, or shards with a ``category``
  column) read in row batches; or the original POPE JSONL with a COCO image folder.
* **Generic JSONL**: ``id``, ``image``, ``question``, optional ``options``, ``answer``,
  ``category``.

Each loader is registered under its benchmark's names in :mod:`speceyes.bench.benchmarks`.

Images are passed on as paths (folder layouts) or as the encoded image ``bytes`` (TSV/parquet);
the project's image loader accepts both.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from speceyes.limits import MAX_OPTIONS
from speceyes.types import Query
from speceyes.usertext import check_question

__all__ = [
    "BenchmarkFormatError",
    "LETTERS",
    "VSTAR_CATEGORIES",
    "POPE_SPLITS",
    "HRBENCH_HEADER",
    "HRBENCH_MAX_LINE_BYTES",
    "load_vstar",
    "load_hrbench",
    "load_pope",
    "load_pope_jsonl",
    "load_jsonl",
    "option_letter",
]

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
VSTAR_CATEGORIES = ("direct_attributes", "relative_position")
POPE_SPLITS = ("adversarial", "popular", "random")
IMAGE_EXTS = (".jpg", ".jpeg", ".png")
# HR-Bench's TSV header as published; the loader needs the required columns, the rest may miss.
HRBENCH_OPTION_COLUMNS = ("A", "B", "C", "D")
HRBENCH_HEADER = (
    "index", "question", "answer", "category", *HRBENCH_OPTION_COLUMNS, "cycle_category", "image"
)  # fmt: skip
HRBENCH_REQUIRED_COLUMNS = ("question", "answer", "A", "B", "image")
# Bound on one TSV line. HR-Bench 8K rows are tens of MB; anything near this is a broken file
# (e.g. a missing newline) and must not be slurped into memory.
HRBENCH_MAX_LINE_BYTES = 512 * 1024 * 1024


class BenchmarkFormatError(ValueError):
    """A benchmark file does not have the expected layout."""


def option_letter(i: int) -> str:
    if not 0 <= i < len(LETTERS):
        raise ValueError(f"option index {i} out of range")
    return LETTERS[i]


# --------------------------------------------------------------------------------------- V* Bench


def _sample_rng(seed: int, folder: str, name: str) -> random.Random:
    """An RNG that depends only on (seed, folder, name), not on iteration order or hash salt."""
    digest = hashlib.sha256(f"{seed}\x00{folder}\x00{name}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def load_vstar(
    root: str | Path,
    shuffle: bool = True,
    seed: int = 0,
    categories: tuple[str, ...] = VSTAR_CATEGORIES,
) -> Iterator[Query]:
    """Yield V* Bench queries in sorted order (category folder, then file name).

    With ``shuffle`` the options are permuted by an RNG derived from ``(seed, folder, name)``;
    ``meta["permutation"]`` lists the original option indices in presented order and ``answer``
    is the letter where the original first (correct) option landed. Without it the options keep
    the published order and the answer is always "A" (parity with the official code).
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"V* Bench root not found or not a directory: {root}")
    folders = []
    for cat in categories:
        folder = root / cat
        if not folder.is_dir():
            raise FileNotFoundError(
                f"V* Bench category folder missing: {folder} (expected {list(categories)} "
                f"under {root})"
            )
        folders.append(folder)
    for folder in folders:
        yield from _iter_vstar_folder(folder, shuffle, seed)


def _iter_vstar_folder(folder: Path, shuffle: bool, seed: int) -> Iterator[Query]:
    cat = folder.name
    images = sorted(
        p
        for p in folder.iterdir()
        if p.is_file() and p.suffix.lower() in IMAGE_EXTS and not p.name.startswith(".")
    )
    for img in images:
        ann_path = img.with_suffix(".json")
        if not ann_path.is_file():
            raise FileNotFoundError(
                f"V* Bench image without annotation: {img} (no {ann_path.name})"
            )
        try:
            ann = json.loads(ann_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise BenchmarkFormatError(f"{ann_path}: invalid JSON ({e})") from e
        if not isinstance(ann, dict):
            raise BenchmarkFormatError(f"{ann_path}: expected a JSON object")
        missing = [k for k in ("question", "options") if k not in ann]
        if missing:
            raise BenchmarkFormatError(f"{ann_path}: missing key(s) {missing}")
        options = ann["options"]
        if (
            not isinstance(options, list)
            or len(options) < 2
            or not all(isinstance(o, str) for o in options)
        ):
            raise BenchmarkFormatError(f"{ann_path}: 'options' must be a list of >= 2 strings")
        if len(options) > MAX_OPTIONS:
            raise BenchmarkFormatError(
                f"{ann_path}: too many options ({len(options)}; at most {MAX_OPTIONS})"
            )
        name = img.stem
        perm = list(range(len(options)))
        if shuffle:
            _sample_rng(seed, cat, name).shuffle(perm)
        presented = [options[i] for i in perm]
        answer = option_letter(perm.index(0))
        meta: dict[str, Any] = {
            "name": name,
            "target_object": ann.get("target_object"),
            "bbox": ann.get("bbox"),
            "permutation": perm,
            "shuffled": shuffle,
            "seed": seed if shuffle else None,
        }
        yield Query(
            id=f"{cat}/{name}",
            image=str(img),
            question=str(ann["question"]),
            options=presented,
            answer=answer,
            category=cat,
            meta=meta,
        )


# --------------------------------------------------------------------------------------- HR-Bench


def _tsv_field(raw: bytes) -> str:
    s = raw.decode("utf-8")
    # The official files are unquoted; tolerate csv-style quoting of a text field anyway.
    if len(s) >= 2 and s[0] == '"' and s[-1] == '"':
        s = s[1:-1].replace('""', '"')
    return s


def _iter_lines_bounded(f, max_bytes: int, path: Path) -> Iterator[tuple[int, bytes]]:
    lineno = 0
    while True:
        line = f.readline(max_bytes + 1)
        if not line:
            return
        lineno += 1
        if len(line) > max_bytes:
            raise BenchmarkFormatError(
                f"{path}:{lineno}: line longer than {max_bytes} bytes; not a valid TSV row"
            )
        line = line.rstrip(b"\r\n")  # rebind: the frame and the caller share one copy
        yield lineno, line


def load_hrbench(
    tsv_path: str | Path, max_line_bytes: int = HRBENCH_MAX_LINE_BYTES
) -> Iterator[Query]:
    """Stream HR-Bench queries from its TSV, one row (and one decoded image) at a time.

    ``image`` holds the decoded image bytes (JPEG/PNG). ``meta`` keeps ``index`` and
    ``cycle_category``; ``category`` is ``single`` or ``cross``.
    """
    path = Path(tsv_path)
    if not path.is_file():
        raise FileNotFoundError(f"HR-Bench TSV not found: {path}")
    with path.open("rb") as f:
        lines = _iter_lines_bounded(f, max_line_bytes, path)
        header_line = next(lines, None)
        if header_line is None:
            raise BenchmarkFormatError(f"{path}: empty file (no header)")
        header = [_tsv_field(c).strip().lstrip("\ufeff") for c in header_line[1].split(b"\t")]
        col = {name: i for i, name in enumerate(header)}
        missing = [c for c in HRBENCH_REQUIRED_COLUMNS if c not in col]
        if missing:
            raise BenchmarkFormatError(
                f"{path}: header lacks column(s) {missing}; got {header} (HR-Bench's header: "
                f"{list(HRBENCH_HEADER)})"
            )
        opt_cols = [c for c in HRBENCH_OPTION_COLUMNS if c in col]
        for lineno, line in lines:
            if not line.strip():
                continue
            cells = line.split(b"\t")
            if len(cells) != len(header):
                raise BenchmarkFormatError(
                    f"{path}:{lineno}: expected {len(header)} tab-separated fields, got {len(cells)}"
                )
            raw_image = cells[col["image"]]
            row = {name: _tsv_field(cells[i]) for name, i in col.items() if name != "image"}
            del line, cells  # keep at most one copy of the row's base64 alive
            try:
                image = base64.b64decode(raw_image.strip(b'" '), validate=False)
            except (binascii.Error, ValueError) as e:
                raise BenchmarkFormatError(
                    f"{path}:{lineno}: image is not valid base64 ({e})"
                ) from e
            del raw_image
            if not image:
                raise BenchmarkFormatError(f"{path}:{lineno}: empty image field")
            options = [row[c] for c in opt_cols]
            while options and not options[-1].strip():  # tolerate rows with fewer options
                options.pop()
            answer = row["answer"].strip().upper()
            if not answer or answer not in LETTERS[: len(options)]:
                raise BenchmarkFormatError(
                    f"{path}:{lineno}: answer {answer!r} is not one of the option letters"
                )
            index = row.get("index", str(lineno - 1)).strip()
            cat = row.get("category", "").strip()
            meta = {"index": index, "cycle_category": row.get("cycle_category")}
            yield Query(
                id=str(index),
                image=image,
                question=row["question"],
                options=options,
                answer=answer,
                category=cat or None,
                meta=meta,
            )


# ------------------------------------------------------------------------------------------- POPE


def _split_from_name(name: str) -> str | None:
    low = name.lower()
    for s in POPE_SPLITS:
        if re.search(rf"(^|[^a-z]){s}([^a-z]|$)", low):
            return s
    return None


def _yes_no(value: Any, where: str) -> str:
    ans = str(value).strip().lower()
    if ans not in ("yes", "no"):
        raise BenchmarkFormatError(f"{where}: answer must be yes or no, got {value!r}")
    return ans


def load_pope(
    path: str | Path,
    split: str | None = None,
    image_dir: str | Path | None = None,
    batch_size: int = 64,
) -> Iterator[Query]:
    """Yield POPE queries from the lmms-lab parquet layout (a file or a folder of files).

    The split of a row is its ``category`` column when that names a split, else the split in the
    file name (``adversarial-00000-of-00001.parquet``). ``split`` keeps only that split. Ids are
    ``"{split}/{question_id}"`` because question ids repeat across splits. A ``.jsonl``/``.json``
    path is read as the original POPE format with ``image_dir`` (see :func:`load_pope_jsonl`).
    """
    path = Path(path)
    if split is not None and split not in POPE_SPLITS:
        raise ValueError(f"unknown POPE split {split!r}; expected one of {POPE_SPLITS}")
    if path.suffix.lower() in (".jsonl", ".json"):
        if image_dir is None:
            raise ValueError("the original POPE JSONL needs image_dir (the COCO val2014 folder)")
        yield from load_pope_jsonl(path, image_dir, split)
        return
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.parquet") if p.is_file())
        if not files:
            raise FileNotFoundError(f"no .parquet files under POPE folder {path}")
    elif path.is_file():
        files = [path]
    else:
        raise FileNotFoundError(f"POPE path not found: {path}")
    import pyarrow.parquet as pq

    for file in files:
        name_split = _split_from_name(file.name)
        pf = pq.ParquetFile(file)
        names = set(pf.schema_arrow.names)
        missing = [c for c in ("question_id", "question", "answer", "image") if c not in names]
        if missing:
            raise BenchmarkFormatError(f"{file}: missing column(s) {missing}")
        has_cat = "category" in names
        if split is not None and not has_cat and name_split not in (None, split):
            continue  # a whole file of another split: skip without reading it
        wanted = ["question_id", "question", "answer", "image"]
        wanted += [c for c in ("category", "image_source") if c in names]
        row0 = 0
        for batch in pf.iter_batches(batch_size=batch_size, columns=wanted):
            for j, row in enumerate(batch.to_pylist()):
                where = f"{file} row {row0 + j}"
                cat = row.get("category")
                row_split = cat if cat in POPE_SPLITS else name_split
                if row_split is None:
                    raise BenchmarkFormatError(
                        f"{where}: cannot tell the split (no split in the file name and "
                        f"category={cat!r})"
                    )
                if split is not None and row_split != split:
                    continue
                img = row["image"]
                data = img.get("bytes") if isinstance(img, dict) else img
                if not data:
                    raise BenchmarkFormatError(f"{where}: image has no bytes")
                qid = row["question_id"]
                yield Query(
                    id=f"{row_split}/{qid}",
                    image=bytes(data),
                    question=str(row["question"]),
                    answer=_yes_no(row["answer"], where),
                    category=row_split,
                    meta={
                        "question_id": qid,
                        "image_source": row.get("image_source"),
                        "image_path": img.get("path") if isinstance(img, dict) else None,
                    },
                )
            row0 += batch.num_rows


def load_pope_jsonl(
    jsonl_path: str | Path, image_dir: str | Path, split: str | None = None
) -> Iterator[Query]:
    """Yield queries from an original POPE file (``coco_pope_<split>.json``, one object a line:
    ``question_id, image, text, label``) with images in ``image_dir``. ``split`` defaults to the
    split named in the file name."""
    jsonl_path = Path(jsonl_path)
    image_dir = Path(image_dir)
    if not jsonl_path.is_file():
        raise FileNotFoundError(f"POPE file not found: {jsonl_path}")
    if not image_dir.is_dir():
        raise FileNotFoundError(f"POPE image folder not found: {image_dir}")
    split = split or _split_from_name(jsonl_path.name)
    if split is None:
        raise ValueError(f"cannot infer the POPE split from {jsonl_path.name}; pass split=")
    for lineno, obj in _iter_json_lines(jsonl_path):
        where = f"{jsonl_path}:{lineno}"
        missing = [k for k in ("question_id", "image", "text", "label") if k not in obj]
        if missing:
            raise BenchmarkFormatError(f"{where}: missing key(s) {missing}")
        img = image_dir / str(obj["image"])
        if not img.is_file():
            raise FileNotFoundError(f"{where}: image not found: {img}")
        qid = obj["question_id"]
        yield Query(
            id=f"{split}/{qid}",
            image=str(img),
            question=str(obj["text"]),
            answer=_yes_no(obj["label"], where),
            category=split,
            meta={"question_id": qid, "image_source": Path(str(obj["image"])).stem},
        )


# ------------------------------------------------------------------------------------------ JSONL


def _iter_json_lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with path.open("r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise BenchmarkFormatError(f"{path}:{lineno}: malformed JSON ({e.msg})") from e
            if not isinstance(obj, dict):
                raise BenchmarkFormatError(f"{path}:{lineno}: expected a JSON object")
            yield lineno, obj


def _norm_text(s: str) -> str:
    return " ".join(re.sub(r"[^\w\s]", " ", s.lower()).split())


def _answer_letter(answer: str, options: list[str], where: str) -> str:
    a = answer.strip()
    m = re.fullmatch(r"\(?([A-Za-z])\)?\.?", a)
    if m and m.group(1).upper() in LETTERS[: len(options)]:
        return m.group(1).upper()
    hits = [i for i, o in enumerate(options) if o.strip() == a]
    if len(hits) != 1:
        hits = [i for i, o in enumerate(options) if _norm_text(o) == _norm_text(a)]
    if len(hits) == 1:
        return option_letter(hits[0])
    raise BenchmarkFormatError(
        f"{where}: answer {answer!r} is neither an option letter nor exactly one option's text"
    )


def load_jsonl(path: str | Path) -> Iterator[Query]:
    """Yield queries from a generic JSONL file.

    Keys: ``id``, ``image`` (absolute, or relative to the file's folder), ``question`` (all
    required), ``options`` (list), ``answer`` and ``category`` (optional). For multiple choice the
    answer may be a letter or an option's text; it is normalised to the letter. Other keys go to
    ``meta``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"JSONL file not found: {path}")
    base = path.parent
    for lineno, obj in _iter_json_lines(path):
        where = f"{path}:{lineno}"
        missing = [k for k in ("id", "image", "question") if k not in obj]
        if missing:
            raise BenchmarkFormatError(f"{where}: missing key(s) {missing}")
        options = obj.get("options")
        if options is not None:
            if (
                not isinstance(options, list)
                or not options
                or not all(isinstance(o, str) for o in options)
            ):
                raise BenchmarkFormatError(
                    f"{where}: 'options' must be a non-empty list of strings"
                )
            if len(options) > MAX_OPTIONS:
                raise BenchmarkFormatError(
                    f"{where}: too many options ({len(options)}; at most {MAX_OPTIONS})"
                )
        # The user-text rule (no control tokens), located by line; the registry's entry says
        # so (checks_user_text), so eval does not apply it again by query id.
        check_question(str(obj["question"]), options, f"{where}: ")
        answer = obj.get("answer")
        if answer is not None:
            answer = str(answer)
            if options:
                answer = _answer_letter(answer, options, where)
        img = Path(str(obj["image"]))
        if not img.is_absolute():
            img = base / img
        meta = {
            k: v
            for k, v in obj.items()
            if k not in ("id", "image", "question", "options", "answer", "category")
        }
        cat = obj.get("category")
        yield Query(
            id=str(obj["id"]),
            image=str(img),
            question=str(obj["question"]),
            options=list(options) if options else None,
            answer=answer,
            category=None if cat is None else str(cat),
            meta=meta,
        )
