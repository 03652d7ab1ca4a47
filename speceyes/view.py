"""``speceyes view``: a static HTML report of evaluation runs, opened from disk.

One page (``index.html``) plus an ``img/`` folder of thumbnails and full images and a copy of
each run's plots: no server, no network. The page holds a summary per run and one card per query
(the image with every zoom box drawn in order, the question, the gold answer, route, P(tool), the
gate's confidence against tau, the small model's and the agent's answers, tool calls, errors).
The cards live in the page as one embedded JSON document and are rendered by the page's script
in chunks as the reader scrolls, so a run of 10,000 queries opens as fast as one of ten; filters,
sorting, search and the side-by-side comparison of two runs all work on that JSON.

Images are not logged in ``samples.jsonl``: they are found again through the run's own benchmark
loader (``bench``, ``data`` and ``loader`` in the run's config; ``--data`` points at a moved
benchmark), or a sample's own ``image`` path when it has one. Thumbnails are written once and
reused by later builds into the same folder.

Bad input never stops the build: a missing or torn ``samples.jsonl``, corrupt lines, a run
without ``results.json`` (still running, or killed), images that moved: each becomes a note on
the page (and in ``ViewResult.notes``) and the report shows what is there.
"""

from __future__ import annotations

import hashlib
import html
import json
import math
import os
import shutil
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from speceyes.rates import beta_alpha_of
from speceyes.rundir import RunDir, RunDirError, ScanReport, read_json, scan_lines

IMG_DIR = "img"
IMG_INDEX = "index.json"
THUMB_SIDE = 320  # px, longest side of a card's thumbnail
FULL_SIDE = 3072  # px, longest side of the image shown on click (small targets stay legible)
TEXT_CAP = 2000  # characters kept of each trace text (the full text stays in samples.jsonl)
_TOPK_KEY = b'"small_topk"'


class ViewError(ValueError):
    """The report cannot be built at all (no run folder given, output is a file, ...)."""


@dataclass
class RunData:
    """One run folder as the viewer reads it: leniently, with notes on what was wrong."""

    path: Path
    name: str
    config: dict[str, Any]
    results: dict[str, Any]
    state: dict[str, Any]  # run.json (config and time segments, kept current while running)
    samples: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)

    @property
    def mode(self) -> str:
        return str(self.config.get("mode") or _only({s.get("mode") for s in self.samples}))

    @property
    def complete(self) -> bool:
        return bool(self.results)


@dataclass
class ViewResult:
    index: Path
    notes: list[str]
    cards: int
    images_made: int
    images_reused: int


# ------------------------------------------------------------------------------ reading runs


def read_run(path: str | Path, name: str | None = None) -> RunData:
    """Read a run folder; only a path that is not a folder is an error, the rest become notes."""
    path = Path(path)
    if not path.exists():
        raise ViewError(f"run folder not found: {path}")
    if not path.is_dir():
        raise ViewError(f"not a run folder: {path}")
    notes: list[str] = []
    run_dir = RunDir(path)
    state = _read_json(run_dir.config_file, notes)
    results = _read_json(run_dir.results_file, notes)
    samples = _read_samples(run_dir.samples_file, notes)
    if not results:
        if run_dir.config_file.is_file() or samples:
            notes.append(
                f"{run_dir.results_file} is missing: the run is still being written or was "
                f"stopped; the summary is computed from the {len(samples)} queries logged so far"
            )
        else:
            notes.append(f"{path} holds no run.json and no results.json: not an evaluation run?")
    config = dict(results.get("config") or state.get("config") or {})
    return RunData(path, name or path.name, config, results, state, samples, notes)


def _read_json(path: Path, notes: list[str]) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return read_json(path)
    except RunDirError as e:
        notes.append(f"{e}; ignored")
        return {}


