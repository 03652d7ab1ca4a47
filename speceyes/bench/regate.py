"""Re-gate a logged run offline: replay the funnel at any (tau, K, aggregation).

A ``both`` run logs, for every query, the judge decision, the small answer with its top-K logits
and the agent answer, so the funnel's routing can be replayed for any gate setting without a
model. Routing (the SpecEyes funnel, arXiv 2603.23483): judge says tools -> agent ("agent_after_judge"); else accept
the small answer iff confidence > tau ("small"), else agent ("agent_after_gate").

Timing model: judge time of every query, plus the small model's time on the queries judged
tool-free (logged per query; a phase missing for a query falls back to the run's mean), plus the
agent phase's wall time for the loops the routing keeps. The agent phase is replayed on the run's
own schedule with a step cost fitted to its logged times (``occupancy``): after routing fewer
loops share each batched step, which saves less than their summed per-query shares. Runs that do
not log their schedule fall back to summing the shares (GPU time; the assumption is stated by
``speedup_model``). Estimated speedup = agent-only agent wall / replayed total. The analytic form
E[L] = c_J + beta*c_S + (1 - beta*alpha)*L_agent (per-query means) is reported alongside.

Every number replayed from a run is in-sample for whatever was chosen by looking at it: pick
K, aggregation or tau on one part of a run (``splits``) and measure on another.

Confidences are computed once per (K, aggregation, sigmoid scale) through ``gate.batch_confidence``
and cached on the Run; a tau sweep is then one sort plus cumulative sums, O((n + T) log n).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from speceyes import gate
from speceyes.bench import occupancy
from speceyes.bench.runlog import Run
from speceyes.rates import analytic_latency

ROUTE_SMALL = "small"
ROUTE_JUDGE = "agent_after_judge"
ROUTE_GATE = "agent_after_gate"


@dataclass(frozen=True)
class RegateRow:
    """The funnel's outcome at one gate setting, replayed from a log."""

    tau: float
    top_k: int
    agg: str
    n: int
    beta: float  # share of queries the judge sends to the small model
    alpha: float  # acceptance rate among those (NaN when beta is 0)
    accuracy: float
    per_category: dict[str, float] = field(default_factory=dict)
    small_share: float = 0.0  # beta * alpha: share answered by the small model
    accepted_error: float = float("nan")  # error rate among accepted small answers
    speedup: float = float("nan")  # sum(agent-only cost) / sum(replayed cost)
    time_per_query: float = float("nan")  # replayed seconds per query
    analytic_time_per_query: float = float("nan")  # c_J + beta*c_S + (1 - beta*alpha)*L_agent
    analytic_speedup: float = float("nan")  # L_agent / analytic time
    scale: float = gate.DEFAULT_SCALE  # the gate's sigmoid scale


@dataclass(frozen=True)
class GateSetting:
    top_k: int
    agg: str
    scale: float


@dataclass(frozen=True)
class PhaseTimes:
    """Per-query seconds per phase, gaps filled with the run's phase mean."""

    judge: np.ndarray
    small: np.ndarray
    agent: np.ndarray  # NaN everywhere when no agent time was logged at all


@dataclass(frozen=True)
class Replay:
    """Per-query outcome of one gate setting."""

    tau: float
    accepted: np.ndarray  # bool
    routes: np.ndarray  # str: small / agent_after_judge / agent_after_gate
    correct: np.ndarray  # bool
    cost: np.ndarray  # seconds under the timing model


def resolve_gate(
    run: Run, top_k: int | None = None, agg: str | None = None, scale: float | None = None
) -> GateSetting:
    """The gate setting to replay: explicit values, else the run's own."""
    k = run.top_k if top_k is None else int(top_k)
    a = run.agg if agg is None else str(agg)
    if a not in gate.AGGREGATIONS:
        raise ValueError(f"unknown aggregation {a!r}; choose from {', '.join(gate.AGGREGATIONS)}")
    if k < 2:
        raise ValueError("top_k must be at least 2 (the top value and one competitor)")
    if run.k_logged and k > run.k_logged:
        raise ValueError(
            f"top_k={k} is larger than the {run.k_logged} logits logged per token in {run.path}; "
            f"re-gate with top_k <= {run.k_logged} or re-run eval logging more"
        )
    return GateSetting(k, a, run.scale if scale is None else float(scale))


def confidences(
    run: Run, top_k: int | None = None, agg: str | None = None, scale: float | None = None
) -> np.ndarray:
    """Confidence of every sample's small answer (NaN where none), cached per gate setting."""
    g = resolve_gate(run, top_k, agg, scale)
    key = ("confidence", g.top_k, g.agg, g.scale)
    if key not in run._cache:
        out = np.full(run.n, np.nan)
        idx = np.flatnonzero(run.has_small)
        if idx.size:
            answers = [run.small_topk[i] for i in idx]
            out[idx] = gate.batch_confidence(answers, top_k=g.top_k, agg=g.agg, scale=g.scale)  # type: ignore[arg-type]
        run._cache[key] = out
    return run._cache[key]


