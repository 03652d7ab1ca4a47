"""Learn then Test on arrays: exact binomial tails, Clopper-Pearson and empirical-Bernstein
bounds, and fixed-sequence testing over candidate taus (pure functions of confidences and labels).

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
in tests/test_ltt.py check the guarantee empirically on fresh data.

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
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypedDict, Unpack

import numpy as np

from speceyes.bench.regate import sums_above

NO_TAU = 1.0  # confidence > 1.0 never holds: accept nothing

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
    m, sums = sums_above(conf, np.asarray(wrong, float)[:, None], cands)
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
    m, sums = sums_above(conf_tf, cols, cands)
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