def _read_samples(path: Path, notes: list[str]) -> list[dict[str, Any]]:
    """The logged queries, read leniently under the run folder's torn-line rule."""
    if not path.is_file():
        notes.append(f"{path} is missing: no queries to show")
        return []
    lines = enumerate(path.read_bytes().split(b"\n"), 1)
    report = ScanReport()
    by_id: dict[str, dict[str, Any]] = {}
    repeated = 0
    for _, obj in scan_lines(lines, path, _parse_line, strict=False, report=report):
        sid = str(obj["id"])
        repeated += sid in by_id
        by_id.pop(sid, None)  # a re-logged query (resume with retries): the last line wins
        by_id[sid] = obj
    if report.torn is not None:
        notes.append(
            f"{path}: the last line is cut off (the run is still being written or was "
            "killed); skipped"
        )
    if report.corrupt:
        bad = report.corrupt
        shown = ", ".join(map(str, bad[:5])) + (" ..." if len(bad) > 5 else "")
        notes.append(f"{path}: {len(bad)} corrupt line(s) skipped (line {shown})")
    if repeated:
        notes.append(f"{path}: {repeated} query id(s) logged more than once; the last line shown")
    return list(by_id.values())


def _parse_line(line: bytes) -> dict[str, Any]:
    """One logged query without its top-K logits (most of the line's bytes; never shown);
    ValueError when the line is not a query's record."""
    line, tokens = _drop_topk(line)
    obj = json.loads(line)
    if not isinstance(obj, dict) or obj.get("id") is None:
        raise ValueError("not a JSON object with an id")
    if tokens is not None:
        obj["small_topk"], obj["_tokens"] = None, tokens
    elif isinstance(obj.get("small_topk"), list):
        obj["_tokens"] = len(obj.pop("small_topk"))
    return obj


def _drop_topk(line: bytes) -> tuple[bytes, int | None]:
    """Cut the ``small_topk`` value (numbers only) out as bytes; returns its row count."""
    start = line.find(_TOPK_KEY)
    if start < 0:
        return line, None
    v0 = line.find(b"[[", start, start + len(_TOPK_KEY) + 8)
    end = line.find(b"]]", v0) if v0 >= 0 else -1
    if end < 0 or b'"' in line[v0:end]:
        return line, None  # not the plain layout: json parses it whole
    return line[:v0] + b"null" + line[end + 2 :], line.count(b"[", v0, end) - 1


# ------------------------------------------------------------------------------ summary


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _only(values: set[Any]) -> str:
    values = values - {None}
    return str(values.pop()) if len(values) == 1 else "unknown"


def _accuracy(run: RunData) -> float | None:
    if run.complete:
        for value in (
            run.results.get("accuracy"),
            (run.results.get("metrics") or {}).get("overall"),
        ):
            if isinstance(value, dict):
                value = value.get("accuracy")
            if (v := _num(value)) is not None:
                return v / 100.0 if v > 1.0 else v
    if not run.samples:
        return None
    return sum(_correct(s) for s in run.samples) / len(run.samples)


def _correct(s: dict[str, Any]) -> bool:
    return bool(s.get("correct")) and not s.get("error") and s.get("route") != "error"


def _beta_alpha(run: RunData) -> tuple[float | None, float | None]:
    if run.complete and ("beta" in run.results or "alpha_accept" in run.results):
        return _num(run.results.get("beta")), _num(run.results.get("alpha_accept"))
    return beta_alpha_of(run.samples)


def _time_per_query(run: RunData) -> float | None:
    wall = _num(run.results.get("wall_time"))
    n = run.results.get("n") or len(run.samples)
    if wall is None:  # running or killed: run.json keeps the seconds of each segment current
        segments = run.state.get("segments") or []
        seconds = [_num(seg.get("seconds")) for seg in segments if isinstance(seg, dict)]
        wall = sum(x for x in seconds if x is not None) if seconds else None
    return wall / n if wall and n else None


def _phase_times(run: RunData) -> dict[str, float]:
    logged = run.results.get("time_by_phase") if run.complete else None
    if isinstance(logged, dict):
        return {k: x for k, v in logged.items() if (x := _num(v)) is not None}
    out: dict[str, float] = {}
    for s in run.samples:
        for k, v in (s.get("timings") or {}).items():
            if (x := _num(v)) is not None:
                out[k] = out.get(k, 0.0) + x
    return out


def _bench_key(run: RunData) -> tuple[str, str]:
    return str(run.config.get("bench")), str(run.config.get("data"))


