"""Choose the gate threshold tau with a finite-sample guarantee (Learn then Test).

Goal (default): the error rate among ACCEPTED speculative answers is at most E, with probability
at least C over the calibration sample (delta = 1 - C).

Method: Learn-then-Test (Angelopoulos et al., 2021) with fixed-sequence testing. Candidate taus
are ordered from most conservative (high) to least. For each, H0: risk(tau) > E is tested with
the exact binomial p-value P(Bin(n_acc, E) <= errors) on the accepted set (equivalently: the
one-sided Clopper-Pearson upper bound at level delta is <= E). Given how many samples a tau
accepts, their errors are Binomial(n_acc, risk(tau)), so the p-value is exact. Testing goes on
while H0 is rejected at level delta; the answer is the last rejected tau. Fixed-sequence testing
controls the family-wise error at delta with no multiplicity correction, because a later tau is
only ever tested after every earlier one was rejected.

The order must not depend on the labels. By default candidates are quantiles of the calibration
confidences, and testing starts at the first tau that accepts enough samples that an error rate of
half of E would reject H0 (``min_accepted``: a count, never a label); otherwise the sequence would
stop at its first, data-starved, candidate. Both use only unlabeled confidences, given which the
labels stay independent; pass ``taus`` for a sequence fixed fully in advance. The repetition tests
in tests/test_calibrate.py check the guarantee empirically on fresh data.

Variant ``min_relative_accuracy=r``: the funnel's overall accuracy at tau must be at least r times
agent-only accuracy. Per query the loss L = r*a - c(tau) (a: agent correct, c: funnel correct)
lies in [-1, r]; H0: E[L] > 0 is rejected when the empirical-Bernstein upper bound
(Maurer & Pontil 2009, Thm 4) on E[L] is <= 0. Bernstein rather than Hoeffding because L is zero
or a constant for most queries (variance ~ share of queries where small and agent disagree), which
makes the bound several times tighter; it counts the queries where the small answer is right and
the agent wrong as gains, which a one-sided count of harms would ignore.

No scipy: the binomial CDF is an exact log-pmf sum using math.lgamma (fine for n up to 1e5+).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypedDict, Unpack

import numpy as np

from speceyes import gate
from speceyes.bench import regate as rg
from speceyes.bench.runlog import Run
from speceyes.bench.splits import Split, split_run
from speceyes.funnel import JUDGES

METHOD_MAX_ERROR = "ltt-fixed-sequence-clopper-pearson"
METHOD_RELATIVE = "ltt-fixed-sequence-empirical-bernstein"
METHODS = (METHOD_MAX_ERROR, METHOD_RELATIVE)
_EXACT_MAX = 20_000  # accepted counts up to which the n-needed estimate uses exact p-values
MIN_RATE_COUNT = 20  # accepted answers below which an observed error rate is not extrapolated
NO_TAU = 1.0  # confidence > 1.0 never holds: accept nothing
FORMAT_VERSION = 3  # 2: the setup (models, agent, judge mode) and held-out numbers; 3: the judge

_log_fact = np.zeros(1)  # log(i!) for i = 0..len-1, grown on demand


# ---------------------------------------------------------------------------- binomial


def log_factorials(n: int) -> np.ndarray:
    """log(i!) for i = 0..n, exact per entry (math.lgamma), cached and grown by doubling."""
    global _log_fact
    if n >= len(_log_fact):
        size = max(n + 1, 2 * len(_log_fact))
        _log_fact = np.fromiter((math.lgamma(i + 1) for i in range(size)), float, count=size)
    return _log_fact[: n + 1]


def binom_logpmf(k: np.ndarray | int, n: int, p: float) -> np.ndarray:
    """log P(Bin(n, p) = k) for integer k in [0, n], 0 < p < 1."""
    k = np.asarray(k, dtype=np.int64)
    lf = log_factorials(n)
    return lf[n] - lf[k] - lf[n - k] + k * math.log(p) + (n - k) * math.log1p(-p)


def binom_cdf(k: int, n: int, p: float) -> float:
    """P(Bin(n, p) <= k), exact: log-sum-exp of the pmf terms 0..k."""
    if n < 0 or not 0.0 <= p <= 1.0:
        raise ValueError(f"need n >= 0 and 0 <= p <= 1, got n={n}, p={p}")
    if k < 0:
        return 0.0
    if k >= n or p == 0.0:
        return 1.0
    if p == 1.0:
        return 0.0
    logs = binom_logpmf(np.arange(k + 1), n, p)
    top = logs.max()
    return float(min(1.0, math.exp(top) * np.exp(logs - top).sum()))


def binom_pvalue(errors: int, n: int, max_error: float) -> float:
    """p-value of H0: risk > max_error after ``errors`` in ``n``: P(Bin(n, E) <= errors)."""
    return 1.0 if n == 0 else binom_cdf(errors, n, max_error)


def clopper_pearson_upper(k: int, n: int, delta: float) -> float:
    """One-sided exact upper bound u: P(Bin(n, u) <= k) = delta (1 - delta confidence)."""
    if n == 0 or k >= n:
        return 1.0
    lo, hi = k / n, 1.0
    for _ in range(100):  # the CDF falls as p rises; bisect to ~1e-15
        mid = 0.5 * (lo + hi)
        if binom_cdf(k, n, mid) > delta:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-13:
            break
    return hi


def empirical_bernstein_upper(mean: float, var: float, n: int, width: float, delta: float) -> float:
    """Maurer-Pontil upper bound on E[X] for X in an interval of ``width``; var has ddof=1."""
    if n < 2:
        return math.inf
    log_term = math.log(2.0 / delta)
    return (
        mean
        + math.sqrt(2.0 * max(var, 0.0) * log_term / n)
        + 7.0 * width * log_term / (3.0 * (n - 1))
    )


def fixed_sequence(reject: Sequence[bool]) -> int:
    """Number of leading rejections: testing stops at the first hypothesis not rejected."""
    count = 0
    for r in reject:
        if not r:
            break
        count += 1
    return count


# ---------------------------------------------------------------------------- LTT on arrays


@dataclass(frozen=True)
class LttResult:
    tau: float  # NO_TAU when nothing passed
    bound: float  # upper bound at tau (error rate, or loss for the relative variant); NaN if none
    n: int  # calibration samples the risk is measured on
    n_accepted: int  # accepted at tau
    tested: int  # candidates tested before stopping
    passed: bool


def candidate_taus(conf: np.ndarray, n_grid: int = 200) -> np.ndarray:
    """Descending candidates: quantiles of the finite confidences (labels unused) and 0."""
    c = conf[np.isfinite(conf)]
    if c.size == 0:
        return np.array([0.0])
    qs = np.quantile(c, np.linspace(1.0, 0.0, n_grid + 1))
    return np.unique(np.append(qs, 0.0))[::-1]


class CandidateOptions(TypedDict, total=False):
    """Which taus ``ltt_scan`` tests and where the sequence starts (its keyword arguments)."""

    taus: Sequence[float] | np.ndarray | None
    n_grid: int
    start_rate: float


@dataclass(frozen=True)
class LttScan:
    """Every candidate's counts and p-value, most conservative candidate first."""

    taus: np.ndarray
    accepted: np.ndarray  # int per candidate
    errors: np.ndarray  # int per candidate
    pvalues: np.ndarray  # P(Bin(accepted, E) <= errors)
    testable: np.ndarray  # bool: enough accepted to start the sequence here


