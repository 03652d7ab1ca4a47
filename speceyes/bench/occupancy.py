"""Agent-phase cost under batching, replayed from a run's own schedule and measured step costs.

The funnel advances all agent loops in flight by one batched turn per step and logs, for each
query, its *share* of the steps it took part in (step wall time / loops in the step). In a
``both`` run every query's loop shares steps with every other loop of its batch; after routing,
only the rejected loops share a batch. A decode step costs nearly the same for 3 loops as for 8,
so summing the shares of the rejected loops (their GPU time) overstates what routing saves.

Model: a batched step with b loops costs ``fixed + per_loop * b`` seconds. Each loop's logged
share is then ``fixed * sum_j 1/b_j + per_loop * T`` over its T steps, with b_j known from the
run's schedule (``batched``: the loops of one batch start together and run until the last one
ends; ``pipelined``: at most ``max_agent_loops`` in flight, a finished loop's slot goes to the
next one, admitted in log order). Both coefficients are fitted to the logged shares by
non-negative least squares; the agent wall time of any routing is then
``fixed * steps + per_loop * sum(T)`` over the loops it keeps, steps replayed on the same schedule.

Turns per loop come from the trace (one ``assistant`` entry per turn; the search agent's region
steps count too), else ``tool_calls + invalid_tool_calls + 1``. A run without a schedule in its
config, or without agent timings or turns, gets the GPU-time model (``fitted`` False): the
agent cost of a routing is the sum of its loops' logged shares. Its assumption is stated in
``StepCost.assumption``.

Phases I-II are taken as logged: judge time per query, and the small model's time on the
queries judged tool-free.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

from speceyes.bench.runlog import Run

GPU_TIME = (
    "GPU-time model: a routed query costs its logged share of the batched agent steps; under "
    "batching the wall clock falls less than this when fewer loops share a step, so the "
    "speedup is an upper bound"
)
# Below this relative spread of the loops' mean 1/occupancy the fit is not identified.
MIN_OCCUPANCY_SPREAD = 0.02
_TURNS, _BATCH, _COST = ("occupancy", "turns"), ("occupancy", "batch"), ("occupancy", "cost")


@dataclass(frozen=True)
class StepCost:
    """Seconds per batched agent step: fixed + per_loop * loops in the step."""

    fixed: float
    per_loop: float
    schedule: str  # "batched", "pipelined" or "gpu-time"
    max_loops: int  # pipelined: loops in flight
    fitted: bool
    assumption: str
    residual: float = float("nan")  # relative RMS error of the fit on the logged shares

    def describe(self) -> str:
        if not self.fitted:
            return self.assumption
        return (
            f"{self.schedule} schedule, step cost {1e3 * self.fixed:.1f} ms + "
            f"{1e3 * self.per_loop:.1f} ms per loop in the step (fitted to the logged shares, "
            f"{100 * self.residual:.0f}% RMS); {self.assumption}"
        )


def turns(run: Run) -> np.ndarray:
    """Agent steps per query (0 where the agent did not run), cached on the Run."""
    if _TURNS not in run._cache:
        search = run.config.get("agent") == "search"
        out = np.zeros(run.n)
        for i, s in enumerate(run.samples):
            if not run.has_agent[i]:
                continue
            trace = s.get("trace") or []
            kinds = [t.get("type") for t in trace if isinstance(t, dict)]
            n = kinds.count("assistant") + (kinds.count("zoom") if search else 0)
            if n == 0:
                n = int(s.get("tool_calls") or 0) + int(s.get("invalid_tool_calls") or 0) + 1
            out[i] = n
        run._cache[_TURNS] = out
    return run._cache[_TURNS]


def batch_ids(run: Run) -> np.ndarray:
    """Batch of each query under the batched schedule: log order in chunks of batch_size,
    restarting at every resumed segment (each segment's queries were batched afresh)."""
    if _BATCH not in run._cache:
        size = int(run.config.get("batch_size") or 1)
        counts = [int(s.get("queries") or 0) for s in run.results.get("segments") or []]
        if sum(counts) != run.n or not counts:
            counts = [run.n]
        out, offset = np.zeros(run.n, dtype=np.int64), 0
        start = 0
        for c in counts:
            pos = np.arange(c)
            out[start : start + c] = offset + pos // size
            offset += -(-c // size)
            start += c
        run._cache[_BATCH] = out
    return run._cache[_BATCH]


def schedule_arrays(run: Run) -> None:
    """Compute the schedule data and step cost on the whole log (before it is cut into parts):
    a part's loops shared their steps with loops of other parts."""
    turns(run)
    batch_ids(run)
    step_cost(run)


def step_cost(run: Run) -> StepCost:
    """``fit_step_cost`` once per Run (kept by the parts cut from it)."""
    if _COST not in run._cache:
        run._cache[_COST] = fit_step_cost(run)  # type: ignore[assignment]
    return run._cache[_COST]  # type: ignore[return-value]


def _schedule(run: Run) -> str | None:
    sched = run.config.get("schedule")
    return (
        str(sched) if sched in ("batched", "pipelined") and run.config.get("batch_size") else None
    )


def _max_loops(run: Run) -> int:
    return int(run.config.get("max_agent_loops") or 32)


def _inverse_occupancy_batched(t: np.ndarray, batch: np.ndarray) -> np.ndarray:
    """sum over each loop's steps of 1/(loops in the step), loops of a batch starting together."""
    out = np.zeros(len(t))
    for b in np.unique(batch):
        members = np.flatnonzero(batch == b)
        tb = t[members].astype(np.int64)
        if tb.max(initial=0) == 0:
            continue
        steps = np.arange(tb.max())
        occ = (tb[:, None] > steps[None, :]).sum(axis=0)
        cum = np.concatenate([[0.0], np.cumsum(1.0 / occ)])
        out[members] = cum[tb]
    return out


def continuous_schedule(t: np.ndarray, max_loops: int) -> tuple[int, np.ndarray]:
    """Replay continuous batching: (steps, sum of 1/occupancy over each loop's steps).

    Loops are admitted in the given order as slots free; each step advances every loop in flight.
    """
    t = np.asarray(t, dtype=np.int64)
    idx = np.flatnonzero(t > 0)
    if idx.size == 0:
        return 0, np.zeros(len(t))
    slots = [0] * min(max_loops, idx.size)
    heapq.heapify(slots)
    start = np.zeros(len(t), dtype=np.int64)
    for i in idx:
        s = heapq.heappop(slots)
        start[i] = s
        heapq.heappush(slots, s + int(t[i]))
    steps = max(slots)
    delta = np.zeros(steps + 1)
    np.add.at(delta, start[idx], 1.0)
    np.add.at(delta, start[idx] + t[idx], -1.0)
    occ = np.cumsum(delta)[:steps]
    cum = np.concatenate([[0.0], np.cumsum(1.0 / np.maximum(occ, 1.0))])
    inv = np.zeros(len(t))
    inv[idx] = cum[start[idx] + t[idx]] - cum[start[idx]]
    return steps, inv


def fit_step_cost(run: Run) -> StepCost:
    """Fit the step cost to the run's logged agent shares (GPU-time model when it cannot)."""
    sched = _schedule(run)
    agent_t = run.timings.get("agent", np.full(run.n, np.nan))
    t = turns(run)
    ok = np.isfinite(agent_t) & (t > 0)
    if sched is None or ok.sum() < 3:
        why = "no schedule in the run's config" if sched is None else "too few agent timings"
        return StepCost(0.0, 0.0, "gpu-time", 0, False, f"{GPU_TIME} ({why})")
    t_ok = np.where(ok, t, 0)
    if sched == "batched":
        inv = _inverse_occupancy_batched(t_ok, batch_ids(run))
        how = "loops of a batch start together"
    else:
        inv = continuous_schedule(t_ok, _max_loops(run))[1]
        how = f"continuous batching of {_max_loops(run)} loops, admitted in log order"
    mean_inv = inv[ok] / t[ok]  # 1 / (harmonic mean of the loops in each loop's steps)
    if np.std(mean_inv) <= MIN_OCCUPANCY_SPREAD * np.mean(mean_inv):
        # Every loop saw the same occupancy (e.g. one turn each in full batches): the two
        # columns are proportional, so any split of fixed vs per-loop fits equally well.
        why = (
            "every agent step held the same number of loops, so fixed and per-loop cost "
            "cannot be told apart"
        )
        return StepCost(0.0, 0.0, "gpu-time", 0, False, f"{GPU_TIME} ({why})")
    x = np.column_stack([inv[ok], t[ok]])
    y = agent_t[ok]
    coef = _nnls2(x, y)
    pred = x @ coef
    resid = float(np.sqrt(np.mean((pred - y) ** 2)) / max(np.mean(y), 1e-12))
    return StepCost(float(coef[0]), float(coef[1]), sched, _max_loops(run), True, how, resid)


def _nnls2(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with two non-negative coefficients (the optimum is interior or on an axis)."""
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    if np.all(coef >= 0):
        return coef
    best, best_err = np.zeros(2), float(np.sum(y**2))
    for j in range(2):
        col = x[:, j]
        denom = float(col @ col)
        c = max(float(col @ y) / denom, 0.0) if denom > 0 else 0.0
        err = float(np.sum((y - c * col) ** 2))
        if err < best_err:
            best, best_err = np.eye(2)[j] * c, err
    return best


def agent_wall(run: Run, keep: np.ndarray, cost: StepCost) -> np.ndarray:
    """Agent seconds when only the loops in ``keep`` run: keep is (n,) or (n, settings) bool."""
    keep = np.asarray(keep, dtype=bool)
    one = keep.ndim == 1
    keep2 = keep[:, None] if one else keep
    agent_t = run.timings.get("agent", np.full(run.n, np.nan))
    if not cost.fitted:
        if np.all(np.isnan(agent_t)):
            out = np.full(keep2.shape[1], np.nan)
        else:
            filled = np.where(np.isnan(agent_t), np.nanmean(agent_t), agent_t)
            out = filled @ keep2
        return out[0] if one else out
    t = turns(run)
    tk = np.where(keep2, t[:, None], 0.0)
    if cost.schedule == "batched":
        batch = batch_ids(run)
        order = np.argsort(batch, kind="stable")
        starts = np.flatnonzero(np.r_[True, np.diff(batch[order]) != 0])
        steps = np.maximum.reduceat(tk[order], starts, axis=0).sum(axis=0)
    else:
        steps = np.array(
            [continuous_schedule(tk[:, j], cost.max_loops)[0] for j in range(tk.shape[1])],
            dtype=np.float64,
        )
    out = cost.fixed * steps + cost.per_loop * tk.sum(axis=0)
    return out[0] if one else out


def measured_agent_wall(run: Run) -> float:
    """The run's own agent seconds: the logged shares add up to the batched steps' wall time."""
    agent_t = run.timings.get("agent", np.full(run.n, np.nan))
    return float(np.nansum(agent_t)) if np.any(np.isfinite(agent_t)) else math.nan
