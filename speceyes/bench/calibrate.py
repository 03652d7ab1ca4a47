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

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from speceyes import gate
from speceyes.bench import regate as rg
from speceyes.bench.runlog import Run

METHOD_MAX_ERROR = "ltt-fixed-sequence-clopper-pearson"
METHOD_RELATIVE = "ltt-fixed-sequence-empirical-bernstein"
METHODS = (METHOD_MAX_ERROR, METHOD_RELATIVE)
NO_TAU = 1.0  # confidence > 1.0 never holds: accept nothing
FORMAT_VERSION = 1

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


def ltt_max_error(
    conf: np.ndarray,
    wrong: np.ndarray,
    max_error: float,
    delta: float,
    taus: Sequence[float] | np.ndarray | None = None,
    n_grid: int = 200,
    start_rate: float = 0.5,
) -> LttResult:
    """Largest-acceptance tau whose error among accepted (conf > tau) is <= max_error w.p. 1-delta.

    ``conf``/``wrong`` cover the queries the gate decides on (judged tool-free); NaN confidence
    is never accepted. Testing starts at the first candidate accepting at least
    ``min_accepted(max_error, delta, start_rate)`` samples (a count, never a label).
    """
    _check_levels(max_error, delta)
    cands = _descending(taus) if taus is not None else candidate_taus(conf, n_grid)
    m, sums = rg.sums_above(conf, np.asarray(wrong, float)[:, None], cands)
    errors = np.rint(sums[:, 0]).astype(np.int64)
    testable = m >= min_accepted(max_error, delta, start_rate, limit=int(m.max(initial=0)))
    best, tested = -1, 0
    for j in np.flatnonzero(testable):
        tested += 1
        if binom_pvalue(int(errors[j]), int(m[j]), max_error) > delta:
            break
        best = int(j)
    n = int(np.sum(np.isfinite(conf)))
    if best < 0:
        return LttResult(NO_TAU, float("nan"), n, 0, tested, False)
    bound = clopper_pearson_upper(int(errors[best]), int(m[best]), delta)
    return LttResult(float(cands[best]), bound, n, int(m[best]), tested, True)


def min_accepted(max_error: float, delta: float, start_rate: float = 0.5, limit: int = 10**6):
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
    """A calibrated gate setting, written as JSON for ``eval``/``serve --calibration FILE``."""

    tau: float
    top_k: int
    agg: str
    alpha: float  # the gate's sigmoid scale
    max_error: float | None
    confidence: float  # C: the guarantee holds with probability >= C
    method: str
    n: int  # calibration queries the risk is measured on
    n_accepted: int = 0
    bound: float | None = None  # upper bound on the controlled risk at tau (level 1 - C)
    expected_acceptance: float | None = None  # alpha at tau on the calibration run
    expected_small_share: float | None = None  # beta * alpha
    expected_speedup: float | None = None
    min_relative_accuracy: float | None = None
    candidates_tested: int = 0
    passed: bool = True  # False: no tau passed, tau = 1.0 accepts nothing
    source: str | None = None
    note: str = ""
    version: int = FORMAT_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {k: _json_safe(v) for k, v in asdict(self).items()}


def _json_safe(v: Any) -> Any:
    if isinstance(v, (float, np.floating)):
        return None if not math.isfinite(v) else float(v)
    if isinstance(v, np.integer):
        return int(v)
    return v


def calibrate(
    run: Run,
    max_error: float = 0.05,
    confidence: float = 0.9,
    *,
    top_k: int | None = None,
    agg: str | None = None,
    alpha: float | None = None,
    taus: Sequence[float] | np.ndarray | None = None,
    min_relative_accuracy: float | None = None,
    n_grid: int = 200,
    start_rate: float = 0.5,
) -> Calibration:
    """Calibrate tau on a logged run (see the module doc for the guarantee)."""
    g = rg.resolve_gate(run, top_k, agg, alpha)
    conf = rg.confidences(run, g.top_k, g.agg, g.alpha)
    delta = 1.0 - confidence
    note = ""
    if min_relative_accuracy is not None:
        rg.check_replayable(run)
        tool_free = run.judge_tool == 0
        res = ltt_relative_accuracy(
            conf,
            tool_free,
            rg.known_correct(run.small_correct),
            rg.known_correct(run.agent_correct),
            min_relative_accuracy,
            delta,
            taus,
            n_grid,
        )
        method, max_err = METHOD_RELATIVE, None
    else:
        eligible, note = _gate_population(run)
        # Unknown correctness (errors) among eligible answers counts as wrong: conservative.
        wrong = ~rg.known_correct(run.small_correct[eligible])
        res = ltt_max_error(conf[eligible], wrong, max_error, delta, taus, n_grid, start_rate)
        method, max_err = METHOD_MAX_ERROR, max_error
    if not res.passed:
        note = (note + " " if note else "") + "no candidate tau passed the test: accept nothing"
    acc, share, speed = _expectations(run, res.tau, g)
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
        bound=res.bound,
        expected_acceptance=acc,
        expected_small_share=share,
        expected_speedup=speed,
        min_relative_accuracy=min_relative_accuracy,
        candidates_tested=res.tested,
        passed=res.passed,
        source=str(run.path),
        note=note,
    )


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
    known = set(Calibration.__dataclass_fields__)
    fields = {k: v for k, v in data.items() if k in known}
    fields.update(tau=tau, top_k=top_k, agg=agg)
    fields.setdefault("alpha", gate.DEFAULT_ALPHA)
    fields["alpha"] = gate.DEFAULT_ALPHA if fields["alpha"] is None else float(fields["alpha"])
    fields.setdefault("max_error", None)
    fields.setdefault("confidence", float("nan"))
    fields.setdefault("method", "unknown")
    fields.setdefault("n", 0)
    return Calibration(**fields)
