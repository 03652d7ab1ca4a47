"""Replay the cascade offline: any per-stage thresholds over a ``both`` run that logged every stage.

Stages, in cascade order: ``small@0`` (the speculative answer), ``small@1`` .. ``small@n`` (the
small model after d light tool calls) and ``large_direct`` (the large model answering from the
full image without tools); the agent loop takes every query no stage accepted. A ``both`` run
logs every stage for every query in ``samples.jsonl`` (``"stages": [{"stage", "answer",
"confidence", "accepted", "seconds", "tool_calls", "correct"}, ...]``); the single-stage fields of
earlier runs (``small_answer``, ``confidence``, ``small_correct``, the ``small`` timing) are stage
``small@0`` wherever the list does not hold it.

Routing: a query visits the stages it is eligible for in order and is accepted at the first one
whose confidence is > its threshold (``gate.accept``: strict, NaN never). Eligibility
(``stage_eligible``): ``small@0`` decides only on queries the judge sent tool-free (as in the
two-stage funnel; every query when no judge decision is logged); the later stages decide on
every query, judged "tools needed" or not.

Timing model, as ``regate`` for one stage (one source: ``regate.phase_times``,
``regate.speedup_model``, ``occupancy.agent_wall``): every query's judge seconds, plus the logged
seconds of each stage it visits (it visits a stage when eligible and no earlier stage accepted
it; a stage's seconds are its own, beyond the stages before it), plus the agent phase's wall time
for the loops the routing keeps, replayed on the run's schedule. Speedup = agent-only agent wall
/ replayed total. Numbers replayed for thresholds chosen on the same queries are in-sample.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from speceyes.bench import occupancy
from speceyes.bench import regate as rg
from speceyes.bench.ltt import NO_TAU
from speceyes.bench.runlog import Run

SMALL0 = "small@0"
LARGE_DIRECT = "large_direct"
AGENT = "agent"  # the route of a query no stage accepted
_SMALL_DEPTH = re.compile(r"^small@(\d+)$")

# (accepted stage (n, T), thresholds (T, S)) -> seconds per setting (T,)
CostFn = Callable[[np.ndarray, np.ndarray], np.ndarray]


def stage_sort_key(name: str) -> tuple[int, int]:
    """Cascade order: small@0, small@1, ..., then large_direct."""
    m = _SMALL_DEPTH.match(name)
    if m:
        return (0, int(m.group(1)))
    if name == LARGE_DIRECT:
        return (1, 0)
    raise ValueError(f"unknown cascade stage {name!r}: expected small@<depth> or {LARGE_DIRECT}")


def ordered_stages(names: Sequence[str]) -> tuple[str, ...]:
    return tuple(sorted(dict.fromkeys(names), key=stage_sort_key))


def stage_eligible(stage: str, judge_tool: np.ndarray) -> np.ndarray:
    """Which queries a stage decides on: small@0 only those judged tool-free (all when no judge
    decision is logged); every later stage all queries."""
    jt = np.asarray(judge_tool, dtype=np.float64)
    if stage == SMALL0 and not np.all(np.isnan(jt)):
        return jt == 0
    return np.ones(len(jt), dtype=bool)


@dataclass(frozen=True)
class CascadeLog:
    """Per-query, per-stage arrays of a cascade log (columns in ``stages`` order)."""

    stages: tuple[str, ...]
    conf: np.ndarray  # (n, S) confidence, NaN where the stage logged none
    wrong: np.ndarray  # (n, S) bool: the stage's answer is wrong or unscored (conservative)
    eligible: np.ndarray  # (n, S) bool: the stage decides on this query (``stage_eligible``)
    seconds: np.ndarray  # (n, S) the stage's own seconds (0 where it did not run; an entry
    # without seconds: the stage's mean)
    judge_seconds: np.ndarray  # (n,)
    agent_seconds: np.ndarray  # (n,) NaN everywhere when no agent time was logged
    agent_correct: np.ndarray  # (n,) bool
    categories: np.ndarray  # (n,) str

    @property
    def n(self) -> int:
        return len(self.judge_seconds)

    def subset(self, idx: np.ndarray) -> CascadeLog:
        return CascadeLog(
            self.stages,
            self.conf[idx],
            self.wrong[idx],
            self.eligible[idx],
            self.seconds[idx],
            self.judge_seconds[idx],
            self.agent_seconds[idx],
            self.agent_correct[idx],
            self.categories[idx],
        )


def _stage_entries(sample: dict[str, Any]) -> dict[str, dict[str, Any]]:
    entries = sample.get("stages") or []
    return {str(e["stage"]): e for e in entries if isinstance(e, dict) and e.get("stage")}


def logged_stages(run: Run) -> tuple[str, ...]:
    """The stages a run logged, in cascade order (small@0 wherever a small answer was logged)."""
    names = {name for s in run.samples for name in _stage_entries(s)}
    if run.has_small.any():
        names.add(SMALL0)
    if not names:
        raise ValueError(f"{run.path}: no stage answers logged")
    return ordered_stages(sorted(names))


def cascade_log(run: Run, stages: Sequence[str] | None = None) -> CascadeLog:
    """The run's per-stage arrays (cached on the Run); ``stages`` defaults to every logged one."""
    names = logged_stages(run) if stages is None else ordered_stages(stages)
    key = ("cascade", names)
    if key in run._cache:
        return run._cache[key]  # type: ignore[return-value]
    rg.check_replayable(run)
    n, s_count = run.n, len(names)
    conf = np.full((n, s_count), np.nan)
    correct = np.full((n, s_count), np.nan)
    seconds = np.full((n, s_count), np.nan)
    entries = [_stage_entries(s) for s in run.samples]
    small0_conf = rg.confidences(run)  # from the logged top-K at the run's gate setting
    t = rg.phase_times(run)
    for j, name in enumerate(names):
        for i, e in enumerate(entries):
            entry = e.get(name)
            if entry is not None:
                conf[i, j] = _number(entry.get("confidence"))
                correct[i, j] = _number(entry.get("correct"))
                seconds[i, j] = _number(entry.get("seconds"))
            elif name == SMALL0:
                conf[i, j] = small0_conf[i]
                correct[i, j] = run.small_correct[i]
                seconds[i, j] = t.small[i]
            else:  # the stage did not run for it (its small loop ended earlier): no answer
                seconds[i, j] = 0.0
        col = seconds[:, j]
        seconds[:, j] = np.where(
            np.isnan(col), np.nanmean(col) if np.any(~np.isnan(col)) else 0.0, col
        )
    eligible = np.column_stack([stage_eligible(name, run.judge_tool) for name in names])
    log = CascadeLog(
        stages=names,
        conf=conf,
        wrong=~rg.known_correct(correct),
        eligible=eligible,
        seconds=seconds,
        judge_seconds=t.judge,
        agent_seconds=t.agent,
        agent_correct=rg.known_correct(run.agent_correct),
        categories=run.categories,
    )
    run._cache[key] = log  # type: ignore[assignment]
    return log