def summarize_runs(runs: Sequence[RunData]) -> list[dict[str, Any]]:
    """Accuracy, beta, alpha, seconds per query, speedup over an agent-only run of the same
    benchmark among ``runs`` (measured; None without one), and seconds per phase."""
    rows = []
    tpq = [_time_per_query(r) for r in runs]
    for run, t in zip(runs, tpq, strict=True):
        beta, alpha = _beta_alpha(run)
        ref = next(
            (
                tpq[j]
                for j, other in enumerate(runs)
                if other.mode == "agent" and _bench_key(other) == _bench_key(run) and tpq[j]
            ),
            None,
        )
        rows.append(
            {
                "name": run.name,
                "path": str(run.path),
                "mode": run.mode,
                "bench": run.config.get("bench"),
                "agent": run.config.get("agent"),
                "tau": _num(run.config.get("tau")),
                "n": len(run.samples),
                "complete": run.complete,
                "accuracy": _accuracy(run),
                "beta": beta,
                "alpha": alpha,
                "time_per_query": t,
                "speedup": ref / t if ref and t else None,
                "phases": _phase_times(run),
                "errors": sum(1 for s in run.samples if s.get("error")),
            }
        )
    return rows


# ------------------------------------------------------------------------------ images


@dataclass
class _ImageJob:
    key: str
    source: Any  # a path (str) or the image bytes
    label: str


def _image_key(run: RunData, s: dict[str, Any], data: str | None) -> tuple[str, str | None]:
    """A stable file name for a query's image, and its logged path when the sample has one."""
    logged = s.get("image")
    if isinstance(logged, str) and logged:
        ident = f"path|{logged}"
    else:
        logged = None
        ident = f"{run.config.get('bench')}|{data or run.config.get('data')}|{s['id']}"
    return hashlib.sha1(ident.encode("utf-8")).hexdigest()[:20], logged


def _benchmark_images(
    run: RunData, wanted: set[str], data: str | None, notes: list[str]
) -> Iterator[tuple[str, Any]]:
    """(id, image source) for the ``wanted`` ids, streamed from the run's benchmark loader (one
    HR-Bench or POPE image in memory at a time)."""
    from speceyes.bench import benchmarks

    bench, root = run.config.get("bench"), data or run.config.get("data")
    if not bench or not root:
        notes.append(f"{run.name}: the run's config names no benchmark data; images not shown")
        return
    try:
        queries = benchmarks.get(str(bench)).load_logged(root, run.config.get("loader") or {})
        left = set(wanted)
        for q in queries:
            if q.id in left:
                left.discard(q.id)
                yield q.id, q.image
                if not left:
                    return  # the loaders stream: stop reading once every image is found
    except (OSError, ValueError, KeyError) as e:
        hint = "" if data else "; pass --data with the benchmark's new location if it moved"
        notes.append(f"{run.name}: cannot read the benchmark's images ({e}){hint}")


def _make_images(
    jobs: Iterable[_ImageJob], img_dir: Path, index: dict[str, Any], thumb: int, full: int
) -> tuple[int, list[str]]:
    """Write a thumbnail and a full view per job (JPEG); returns how many and what failed."""
    from PIL import Image

    from speceyes.images import ImageError, load_image

    made, failed = 0, []
    for job in jobs:
        try:
            img = load_image(job.source)
        except ImageError as e:
            index[job.key] = {"err": str(e)}
            failed.append(str(e))
            continue
        w, h = img.size
        for suffix, side in (("f", full), ("t", thumb)):
            if max(img.size) > side:
                img.thumbnail((side, side), Image.Resampling.LANCZOS)
            img.save(img_dir / f"{job.key}_{suffix}.jpg", quality=88 if suffix == "f" else 82)
        index[job.key] = {"w": w, "h": h}
        made += 1
    return made, failed


def _have_image(img_dir: Path, index: dict[str, Any], key: str) -> bool:
    entry = index.get(key)
    return (
        isinstance(entry, dict)
        and "w" in entry
        and (img_dir / f"{key}_t.jpg").is_file()
        and (img_dir / f"{key}_f.jpg").is_file()
    )


# ------------------------------------------------------------------------------ cards


def _short(value: Any, cap: int = TEXT_CAP) -> str | None:
    if value is None:
        return None
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= cap else f"{text[:cap]}… ({len(text) - cap} more characters)"


