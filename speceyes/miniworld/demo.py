"""``speceyes demo``: the mini-world benchmark with the two bundled trained models.

One test split of mini-world scenes (:func:`speceyes.miniworld.scenes.make_split`) is split by
target size, and each size runs agent-only, small-only and SpecEyes back to back through the
evaluation harness (:func:`speceyes.bench.runner.run_eval`), so each mode's wall time per split
is measured on its own. Every run folder is an ordinary ``speceyes eval`` folder
(``samples.jsonl``, ``results.json``, ``plots/``) that ``speceyes report`` and ``speceyes regate``
read. The table at the end (also ``summary.md`` and ``summary.json``) compares the modes and puts
the measured SpecEyes speedup next to the analytic one from the measured per-phase costs,
``L_agent / (c_J + beta*c_S + (1 - beta*alpha) * L_agent)``.

Layout of ``--out``::

    data/                    the split: images/, questions.jsonl, manifest.json,
                             questions-small.jsonl, questions-large.jsonl (subsets by target size)
    runs/{small-targets,large-targets}/{agent,small,speceyes}/
    summary.md, summary.json

Re-running continues: a run folder made with the same settings is resumed (nothing redone); one
made with other settings (split, models, tau, agent) is moved aside to ``NAME.stale-TIMESTAMP``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from speceyes.rates import analytic_speedup

MODELS_DIR = Path(__file__).resolve().parent / "models"  # level 1, the default
# The multi-object world's pair (``--level 2``), trained for it and kept with its numbers.
LEVEL_MODELS = {1: MODELS_DIR, 2: Path(__file__).resolve().parent / "models_level2"}
MANIFEST = "manifest.json"
ROLES = ("small", "large")
MODES = ("agent", "small", "speceyes")
MODE_LABEL = {"agent": "agent-only", "small": "small-only", "speceyes": "SpecEyes"}
SPLITS = (("small-targets", "small"), ("large-targets", "large"))
SPLIT_LABEL = {"small-targets": "small targets", "large-targets": "large targets", "all": "all"}
DATA_DIR = "data"
RUNS_DIR = "runs"
IDENTITY = "demo.json"  # per run folder: what the run's results depend on beyond run.json
TRAIN_HINT = (
    "Train and export them with `speceyes miniworld train --out runs/mw --role small|large "
    "--stage A|B|eval ...` (see docs/miniworld-training.md), then copy the exported folders to "
    "{dir}/small and {dir}/large; or point --models at a folder holding small/ and large/."
)
EPILOG = (
    "MODELS/manifest.json (written by the trainer; every key optional): "
    '{"level": 1, "canvas": [1024, 1024], "tau": 0.9, "agg": "min", "agent": {"kind": "search", "depth": 3, '
    '"grid": 2, "answer_prompt": "small"}, "test": {"seed": 0, "scenes": 40, '
    '"small_fraction": 0.5}}; agent kind "zoom" runs the DeepEyes zoom-tool loop instead of the '
    "search agent; other keys (training metadata) are carried into summary.json. "
    "Time per query is a run's wall time over its questions, so each size split runs its modes "
    "back to back after one warm-up call per model; per category only accuracy is reported. "
    "Threads: torch's default (set OMP_NUM_THREADS to change it)."
)


class MissingModelsError(ValueError):
    """The models folder lacks the small or large checkpoint."""


# ------------------------------------------------------------------------------------ settings


@dataclass
class AgentSettings:
    kind: str = "search"  # "search" (SearchAgent) or "zoom" (the DeepEyes ZoomAgent loop)
    depth: int = 3
    grid: int = 2
    answer_prompt: str = "small"
    overlap: float = 0.25
    min_region: int | None = None  # search: stop zooming below this side (px); None = the view
    stay: bool = False  # search: stop where the current region outscores all its cells
    beam: int = 1  # search: regions kept per depth
    fill_view: bool = False  # search: crops upscaled to the full image's view size
    min_box: int = 28  # search: smallest zoom box side, in pixels of the full image's view
    max_tool_calls: int = 5  # zoom only
    max_new_tokens: int | None = None  # default: 64 for search, 1024 for zoom (as the CLI)


@dataclass
class TestSettings:
    seed: int = 0
    scenes: int = 40
    small_fraction: float = 0.5


@dataclass
class DemoSettings:
    """The demo's settings from ``models/manifest.json`` (defaults for missing keys)."""

    canvas: tuple[int, int] = (1024, 1024)
    level: int = 1  # 1: one target among clutter (speceyes.miniworld.level1); 2: multi-object
    tau: float = 0.9
    agg: str = "min"
    top_k: int = 64
    batch_size: int = 8
    agent: AgentSettings = field(default_factory=AgentSettings)
    test: TestSettings = field(default_factory=TestSettings)
    extra: dict[str, Any] = field(default_factory=dict)  # training metadata, carried into results

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["canvas"] = list(self.canvas)
        return d


