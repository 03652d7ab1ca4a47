"""The demo's runs taking turns, batch by batch, each filling its own run folder.

Each mode of a size split is a :class:`ModeRun`: an ordinary ``speceyes eval`` run folder that
:func:`speceyes.bench.runner.run_eval` fills one batch at a time (each call runs one batch's
slice of the questions and resumes the folder, adding one time segment). :func:`schedule` puts
the batches of every run (every mode of every split) in one order: batch 1 of every run, then
batch 2 in the next run's order, and so on (A B C D E F, B C D E F A, ...), a run with fewer
batches spreading its batches evenly over the same time. So a change of machine load during the
demo falls on every mode of every split alike, and the ratios of their times stay fair, within a
split and pooled over the splits. A batch is the same questions the funnel would have batched in
one uninterrupted run (``batch_size`` consecutive questions of the subset), so answers and
routes are those of a run of the mode on its own.

Resuming: a killed demo keeps each folder's finished queries; the next run skips the batches
that are logged and runs the rest. Each folder's configuration is checked by its first
``run_eval`` call; a folder made with other settings is moved aside to ``NAME.stale-TIMESTAMP``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from itertools import groupby
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from speceyes.factory import Settings
    from speceyes.funnel import Funnel
    from speceyes.types import Query

IDENTITY = "demo.json"  # per run folder: what the run's results depend on beyond run.json


def move_aside(run_dir: Path, why: str) -> None:
    stale = run_dir.with_name(f"{run_dir.name}.stale-{time.strftime('%Y%m%d-%H%M%S')}")
    n = 1
    while stale.exists():
        stale = stale.with_name(f"{run_dir.name}.stale-{time.strftime('%Y%m%d-%H%M%S')}-{n}")
        n += 1
    run_dir.rename(stale)
    print(f"  {run_dir} was made with other settings ({why}); moved to {stale.name}")


def _start_folder(run_dir: Path, ident: dict) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / IDENTITY).write_text(json.dumps(ident, indent=2))


@dataclass
class ModeRun:
    """One mode on one size split, run into ``run_dir`` one batch at a time."""

    run_dir: Path
    subset: Path  # the questions file, as run.json records it
    ident: dict[str, Any]  # demo.json: the split, target size, model fingerprints, agent
    funnel: Funnel | None  # None where the batches run in worker processes (workers.py)
    queries: list[Query]
    models: dict[str, str]
    done: set[str] = field(default_factory=set)  # ids logged in the folder
    resume: bool = False  # whether the next run_eval call continues a run in the folder
    checked: bool = False  # whether a run_eval call has checked the folder's configuration
    results: dict[str, Any] | None = None  # from the call that logged the last question
    settings: Settings | None = None  # the funnel's resolved settings (recorded in run.json)

    @property
    def batch_size(self) -> int:
        config = self.funnel.config if self.funnel is not None else self.settings.funnel
        return config.batch_size or max(1, len(self.queries))

    @property
    def n_batches(self) -> int:
        # At least one: an empty subset still gets its (empty) run folder and results.
        return max(1, -(-len(self.queries) // self.batch_size))

    def batch(self, b: int) -> list[Query]:
        return self.queries[b * self.batch_size : (b + 1) * self.batch_size]

    def pending(self, b: int) -> bool:
        """Whether batch ``b`` needs a call: it has unlogged questions, or the folder is still
        unchecked (a folder made with other settings must be found before anything is
        skipped as logged)."""
        if self.results is not None or b >= self.n_batches:
            return False
        return not self.checked or any(q.id not in self.done for q in self.batch(b))

    def run_batch(self, b: int) -> int:
        """Run batch ``b``'s unlogged questions into the folder; returns how many ran."""
        from speceyes.rundir import RunDirError

        try:
            ran = self._call(b)
        except RunDirError as e:  # config differs (e.g. tau) or an unreadable log: keep it
            if self.checked:
                raise
            move_aside(self.run_dir, str(e).split(": ", 1)[-1])
            _start_folder(self.run_dir, self.ident)
            if self.funnel is not None:
                self.funnel.stats = type(self.funnel.stats)()
            self.done, self.resume = set(), False
            ran = self._call(b)
        self.checked = self.resume = True
        return ran

    def _call(self, b: int) -> int:
        from speceyes.bench.runner import EvalSpec, run_eval

        batch = self.batch(b)
        todo = [q for q in batch if q.id not in self.done]
        after = self.done | {q.id for q in batch}
        complete = all(q.id in after for q in self.queries)
        spec = EvalSpec(
            bench="jsonl",
            data=str(self.subset),
            output=self.run_dir,
            resume=self.resume,
            models=self.models,
            settings=self.settings,
            loader_kw={"target_size": self.ident["target_size"], "split": self.ident["split"]},
        )
        # The figures only once, when the folder is complete: they do not change per batch.
        res = run_eval(
            spec, self.funnel, batch, total=len(self.queries), progress=False, plots=complete
        )
        self.done = after
        if complete:
            self.results = res
        return len(todo)


