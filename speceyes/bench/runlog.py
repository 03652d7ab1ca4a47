"""Read an evaluation run directory (``samples.jsonl`` + ``results.json``) into arrays.

``load_run`` parses the log once and builds the numpy views that re-gating, calibration, plots
and reports need, so none of them walks the sample dicts again. Missing values are NaN in the
float views (``judge_tool``, ``small_correct``, ``agent_correct``, timings). The run folder's
files and its torn-last-line rule are :mod:`speceyes.rundir`'s; this module adds the fast top-K
decode and the array views on top.

Speed: a log of 10,000 queries with K=64 top logits for ~5 tokens each is ~65 MB of JSON, almost
all of it floats. Plain ``json.loads`` spends seconds on those floats, so each line's
``small_topk`` value is cut out as bytes, the rest of the line goes through ``json.loads``, and
all the top-K rows are parsed in one pass by pyarrow's (multi-threaded) CSV reader. Any line the
fast path does not understand goes through plain ``json`` instead; results are identical.
"""

from __future__ import annotations

import io
import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from speceyes import gate
from speceyes.rundir import RunDir, RunDirError, ScanReport, TruncatedLogWarning, scan_lines
from speceyes.types import NO_CATEGORY, PHASES

_TOPK_KEY = b'"small_topk"'
_TO_CSV = bytes.maketrans(b"[]", b",\n")


@dataclass
class Run:
    """One evaluation run: its config, summary, samples and array views over the samples.

    ``samples[i]["small_topk"]`` is the same float array as ``small_topk[i]`` (None where not
    logged): parsed once, not kept twice.
    """

    path: Path
    config: dict[str, Any]
    results: dict[str, Any]
    samples: list[dict[str, Any]]
    ids: list[str]
    categories: np.ndarray  # str per sample; NO_CATEGORY where null
    routes: np.ndarray  # logged route per sample (str)
    judge_tool: np.ndarray  # 1.0 tools needed, 0.0 tool-free, NaN unknown
    small_correct: np.ndarray  # 1.0 / 0.0 / NaN
    agent_correct: np.ndarray  # 1.0 / 0.0 / NaN
    correct: np.ndarray  # bool, final prediction (errors count as wrong)
    has_small: np.ndarray  # bool: small_topk was logged (may be an empty answer)
    has_agent: np.ndarray  # bool: the agent ran (answer or correctness logged)
    is_error: np.ndarray  # bool: route "error" or an error message
    logged_confidence: np.ndarray  # the run's own confidence, NaN where absent
    timings: dict[str, np.ndarray]  # phase -> seconds per sample, NaN where the phase did not run
    small_topk: list[np.ndarray]  # [tokens, K] per sample; shape (0, 0) where not logged
    k_logged: int  # smallest logged K over all tokens (0 if nothing logged)
    skipped_lines: int = 0
    _cache: dict[tuple, np.ndarray] = field(default_factory=dict, repr=False)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def n(self) -> int:
        return len(self.samples)

    @property
    def mode(self) -> str:
        mode = self.config.get("mode")
        if mode:
            return str(mode)
        modes = {s.get("mode") for s in self.samples} - {None}
        return str(modes.pop()) if len(modes) == 1 else "unknown"

    @property
    def tau(self) -> float | None:
        tau = self.config.get("tau")
        return None if tau is None else float(tau)

    @property
    def top_k(self) -> int:
        return int(self.config.get("top_k") or gate.DEFAULT_TOP_K)

    @property
    def agg(self) -> str:
        return str(self.config.get("agg") or "min")

    @property
    def scale(self) -> float:
        """The gate's sigmoid scale (config "scale"; runs before the rename wrote "alpha")."""
        scale = self.config.get("scale", self.config.get("alpha"))
        return gate.DEFAULT_SCALE if scale is None else float(scale)

    @property
    def category_names(self) -> list[str]:
        return sorted(set(self.categories.tolist()))


def load_run(run_dir: str | Path, require_results: bool = True) -> Run:
    """Load ``run_dir``; ``require_results=False`` accepts a killed run without results.json."""
    path = Path(run_dir)
    if not path.exists():
        raise FileNotFoundError(f"run directory not found: {path}")
    if not path.is_dir():
        raise NotADirectoryError(f"not a run directory: {path}")
    run_dir = RunDir(path)
    samples_path = run_dir.samples_file
    if not samples_path.is_file():
        raise FileNotFoundError(f"{samples_path} is missing: not an evaluation run directory")
    results = _read_results(run_dir, require_results)
    samples, topk, skipped = _read_samples(samples_path)
    config = results.get("config") or {}
    return _build_run(path, config, results, samples, topk, skipped)