def _sub(cls, data: Any, where: str):
    if data is None:
        return cls()
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected an object")
    known = {f for f in cls.__dataclass_fields__}
    return cls(**{k: v for k, v in data.items() if k in known})


def load_settings(path: str | Path | None) -> DemoSettings:
    """Read a models manifest; a missing file or key takes the default. Unknown keys are kept
    in ``extra`` (training metadata)."""
    from speceyes import gate

    raw: dict[str, Any] = {}
    if path is not None and Path(path).is_file():
        try:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e.msg})") from e
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a JSON object")
    s = DemoSettings(
        agent=_sub(AgentSettings, raw.get("agent"), f"{path}: agent"),
        test=_sub(TestSettings, raw.get("test"), f"{path}: test"),
        extra={
            k: v
            for k, v in raw.items()
            if k not in ("canvas", "level", "tau", "agg", "top_k", "batch_size", "agent", "test")
        },
    )
    if "canvas" in raw:
        c = raw["canvas"]
        if not (isinstance(c, list | tuple) and len(c) == 2):
            raise ValueError(f"{path}: canvas must be [width, height]")
        s.canvas = (int(c[0]), int(c[1]))
    for key in ("level", "tau", "top_k", "batch_size", "agg"):
        if key in raw:
            setattr(s, key, type(getattr(s, key))(raw[key]))
    if s.agent.kind not in ("search", "zoom"):
        raise ValueError(f"{path}: agent.kind must be 'search' or 'zoom', got {s.agent.kind!r}")
    if s.agg not in gate.AGGREGATIONS:
        raise ValueError(f"{path}: unknown aggregation {s.agg!r}")
    if s.level not in (1, 2):
        raise ValueError(f"{path}: level must be 1 or 2, got {s.level}")
    return s


# -------------------------------------------------------------------------------------- models


def find_models(models_dir: Path) -> dict[str, Path]:
    """``{"small": folder, "large": folder}``; raises MissingModelsError with how to get them."""
    missing = [
        f"{r}/"
        for r in ROLES
        if not (models_dir / r / "config.json").is_file()
        or not any((models_dir / r).glob("*.safetensors"))
    ]
    if missing:
        raise MissingModelsError(
            f"no trained mini-world models in {models_dir} (missing or incomplete: "
            f"{', '.join(missing)}; each needs config.json and model.safetensors). "
            + TRAIN_HINT.format(dir=models_dir)
        )
    return {r: models_dir / r for r in ROLES}


def fingerprint(folder: Path) -> str:
    """sha256 over every file of a model folder (names and bytes): retrained weights differ."""
    h = hashlib.sha256()
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(folder)).encode() + b"\0")
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