def ltt_scan(
    conf: np.ndarray,
    wrong: np.ndarray,
    max_error: float,
    delta: float,
    *,
    taus: Sequence[float] | np.ndarray | None = None,
    n_grid: int = 200,
    start_rate: float = 0.5,
) -> LttScan:
    """Counts and exact p-values for every candidate tau (labels enter only the error counts)."""
    _check_levels(max_error, delta)
    cands = _descending(taus) if taus is not None else candidate_taus(conf, n_grid)
    m, sums = rg.sums_above(conf, np.asarray(wrong, float)[:, None], cands)
    errors = np.rint(sums[:, 0]).astype(np.int64)
    m = np.asarray(m, dtype=np.int64)
    testable = m >= min_accepted(max_error, delta, start_rate, limit=int(m.max(initial=0)))
    return LttScan(cands, m, errors, binom_pvalues(errors, m, max_error), testable)


def fixed_sequence_choice(scan: LttScan, delta: float) -> tuple[int, int]:
    """(index of the chosen candidate or -1, candidates tested): test the testable candidates
    from the most conservative down and stop at the first that is not rejected."""
    order = np.flatnonzero(scan.testable)
    fails = scan.pvalues[order] > delta
    stop = int(np.argmax(fails)) if fails.any() else len(order)
    return (int(order[stop - 1]) if stop else -1), min(stop + 1, len(order))