def _number(value: Any) -> float:
    if value is None or isinstance(value, str):
        return math.nan
    value = float(value)
    return value if math.isfinite(value) else math.nan


# ---------------------------------------------------------------------------- routing


def tau_matrix(stages: Sequence[str], taus: Mapping[str, float] | np.ndarray) -> np.ndarray:
    """(T, S) thresholds: one mapping (a missing stage accepts nothing) or an array."""
    if isinstance(taus, Mapping):
        unknown = sorted(set(taus) - set(stages))
        if unknown:
            raise ValueError(f"thresholds for stages the log does not hold: {', '.join(unknown)}")
        return np.array([[float(taus.get(s, np.inf)) for s in stages]])
    arr = np.atleast_2d(np.asarray(taus, dtype=np.float64))
    if arr.shape[1] != len(stages) or np.any(np.isnan(arr)):
        raise ValueError(f"thresholds must be (settings, {len(stages)}) numbers")
    return arr


def _settings(taus: np.ndarray) -> np.ndarray:
    """Thresholds as (1 or n, T, S): (T, S) is one row per setting for every query; (n, T, S)
    thresholds that differ per query (per category)."""
    taus = np.asarray(taus, dtype=np.float64)
    return taus if taus.ndim == 3 else np.atleast_2d(taus)[None]


def accepted_stage(log: CascadeLog, taus: np.ndarray) -> np.ndarray:
    """(n, T) index of the stage that accepts each query at each setting, -1: the agent.
    ``taus`` is (T, S), or (n, T, S) (``_settings``)."""
    th = _settings(taus)
    conf = np.nan_to_num(log.conf, nan=-np.inf)  # NaN never passes (gate.accept)
    out = np.full((log.n, th.shape[1]), -1, dtype=np.int64)
    for j in range(len(log.stages)):
        passes = log.eligible[:, j : j + 1] & (conf[:, j : j + 1] > th[:, :, j])
        out = np.where((out < 0) & passes, j, out)
    return out