def build_standin_models(dest: Path, seed: int = 0, size: Any = None) -> Path:
    """Random tiny Qwen2.5-VL stand-ins in ``dest/small`` and ``dest/large`` (the bundled
    models' layout and view budget), for development and tests before real weights exist."""
    from speceyes.miniworld import tinymodel as train

    dest = Path(dest)
    work = dest / ".build"
    for i, role in enumerate(ROLES):
        if (dest / role / "config.json").is_file():
            continue
        base = train.build_base(work / role, role, size or train.TINY, seed + i, "qwen2_5_vl")
        shutil.copytree(base, dest / role, dirs_exist_ok=True)
    shutil.rmtree(work, ignore_errors=True)
    return dest


# --------------------------------------------------------------------------------------- split


def split_key(
    settings: DemoSettings, scenes: int, seed: int, split: str = "test"
) -> dict[str, Any]:
    from speceyes.miniworld.level1 import LEVEL1_VERSION
    from speceyes.miniworld.scenes import GENERATOR_VERSION
    from speceyes.miniworld.splits import level_defaults

    level1 = settings.level == 1
    return {
        "generator": LEVEL1_VERSION if level1 else GENERATOR_VERSION,
        "level": settings.level,
        "clutter": level_defaults(settings.level)[1],
        "split": split,
        "seed": seed,
        "n_scenes": scenes,
        "canvas": list(settings.canvas),
        "small_fraction": settings.test.small_fraction,
    }


def subset_path(data: Path, size: str) -> Path:
    return data / f"questions-{size}.jsonl"