def ltt_max_error(
    conf: np.ndarray,
    wrong: np.ndarray,
    max_error: float,
    delta: float,
    **candidates: Unpack[CandidateOptions],
) -> LttResult:
    """Largest-acceptance tau whose error among accepted (conf > tau) is <= max_error w.p. 1-delta.

    ``conf``/``wrong`` cover the queries the gate decides on (judged tool-free); NaN confidence
    is never accepted. ``candidates`` are ``ltt_scan``'s: testing starts at the first candidate
    accepting at least ``min_accepted(max_error, delta, start_rate)`` samples (a count, never a
    label).
    """
    scan = ltt_scan(conf, wrong, max_error, delta, **candidates)
    best, tested = fixed_sequence_choice(scan, delta)
    n = int(np.sum(np.isfinite(conf)))
    if best < 0:
        return LttResult(NO_TAU, float("nan"), n, 0, tested, False)
    m, k = int(scan.accepted[best]), int(scan.errors[best])
    bound = clopper_pearson_upper(k, m, delta)
    return LttResult(float(scan.taus[best]), bound, n, m, tested, True)


def choose_in_family(results: Sequence[LttResult]) -> int:
    """Index of the configuration kept from a family tested at delta / len(results) each: the
    passing one that accepts most (-1 when none passes). Every passing configuration is valid
    simultaneously with probability >= 1 - delta (union bound), so the choice may look at the
    data without breaking the guarantee."""
    passing = [i for i, r in enumerate(results) if r.passed]
    return max(passing, key=lambda i: results[i].n_accepted) if passing else -1


@functools.lru_cache(maxsize=4096)
def _cdf_row(n: int, p: float) -> np.ndarray:
    """P(Bin(n, p) <= k) for k = 0..n, as one cumulative sum of exact pmf terms."""
    return np.minimum(np.cumsum(np.exp(binom_logpmf(np.arange(n + 1), n, p))), 1.0)


def binom_pvalues(errors: np.ndarray, n: np.ndarray, max_error: float) -> np.ndarray:
    """``binom_pvalue`` elementwise (1.0 where n is 0): from one cached table when every n is
    small, else one CDF row per distinct n."""
    errors, n = np.asarray(errors, np.int64), np.asarray(n, np.int64)
    top = int(n.max(initial=0))
    if top <= _TABLE_MAX:
        size = max(64, 1 << max(top, 1).bit_length())  # a few table sizes serve all calls
        table = _cdf_table(min(size, _TABLE_MAX), float(max_error))
        return table[n, np.clip(errors, 0, n)]
    out = np.ones(n.shape)
    for size in np.unique(n[n > 0]):
        sel = n == size
        out[sel] = _cdf_row(int(size), float(max_error))[np.minimum(errors[sel], size)]
    return out


_TABLE_MAX = 1024  # (n+1)^2 floats: 8 MB at most


@functools.lru_cache(maxsize=8)
def _cdf_table(n: int, p: float) -> np.ndarray:
    """P(Bin(m, p) <= k) for m, k = 0..n, by the recurrence
    F(m+1, k) = (1-p) F(m, k) + p F(m, k-1) (a convex combination: no loss of precision)."""
    table = np.ones((n + 1, n + 1))
    row = np.ones(n + 1)
    for m in range(1, n + 1):
        shifted = np.concatenate([[0.0], row[:-1]])
        row = (1.0 - p) * row + p * shifted
        row[m:] = 1.0
        table[m] = row
    table.setflags(write=False)
    return table


@functools.lru_cache(maxsize=1024)  # a scan over counts; the same levels recur
def min_accepted(
    max_error: float, delta: float, start_rate: float = 0.5, limit: int = 10**6
) -> int:
    """Smallest accepted count at which an observed error rate of ``start_rate * max_error``
    would reject H0 (start_rate 0: zero errors). Starting the fixed sequence there keeps it from
    stopping at a first candidate with almost no data; it depends on counts only, so the
    guarantee is untouched. Returns limit + 1 when no count up to ``limit`` qualifies.
    """
    if not 0.0 <= start_rate < 1.0:
        raise ValueError(f"start_rate must be in [0, 1), got {start_rate}")
    zero_errors = math.ceil(math.log(delta) / math.log1p(-max_error))  # (1-E)^m <= delta
    for count in range(max(zero_errors, 1), limit + 1):
        if binom_cdf(math.floor(start_rate * max_error * count), count, max_error) <= delta:
            return count
    return limit + 1