def visited(log: CascadeLog, stage_idx: np.ndarray, taus: np.ndarray) -> np.ndarray:
    """(n, S, T) bool: the stage ran for the query: it is in the cascade (a threshold below
    NO_TAU; one at NO_TAU accepts nothing, so the cascade skips it), the query is eligible and
    no earlier stage accepted it. ``taus`` as for ``accepted_stage``."""
    s = np.arange(len(log.stages))[None, :, None]
    not_yet = (stage_idx[:, None, :] < 0) | (stage_idx[:, None, :] >= s)
    runs = np.swapaxes(_settings(taus) < NO_TAU, 1, 2)  # (1 or n, S, T)
    return log.eligible[:, :, None] & not_yet & runs


def accepted_wrong(log: CascadeLog, stage_idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per setting: (answers accepted by any stage, of them wrong)."""
    acc = stage_idx >= 0
    rows = np.arange(log.n)[:, None]
    wrong = acc & log.wrong[rows, np.maximum(stage_idx, 0)]
    return acc.sum(axis=0), wrong.sum(axis=0)


def stage_mix(log: CascadeLog, taus: np.ndarray, idx: np.ndarray) -> dict[str, Any]:
    """What one threshold vector does, in the simulator's terms: ``beta``, the share the judge
    sent tool-free (1.0 without judge decisions), and ``accept``, each stage's acceptance among
    the queries that reached it, for the stages that are on (a stage at NO_TAU is skipped, and
    absent). ``taus`` (S,), ``idx`` (n,): the stage accepting each query."""
    taus, idx = np.asarray(taus, dtype=np.float64), np.asarray(idx)
    beta = float(log.eligible[:, log.stages.index(SMALL0)].mean()) if SMALL0 in log.stages else 1.0
    ran = visited(log, idx[:, None], taus[None, :])[:, :, 0]  # (n, S)
    accept = {}
    for j, stage in enumerate(log.stages):
        if taus[j] >= NO_TAU:
            continue
        reached = int(ran[:, j].sum())
        accept[stage] = float(np.sum(idx == j) / reached) if reached else 0.0
    return {"beta": beta, "accept": accept}


def gpu_time_cost(log: CascadeLog) -> CostFn:
    """Cost of a routing with agent seconds summed over the loops kept (the GPU-time model)."""
    agent = np.where(np.isnan(log.agent_seconds), np.nanmean(log.agent_seconds), log.agent_seconds)

    def cost(stage_idx: np.ndarray, taus: np.ndarray) -> np.ndarray:
        stage_s = np.einsum("nst,ns->t", visited(log, stage_idx, taus), log.seconds)
        return log.judge_seconds.sum() + stage_s + agent @ (stage_idx < 0)

    return cost


def run_cost(run: Run, log: CascadeLog) -> tuple[CostFn, float]:
    """(cost of a routing, agent-only cost) under regate's timing model for this run."""
    step = rg.speedup_model(run)

    def cost(stage_idx: np.ndarray, taus: np.ndarray) -> np.ndarray:
        stage_s = np.einsum("nst,ns->t", visited(log, stage_idx, taus), log.seconds)
        return log.judge_seconds.sum() + stage_s + occupancy.agent_wall(run, stage_idx < 0, step)

    return cost, float(occupancy.agent_wall(run, np.ones(run.n, bool), step))


# ---------------------------------------------------------------------------- the replay


@dataclass(frozen=True)
class StageRow:
    """One stage's outcome under the replayed thresholds."""

    stage: str
    tau: float
    reached: int  # queries that visited the stage
    accepted: int
    acceptance: float  # accepted / reached (NaN when none reached)
    accuracy: float  # of the stage's answers on the queries that reached it
    accepted_error: float  # error among its accepted answers (NaN when none)
    seconds: float  # summed seconds of the stage over the queries that visited it


@dataclass(frozen=True)
class CascadeReplay:
    taus: dict[str, float]
    n: int
    stages: list[StageRow]
    routes: dict[str, int]  # stage (or "agent") -> queries it answered
    accuracy: float
    agent_only_accuracy: float
    accepted: int
    accepted_error: float  # error among all accepted answers together
    per_category: dict[str, float] = field(default_factory=dict)  # accuracy per category
    time_per_query: float = math.nan
    speedup: float = math.nan  # agent-only cost / replayed cost
    speedup_model: str = ""


def replay_cascade(
    run: Run,
    taus: Mapping[str, float],
    category_taus: Mapping[str, Mapping[str, float]] | None = None,
) -> CascadeReplay:
    """The cascade at the given per-stage thresholds (a stage without one is not run);
    ``category_taus`` replaces them for the queries of the categories it names."""
    log = cascade_log(run)
    per_query = np.repeat(tau_matrix(log.stages, taus), log.n, axis=0)  # (n, S)
    for cat, ctaus in (category_taus or {}).items():
        per_query[log.categories == cat] = tau_matrix(log.stages, ctaus)[0]
    return summarize(run, log, per_query, dict(taus))


def summarize(
    run: Run, log: CascadeLog, per_query_taus: np.ndarray, taus: dict[str, float]
) -> CascadeReplay:
    """The replay's numbers at per-query thresholds (n, S); ``taus`` is what the rows report."""
    n = log.n
    th = per_query_taus[:, None, :]
    idx2 = accepted_stage(log, th)
    stage_idx = idx2[:, 0]
    vis = visited(log, idx2, th)[:, :, 0]
    rows = []
    for j, name in enumerate(log.stages):
        reached = vis[:, j]
        acc = stage_idx == j
        n_r, n_a = int(reached.sum()), int(acc.sum())
        rows.append(
            StageRow(
                stage=name,
                tau=float(taus.get(name, math.inf)),
                reached=n_r,
                accepted=n_a,
                acceptance=n_a / n_r if n_r else math.nan,
                accuracy=float(np.mean(~log.wrong[reached, j])) if n_r else math.nan,
                accepted_error=float(np.mean(log.wrong[acc, j])) if n_a else math.nan,
                seconds=float(log.seconds[reached, j].sum()),
            )
        )
    accepted = stage_idx >= 0
    answer_wrong = log.wrong[np.arange(n), np.maximum(stage_idx, 0)]
    correct = np.where(accepted, ~answer_wrong, log.agent_correct)
    cost_fn, agent_only = run_cost(run, log)
    cost = float(cost_fn(idx2, th)[0])
    n_acc, n_wrong = int(accepted.sum()), int((accepted & answer_wrong).sum())
    routes = {name: int(np.sum(stage_idx == j)) for j, name in enumerate(log.stages)}
    routes[AGENT] = int(np.sum(~accepted))
    cats = sorted(set(log.categories.tolist()))
    return CascadeReplay(
        taus=taus,
        n=n,
        stages=rows,
        routes=routes,
        accuracy=float(correct.mean()) if n else math.nan,
        agent_only_accuracy=float(log.agent_correct.mean()) if n else math.nan,
        accepted=n_acc,
        accepted_error=n_wrong / n_acc if n_acc else math.nan,
        per_category={c: float(correct[log.categories == c].mean()) for c in cats},
        time_per_query=cost / n if n else math.nan,
        speedup=agent_only / cost if cost > 0 and math.isfinite(agent_only) else math.nan,
        speedup_model=rg.speedup_model(run).describe(),
    )


def parse_stage_taus(text: str) -> dict[str, float]:
    """'small@0=0.9,small@1=0.85,large_direct=0.95' -> {stage: tau}."""
    out: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"expected stage=tau, got {part!r}")
        stage_sort_key(name.strip())  # raises on an unknown stage name
        out[name.strip()] = float(value)
    if not out:
        raise ValueError("give at least one stage=tau")
    return out


