"""The demo's schedule on worker processes, each batch on a core of its own.

Why: in one process whose torch spreads every batch over all cores, a CPU-bound process beside
the demo slowed the modes unequally. Agent-only's long batches, which split well over two
threads, lost 29% where SpecEyes' short small-model batches lost 9%, so the speedup on large
targets read 17% higher beside the busy process than on a quiet machine. Here each worker runs
one batch at a time on ``threads`` threads (one each on a 2-core machine), so another process's
load takes the same share of every batch's core, whatever its mode; and two single-threaded
batches side by side take the demo about as long as one batch split over both cores did (one
thread in one process took about 40% longer).

The workers take the batches in the order of :func:`speceyes.miniworld.interleave.schedule`, a
run's next batch only once its last one is logged (one writer per run folder), so the modes still
take turns and a change of load falls on all of them alike. This process keeps each folder's
bookkeeping (the :class:`ModeRun`: which questions are logged, whether its configuration was
checked) and hands it to the worker with each batch; a worker holds the models and every run's
funnel, loaded and warmed up before any worker times a batch.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speceyes.miniworld.interleave import ModeRun, schedule

if TYPE_CHECKING:
    from multiprocessing.synchronize import Barrier

    from speceyes.factory import Settings

RunKey = tuple[str, str]  # (split, mode)
START_TIMEOUT_S = 900.0  # a worker loads two tiny models and warms them up: seconds, not minutes


def available_cpus() -> int:
    """CPUs this process may run on (a container's or ``taskset``'s share, not the host's)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_workers() -> int:
    return min(2, available_cpus())


def threads_per_worker(workers: int) -> int:
    """``OMP_NUM_THREADS`` when set (the user's choice, per worker), else the cores each worker
    gets: one on a 2-core machine."""
    set_by_user = os.environ.get("OMP_NUM_THREADS", "")
    if set_by_user.isdigit() and int(set_by_user) > 0:
        return int(set_by_user)
    return max(1, available_cpus() // max(1, workers))


@dataclass(frozen=True)
class WorkerPlan:
    settings: Settings  # the demo's settings: the models and the agent every run shares
    data: Path  # the split's folder (warm-up reads its images)
    roles: tuple[str, ...]  # the models the runs need
    runs: dict[RunKey, ModeRun]  # this process's runs, without their funnels (funnel=None)
    workers: int  # processes, each running one batch at a time
    threads: int  # torch threads in each
    quiet: bool  # no progress bars (the models' loading)


@dataclass(frozen=True)
class BatchTask:
    key: RunKey
    batch: int
    done: frozenset[str]
    resume: bool
    checked: bool


@dataclass(frozen=True)
class BatchDone:
    key: RunKey
    ran: int
    done: frozenset[str]
    resume: bool
    checked: bool
    results: dict[str, Any] | None


_RUNS: dict[RunKey, ModeRun] = {}  # a worker's runs, built by _start


def _start(plan: WorkerPlan, ready: Barrier) -> None:
    """Worker initializer: the models, one warm-up call each, every run's funnel; then wait for
    the other workers, so that no batch is timed while another worker is still loading."""
    import torch

    from speceyes.factory import build_funnel
    from speceyes.miniworld.demo import load_models, warm_up

    torch.set_num_threads(plan.threads)
    if plan.quiet:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    backends, agent = load_models(plan.settings, plan.roles)
    warm_up(backends, plan.data)
    for key, run in plan.runs.items():
        funnel = build_funnel(run.settings, (backends.get("small"), backends.get("large")), agent)
        _RUNS[key] = replace(run, funnel=funnel)  # its bookkeeping comes with each task
    ready.wait(timeout=START_TIMEOUT_S)


def _run_batch(task: BatchTask) -> BatchDone:
    run = _RUNS[task.key]
    run.done, run.resume, run.checked, run.results = set(task.done), task.resume, task.checked, None
    ran = run.run_batch(task.batch)
    return BatchDone(task.key, ran, frozenset(run.done), run.resume, run.checked, run.results)


def run_on_workers(
    runs: dict[RunKey, ModeRun],
    plan: WorkerPlan,
    on_batch: Callable[[ModeRun, int], None],
) -> None:
    """Every batch of ``runs`` on ``plan.workers`` processes, in the order of :func:`schedule`, at
    most one batch of a run at a time; ``on_batch(run, questions_run)`` after each."""
    key_of = {id(r): k for k, r in runs.items()}
    waiting = [(r, b) for r, b in schedule(list(runs.values())) if r.pending(b)]
    # The pool starts a process per task while none is idle, and every process waits for the
    # others at the barrier: so no more processes than the first round of tasks can start.
    workers = min(plan.workers, len({id(r) for r, _ in waiting}))
    if workers == 0:
        return
    ctx = multiprocessing.get_context("spawn")  # torch's thread pools do not survive a fork
    ready = ctx.Barrier(workers)
    try:
        with ProcessPoolExecutor(
            workers, mp_context=ctx, initializer=_start, initargs=(plan, ready)
        ) as pool:
            busy: dict[Future[BatchDone], ModeRun] = {}
            while waiting or busy:
                for run, b in _next_batches(waiting, busy.values(), workers - len(busy)):
                    task = BatchTask(
                        key_of[id(run)], b, frozenset(run.done), run.resume, run.checked
                    )
                    busy[pool.submit(_run_batch, task)] = run
                if not busy:
                    break
                finished, _ = wait(busy, return_when=FIRST_COMPLETED)
                for fut in finished:
                    run = busy.pop(fut)
                    out = fut.result()
                    run.done, run.resume, run.checked = set(out.done), out.resume, out.checked
                    run.results = out.results if out.results is not None else run.results
                    on_batch(run, out.ran)
    except BrokenProcessPool as e:  # a worker died, or failed to start (a barrier timeout too)
        raise RuntimeError(
            f"a demo worker process failed ({e!r}; its traceback is above); the run folders "
            "keep every logged question, so running the demo again resumes them"
        ) from e


def _next_batches(
    waiting: list[tuple[ModeRun, int]], in_flight: Iterable[ModeRun], free: int
) -> list[tuple[ModeRun, int]]:
    """Up to ``free`` batches to start, taken from the front of ``waiting`` (removed there):
    the first whose run has no batch in flight; a batch with nothing left to run is dropped."""
    busy = {id(r) for r in in_flight}
    picked: list[tuple[ModeRun, int]] = []
    i = 0
    while len(picked) < free and i < len(waiting):
        run, b = waiting[i]
        if id(run) in busy:  # its earlier batch is running: its later ones wait their turn
            i += 1
            continue
        del waiting[i]
        if run.pending(b):
            picked.append((run, b))
            busy.add(id(run))
    return picked