def check_replayable(run: Run) -> None:
    """Raise a clear error unless every query has what any gate setting could route it to."""
    if run.n == 0:
        raise ValueError(f"cannot re-gate {run.path}: the log has no samples")
    ok = ~run.is_error
    problems = []
    if (no_judge := int(np.sum(ok & np.isnan(run.judge_tool)))) > 0:
        problems.append(f"{no_judge} without a judge decision")
    if (no_agent := int(np.sum(ok & ~run.has_agent))) > 0:
        problems.append(f"{no_agent} without an agent answer")
    tool_free = run.judge_tool == 0
    if (no_small := int(np.sum(ok & tool_free & ~run.has_small))) > 0:
        problems.append(f"{no_small} judged tool-free without the small answer's top-K")
    if problems:
        raise ValueError(
            f"cannot re-gate {run.path} (mode {run.mode!r}): of {run.n} queries, "
            + ", ".join(problems)
            + ". Re-gating needs a `speceyes eval --mode both` run, which logs the judge, the "
            "small answer with its top-K logits and the agent answer for every query."
        )


def phase_times(run: Run) -> PhaseTimes:
    """Per-query phase timings; a missing value takes the run's mean for that phase."""

    def filled(name: str, if_absent: float) -> np.ndarray:
        t = run.timings.get(name, np.full(run.n, np.nan))
        if np.all(np.isnan(t)):
            return np.full(run.n, if_absent)
        return np.where(np.isnan(t), np.nanmean(t), t)

    # Judge/small not logged at all: count them as free; agent unknown: no speedup estimate.
    return PhaseTimes(filled("judge", 0.0), filled("small", 0.0), filled("agent", np.nan))


def replay(
    run: Run,
    tau: float,
    top_k: int | None = None,
    agg: str | None = None,
    scale: float | None = None,
) -> Replay:
    """Per-query routes and correctness at one tau, decided by ``gate.accept``."""
    check_replayable(run)
    conf = confidences(run, top_k, agg, scale)
    tool_free = run.judge_tool == 0
    gate_ok = np.array([gate.accept(float(c), tau) for c in conf], dtype=bool)
    accepted = tool_free & gate_ok
    routes = np.where(tool_free, np.where(accepted, ROUTE_SMALL, ROUTE_GATE), ROUTE_JUDGE)
    sc, ac = known_correct(run.small_correct), known_correct(run.agent_correct)
    t = phase_times(run)
    cost = t.judge + np.where(tool_free, t.small, 0.0) + np.where(accepted, 0.0, t.agent)
    return Replay(float(tau), accepted, routes.astype(object), np.where(accepted, sc, ac), cost)


def known_correct(x: np.ndarray) -> np.ndarray:
    """Correctness as bool: unknown (errors, unscored) counts as wrong."""
    return np.nan_to_num(x, nan=0.0) > 0.5


def regate(
    run: Run,
    taus: Iterable[float],
    top_k: int | None = None,
    agg: str | None = None,
    scale: float | None = None,
) -> list[RegateRow]:
    """Replay the funnel at every tau (vectorised). ``scale`` is the sigmoid scale (default: run's)."""
    check_replayable(run)
    g = resolve_gate(run, top_k, agg, scale)
    taus_arr = _as_taus(taus)
    conf = confidences(run, g.top_k, g.agg, g.scale)
    tool_free = run.judge_tool == 0
    sc, ac = known_correct(run.small_correct), known_correct(run.agent_correct)
    t = phase_times(run)
    cats = run.category_names
    onehot = run.categories[:, None] == np.array(cats, dtype=object)[None, :]

    # Per accepted query: the change in correct answers, per category, and its error.
    gain = (sc.astype(float) - ac.astype(float))[:, None]
    columns = np.hstack([gain, gain * onehot, (~sc).astype(float)[:, None]])
    m, sums = sums_above(conf[tool_free], columns[tool_free], taus_arr)

    n, n_tf = run.n, int(tool_free.sum())
    cat_base = (ac[:, None] & onehot).sum(axis=0)
    per_cat = (cat_base[None, :] + sums[:, 1 : 1 + len(cats)]) / np.maximum(onehot.sum(axis=0), 1)
    step = speedup_model(run)
    keep = ~(tool_free[:, None] & (np.nan_to_num(conf, nan=-np.inf)[:, None] > taus_arr[None, :]))
    agent_total = occupancy.agent_wall(run, np.ones(n, bool), step)
    cost = t.judge.sum() + t.small[tool_free].sum() + occupancy.agent_wall(run, keep, step)
    beta = n_tf / n
    alpha_acc = m / n_tf if n_tf else np.full(len(m), np.nan)
    c_small = float(t.small[tool_free].mean()) if n_tf else float(t.small.mean())
    analytic = analytic_latency(t.judge.mean(), c_small, t.agent.mean(), beta, alpha_acc)
    with np.errstate(divide="ignore", invalid="ignore"):  # nothing accepted / no agent time
        accepted_error = np.where(m > 0, sums[:, -1] / m, np.nan)
        speedup = np.where(cost > 0, agent_total / cost, np.nan)
        analytic_speedup = np.where(analytic > 0, t.agent.mean() / analytic, np.nan)
    return [
        RegateRow(
            tau=float(tau),
            top_k=g.top_k,
            agg=g.agg,
            n=n,
            beta=beta,
            alpha=float(alpha_acc[j]),
            accuracy=float((ac.sum() + sums[j, 0]) / n),
            per_category={c: float(per_cat[j, i]) for i, c in enumerate(cats)},
            small_share=float(m[j] / n),
            accepted_error=float(accepted_error[j]),
            speedup=float(speedup[j]),
            time_per_query=float(cost[j] / n),
            analytic_time_per_query=float(analytic[j]),
            analytic_speedup=float(analytic_speedup[j]),
            scale=g.scale,
        )
        for j, tau in enumerate(taus_arr)
    ]


