"""Choose the gate threshold tau with a finite-sample guarantee (Learn then Test) on a logged run.

Goal (default): the error rate among ACCEPTED speculative answers is at most E, with probability
at least C over the calibration sample (delta = 1 - C). ``min_relative_accuracy=r`` instead keeps
the funnel's overall accuracy at tau at least r times agent-only accuracy. The tests themselves
(fixed sequence, exact binomial and empirical-Bernstein bounds) are in :mod:`speceyes.bench.ltt`;
the file this writes, and the check that a setup matches it, in
:mod:`speceyes.bench.calibration_file`. Here: a run to a ``Calibration`` (the gated population,
the family of top-K/aggregation configurations, held-out numbers, the queries a failed test would
need) and the report text.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from speceyes.bench import regate as rg
from speceyes.bench.calibration_file import (
    FORMAT_VERSION,
    Calibration,
    CalibrationSetup,
    check_calibration,
    check_setup,
    judge_words,
    read_calibration,
    recorded_setup,
    run_setup,
    setup_of,
    write_calibration,
)
from speceyes.bench.ltt import (
    NO_TAU,
    LttResult,
    LttScan,
    binom_pvalues,
    candidate_taus,
    choose_in_family,
    fixed_sequence_choice,
    ltt_max_error,
    ltt_relative_accuracy,
    min_accepted,
)
from speceyes.bench.runlog import Run
from speceyes.bench.splits import Split, split_run

# Re-exported: callers read and check calibration files through this module too.
__all__ = [
    "FORMAT_VERSION",
    "METHOD_MAX_ERROR",
    "METHOD_RELATIVE",
    "NO_TAU",
    "Calibration",
    "CalibrationSetup",
    "FamilyMember",
    "calibrate",
    "check_calibration",
    "check_setup",
    "format_calibration",
    "held_out_metrics",
    "read_calibration",
    "run_setup",
    "setup_of",
    "write_calibration",
]

METHOD_MAX_ERROR = "ltt-fixed-sequence-clopper-pearson"
METHOD_RELATIVE = "ltt-fixed-sequence-empirical-bernstein"
_EXACT_MAX = 20_000  # accepted counts up to which the n-needed estimate uses exact p-values
MIN_RATE_COUNT = 20  # accepted answers below which an observed error rate is not extrapolated


@dataclass(frozen=True)
class FamilyMember:
    """One gate configuration tested inside the family."""

    top_k: int
    agg: str
    result: LttResult


def calibrate(
    run: Run,
    max_error: float = 0.05,
    confidence: float = 0.9,
    *,
    top_k: int | Sequence[int] | None = None,
    agg: str | Sequence[str] | None = None,
    scale: float | None = None,
    taus: Sequence[float] | np.ndarray | None = None,
    min_relative_accuracy: float | None = None,
    n_grid: int = 200,
    start_rate: float = 0.5,
    holdout: Run | None = None,
    split: Split | None = None,
) -> Calibration:
    """Calibrate tau on a logged run (see the module doc for the guarantee).

    Several ``top_k`` / ``agg`` values form one family: each configuration is tested by fixed
    sequence at level delta / (number of configurations) (Bonferroni), and the passing one that
    accepts most is kept, so the guarantee holds for the chosen configuration. ``split``
    calibrates on its ``calib`` part and measures on its ``test`` part; ``holdout`` measures on
    another run of the same setup.
    """
    if split is not None and holdout is not None:
        raise ValueError("give either a split or a holdout run, not both")
    source = str(run.path)
    calib_run, test_run = run, holdout
    if split is not None:
        parts = split_run(run, split)
        calib_run, test_run = parts["calib"], parts["test"]
    if test_run is not None and holdout is not None:
        _check_holdout(run, holdout)
    ks = _as_list(top_k)
    aggs = _as_list(agg)
    configs = [rg.resolve_gate(calib_run, k, a, scale) for k in ks for a in aggs]
    delta = 1.0 - confidence
    family_delta = delta / len(configs)
    note = ""
    members: list[FamilyMember] = []
    for g in configs:
        conf = rg.confidences(calib_run, g.top_k, g.agg, g.scale)
        if min_relative_accuracy is not None:
            rg.check_replayable(calib_run)
            res = ltt_relative_accuracy(
                conf,
                calib_run.judge_tool == 0,
                rg.known_correct(calib_run.small_correct),
                rg.known_correct(calib_run.agent_correct),
                min_relative_accuracy,
                family_delta,
                taus,
                n_grid,
            )
        else:
            eligible, note = _gate_population(calib_run)
            # Unknown correctness (errors) among eligible answers counts as wrong: conservative.
            wrong = ~rg.known_correct(calib_run.small_correct[eligible])
            res = ltt_max_error(
                conf[eligible],
                wrong,
                max_error,
                family_delta,
                taus=taus,
                n_grid=n_grid,
                start_rate=start_rate,
            )
        members.append(FamilyMember(g.top_k, g.agg, res))
    chosen = members[max(choose_in_family([m.result for m in members]), 0)]
    g = rg.GateSetting(chosen.top_k, chosen.agg, configs[0].scale)
    res = chosen.result
    if min_relative_accuracy is not None:
        method, max_err, needed = METHOD_RELATIVE, None, None
    else:
        method, max_err = METHOD_MAX_ERROR, max_error
        needed = (
            None
            if res.passed
            else _needed_n(calib_run, configs, max_error, family_delta, start_rate)
        )
    if not res.passed:
        note = (note + " " if note else "") + "no candidate tau passed the test: accept nothing"
    acc, share, speed = _expectations(calib_run, res.tau, g)
    cfg = run.config
    return Calibration(
        tau=res.tau,
        top_k=g.top_k,
        agg=g.agg,
        scale=g.scale,
        max_error=max_err,
        confidence=confidence,
        method=method,
        n=res.n,
        n_accepted=res.n_accepted,
        n_queries=calib_run.n,
        bound=res.bound,
        expected_acceptance=acc,
        expected_small_share=share,
        expected_speedup=speed,
        min_relative_accuracy=min_relative_accuracy,
        candidates_tested=res.tested,
        passed=res.passed,
        source=source,
        note=note,
        **recorded_setup(cfg),
        family=[
            {
                "top_k": m.top_k,
                "agg": m.agg,
                "passed": m.result.passed,
                "tau": m.result.tau,
                "n_accepted": m.result.n_accepted,
                "delta": family_delta,
            }
            for m in members
        ],  # fmt: skip
        split=None if split is None else str(split),
        holdout=None if holdout is None else str(holdout.path),
        held_out=None if test_run is None else held_out_metrics(test_run, res.tau, g),
        needed_n=needed,
        speedup_model=rg.speedup_model(calib_run).describe(),
    )


def _as_list(x: Any) -> list:
    if x is None or isinstance(x, (str, int)):
        return [x]
    out = list(x)
    if not out:
        raise ValueError("give at least one top-K and one aggregation")
    return out


def _check_holdout(run: Run, holdout: Run) -> None:
    """The held-out run must come from the same setup and share no query with the calibration."""
    setup_a, setup_b = run_setup(run.config).to_dict(), run_setup(holdout.config).to_dict()
    for key in ("judge_mode", "judge_threshold"):
        setup_a[key], setup_b[key] = run.config.get(key), holdout.config.get(key)
    for key, a in setup_a.items():
        b = setup_b[key]
        # An unrecorded setting is not compared; the judge always is (None is the full view).
        if a != b and (key in ("judge", "judge_max_pixels") or (a is not None and b is not None)):
            raise ValueError(
                f"holdout {holdout.path} was made with another {key} ({b!r}, calibration run "
                f"{a!r}): its numbers would not describe this calibration"
            )
    shared = len(set(run.ids) & set(holdout.ids))
    if shared:
        raise ValueError(
            f"holdout {holdout.path} shares {shared} queries with {run.path}: not held out "
            "(use --split to cut one run into parts)"
        )


def held_out_metrics(run: Run, tau: float, g: rg.GateSetting) -> dict[str, Any]:
    """Accuracy, error among accepted answers and speedup at tau on queries not used to pick it."""
    conf = rg.confidences(run, g.top_k, g.agg, g.scale)
    eligible, _ = _gate_population(run)
    accepted = eligible & (np.nan_to_num(conf, nan=-np.inf) > tau)
    wrong = ~rg.known_correct(run.small_correct)
    n_acc = int(accepted.sum())
    out: dict[str, Any] = {
        "n": run.n,
        "n_accepted": n_acc,
        "accepted_error": float(wrong[accepted].mean()) if n_acc else None,
        "acceptance": float(n_acc / eligible.sum()) if eligible.any() else None,
    }
    try:
        row = rg.regate(run, [tau], g.top_k, g.agg, g.scale)[0]
    except ValueError:  # not a both run: no agent answers to replay accuracy with
        return out
    out |= {
        "accuracy": row.accuracy,
        "agent_only_accuracy": float(rg.known_correct(run.agent_correct).mean()),
        "small_share": row.small_share,
        "speedup": row.speedup,
    }
    return out


def _needed_n(
    run: Run,
    configs: list[rg.GateSetting],
    max_error: float,
    delta: float,
    start_rate: float = 0.5,
    max_queries: float = 1e7,
) -> int | None:
    """Queries a run would need for the test to pass if its error rates stayed as observed.

    The run is scaled by a factor c: every candidate's accepted count becomes c*m and its error
    rate (e + 1)/(m + 1) (one error added, so a handful of lucky answers does not promise a
    pass); the same fixed-sequence test then runs on those counts (exact p-values up to
    _EXACT_MAX accepted, a normal approximation beyond), from the first candidate with at least MIN_RATE_COUNT
    answers today (fewer say too little about a rate). Returns the smallest run size
    that passes for some configuration (to 1%), or None when none passes even with
    ``max_queries`` queries (more data would not help: run agent-only).
    """
    eligible, _ = _gate_population(run)
    wrong = ~rg.known_correct(run.small_correct[eligible])
    scans = []
    for g in configs:
        conf = rg.confidences(run, g.top_k, g.agg, g.scale)[eligible]
        m, sums = rg.sums_above(conf, wrong.astype(float)[:, None], candidate_taus(conf))
        scans.append((np.asarray(m, float), (sums[:, 0] + 1.0) / (np.asarray(m, float) + 1.0)))

    start = min_accepted(max_error, delta, start_rate, limit=10**7)
    sd = math.sqrt(max_error * (1.0 - max_error))

    def passes(c: float) -> bool:
        for m, rate in scans:
            mc = np.floor(m * c).astype(np.int64)
            ec = np.floor(rate * mc).astype(np.int64)
            if mc.max(initial=0) <= _EXACT_MAX:
                pvalues = binom_pvalues(ec, mc, max_error)
            else:  # normal approximation with continuity correction, at any size
                z = (ec + 0.5 - mc * max_error) / (sd * np.sqrt(np.maximum(mc, 1)))
                pvalues = 0.5 * np.vectorize(math.erfc)(-z / math.sqrt(2.0))
            testable = (mc >= start) & (m >= MIN_RATE_COUNT)
            if fixed_sequence_choice(LttScan(m, mc, ec, pvalues, testable), delta)[0] >= 0:
                return True
        return False

    if not passes(max_queries / max(run.n, 1)):
        return None
    lo, hi = 1.0, 2.0
    while not passes(hi):
        lo, hi = hi, hi * 2
    while hi / lo > 1.01:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if passes(mid) else (mid, hi)
    return int(math.ceil(hi * run.n))


def _gate_population(run: Run) -> tuple[np.ndarray, str]:
    """The queries the gate decides on: judged tool-free with a logged small answer."""
    if np.all(np.isnan(run.judge_tool)):
        return run.has_small.copy(), "no judge decisions logged: calibrated on all small answers"
    return (run.judge_tool == 0) & run.has_small, ""


def _expectations(run: Run, tau: float, g: rg.GateSetting):
    """(acceptance, small share, speedup) at tau on the calibration run, where data allows."""
    try:
        beta, alphas = rg.acceptance(run, [tau], g.top_k, g.agg, g.scale)
    except ValueError:
        conf = rg.confidences(run, g.top_k, g.agg, g.scale)
        pool = conf[run.has_small]
        acc = float(np.mean(pool > tau)) if pool.size else None
        return acc, None, None
    acc = float(alphas[0])
    try:
        rg.check_replayable(run)
    except ValueError:
        return acc, float(beta * acc), _analytic_speedup(run, beta, acc)
    row = rg.regate(run, [tau], g.top_k, g.agg, g.scale)[0]
    return acc, row.small_share, row.speedup


def _analytic_speedup(run: Run, beta: float, acc: float) -> float | None:
    t = rg.phase_times(run)
    l_agent = float(np.mean(t.agent))
    if not math.isfinite(l_agent):
        return None
    latency = rg.analytic_latency(
        float(np.mean(t.judge)), float(np.mean(t.small)), l_agent, beta, acc
    )
    return l_agent / latency if latency > 0 else None


def format_calibration(cal: Calibration) -> str:
    """The calibration in words: the guarantee, where each number was measured, what to do."""
    level = f"probability >= {cal.confidence:g}"
    if cal.method == METHOD_RELATIVE:
        claim = f"funnel accuracy >= {cal.min_relative_accuracy:g} x agent-only, with {level}"
    else:
        claim = f"error among accepted answers <= {cal.max_error:g}, with {level}"
    where = f"calibration part of split {cal.split}" if cal.split else "the calibration run"
    family = len(cal.family) or 1
    lines = [f"guarantee ({where}, n={cal.n} gated queries): {claim}"]
    if family > 1:
        tried = ", ".join(f"K={m['top_k']}/{m['agg']}" for m in cal.family)
        lines.append(
            f"family of {family} configurations ({tried}), each tested at delta/{family} "
            "(Bonferroni); the guarantee holds for the one kept"
        )
    if cal.passed:
        lines.append(
            f"tau = {cal.tau:.6f}  K={cal.top_k} agg={cal.agg} sigmoid scale={cal.scale:g}; "
            f"bound {cal.bound:.4f} on {cal.n_accepted} accepted ({cal.method})"
        )
        lines.append(
            f"valid with {judge_words(cal.judge, cal.judge_max_pixels)} (eval/serve refuse "
            "another judge)"
        )
        share = "-" if cal.expected_acceptance is None else f"{cal.expected_acceptance:.3f}"
        speed = "-" if cal.expected_speedup is None else f"{cal.expected_speedup:.2f}x"
        lines.append(f"on the calibration queries: acceptance {share}, speedup {speed}")
    else:
        lines.append("NO tau passed the test: the gate must accept nothing at this setting.")
        if cal.method == METHOD_RELATIVE:
            lines.append(
                "No tau keeps the funnel's accuracy at the target: calibrate on more queries, "
                "or run agent-only (--mode agent)."
            )
        elif cal.needed_n is not None:
            lines.append(
                f"If error rates stay as observed, about {cal.needed_n} queries would be needed "
                f"for a tau to pass (the calibration set has {_run_size(cal)}); or run "
                "agent-only (--mode agent)."
            )
        else:
            lines.append(
                "Even the most confident small answers err too often for any amount of data "
                "to pass: run agent-only (--mode agent), or loosen --max-error / --confidence."
            )
    h = cal.held_out
    if h:
        what = f"held out ({cal.holdout or 'test part'}, n={h['n']})"
        parts = [f"accepted {h['n_accepted']}"]
        if h.get("accepted_error") is not None:
            parts.append(f"error among accepted {h['accepted_error']:.4f}")
        if h.get("accuracy") is not None:
            parts.append(
                f"accuracy {h['accuracy']:.4f} (agent-only {h['agent_only_accuracy']:.4f})"
            )
        if h.get("speedup") is not None and math.isfinite(h["speedup"]):
            parts.append(f"speedup {h['speedup']:.2f}x")
        lines.append(f"{what}: " + ", ".join(parts))
    else:
        lines.append(
            "all numbers above are in-sample; --split calib:test or --holdout RUN measures them "
            "on queries the test never saw"
        )
    if cal.speedup_model:
        lines.append(f"speedup model: {cal.speedup_model}")
    if cal.note:
        lines.append(cal.note)
    return "\n".join(lines)


def _run_size(cal: Calibration) -> str:
    return f"{cal.n_queries} queries" if cal.n_queries else "too few"