def _read_results(run_dir: RunDir, required: bool) -> dict[str, Any]:
    path = run_dir.results_file
    if path.is_file():
        return run_dir.read_results()
    if required:
        raise FileNotFoundError(
            f"{path} is missing (pass require_results=False to read a partial run)"
        )
    warnings.warn(f"{path} is missing: using default gate settings", stacklevel=3)
    return {}


# ---------------------------------------------------------------------------- samples.jsonl


def _read_samples(path: Path) -> tuple[list[dict[str, Any]], list[np.ndarray | None], int]:
    """Parse every line; returns sample dicts, top-K arrays (None = not logged), lines skipped."""
    numbered = [(i + 1, ln) for i, ln in enumerate(path.read_bytes().split(b"\n")) if ln.strip()]
    cuts = [_cut_topk(line) for _, line in numbered]
    rests = [line if cut is None else cut[0] for (_, line), cut in zip(numbered, cuts, strict=True)]
    objs = _loads_bulk(rests)
    skipped = 0
    if objs is None:  # something is off: parse line by line to say where
        objs = _loads_each(path, [n for n, _ in numbered], rests)
        skipped = len(numbered) - len(objs)
    segments: list[bytes | None] = []
    values: dict[int, Any] = {}  # lines the fast path did not cut: their parsed value
    for i, obj in enumerate(objs):
        cut = cuts[i]
        if cut is not None and "small_topk" not in obj:  # the cut missed the top level: redo
            obj = objs[i] = json.loads(numbered[i][1])
            cut = None
        segments.append(None if cut is None else cut[1])
        if cut is None and obj.get("small_topk") is not None:
            values[i] = obj["small_topk"]
    topk = _parse_topk_segments(segments, path, [n for n, _ in numbered])
    for i, value in values.items():
        topk[i] = _as_topk(value, path, numbered[i][0])
    return objs, topk, skipped


def _loads_bulk(rests: list[bytes]) -> list[dict[str, Any]] | None:
    """All lines in one json.loads (much less per-call overhead); None if anything is off."""
    try:
        objs = json.loads(b"[" + b",".join(rests) + b"]")
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if len(objs) != len(rests) or not all(isinstance(o, dict) for o in objs):
        return None
    return objs


def _loads_each(path: Path, linenos: list[int], rests: list[bytes]) -> list[dict[str, Any]]:
    """Line by line under the run folder's torn-line rule: a corrupt line is an error naming
    it, a torn last line is skipped with a warning."""
    report = ScanReport()
    objs = [obj for _, obj in scan_lines(zip(linenos, rests, strict=True), path, report=report)]
    if report.torn is not None:
        lineno, reason = report.torn
        warnings.warn(
            f"{path}:{lineno}: skipping truncated last line ({reason})",
            TruncatedLogWarning,
            stacklevel=5,
        )
    return objs


def _cut_topk(line: bytes) -> tuple[bytes, bytes | None] | None:
    """Cut the small_topk value out of a line as bytes; None when the fast path does not apply.

    Returns (the line with the value replaced by null, the value's bytes or None for null).
    The value holds numbers and brackets only, so the first ']]' after it closes it.
    """
    start = line.find(_TOPK_KEY)
    if start < 0:
        return None
    colon = start + len(_TOPK_KEY)
    while colon < len(line) and line[colon] in b" \t":
        colon += 1
    if colon >= len(line) or line[colon] != ord(":"):
        return None
    v0 = colon + 1
    while v0 < len(line) and line[v0] in b" \t":
        v0 += 1
    if line.startswith(b"null", v0):
        return line, None
    if line.startswith(b"[]", v0):
        return line[:v0] + b"null" + line[v0 + 2 :], b"[]"
    if not line.startswith(b"[[", v0):
        return None
    end = line.find(b"]]", v0)
    seg = line[v0 : end + 2]
    if end < 0 or b'"' in seg or b"{" in seg or line.find(_TOPK_KEY, end) >= 0:
        return None  # not plain numbers, or the key again (nested or repeated): use json
    return line[:v0] + b"null" + line[end + 2 :], seg


def _parse_topk_segments(
    segments: list[bytes | None], path: Path, linenos: list[int]
) -> list[np.ndarray | None]:
    """Parse all cut-out top-K values; pyarrow CSV when available, else json (same numbers)."""
    out: list[np.ndarray | None] = [None] * len(segments)
    groups: dict[int, list[int]] = {}
    for i, seg in enumerate(segments):
        if seg is None:
            continue
        if seg == b"[]":
            out[i] = np.zeros((0, 0))
            continue
        width = seg.count(b",", 0, seg.find(b"]")) + 1  # values in the first token's row
        groups.setdefault(width, []).append(i)
    for width, idx in groups.items():
        parsed = _parse_group_csv([segments[i] for i in idx], width)  # type: ignore[misc]
        if parsed is None:
            parsed = [_parse_segment_json(segments[i], path, linenos[i]) for i in idx]  # type: ignore[arg-type]
        for i, arr in zip(idx, parsed, strict=True):
            out[i] = arr
    return out