def _box(value: Any) -> list[float] | None:
    if (
        isinstance(value, (list, tuple))
        and len(value) == 4
        and all(_num(v) is not None for v in value)
    ):
        return [round(float(v), 1) for v in value]
    return None


def _steps(trace: Any) -> tuple[list[list[float]], list[dict[str, Any]]]:
    """The zoom boxes in order (original-image pixels) and a shortened trace."""
    boxes: list[list[float]] = []
    steps: list[dict[str, Any]] = []
    for entry in trace if isinstance(trace, list) else []:
        if not isinstance(entry, dict):
            continue
        kind = str(entry.get("type"))
        step: dict[str, Any] = {"k": kind}
        if kind == "zoom" and (box := _box(entry.get("crop_box"))) is not None:
            boxes.append(box)
            step |= {"n": len(boxes), "box": box, "label": entry.get("label")}
            for extra in ("depth", "score"):
                if entry.get(extra) is not None:
                    step[extra] = entry[extra]
        elif kind in ("assistant", "small"):
            step["text"] = _short(entry.get("text"))
        elif kind == "code":
            step |= {"text": _short(entry.get("code")), "ok": entry.get("ok")}
            step["out"] = _short(entry.get("stdout") or "", 500)
            step["err"] = _short(entry.get("error"), 500)
        elif kind == "end":
            step["s"] = entry.get("seconds")
        elif kind == "stay":
            step |= {"box": _box(entry.get("crop_box")), "score": entry.get("score")}
        elif "error" in entry:
            step["err"] = _short(entry.get("error"), 500)
        else:
            step["text"] = _short({k: v for k, v in entry.items() if k != "type"}, 500)
        steps.append(step)
    return boxes, steps


def _gold_boxes(s: dict[str, Any], bench: str | None) -> list[list[float]]:
    """Where the target is, when the benchmark says: mini-world ``target_bbox`` (x1, y1, x2,
    y2) or V* ``bbox`` ([x, y, w, h] per target object)."""
    meta = s.get("meta") if isinstance(s.get("meta"), dict) else {}
    if (box := _box(meta.get("target_bbox"))) is not None:
        return [box]
    if str(bench).lower() not in ("vstar", "v*", "vstar_bench", "v_star"):
        return []
    raw = meta.get("bbox")
    if _box(raw) is not None:
        raw = [raw]
    out = []
    for b in raw if isinstance(raw, list) else []:
        if (xywh := _box(b)) is not None:
            out.append([xywh[0], xywh[1], xywh[0] + xywh[2], xywh[1] + xywh[3]])
    return out


def _point(trace: Any) -> str | None:
    """The operating point that answered the query (``--judge auto``), with its tau."""
    for t in trace if isinstance(trace, list) else ():
        if isinstance(t, dict) and t.get("type") == "operating_point":
            tau, n = _num(t.get("tau")), _num(t.get("in_flight"))
            text = f"{t.get('point')}" + ("" if tau is None else f", tau {tau:g}")
            return _short(text + ("" if n is None else f", {n:g} in flight"), 80)
    return None


def _card(s: dict[str, Any], image: str | None, bench: str | None) -> dict[str, Any]:
    boxes, steps = _steps(s.get("trace"))
    timings = {k: round(v, 6) for k, v in (s.get("timings") or {}).items() if _num(v) is not None}
    card = {
        "id": str(s.get("id")),
        "c": s.get("category"),
        "q": _short(s.get("question")),
        "o": s.get("options") if isinstance(s.get("options"), list) else None,
        "g": s.get("answer"),
        "r": s.get("route") or "",
        "pt": _num(s.get("p_tool")),
        "op": _point(s.get("trace")),
        "cf": _num(s.get("confidence")),
        "tk": s.get("_tokens"),
        "sa": _short(s.get("small_answer"), 500),
        "sc": s.get("small_correct"),
        "aa": _short(s.get("agent_answer"), 500),
        "ac": s.get("agent_correct"),
        "p": _short(s.get("prediction"), 500),
        "ok": _correct(s),
        "tc": s.get("tool_calls") or 0,
        "itc": s.get("invalid_tool_calls") or 0,
        "t": timings,
        "tt": round(sum(timings.values()), 6) if timings else None,
        "e": _short(s.get("error"), 1000),
        "ae": _short(s.get("agent_error"), 1000),
        "im": image,
        "b": boxes,
        "gb": _gold_boxes(s, bench),
        "st": steps,
    }
    return {k: v for k, v in card.items() if v is not None and v != [] and v != {}}