def ltt_relative_accuracy(
    conf: np.ndarray,
    tool_free: np.ndarray,
    small_correct: np.ndarray,
    agent_correct: np.ndarray,
    ratio: float,
    delta: float,
    taus: Sequence[float] | np.ndarray | None = None,
    n_grid: int = 200,
) -> LttResult:
    """Largest-acceptance tau with funnel accuracy >= ratio * agent-only accuracy w.p. 1-delta.

    Over all n queries (judge-routed ones count as agent answers). Accepting nothing is the
    agent-only funnel and needs no test.
    """
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"min relative accuracy must be in (0, 1], got {ratio}")
    _check_delta(delta)
    a = np.asarray(agent_correct, bool).astype(float)
    s = np.asarray(small_correct, bool).astype(float)
    n = len(a)
    base = (ratio - 1.0) * a  # L when not accepted; accepting adds d = a - s
    d = a - s
    eligible = np.asarray(tool_free, bool)
    conf_tf = np.where(eligible, conf, np.nan)
    pool = conf_tf[eligible]
    cands = _descending(taus) if taus is not None else candidate_taus(pool, n_grid)
    cols = np.column_stack([d, 2.0 * base * d + d * d])
    m, sums = rg.sums_above(conf_tf, cols, cands)
    mean = (base.sum() + sums[:, 0]) / n
    sq = (np.square(base).sum() + sums[:, 1]) / n
    var = (sq - mean**2) * n / max(n - 1, 1)
    bounds = np.array(
        [
            empirical_bernstein_upper(mu, v, n, 1.0 + ratio, delta)
            for mu, v in zip(mean, var, strict=True)
        ]
    )
    rejected = fixed_sequence(bounds <= 0.0)
    tested = min(rejected + 1, len(cands))
    if rejected == 0:
        return LttResult(NO_TAU, float("nan"), n, 0, tested, False)
    best = rejected - 1
    return LttResult(float(cands[best]), float(bounds[best]), n, int(m[best]), tested, True)


def _descending(taus: Sequence[float] | np.ndarray) -> np.ndarray:
    arr = np.asarray(taus, dtype=np.float64).ravel()
    if arr.size == 0 or np.any(np.isnan(arr)):
        raise ValueError("candidate taus must be a non-empty list of numbers")
    return np.sort(arr)[::-1]  # fixed sequence: most conservative first


def _check_levels(max_error: float, delta: float) -> None:
    if not 0.0 < max_error < 1.0:
        raise ValueError(f"max error must be in (0, 1), got {max_error}")
    _check_delta(delta)


def _check_delta(delta: float) -> None:
    if not 0.0 < delta < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {1.0 - delta}")


# ---------------------------------------------------------------------------- on a run


@dataclass
class Calibration:
    """A calibrated gate setting, written as JSON for ``eval``/``serve --calibration FILE``.

    It records the setup it is valid for (models, agent, judge variant, view, mode and threshold)
    besides the gate (tau, top-K, aggregation, sigmoid scale); ``eval``/``serve`` apply the gate
    and judge mode and refuse other models, agents or judges (``check_setup``). ``expected_*`` are measured on the calibration queries;
    ``held_out`` on queries the test never saw.
    """

    tau: float
    top_k: int
    agg: str
    alpha: float  # the gate's sigmoid scale
    max_error: float | None
    confidence: float  # C: the guarantee holds with probability >= C
    method: str
    n: int  # calibration queries the risk is measured on
    n_accepted: int = 0
    n_queries: int = 0  # all queries of the calibration run (or part)
    bound: float | None = None  # upper bound on the controlled risk at tau (level 1 - C)
    expected_acceptance: float | None = None  # alpha at tau on the calibration queries
    expected_small_share: float | None = None  # beta * alpha
    expected_speedup: float | None = None
    min_relative_accuracy: float | None = None
    candidates_tested: int = 0
    passed: bool = True  # False: no tau passed, tau = 1.0 accepts nothing
    source: str | None = None
    note: str = ""
    models: dict[str, str | None] | None = None  # {"small": ..., "large": ...} as the run had them
    agent: str | None = None
    judge_mode: str | None = None
    judge_threshold: float | None = None
    judge: str = "large"  # the judge variant (funnel.JUDGES) of the calibrated runs
    judge_max_pixels: int | None = None  # their judge view budget; None: the full image
    family: list[dict[str, Any]] = field(default_factory=list)  # every (K, agg) tested
    split: str | None = None  # e.g. "50:50 (seed 0)", or None for the whole run
    holdout: str | None = None  # run folder measured as the held-out part
    held_out: dict[str, Any] | None = None  # accuracy, error among accepted, speedup there
    needed_n: int | None = None  # no tau passed: queries needed at the observed error rate
    speedup_model: str = ""
    version: int = FORMAT_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {k: _json_safe(v) for k, v in asdict(self).items()}