def open_run(
    run_dir: Path,
    subset: Path,
    ident: dict[str, Any],
    funnel: Funnel | None,
    models: dict[str, Path],
    settings: Settings | None = None,
) -> ModeRun:
    """The mode's run folder, ready to fill: a folder of this demo's identity is kept (its
    logged questions are skipped), one of another identity moved aside."""
    from speceyes.bench.datasets import load_jsonl
    from speceyes.rundir import RunDir

    folder = RunDir(run_dir)
    started = folder.holds_run()
    if started:
        idp = run_dir / IDENTITY
        old = json.loads(idp.read_text()) if idp.is_file() else None
        if old != ident:
            diff = (
                "unknown" if old is None else ", ".join(k for k in ident if old.get(k) != ident[k])
            )
            move_aside(run_dir, diff)
            started = False
    _start_folder(run_dir, ident)
    done = {r["id"] for r in folder.iter_records(strict=False)} if started else set()
    return ModeRun(
        run_dir=run_dir,
        subset=subset,
        ident=ident,
        funnel=funnel,
        queries=list(load_jsonl(subset)),
        models={r: str(p) for r, p in models.items()},
        done=done,
        resume=started,
        settings=settings,
    )


def rotation(items: Sequence[Any], turn: int) -> list[Any]:
    """``items`` starting at ``turn`` (mod their count): A B C, B C A, C A B, A B C, ..."""
    k = turn % len(items) if items else 0
    return [*items[k:], *items[:k]]


def schedule(runs: Sequence[ModeRun]) -> list[tuple[ModeRun, int]]:
    """Every batch of every run, as ``(run, batch)`` in the order they run.

    Batch ``b`` of a run of ``n`` batches is due at ``(b + 1/2) / n`` of the way through; the
    batches due at the same point form a turn, and turn ``t`` runs them in the runs' order
    rotated by ``t`` (:func:`rotation`). Runs of as many batches (the modes of one split, and
    the splits when they are the same size) thus run their batch ``b`` in turn ``b``, each run
    first in one turn of every ``len(runs)``; a run of fewer batches has its batches spread
    evenly between the others'."""
    due = sorted(
        (
            (Fraction(2 * b + 1, 2 * r.n_batches), i, b)
            for i, r in enumerate(runs)
            for b in range(r.n_batches)
        )
    )
    order: list[tuple[ModeRun, int]] = []
    for turn, (_, units) in enumerate(groupby(due, key=lambda u: u[0])):
        batch_of = {i: b for _, i, b in units}
        order += [(runs[i], batch_of[i]) for i in rotation(list(batch_of), turn)]
    return order


def interleave(runs: Sequence[ModeRun], on_batch: Callable[[ModeRun, int], None]) -> None:
    """Every run's batches in the order of :func:`schedule`; ``on_batch(run, questions_run)``
    after each call (progress)."""
    for run, b in schedule(runs):
        if run.pending(b):
            on_batch(run, run.run_batch(b))