# ------------------------------------------------------------------------------ building


def _unique_names(paths: Sequence[Path]) -> list[str]:
    """The shortest trailing path parts that tell the runs apart (demo: split/mode)."""
    parts = [p.resolve().parts for p in paths]
    for depth in range(1, max(len(p) for p in parts) + 1):
        names = ["/".join(p[-depth:]) for p in parts]
        if len(set(names)) == len(names):
            return names
    return [f"{n} ({i + 1})" for i, n in enumerate(names)]


def _copy_plots(run: RunData, dest: Path) -> list[str]:
    plots = sorted((run.path / "plots").glob("*.png")) if (run.path / "plots").is_dir() else []
    out = []
    for p in plots:
        target = dest / p.name
        st = p.stat()
        if not (target.is_file() and target.stat().st_size == st.st_size
                and target.stat().st_mtime >= st.st_mtime):  # fmt: skip
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, target)
        out.append(target.name)
    return out


def _asset(name: str) -> str:
    return resources.files("speceyes.view_assets").joinpath(name).read_text(encoding="utf-8")


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


def _summary_html(rows: list[dict[str, Any]], plots: list[list[str]]) -> str:
    head = (
        "<tr><th>run</th><th>mode</th><th>queries</th><th>accuracy</th><th>beta</th>"
        "<th>alpha</th><th>s / query</th><th>speedup</th><th>time per phase</th></tr>"
    )
    body = []
    for i, r in enumerate(rows):
        total = sum(r["phases"].values())
        phases = " · ".join(
            f"{k} {v:.2f}s ({v / total:.0%})" for k, v in r["phases"].items() if total and v
        )
        state = "" if r["complete"] else ' <span class="badge warn">partial</span>'
        imgs = "".join(
            f'<a href="runs/{i}/plots/{html.escape(p)}" target="_blank">'
            f'<img src="runs/{i}/plots/{html.escape(p)}" alt="{html.escape(p)}" loading="lazy"></a>'
            for p in plots[i]
        )
        body.append(
            f'<tr data-run="{i}"><td title="{html.escape(r["path"])}"><b>{html.escape(r["name"])}'
            f"</b>{state}<br><small>{html.escape(str(r['bench']))} · agent "
            f"{html.escape(str(r['agent'] or '–'))} · tau {_fmt(r['tau'], 'g')}</small></td>"
            f"<td>{html.escape(r['mode'])}</td><td>{r['n']}"
            + (f" <small>({r['errors']} errors)</small>" if r["errors"] else "")
            + f"</td><td>{_fmt(r['accuracy'], '.3f')}</td><td>{_fmt(r['beta'], '.2f')}</td>"
            f"<td>{_fmt(r['alpha'], '.2f')}</td><td>{_fmt(r['time_per_query'], '.3f')}</td>"
            f"<td>{_fmt(r['speedup'], '.2f', 'x')}</td><td><small>{html.escape(phases)}</small>"
            + (
                f'<details><summary>plots</summary><div class="plots">{imgs}</div></details>'
                if imgs
                else ""
            )
            + "</td></tr>"
        )
    return f'<table class="summary">{head}{"".join(body)}</table>'