def speedup_model(run: Run) -> occupancy.StepCost:
    """The agent-phase cost model regate uses for this run (see ``occupancy``)."""
    return occupancy.step_cost(run)


def _as_taus(taus: Iterable[float]) -> np.ndarray:
    arr = np.atleast_1d(np.asarray(list(taus) if not isinstance(taus, np.ndarray) else taus))
    arr = arr.astype(np.float64)
    if arr.size == 0:
        raise ValueError("give at least one tau")
    if np.any(np.isnan(arr)):
        raise ValueError("tau must not be NaN")
    return arr


def sums_above(
    conf: np.ndarray, columns: np.ndarray, taus: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """For each tau: number of samples with conf > tau (strict, as the gate) and column sums.

    One sort, then suffix sums read at searchsorted positions; NaN confidences never pass.
    """
    finite = ~np.isnan(conf)
    c, cols = conf[finite], columns[finite]
    order = np.argsort(c, kind="stable")
    ascending = c[order]
    top_first = cols[order][::-1]
    cum = np.vstack([np.zeros((1, cols.shape[1])), np.cumsum(top_first, axis=0)])
    m = len(ascending) - np.searchsorted(ascending, taus, side="right")
    return m, cum[m]


def acceptance(
    run: Run,
    taus: Iterable[float],
    top_k: int | None = None,
    agg: str | None = None,
    scale: float | None = None,
) -> tuple[float, np.ndarray]:
    """(beta, alpha per tau) from judge decisions and small confidences only (no agent needed).

    Works on a speceyes-mode run too, since the small model ran on every judged tool-free query.
    """
    taus_arr = _as_taus(taus)
    known = ~np.isnan(run.judge_tool)
    tool_free = run.judge_tool == 0
    if not known.any():
        raise ValueError(f"{run.path}: no judge decisions logged (mode {run.mode!r})")
    n_tf = int(tool_free.sum())
    conf = confidences(run, top_k, agg, scale)
    m, _ = sums_above(conf[tool_free], np.zeros((n_tf, 1)), taus_arr)
    alpha_acc = m / n_tf if n_tf else np.full(len(taus_arr), np.nan)
    return n_tf / int(known.sum()), alpha_acc


def default_taus() -> np.ndarray:
    """A grid dense near 1, where min-aggregated confidences live (tau 0.98 = aggregate 6.49)."""
    return np.unique(np.concatenate([np.linspace(0.0, 0.9, 46), 1.0 - np.geomspace(1e-4, 0.1, 60)]))


def in_sample_note(run: Run, n_rows: int) -> str:
    """What the replayed numbers are worth: in-sample for anything chosen by looking at them."""
    from speceyes.bench.splits import part_label

    where = part_label(run) or "the whole run"
    lines = [
        f"In-sample: all {n_rows} rows are measured on the same {run.n} queries ({where}). "
        "A tau, K or aggregation picked from them is not validated by them: calibrate it on "
        "another part (speceyes calibrate RUN --split sweep:calib:test) and read the held-out "
        "numbers there.",
        f"Speedup model: {speedup_model(run).describe()}.",
    ]
    return "\n".join(lines)


def _fmt(x: float, spec: str = ".4f") -> str:
    return "-" if x is None or np.isnan(x) else format(x, spec)


def _fmt_speedup(x: float) -> str:
    return "-" if x is None or np.isnan(x) else f"{x:.2f}x"


def format_table(rows: Sequence[RegateRow]) -> str:
    """Markdown table of re-gating rows (accuracies in percent)."""
    cats = sorted({c for r in rows for c in r.per_category})
    head = ["tau", "K", "agg", "beta", "alpha", "small share", "acc %"]
    head += [f"{c} %" for c in cats] + ["acc. err %", "speedup", "s/query", "analytic s/query"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [_fmt(r.tau, ".4g"), str(r.top_k), r.agg, _fmt(r.beta, ".3f"), _fmt(r.alpha, ".3f")]
        cells += [_fmt(r.small_share, ".3f"), _fmt(100 * r.accuracy, ".2f")]
        cells += [_fmt(100 * r.per_category.get(c, np.nan), ".2f") for c in cats]
        cells += [_fmt(100 * r.accepted_error, ".2f"), _fmt_speedup(r.speedup)]
        cells += [_fmt(r.time_per_query, ".3f"), _fmt(r.analytic_time_per_query, ".3f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
