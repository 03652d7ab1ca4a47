"""``speceyes demo``: the mini-world benchmark with the two bundled trained models.

One test split of mini-world scenes (:func:`speceyes.miniworld.scenes.make_split`) is split by
target size, and agent-only, small-only and SpecEyes on both sizes (six runs) take turns batch
by batch through the evaluation harness (:mod:`speceyes.miniworld.interleave` over
:func:`speceyes.bench.runner.run_eval`): batch 1 of each run, then batch 2 in a rotated order,
and so on, so a change of machine load falls on every mode of every split alike, and the
speedup over all questions is as fair as the one within a split. The batches run on worker
processes, each one batch at a time on its share of the cores (:mod:`speceyes.miniworld.workers`),
so another process's load slows every mode alike. A run's time is the sum of its own batches'
times, wall-clock and process CPU (all threads). Every run folder is an ordinary
``speceyes eval`` folder (``samples.jsonl``, ``results.json``, ``plots/``) that ``speceyes
report``, ``speceyes regate`` and ``speceyes view`` read. The table at the end (also
``summary.md`` and ``summary.json``) compares the modes and puts the measured SpecEyes speedup
next to the analytic one from the measured per-phase costs,
``L_agent / (c_J + beta*c_S + (1 - beta*alpha) * L_agent)``.

Layout of ``--out``::

    data/                    the split: images/, questions.jsonl, manifest.json,
                             questions-small.jsonl, questions-large.jsonl (subsets by target size)
    runs/{small-targets,large-targets}/{agent,small,speceyes}/
    summary.md, summary.json

Re-running continues: a run folder made with the same settings is resumed (its logged batches
are skipped, nothing is redone); one made with other settings (split, models, tau, agent) is
moved aside to ``NAME.stale-TIMESTAMP``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speceyes.factory import MANIFEST, MANIFEST_AGENT, MANIFEST_TAU
from speceyes.miniworld.interleave import ModeRun, interleave, open_run
from speceyes.miniworld.level1 import LEVEL1_CANVAS
from speceyes.miniworld.summary import (
    MODE_LABEL,
    MODES,
    RUNS_DIR,
    SPLIT_LABEL,
    SPLITS,
    checks,
    fmt,
    format_report,
    summarize_demo,
    write_viewer,
)
from speceyes.miniworld.workers import (
    WorkerPlan,
    default_workers,
    run_on_workers,
    threads_per_worker,
)

if TYPE_CHECKING:
    from speceyes.factory import Settings

MODELS_DIR = Path(__file__).resolve().parent / "models"  # level 1, the default
# The multi-object world's pair (``--level 2``), trained for it and kept with its numbers.
LEVEL_MODELS = {1: MODELS_DIR, 2: Path(__file__).resolve().parent / "models_level2"}
LEVELS = tuple(LEVEL_MODELS)
ROLES = ("small", "large")
MODE_ROLES = {"agent": ("large",), "small": ("small",), "speceyes": ROLES}  # the models it runs
DATA_DIR = "data"
TRAIN_HINT = (
    "Train and export them with `speceyes miniworld train --out runs/mw --role small|large "
    "--stage A|B|eval ...` (see docs/miniworld-training.md), then copy the exported folders to "
    "{dir}/small and {dir}/large; or point --models at a folder holding small/ and large/."
)


class MissingModelsError(ValueError):
    """The models folder lacks the small or large checkpoint."""


@dataclass
class TestSplit:
    """The demo's test split, from the manifest's ``canvas``, ``level`` and ``test`` keys."""

    canvas: tuple[int, int] = LEVEL1_CANVAS
    level: int = 1  # 1: one target among clutter (speceyes.miniworld.level1); 2: multi-object
    seed: int = 0
    scenes: int = 40
    small_fraction: float = 0.5

    __test__ = False  # not a pytest test class

    @classmethod
    def from_settings(cls, settings: Settings, where: str = "manifest") -> TestSplit:
        """Read from the keys ``Settings.from_manifest`` keeps in ``settings.extra``."""
        extra = settings.extra
        split = cls()
        if "canvas" in extra:
            c = extra["canvas"]
            if not (isinstance(c, list | tuple) and len(c) == 2):
                raise ValueError(f"{where}: canvas must be [width, height]")
            split.canvas = (int(c[0]), int(c[1]))
        if "level" in extra:
            split.level = int(extra["level"])
        if split.level not in LEVELS:
            raise ValueError(f"{where}: level must be 1 or 2, got {split.level}")
        test = extra.get("test")
        if test is not None and not isinstance(test, dict):
            raise ValueError(f"{where}: test: expected an object")
        for key in ("seed", "scenes", "small_fraction"):
            if key in (test or {}):
                setattr(split, key, type(getattr(split, key))(test[key]))
        return split


# On a busy machine spinning OpenMP threads wait out a partner that lost its core, which slows
# the modes by how often they sync (unequally) and inflates their CPU time; sleeping ones do not.
# Read when torch first loads, so it takes effect only if the demo is what loads it.
OMP_WAIT_POLICY = "PASSIVE"

_T = TestSplit
EPILOG = (
    "MODELS/manifest.json (written by the trainer; every key optional): "
    + json.dumps(
        {
            "level": _T.level,
            "canvas": list(_T.canvas),
            "tau": MANIFEST_TAU,
            "agg": "min",
            "agent": {**MANIFEST_AGENT, "grid": 2},
            "test": {"seed": _T.seed, "scenes": _T.scenes, "small_fraction": _T.small_fraction},
        }
    )
    + '; agent kind "deepeyes" (or its old name "zoom") runs the DeepEyes zoom-tool loop '
    "instead of the search agent; other keys (training metadata) are carried into summary.json. "
    "Time per query is a run's wall time (and its process CPU time) over its questions; after "
    "one warm-up call per model, the modes of both size splits run in turns, batch by batch in "
    "one rotating order, so a change of machine load falls on all of them alike; the batches "
    "run on --workers processes, one batch each at a time on its share of the cores, so that "
    "another process's load slows every mode by the same share; the speedup over all "
    "questions is total agent-only time / total time of the mode; per category only accuracy "
    "is reported. Threads: per worker, the cores / workers (set OMP_NUM_THREADS to change it; "
    "with --workers 1, torch's default); "
    f"OMP_WAIT_POLICY defaults to {OMP_WAIT_POLICY} (threads waiting at a barrier sleep instead "
    "of spinning, so on a busy machine a thread whose partner lost its core does not burn its "
    "own time slice; set it to ACTIVE for OpenMP's spinning)."
)


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


def split_key(test: TestSplit, split: str = "test") -> dict[str, Any]:
    from speceyes.miniworld.level1 import LEVEL1_VERSION
    from speceyes.miniworld.scenes import GENERATOR_VERSION
    from speceyes.miniworld.splits import level_defaults

    level1 = test.level == 1
    return {
        "generator": LEVEL1_VERSION if level1 else GENERATOR_VERSION,
        "level": test.level,
        "clutter": level_defaults(test.level)[1],
        "split": split,
        "seed": test.seed,
        "n_scenes": test.scenes,
        "canvas": list(test.canvas),
        "small_fraction": test.small_fraction,
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


def load_models(settings: Settings, roles: Sequence[str]) -> tuple[dict[str, Any], Any]:
    """The backends of ``roles`` and one agent on the large one, shared by every mode's funnel
    (built as build_funnel would build it)."""
    from speceyes.factory import make_agent, make_backend

    specs = {"small": settings.small, "large": settings.large}
    backends = {r: make_backend(specs[r], settings=settings.backend) for r in ROLES if r in roles}
    resolved = settings.resolved()
    agent = make_agent(resolved.agent, backends["large"]) if "large" in backends else None
    return backends, agent


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


def _identity(key: dict, size: str, mode: str, prints: dict[str, str], s: Settings) -> dict:
    return {
        "split": key,
        "target_size": size,
        "models": {r: prints[r] for r in MODE_ROLES[mode]},  # retrained weights under the same path
        "agent": None if mode == "small" else asdict(s.resolved().agent),
    }


def run_all(
    runs: dict[tuple[str, str], ModeRun], progress: bool, plan: WorkerPlan | None = None
) -> None:
    """Every mode of every size split, ``runs[(split, mode)]``, interleaved batch by batch in
    one schedule (:func:`interleave`): in this process, or with ``plan`` on its worker
    processes (:func:`run_on_workers`)."""
    from tqdm import tqdm

    total = sum(len(r.queries) for r in runs.values())
    done = sum(len(r.done) for r in runs.values())
    label_of = {id(r): f"{SPLIT_LABEL[s]}, {MODE_LABEL[m]}" for (s, m), r in runs.items()}
    with tqdm(total=total, initial=done, disable=not progress, unit="q", desc="demo") as bar:

        def on_batch(run: ModeRun, ran: int) -> None:
            bar.set_postfix_str(label_of[id(run)], refresh=False)
            bar.update(ran)

        if plan is None:
            interleave(list(runs.values()), on_batch)
        else:
            run_on_workers(runs, plan, on_batch)


def set_wait_policy() -> str | None:
    """Default ``OMP_WAIT_POLICY`` to :data:`OMP_WAIT_POLICY` while torch (and with it OpenMP)
    is not loaded yet; returns the policy in effect (None: OpenMP's own default)."""
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", OMP_WAIT_POLICY)
    return os.environ.get("OMP_WAIT_POLICY")


# ----------------------------------------------------------------------------------------- main


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="runs/demo", help="output folder (default runs/demo)")
    p.add_argument(
        "--models",
        default=None,
        help="folder with small/, large/ (Hugging Face checkpoint folders) and an optional "
        f"{MANIFEST} of demo settings (default: the bundled {MODELS_DIR})",
    )
    p.add_argument(
        "--scenes",
        type=int,
        default=None,
        help=f"test scenes, 8 questions each (default: manifest test.scenes, {TestSplit.scenes})",
    )
    p.add_argument(
        "--seed", type=int, default=None, help=f"split seed (default: manifest, {TestSplit.seed})"
    )
    p.add_argument(
        "--level",
        type=int,
        choices=LEVELS,
        default=None,
        help="mini-world level: 1 one target shape among pastel clutter (default; the bundled "
        "level-1 models), 2 the multi-object world (the bundled level-2 models)",
    )
    p.add_argument(
        "--tau",
        type=float,
        default=None,
        help=f"gate threshold (default: manifest, {MANIFEST_TAU})",
    )
    p.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"comma-separated subset of {','.join(MODES)} (default: all three; speedups "
        "need agent)",
    )
    p.add_argument(
        "--split",
        choices=("test", "val"),
        default="test",
        help="test (easy-VQA test shapes; the reported numbers) or val (train shapes, another "
        "seed stream; for choosing tau and the agent's settings without touching test)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="worker processes that run the batches, each one batch at a time on its share of "
        "the cores (one thread each on a 2-core machine; OMP_NUM_THREADS sets it), so a busy "
        "machine slows every mode alike; 1 runs them in this process on torch's default threads "
        "(default: 2, or 1 on a one-core machine)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    wait_policy = set_wait_policy()  # before torch loads
    from speceyes.factory import Settings

    level = getattr(args, "level", None)
    models_dir = (
        Path(args.models) if args.models else (LEVEL_MODELS[2] if level == 2 else MODELS_DIR)
    )
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"--modes: unknown {', '.join(bad) or '(none)'}; choose from {MODES}")
    modes = [m for m in MODES if m in modes]
    workers = default_workers() if getattr(args, "workers", None) is None else args.workers
    if workers < 1:
        raise ValueError("--workers must be at least 1")
    threads = threads_per_worker(workers) if workers > 1 else None  # None: torch's default
    models = find_models(models_dir)  # fail before anything is written or loaded
    settings = Settings.from_manifest(models_dir / MANIFEST)
    if args.tau is not None:
        settings = settings.with_funnel(tau=args.tau)
    test = TestSplit.from_settings(settings, str(models_dir / MANIFEST))
    if level is not None:
        test.level = level
    if args.scenes is not None:
        test.scenes = args.scenes
    if args.seed is not None:
        test.seed = args.seed
    if test.scenes < 1:
        raise ValueError("--scenes must be at least 1")
    out = Path(args.out).resolve()
    data = out / DATA_DIR
    key = split_key(test, getattr(args, "split", "test"))
    man, reused = ensure_split(data, key)
    print(
        f"split: {data} ({'reused' if reused else 'generated'}; {man['n_scenes']} scenes, "
        f"{man['n_questions']} questions, canvas {man['canvas'][0]}x{man['canvas'][1]}, "
        f"seed {test.seed})"
    )
    if args.no_progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    need = tuple(r for r in ROLES if any(r in MODE_ROLES[m] for m in modes))
    where = (
        f"{workers} worker processes, {threads} torch thread(s) each" if threads else "this process"
    )
    print(
        f"models: {models_dir} ({', '.join(sorted(need))}; {settings.backend.dtype}); "
        f"batches run in {where}"
    )
    prints = {r: fingerprint(models[r]) for r in ROLES}
    resolved = settings.resolved()
    backends: dict[str, Any] = {}
    agent = None
    if threads is None:  # in this process: the models load here
        backends, agent = load_models(settings, need)
        warm_up(backends, data)
    from speceyes.factory import build_funnel

    # Every mode of every split takes turns batch by batch, in one schedule: a change of load
    # falls on all of them alike, so both the per-split and the pooled ratios stay fair.
    runs: dict[tuple[str, str], ModeRun] = {}
    for split, size in SPLITS:
        subset = subset_path(data, size)
        for mode in modes:
            run_dir = out / RUNS_DIR / split / mode
            print(f"[{SPLIT_LABEL[split]}] {MODE_LABEL[mode]} -> {run_dir}", flush=True)
            mode_settings = settings.with_funnel(mode=mode).resolved()
            funnel = (
                build_funnel(mode_settings, (backends.get("small"), backends.get("large")), agent)
                if threads is None
                else None  # built by each worker
            )
            ident = _identity(key, size, mode, prints, settings)
            runs[split, mode] = open_run(run_dir, subset, ident, funnel, models, mode_settings)
    parts = [
        f"{SPLIT_LABEL[split]} {len(r.queries)} questions, {r.n_batches} batch(es)"
        for (split, mode), r in runs.items()
        if mode == modes[0]
    ]
    first = next(iter(runs.values()))
    print(
        f"  {'; '.join(parts)} of {first.batch_size}; every mode of both splits takes turns",
        flush=True,
    )
    plan = None
    if threads is not None:
        plan = WorkerPlan(
            settings=settings,
            data=data,
            roles=need,
            runs=runs,
            workers=workers,
            threads=threads,
            quiet=args.no_progress,
        )
    run_all(runs, progress=not args.no_progress, plan=plan)
    for (split, mode), r in runs.items():
        res = r.results or {}
        print(
            f"  [{SPLIT_LABEL[split]}] {MODE_LABEL[mode]}: n={res.get('n')} "
            f"accuracy={fmt(res.get('accuracy'))} s/query={fmt(res.get('time_per_query'))} "
            f"CPU s/query={fmt(res.get('cpu_time_per_query'))} "
            f"beta={fmt(res.get('beta'), '.2f')} alpha={fmt(res.get('alpha_accept'), '.2f')}",
            flush=True,
        )
    summary = summarize_demo(out, modes)
    if threads is None:
        import torch

        threads = torch.get_num_threads()
    summary.update(
        batch_size=resolved.funnel.batch_size,
        # what the timings depend on beyond the machine's load: threads per batch
        threads={"torch": threads, "workers": workers, "omp_wait_policy": wait_policy},
        settings=resolved.to_dict(),
        split=key,
        models={r: {"path": str(models[r]), "fingerprint": prints[r]} for r in ROLES},
    )
    summary.update(checks(out, modes, resolved.funnel.tau, summary))
    table = format_report(summary)
    print()
    print(table)
    (out / "summary.md").write_text(table, encoding="utf-8")
    if summary.get("plot"):
        print(f"plot: {summary['plot']}")
    view = write_viewer(out, modes)
    if view is not None:
        print(f"viewer: {view} (open it in a browser; no server needed)")
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2), encoding="utf-8")
    os.replace(tmp, out / "summary.json")
    print(f"wrote {out / 'summary.md'} and {out / 'summary.json'}; run folders in {out / RUNS_DIR}")
    return 0