def _parse_group_csv(segs: list[bytes], width: int) -> list[np.ndarray] | None:
    """All rows of K values as one CSV, one line per token. None if anything does not fit."""
    try:
        import pyarrow as pa
        import pyarrow.csv as pacsv
    except ImportError:
        return None
    rows = [seg.count(b"[") - 1 for seg in segs]
    # One translate pass at C speed: '[[a, b], [c, d]]' -> ',,a,b\n,,c,d\n\n': every token row
    # gets two empty leading fields, and the column count checks each row's length.
    data = b"".join(segs).translate(_TO_CSV, b" ")
    names = ["pad0", "pad1", *(f"c{j}" for j in range(width))]
    try:
        table = pacsv.read_csv(
            io.BytesIO(data),
            read_options=pacsv.ReadOptions(column_names=names, block_size=1 << 22),
            parse_options=pacsv.ParseOptions(quote_char=False),
            convert_options=pacsv.ConvertOptions(
                include_columns=names[2:],
                column_types={c: pa.float64() for c in names[2:]},
                null_values=[],
                strings_can_be_null=False,
            ),
        )
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return None  # ragged rows or odd tokens: json will say which line
    if table.num_rows != sum(rows):
        return None
    matrix = np.empty((table.num_rows, width), order="F")  # column writes stay contiguous
    for j, col in enumerate(table.columns):
        matrix[:, j] = col.to_numpy()
    bounds = np.cumsum([0, *rows])
    return [matrix[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def _as_topk(value: Any, path: Path, lineno: int) -> np.ndarray:
    where = f"{path}:{lineno}: small_topk"
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise RunDirError(f"{where} is not a [tokens, K] array of numbers ({exc})") from exc
    if arr.size == 0:
        return np.zeros((0, 0))
    if arr.ndim != 2:
        raise RunDirError(f"{where} must be a list of per-token lists of equal length K")
    return arr


def _parse_segment_json(seg: bytes, path: Path, lineno: int) -> np.ndarray:
    try:
        value = json.loads(seg)
    except json.JSONDecodeError as exc:
        raise RunDirError(f"{path}:{lineno}: small_topk is not valid JSON ({exc})") from exc
    return _as_topk(value, path, lineno)


# ---------------------------------------------------------------------------- array views


def _as_float(values: list[Any]) -> np.ndarray:
    return np.array([np.nan if v is None else float(v) for v in values], dtype=np.float64)


def _build_run(
    path: Path,
    config: dict[str, Any],
    results: dict[str, Any],
    samples: list[dict[str, Any]],
    topk: list[np.ndarray | None],
    skipped: int,
) -> Run:
    for i, s in enumerate(samples):
        s["small_topk"] = topk[i]  # same array as Run.small_topk[i], parsed once
    get = [s.get for s in samples]
    routes = np.array([g("route") or "" for g in get], dtype=object)
    errors = np.array(
        [r == "error" or bool(g("error")) for r, g in zip(routes, get, strict=True)], dtype=bool
    )
    k_values = [a.shape[1] for a in topk if a is not None and a.size]
    timing_keys = sorted({k for s in samples for k in (s.get("timings") or {})} | set(PHASES))
    return Run(
        path=path,
        config=dict(config),
        results=results,
        samples=samples,
        ids=[str(g("id")) for g in get],
        categories=np.array(
            [NO_CATEGORY if g("category") is None else str(g("category")) for g in get],
            dtype=object,
        ),
        routes=routes,
        judge_tool=_as_float([g("judge_tool") for g in get]),
        small_correct=_as_float([g("small_correct") for g in get]),
        agent_correct=_as_float([g("agent_correct") for g in get]),
        correct=np.array([bool(g("correct")) for g in get], dtype=bool) & ~errors,
        has_small=np.array([a is not None for a in topk], dtype=bool),
        has_agent=np.array(
            [g("agent_answer") is not None or g("agent_correct") is not None for g in get],
            dtype=bool,
        ),
        is_error=errors,
        logged_confidence=_as_float([_finite_or_none(g("confidence")) for g in get]),
        timings={k: _timings(samples, k) for k in timing_keys},
        small_topk=[np.zeros((0, 0)) if a is None else a for a in topk],
        k_logged=min(k_values, default=0),
        skipped_lines=skipped,
    )


def _finite_or_none(value: Any) -> float | None:
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _timings(samples: list[dict[str, Any]], phase: str) -> np.ndarray:
    """Seconds per sample; anything that is not a number (absent, null, nested) is NaN."""
    values = [(s.get("timings") or {}).get(phase) for s in samples]
    ok = (int, float)
    return _as_float([v if isinstance(v, ok) and not isinstance(v, bool) else None for v in values])