def _json_safe(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_json_safe(x) for x in v]
    if isinstance(v, (float, np.floating)):
        return None if not math.isfinite(v) else float(v)
    if isinstance(v, np.integer):
        return int(v)
    return v


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
    alpha: float | None = None,
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
    configs = [rg.resolve_gate(calib_run, k, a, alpha) for k in ks for a in aggs]
    delta = 1.0 - confidence
    family_delta = delta / len(configs)
    note = ""
    members: list[FamilyMember] = []
    for g in configs:
        conf = rg.confidences(calib_run, g.top_k, g.agg, g.alpha)
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
    g = rg.GateSetting(chosen.top_k, chosen.agg, configs[0].alpha)
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
        alpha=g.alpha,
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
        models=dict(cfg["models"]) if isinstance(cfg.get("models"), dict) else None,
        agent=cfg.get("agent"),
        judge_mode=cfg.get("judge_mode"),
        judge_threshold=cfg.get("judge_threshold"),
        **_judge_setup(cfg),
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


def _judge_setup(config: dict[str, Any]) -> dict[str, Any]:
    """The judge variant and view a run was made with; runs from before the variants had the
    large judge on the full image."""
    return {
        "judge": config.get("judge") or "large",
        "judge_max_pixels": config.get("judge_max_pixels"),
    }