def _fmt(x: float, spec: str) -> str:
    return "-" if x is None or not math.isfinite(x) else format(x, spec)


def format_replay(r: CascadeReplay) -> str:
    """Markdown: one row per stage, then the cascade's totals."""
    head = "| stage | tau | reached | accepted | acceptance | stage acc. % | acc. err % | seconds |"
    lines = [head, "|" + "---|" * 8]
    for s in r.stages:
        lines.append(
            f"| {s.stage} | {_fmt(s.tau, '.4g')} | {s.reached} | {s.accepted} | "
            f"{_fmt(s.acceptance, '.3f')} | {_fmt(100 * s.accuracy, '.2f')} | "
            f"{_fmt(100 * s.accepted_error, '.2f')} | {_fmt(s.seconds, '.1f')} |"
        )
    routes = ", ".join(f"{k} {v}" for k, v in r.routes.items())
    lines += [
        "",
        f"routes: {routes} (of {r.n})",
        f"accuracy {_fmt(100 * r.accuracy, '.2f')}% (agent-only {_fmt(100 * r.agent_only_accuracy, '.2f')}%); "
        f"error among all {r.accepted} accepted answers {_fmt(100 * r.accepted_error, '.2f')}%",
        f"replayed {_fmt(r.time_per_query, '.3f')} s/query, speedup {_fmt(r.speedup, '.2f')}x "
        "against agent-only",
    ]
    if r.per_category:
        lines.append(
            "accuracy per category: "
            + ", ".join(f"{c} {_fmt(100 * v, '.2f')}%" for c, v in r.per_category.items())
        )
    lines.append(f"speedup model: {r.speedup_model}")
    return "\n".join(lines) + "\n"