def build_view(
    run_dirs: Sequence[str | Path],
    out_dir: str | Path,
    *,
    data: str | Path | None = None,
    thumb_side: int = THUMB_SIDE,
    full_side: int = FULL_SIDE,
    title: str = "speceyes view",
) -> ViewResult:
    """Write ``out_dir/index.html`` for ``run_dirs``; ``data`` replaces the benchmark path
    logged in the runs (images that moved)."""
    if not run_dirs:
        raise ViewError("give at least one run folder")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ViewError(f"--out {out} exists and is not a folder")
    paths = [Path(p) for p in run_dirs]
    runs = [read_run(p, n) for p, n in zip(paths, _unique_names(paths), strict=True)]
    notes = [f"{r.name}: {n}" for r in runs for n in r.notes]
    img_dir = out / IMG_DIR
    img_dir.mkdir(parents=True, exist_ok=True)
    index = _read_json(img_dir / IMG_INDEX, [])
    data_s = None if data is None else str(data)

    jobs: dict[str, _ImageJob] = {}
    keys: list[dict[str, str]] = []
    reused: set[str] = set()
    handled: set[str] = set()  # made (or failed) by this build
    made, failed, sides = 0, [], (thumb_side, full_side)
    for run in runs:
        run_keys, missing = {}, {}
        for s in run.samples:
            sid = str(s["id"])
            key, logged = _image_key(run, s, data_s)
            run_keys[sid] = key
            if key in jobs or key in reused or key in handled:
                pass
            elif _have_image(img_dir, index, key):
                reused.add(key)
            elif logged is not None:
                jobs[key] = _ImageJob(key, logged, sid)
            else:
                missing[sid] = key
        if missing:
            run_notes: list[str] = []
            found = set()
            for sid, src in _benchmark_images(run, set(missing), data_s, run_notes):
                found.add(sid)
                handled.add(missing[sid])
                m, f = _make_images([_ImageJob(missing[sid], src, sid)], img_dir, index, *sides)
                made, failed = made + m, failed + f
            notes += run_notes
            lost = [sid for sid in missing if sid not in found]
            if lost and found:  # the benchmark was read, these ids are not in it
                notes.append(
                    f"{run.name}: {len(lost)} logged query id(s) not in the benchmark "
                    f"({', '.join(lost[:3])}{' ...' if len(lost) > 3 else ''})"
                )
            handled.update(missing[sid] for sid in lost)
            for sid in lost:
                index[missing[sid]] = {"err": "image not found (see the notes above)"}
        keys.append(run_keys)
    m, f = _make_images(jobs.values(), img_dir, index, *sides)
    made, failed = made + m, failed + f
    if failed:
        notes.append(
            f"{len(failed)} image(s) could not be read (first: {failed[0]}); moved? pass --data"
        )
    _write_text(img_dir / IMG_INDEX, json.dumps(index))

    rows = summarize_runs(runs)
    plots = [_copy_plots(r, out / "runs" / str(i) / "plots") for i, r in enumerate(runs)]
    used = {k for run_keys in keys for k in run_keys.values()}
    doc = {
        "title": title,
        "runs": [
            {
                "name": r.name,
                "mode": r.mode,
                "tau": row["tau"],
                "cards": [
                    _card(s, keys[i][str(s["id"])], r.config.get("bench")) for s in r.samples
                ],
            }
            for i, (r, row) in enumerate(zip(runs, rows, strict=True))
        ],
        "images": {k: index[k] for k in sorted(used) if k in index},
        "notes": notes,
    }
    page = _page(title, _summary_html(rows, plots), notes, doc)
    target = out / "index.html"
    _write_text(target, page)
    n_cards = sum(len(r.samples) for r in runs)
    return ViewResult(target, notes, n_cards, made, len(reused))


def write_view(run_dirs: list[Path], out_dir: Path) -> Path:
    """Build the viewer for ``run_dirs`` into ``out_dir``; returns the path of index.html."""
    return build_view(run_dirs, out_dir).index


def _page(title: str, summary: str, notes: list[str], doc: dict[str, Any]) -> str:
    # "</" would end the script element early; "\u003c" is the same character to JSON.
    payload = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).replace("<", "\\u003c")
    note_html = "".join(f"<li>{html.escape(n)}</li>" for n in notes)
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{html.escape(title)}</title><style>{_asset('viewer.css')}</style></head><body>"
        f"<header><h1>{html.escape(title)}</h1></header>"
        + (f'<ul id="notes" class="notes">{note_html}</ul>' if notes else "")
        + f'<section id="summary">{summary}</section>'
        '<section id="controls"></section><div id="status"></div><main id="cards"></main>'
        '<div id="more"><button type="button">show more</button></div>'
        '<div id="lightbox" hidden></div>'
        f'<script type="application/json" id="speceyes-data">{payload}</script>'
        f"<script>{_asset('viewer.js')}</script></body></html>\n"
    )


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