def _check_holdout(run: Run, holdout: Run) -> None:
    """The held-out run must come from the same setup and share no query with the calibration."""
    setup_a, setup_b = _judge_setup(run.config), _judge_setup(holdout.config)
    for key in ("models", "agent", "judge_mode", "judge_threshold"):
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
    conf = rg.confidences(run, g.top_k, g.agg, g.alpha)
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
        row = rg.regate(run, [tau], g.top_k, g.agg, g.alpha)[0]
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
        conf = rg.confidences(run, g.top_k, g.agg, g.alpha)[eligible]
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
        beta, alphas = rg.acceptance(run, [tau], g.top_k, g.agg, g.alpha)
    except ValueError:
        conf = rg.confidences(run, g.top_k, g.agg, g.alpha)
        pool = conf[run.has_small]
        acc = float(np.mean(pool > tau)) if pool.size else None
        return acc, None, None
    acc = float(alphas[0])
    try:
        rg.check_replayable(run)
    except ValueError:
        return acc, float(beta * acc), _analytic_speedup(run, beta, acc)
    row = rg.regate(run, [tau], g.top_k, g.agg, g.alpha)[0]
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
            f"tau = {cal.tau:.6f}  K={cal.top_k} agg={cal.agg} sigmoid scale={cal.alpha:g}; "
            f"bound {cal.bound:.4f} on {cal.n_accepted} accepted ({cal.method})"
        )
        lines.append(
            f"valid with {_judge_words(cal.judge, cal.judge_max_pixels)} (eval/serve refuse "
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


# ---------------------------------------------------------------------------- setup


def _same_model(recorded: str | None, given: str | None) -> bool:
    """Same model spec: equal text, or the same existing folder."""
    if recorded is None or given is None:
        return recorded == given
    if recorded.rstrip("/") == given.rstrip("/"):
        return True
    a, b = Path(recorded), Path(given)
    return a.exists() and b.exists() and a.resolve() == b.resolve()


def _judge_words(judge: str, max_pixels: int | None) -> str:
    view = "the full image" if max_pixels is None else f"--judge-max-pixels {max_pixels}"
    return f"--judge {judge} on {view}"


def check_setup(
    cal: Calibration,
    small: str | None,
    large: str | None,
    agent: str | None,
    judge: str = "large",
    judge_max_pixels: int | None = None,
) -> None:
    """Raise a clear error unless the calibration was made for these models, this agent and this
    judge variant and view (the defaults are the funnel's: the large judge on the full image)."""
    where = f" (calibration from {cal.source})" if cal.source else ""
    if not cal.passed:
        raise ValueError(
            f"this calibration file accepts nothing: no tau passed its test{where}. Use --mode "
            "agent, or calibrate on more queries (the file's needed_n estimates how many)"
        )
    if not cal.models:
        raise ValueError(
            f"the calibration file records no models{where}; it cannot be checked against this "
            "setup. Re-run speceyes calibrate on a run made with these models"
        )
    for role, given in (("small", small), ("large", large)):
        recorded = cal.models.get(role)
        if not _same_model(recorded, given):
            raise ValueError(
                f"the calibration file was made for --{role} {recorded!r}, not {given!r}{where}: "
                "tau is only valid for the models, backend and K it was calibrated with; "
                "calibrate on a run of this setup"
            )
    if cal.agent and agent and cal.agent != agent:
        raise ValueError(
            f"the calibration file was made with --agent {cal.agent}, not {agent}{where}"
        )
    # The judge decides which queries reach the gate, so the accepted set, and the error rate
    # the guarantee bounds, changes with the judge and with the view it is shown.
    if (cal.judge, cal.judge_max_pixels) != (judge, judge_max_pixels):
        raise ValueError(
            f"the calibration file was made with {_judge_words(cal.judge, cal.judge_max_pixels)}, "
            f"not {_judge_words(judge, judge_max_pixels)}{where}: the guarantee holds only for "
            "the judge it was calibrated with; pass the same judge options, or calibrate on a "
            "run made with these"
        )


# ---------------------------------------------------------------------------- the JSON file


def write_calibration(calibration: Calibration, path: str | Path) -> Path:
    """Write the calibration JSON; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(calibration.to_dict(), indent=2) + "\n", encoding="utf-8")
    return path


def read_calibration(path: str | Path) -> Calibration:
    """Read and validate a calibration file (as written by ``write_calibration``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"calibration file not found: {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    missing = [k for k in ("tau", "top_k", "agg") if data.get(k) is None]
    if missing:
        raise ValueError(f"{path}: missing required keys: {', '.join(missing)}")
    tau, top_k, agg = float(data["tau"]), int(data["top_k"]), str(data["agg"])
    if not 0.0 <= tau <= 1.0:
        raise ValueError(f"{path}: tau must be in [0, 1], got {tau}")
    if top_k < 2:
        raise ValueError(f"{path}: top_k must be >= 2, got {top_k}")
    if agg not in gate.AGGREGATIONS:
        raise ValueError(f"{path}: unknown aggregation {agg!r}")
    judge_mode = data.get("judge_mode")
    if judge_mode is not None and judge_mode not in ("logit", "decode"):
        raise ValueError(f"{path}: unknown judge_mode {judge_mode!r}")
    judge = data.get("judge") or "large"  # files before version 3: the large judge
    if judge not in JUDGES:
        raise ValueError(f"{path}: unknown judge {judge!r}; one of {', '.join(JUDGES)}")
    judge_max_pixels = data.get("judge_max_pixels")
    if judge_max_pixels is not None and (
        isinstance(judge_max_pixels, bool)
        or not isinstance(judge_max_pixels, int)
        or judge_max_pixels <= 0
    ):
        raise ValueError(f"{path}: judge_max_pixels must be a positive integer or null")
    known = set(Calibration.__dataclass_fields__)
    values = {k: v for k, v in data.items() if k in known}
    values.update(tau=tau, top_k=top_k, agg=agg, judge=judge)
    values["alpha"] = float(values.get("alpha") or gate.DEFAULT_ALPHA)
    if values.get("judge_threshold") is not None:
        values["judge_threshold"] = float(values["judge_threshold"])
    values.setdefault("max_error", None)
    values.setdefault("confidence", float("nan"))
    values.setdefault("method", "unknown")
    values.setdefault("n", 0)
    values.setdefault("version", 1)  # files before version 2 did not write it
    return Calibration(**values)