def ensure_split(data: Path, key: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The test split in ``data`` with its per-size subsets; reused when its manifest matches
    ``key`` (returns ``(manifest, reused)``), else generated afresh."""
    from speceyes.miniworld.splits import make_split

    man_path = data / "manifest.json"
    if man_path.is_file() and (data / "questions.jsonl").is_file():
        man = json.loads(man_path.read_text(encoding="utf-8"))
        if all(man.get(k) == v for k, v in key.items()):
            rows = _read_rows(data / "questions.jsonl")
            if all((data / r["image"]).is_file() for r in rows):
                if not all(subset_path(data, s).is_file() for _, s in SPLITS):
                    _write_subsets(data, rows)
                return man, True
    # Generated data only: remove what a previous split wrote (manifest first, so a crash in
    # between never leaves an old manifest over new images).
    for name in (
        "manifest.json",
        "questions.jsonl",
        *(subset_path(data, s).name for _, s in SPLITS),
    ):
        (data / name).unlink(missing_ok=True)
    shutil.rmtree(data / "images", ignore_errors=True)
    man = make_split(
        data,
        key["split"],
        key["n_scenes"],
        key["seed"],
        canvas=tuple(key["canvas"]),
        small_fraction=key["small_fraction"],
        clutter=key.get("clutter", 0),
        level=key.get("level", 2),
    )
    _write_subsets(data, _read_rows(data / "questions.jsonl"))
    return man, False


def _read_rows(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _write_subsets(data: Path, rows: list[dict[str, Any]]) -> None:
    for _, size in SPLITS:
        path = subset_path(data, size)
        tmp = path.with_suffix(".jsonl.tmp")
        with tmp.open("w", encoding="utf-8", newline="\n") as f:
            for r in rows:
                if r["target_size"] == size:
                    f.write(json.dumps(r, ensure_ascii=False) + "\n")
        os.replace(tmp, path)


# ---------------------------------------------------------------------------------------- runs


def agent_settings(a: AgentSettings):
    """The factory's agent settings for the manifest's ``agent`` object (its search keys are
    the factory's SEARCH_KEYS, the names ``--search`` takes)."""
    from speceyes import factory

    if a.kind == "zoom":
        return factory.AgentSettings(
            kind="deepeyes",
            max_tool_calls=a.max_tool_calls,
            max_new_tokens=a.max_new_tokens or 1024,
        )
    return factory.AgentSettings(
        kind="search",
        max_new_tokens=a.max_new_tokens or 64,
        search={k: getattr(a, k) for k in factory.SEARCH_KEYS},
    )


def make_agent(large, a: AgentSettings):
    from speceyes import factory

    return factory.make_agent(agent_settings(a), large)


def warm_up(backends: dict[str, Any], data: Path) -> None:
    """One short call per backend (first-call allocations and lazy init stay out of the timed
    runs), and every image of the split read once (so no run pays cold disk reads)."""
    from speceyes import prompts
    from speceyes.images import load_image
    from speceyes.judging import tool_probability

    rows = _read_rows(data / "questions.jsonl")
    for r in rows:
        (data / r["image"]).read_bytes()
    img = load_image(str(data / rows[0]["image"]))
    q = rows[0]["question"]
    if "large" in backends:
        tool_probability(backends["large"], [prompts.judge_messages(img, q)])
        backends["large"].answer([prompts.small_messages(img, q)], max_new_tokens=2)
    if "small" in backends:
        backends["small"].answer([prompts.small_messages(img, q)], max_new_tokens=2)


def _move_aside(run_dir: Path, why: str) -> None:
    stale = run_dir.with_name(f"{run_dir.name}.stale-{time.strftime('%Y%m%d-%H%M%S')}")
    n = 1
    while stale.exists():
        stale = stale.with_name(f"{run_dir.name}.stale-{time.strftime('%Y%m%d-%H%M%S')}-{n}")
        n += 1
    run_dir.rename(stale)
    print(f"  {run_dir} was made with other settings ({why}); moved to {stale.name}")


def _identity(key: dict, size: str, mode: str, prints: dict[str, str], s: DemoSettings) -> dict:
    roles = {"agent": ("large",), "small": ("small",), "speceyes": ROLES}[mode]
    return {
        "split": key,
        "target_size": size,
        "models": {r: prints[r] for r in roles},  # retrained weights under the same path
        "agent": None if mode == "small" else asdict(s.agent),
    }


def run_one(
    run_dir: Path,
    mode: str,
    subset: Path,
    ident: dict,
    funnel_kw: dict,
    backends: dict,
    agent,
    models: dict[str, Path],
    progress: bool,
) -> dict[str, Any]:
    """One mode on one size split through the evaluation harness, resuming a matching run."""
    from speceyes.bench.datasets import load_jsonl
    from speceyes.bench.runner import EvalSpec, RunDirError, run_eval
    from speceyes.factory import assemble_funnel
    from speceyes.funnel import FunnelConfig

    started = (run_dir / "run.json").exists() or (run_dir / "samples.jsonl").exists()
    if started:
        idp = run_dir / IDENTITY
        old = json.loads(idp.read_text()) if idp.is_file() else None
        if old != ident:
            diff = (
                "unknown" if old is None else ", ".join(k for k in ident if old.get(k) != ident[k])
            )
            _move_aside(run_dir, diff)
            started = False
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / IDENTITY).write_text(json.dumps(ident, indent=2))
    funnel = assemble_funnel(
        FunnelConfig(mode=mode, **funnel_kw), backends.get("small"), backends.get("large"), agent
    )
    n = sum(1 for line in subset.open(encoding="utf-8") if line.strip())

    def spec(resume: bool) -> EvalSpec:
        return EvalSpec(
            bench="jsonl",
            data=str(subset),
            output=run_dir,
            resume=resume,
            models={r: str(p) for r, p in models.items()},
            loader_kw={"target_size": ident["target_size"], "split": ident["split"]},
        )

    try:
        return run_eval(spec(started), funnel, load_jsonl(subset), total=n, progress=progress)
    except RunDirError as e:  # config differs (e.g. tau) or an unreadable log: keep it, start over
        _move_aside(run_dir, str(e).split(": ", 1)[-1])
        run_dir.mkdir(parents=True)
        (run_dir / IDENTITY).write_text(json.dumps(ident, indent=2))
        funnel.stats = type(funnel.stats)()
        return run_eval(spec(False), funnel, load_jsonl(subset), total=n, progress=progress)


# ------------------------------------------------------------------------------------- summary


def _counts(records: list[dict]) -> dict[str, int]:
    judged = [r for r in records if r.get("judge_tool") is not None]
    free = [r for r in judged if not r["judge_tool"]]
    return {
        "judged": len(judged),
        "tool_free": len(free),
        "accepted": sum(1 for r in free if r["route"] == "small"),
    }


def zoom_on_target(records: list[dict]) -> dict[str, Any]:
    """How often the agent's last zoom holds the whole target box of the question (the
    relative-position target, the attribute object, a POPE positive), over the agent runs that
    zoomed on a question with a known target: the search's localisation, measured."""
    hits = n = 0
    for r in records:
        box = (r.get("meta") or {}).get("target_bbox")
        zooms = [t for t in r.get("trace") or [] if t.get("type") == "zoom"]
        if box is None or not zooms:
            continue
        c = zooms[-1]["crop_box"]
        n += 1
        hits += c[0] <= box[0] and c[1] <= box[1] and c[2] >= box[2] and c[3] >= box[3]
    return {"n": n, "hits": hits, "share": hits / n if n else None}


def _cell(records: list[dict], wall: float) -> dict[str, Any]:
    """Accuracy, time, phase costs and funnel counts of a set of records run in ``wall`` s."""
    from speceyes.bench.runner import summarize

    s = summarize(records, "jsonl")
    c = _counts(records)
    n = len(records)
    tp = s["time_by_phase"]
    return {
        "n": n,
        "accuracy": s["accuracy"],
        "n_errors": s["n_errors"],
        "wall_time": wall,
        "time_per_query": wall / n if n else None,
        **c,
        "beta": s["beta"],
        "alpha": s["alpha_accept"],
        "time_by_phase": tp,
        # c_J: judge seconds per query; c_S: small model + gate seconds per query it answered.
        "c_J": tp["judge"] / n if n and c["judged"] else None,
        "c_S": (tp["small"] + tp["gate"]) / c["tool_free"] if c["tool_free"] else None,
        "zoom_on_target": zoom_on_target(records),
    }


def _add_speedups(row: dict[str, dict]) -> None:
    agent = row.get("agent")
    L = agent["time_per_query"] if agent else None
    for mode, cell in row.items():
        tpq = cell["time_per_query"]
        cell["speedup"] = L / tpq if (L and tpq) else None
        if mode == "speceyes":
            cell["L_agent"] = L
            ok = L and cell["c_J"] is not None
            beta, alpha = cell["beta"] or 0.0, cell["alpha"] or 0.0
            an = analytic_speedup(cell["c_J"], cell["c_S"] or 0.0, L, beta, alpha) if ok else None
            cell["analytic_speedup"] = an
            cell["share_of_analytic"] = cell["speedup"] / an if (an and cell["speedup"]) else None


def summarize_demo(out: Path, modes: list[str]) -> dict[str, Any]:
    """Rows per split, pooled, and per category, from the run folders' logs and results."""
    from speceyes.bench.runner import read_logged
    from speceyes.bench.scoring import record_correct

    rows: dict[str, dict[str, dict]] = {}
    pooled: dict[str, tuple[list, float]] = {}
    for split, _ in SPLITS:
        rows[split] = {}
        for mode in modes:
            d = out / RUNS_DIR / split / mode
            res = json.loads((d / "results.json").read_text())
            recs = read_logged(d / "samples.jsonl")
            rows[split][mode] = {**_cell(recs, float(res["wall_time"])), "run": str(d)}
            prev_recs, prev_wall = pooled.get(mode, ([], 0.0))
            pooled[mode] = (prev_recs + recs, prev_wall + float(res["wall_time"]))
    rows["all"] = {m: _cell(recs, wall) for m, (recs, wall) in pooled.items()}
    for r in rows.values():
        _add_speedups(r)
    cats: dict[str, dict[str, dict]] = {}
    for mode, (recs, _) in pooled.items():
        by: dict[str, list[bool]] = {}
        for r in recs:
            by.setdefault(r.get("category") or "(none)", []).append(record_correct(r))
        for cat, ok in by.items():
            cats.setdefault(cat, {})[mode] = {"n": len(ok), "accuracy": sum(ok) / len(ok)}
    from speceyes.miniworld.scenes import CATEGORIES

    order = [c for c in CATEGORIES if c in cats] + sorted(c for c in cats if c not in CATEGORIES)
    return {"modes": modes, "rows": rows, "categories": {c: cats[c] for c in order}}


def _pooled(out: Path, mode: str) -> list[dict]:
    from speceyes.bench.runner import read_logged

    return [
        r
        for split, _ in SPLITS
        for r in read_logged(out / RUNS_DIR / split / mode / "samples.jsonl")
    ]


def checks(out: Path, modes: list[str], tau: float, summary: dict[str, Any]) -> dict[str, Any]:
    """The gate's AUROC, the judge's routing by target size, accuracy against tau (replayed
    from the logs), the figure and the targets, from the run folders."""
    import numpy as np

    from speceyes.miniworld import targets as T

    extra: dict[str, Any] = {}
    # AUROC over the small model's answers: the small-only run answers every question.
    source = "small" if "small" in modes else ("speceyes" if "speceyes" in modes else None)
    if source:
        extra["gate_auroc"] = {"run": source, **T.gate_auroc(_pooled(out, source))}
    if "speceyes" in modes:
        spec = _pooled(out, "speceyes")
        extra["judge_routing"] = T.judge_routing(spec)
        curve = None
        if "agent" in modes:
            taus = np.round(np.concatenate([np.linspace(0.5, 0.95, 10), [0.97, 0.98, 0.99]]), 4)
            curve = T.accuracy_vs_tau(spec, _pooled(out, "agent"), taus)
            extra["accuracy_vs_tau"] = curve
        extra["plot"] = str(T.plot_demo(summary, curve, tau, out / "demo.png"))
    extra["targets"] = T.check_targets({**summary, **extra})
    return extra


def _write_viewer(out: Path, modes: list[str]) -> Path | None:
    """The runs as one static HTML report (``speceyes view``); a failure here never costs the
    demo its results, so it is reported and skipped."""
    from speceyes.view import write_view

    runs = [out / RUNS_DIR / split / mode for split, _ in SPLITS for mode in modes]
    try:
        return write_view(runs, out / "view")
    except Exception as e:  # noqa: BLE001 - the report is an extra; the results are written
        print(f"viewer: not written ({type(e).__name__}: {e})")
        return None


def format_checks(summary: dict[str, Any]) -> str:
    lines = []
    au = summary.get("gate_auroc")
    if au and au.get("n"):
        lines.append(
            f"Gate AUROC (confidence as a predictor of the small model being right, "
            f"{au['run']} runs, {au['right']}/{au['n']} right): {_f(au['auroc'])}."
        )
    jr = summary.get("judge_routing")
    if jr:
        parts = [
            f"{size} targets {v['to_agent']}/{v['n']} to the agent ({_f(v['share_to_agent'], '.0%')})"
            for size, v in jr.items()
            if v["n"]
        ]
        lines.append("Judge routing: " + "; ".join(parts) + ".")
    return "\n".join(lines) + "\n"


def _f(x, spec: str = ".3f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def format_table(summary: dict[str, Any]) -> str:
    modes = summary["modes"]
    head = ["questions"]
    for m in modes:
        lab = MODE_LABEL[m]
        head += [f"{lab} acc", f"{lab} s/query", f"{lab} speedup"]
        if m == "speceyes":
            head += ["beta", "alpha", "analytic speedup", "share of analytic"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, row in summary["rows"].items():
        cells = [f"{SPLIT_LABEL[key]} (n={next(iter(row.values()))['n']})" if row else key]
        for m in modes:
            c = row[m]
            cells += [_f(c["accuracy"]), _f(c["time_per_query"]), _f(c["speedup"], ".2f", "x")]
            if m == "speceyes":
                cells += [
                    _f(c["beta"], ".2f"),
                    _f(c["alpha"], ".2f"),
                    _f(c["analytic_speedup"], ".2f", "x"),
                    _f(c["share_of_analytic"], ".0%"),
                ]
        lines.append("| " + " | ".join(cells) + " |")
    for cat, row in summary["categories"].items():
        n = next(iter(row.values()))["n"]
        cells = [f"{cat} (n={n})"]
        for m in modes:
            cells += [_f(row[m]["accuracy"] if m in row else None), "", ""]
            if m == "speceyes":
                cells += ["", "", "", ""]
        lines.append("| " + " | ".join(cells) + " |")
    notes = [
        "",
        "s/query: the run's wall time / its questions (batches of "
        f"{summary.get('batch_size', '?')}); 'all' pools both splits: total time / total "
        "questions. speedup: agent-only s/query / the mode's s/query.",
        "beta: share of questions the judge sent to the small model; alpha: share of those the "
        "gate accepted. analytic speedup: L_agent / (c_J + beta*c_S + (1 - beta*alpha)*L_agent) "
        "from the measured costs below; share of analytic: measured / analytic.",
        "Category rows: accuracy only, pooled over both splits; time per query cannot be "
        "attributed to a category, since a batch mixes categories and shares its time.",
    ]
    if "agent" in modes:
        hits = []
        for key, row in summary["rows"].items():
            z = row["agent"].get("zoom_on_target") or {}
            if z.get("n"):
                hits.append(f"{SPLIT_LABEL[key]} {z['hits']}/{z['n']} ({z['share']:.0%})")
        if hits:
            notes.append(
                "Agent-only zooms whose last crop holds the whole target: " + "; ".join(hits) + "."
            )
    if "speceyes" in modes:
        costs = []
        for key, row in summary["rows"].items():
            c = row["speceyes"]
            costs.append(
                f"{SPLIT_LABEL[key]}: c_J {_f(c['c_J'], '.4f')} s, c_S {_f(c['c_S'], '.4f')} s, "
                f"L_agent {_f(c.get('L_agent'), '.4f')} s"
            )
        notes.append(
            "Measured costs per query (c_J: judge; c_S: small model + gate, per question it "
            "answered; L_agent: agent-only s/query): " + "; ".join(costs) + "."
        )
    return "\n".join(lines + notes) + "\n"


# ----------------------------------------------------------------------------------------- main


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="runs/demo", help="output folder (default runs/demo)")
    p.add_argument(
        "--models",
        default=None,
        help="folder with small/, large/ (Hugging Face checkpoint folders) and an optional "
        f"manifest.json of demo settings (default: the bundled {MODELS_DIR})",
    )
    p.add_argument(
        "--scenes",
        type=int,
        default=None,
        help="test scenes, 8 questions each (default: manifest test.scenes, 40)",
    )
    p.add_argument("--seed", type=int, default=None, help="split seed (default: manifest, 0)")
    p.add_argument(
        "--level",
        type=int,
        choices=(1, 2),
        default=None,
        help="mini-world level: 1 one target shape among pastel clutter (default; the bundled "
        "level-1 models), 2 the multi-object world (the bundled level-2 models)",
    )
    p.add_argument(
        "--tau", type=float, default=None, help="gate threshold (default: manifest, 0.9)"
    )
    p.add_argument(
        "--modes",
        default=",".join(MODES),
        help="comma-separated subset of agent,small,speceyes (default: all three; speedups "
        "need agent)",
    )
    p.add_argument(
        "--split",
        choices=("test", "val"),
        default="test",
        help="test (easy-VQA test shapes; the reported numbers) or val (train shapes, another "
        "seed stream; for choosing tau and the agent's settings without touching test)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    level = getattr(args, "level", None)
    models_dir = (
        Path(args.models) if args.models else (LEVEL_MODELS[2] if level == 2 else MODELS_DIR)
    )
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"--modes: unknown {', '.join(bad) or '(none)'}; choose from {MODES}")
    modes = [m for m in MODES if m in modes]
    models = find_models(models_dir)  # fail before anything is written or loaded
    settings = load_settings(models_dir / MANIFEST)
    if level is not None:
        settings.level = level
    if args.tau is not None:
        settings.tau = args.tau
    scenes = settings.test.scenes if args.scenes is None else args.scenes
    seed = settings.test.seed if args.seed is None else args.seed
    if scenes < 1:
        raise ValueError("--scenes must be at least 1")
    out = Path(args.out).resolve()
    data = out / DATA_DIR
    key = split_key(settings, scenes, seed, getattr(args, "split", "test"))
    man, reused = ensure_split(data, key)
    print(
        f"split: {data} ({'reused' if reused else 'generated'}; {man['n_scenes']} scenes, "
        f"{man['n_questions']} questions, canvas {man['canvas'][0]}x{man['canvas'][1]}, seed {seed})"
    )
    from speceyes.factory import BackendSettings, make_backend

    if args.no_progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    need = {r for m in modes for r in {"agent": ("large",), "small": ("small",)}.get(m, ROLES)}
    print(f"models: {models_dir} ({', '.join(sorted(need))}; float32)")
    float32 = BackendSettings(dtype="float32")
    backends = {r: make_backend(str(models[r]), settings=float32) for r in ROLES if r in need}
    prints = {r: fingerprint(models[r]) for r in ROLES}
    agent = make_agent(backends["large"], settings.agent) if "large" in backends else None
    funnel_kw = {
        "tau": settings.tau,
        "agg": settings.agg,
        "top_k": settings.top_k,
        "batch_size": settings.batch_size,
    }
    warm_up(backends, data)
    for split, size in SPLITS:  # the modes of one split back to back: fair timing under noise
        subset = subset_path(data, size)
        for mode in modes:
            run_dir = out / RUNS_DIR / split / mode
            print(f"[{SPLIT_LABEL[split]}] {MODE_LABEL[mode]} -> {run_dir}", flush=True)
            ident = _identity(key, size, mode, prints, settings)
            res = run_one(
                run_dir,
                mode,
                subset,
                ident,
                funnel_kw,
                backends,
                agent,
                models,
                progress=not args.no_progress,
            )
            print(
                f"  n={res['n']} accuracy={_f(res['accuracy'])} "
                f"s/query={_f(res['time_per_query'])} beta={_f(res['beta'], '.2f')} "
                f"alpha={_f(res['alpha_accept'], '.2f')}",
                flush=True,
            )
    summary = summarize_demo(out, modes)
    summary.update(
        batch_size=settings.batch_size,
        settings=settings.to_dict(),
        split=key,
        models={r: {"path": str(models[r]), "fingerprint": prints[r]} for r in ROLES},
    )
    summary.update(checks(out, modes, settings.tau, summary))
    table = format_table(summary)
    if summary.get("targets"):
        from speceyes.miniworld.targets import format_targets

        table += "\n" + format_checks(summary) + "\n" + format_targets(summary["targets"])
    print()
    print(table)
    (out / "summary.md").write_text(table, encoding="utf-8")
    if summary.get("plot"):
        print(f"plot: {summary['plot']}")
    view = _write_viewer(out, modes)
    if view is not None:
        print(f"viewer: {view} (open it in a browser; no server needed)")
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2), encoding="utf-8")
    os.replace(tmp, out / "summary.json")
    print(f"wrote {out / 'summary.md'} and {out / 'summary.json'}; run folders in {out / RUNS_DIR}")
    return 0
