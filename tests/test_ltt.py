"""Learn then Test on arrays (speceyes.bench.ltt): exact binomial tails and bounds, and the
guarantee of fixed-sequence testing checked over repetitions on fresh data."""

import math
from fractions import Fraction

import numpy as np
import pytest

from speceyes.bench import ltt

# ------------------------------------------------------------------------------- binomial


def _brute_cdf(k: int, n: int, p: float) -> float:
    q = Fraction(p)
    return float(sum(math.comb(n, i) * q**i * (1 - q) ** (n - i) for i in range(k + 1)))


@pytest.mark.parametrize("n", [1, 2, 7, 30, 60])
@pytest.mark.parametrize("p", [0.001, 0.05, 0.3, 0.5, 0.93])
def test_binom_cdf_equals_brute_force(n, p):
    for k in range(-1, n + 1):
        expected = 0.0 if k < 0 else _brute_cdf(k, n, p)
        assert ltt.binom_cdf(k, n, p) == pytest.approx(expected, rel=1e-10, abs=1e-300)


def test_binom_cdf_large_n_and_edges():
    n, p = 100_000, 0.01
    pmf = np.exp(ltt.binom_logpmf(np.arange(n + 1), n, p))
    assert pmf.sum() == pytest.approx(1.0, abs=1e-9)
    assert ltt.binom_cdf(1000, n, p) == pytest.approx(pmf[:1001].sum(), rel=1e-9)
    assert 0.5 < ltt.binom_cdf(1000, n, p) < 0.56  # just above the mean
    assert ltt.binom_cdf(900, n, p) < 1e-3 and ltt.binom_cdf(1100, n, p) > 0.999
    assert (ltt.binom_cdf(3, 10, 0.0), ltt.binom_cdf(3, 10, 1.0), ltt.binom_cdf(10, 10, 0.4)) == (
        1.0,
        0.0,
        1.0,
    )
    with pytest.raises(ValueError):
        ltt.binom_cdf(1, 10, 1.5)


def test_clopper_pearson_upper():
    for n in (5, 50, 500):
        for delta in (0.01, 0.1):
            assert ltt.clopper_pearson_upper(0, n, delta) == pytest.approx(
                1 - delta ** (1 / n), rel=1e-9
            )
    u = ltt.clopper_pearson_upper(7, 120, 0.05)
    assert ltt.binom_cdf(7, 120, u) == pytest.approx(0.05, rel=1e-6)
    bounds = [ltt.clopper_pearson_upper(k, 100, 0.1) for k in range(0, 101, 10)]
    assert bounds == sorted(bounds) and bounds[-1] == 1.0
    assert ltt.clopper_pearson_upper(10, 1000, 0.1) < ltt.clopper_pearson_upper(1, 100, 0.1)
    # Reject H0 (risk > E) exactly when the upper bound is <= E.
    for k in range(0, 15):
        assert (ltt.binom_pvalue(k, 100, 0.1) <= 0.05) == (
            ltt.clopper_pearson_upper(k, 100, 0.05) <= 0.1 + 1e-12
        )


def test_pvalue_monotone():
    ps = [ltt.binom_pvalue(k, 200, 0.1) for k in range(0, 40)]
    assert ps == sorted(ps)
    es = [ltt.binom_pvalue(10, 200, e) for e in (0.02, 0.05, 0.1, 0.2)]
    assert es == sorted(es, reverse=True)
    assert ltt.binom_pvalue(0, 0, 0.1) == 1.0


def test_fixed_sequence_and_start():
    assert ltt.fixed_sequence([True, True, False, True]) == 2
    assert ltt.fixed_sequence([False, True]) == 0
    m = ltt.min_accepted(0.1, 0.1, start_rate=0.0)
    assert m == 22 and 0.9**22 <= 0.1 < 0.9**21
    m_half = ltt.min_accepted(0.1, 0.1)
    assert m_half > m
    assert ltt.binom_cdf(math.floor(0.05 * m_half), m_half, 0.1) <= 0.1


# ------------------------------------------------------------------------------- guarantee

A_ERR = 0.9  # P(wrong | c) = A_ERR * (1 - c)^2 with c ~ U(0, 1): risk(t) = A_ERR (1-t)^2 / 3


def _draw(rng, n):
    conf = rng.random(n)
    wrong = rng.random(n) < A_ERR * (1 - conf) ** 2
    return conf, wrong


def _risk_on(fresh_conf, fresh_wrong):
    """Error rate among conf > tau on a large fresh sample, for any tau."""
    order = np.argsort(fresh_conf)
    c = fresh_conf[order]
    cum_wrong = np.concatenate([[0], np.cumsum(fresh_wrong[order][::-1])])

    def risk(tau):
        m = len(c) - np.searchsorted(c, tau, side="right")
        return 0.0 if m == 0 else cum_wrong[m] / m

    return risk


# Analytic risks: confidence c ~ U(0, 1), P(wrong | c) = r(c); the risk among accepted answers
# at tau is R(tau) = integral_tau^1 r / (1 - tau), exact, so a violation (R(tau) > E) needs no
# large fresh sample. Piecewise-constant r gives R in closed form.
E, DELTA, REPS, N = 0.1, 0.1, 2000, 300


def _piecewise(edges, values):
    """r = values[i] on [edges[i], edges[i+1]); returns (r, R)."""
    edges, values = np.asarray(edges, float), np.asarray(values, float)
    mass = np.concatenate([np.cumsum((np.diff(edges) * values)[::-1])[::-1], [0.0]])

    def r(c):
        return values[np.clip(np.searchsorted(edges, c, side="right") - 1, 0, len(values) - 1)]

    def risk(tau):
        if tau >= 1.0:
            return 0.0
        i = int(np.clip(np.searchsorted(edges, tau, side="right") - 1, 0, len(values) - 1))
        return (mass[i + 1] + (edges[i + 1] - tau) * values[i]) / (1.0 - tau)

    return r, risk


def _steep():
    # r = 0.9 (1 - c)^2: R = 0.3 (1 - tau)^2, valid for tau >= 1 - sqrt(1/3) = 0.42
    return (lambda c: 0.9 * (1 - c) ** 2), (lambda tau: 0.3 * (1 - tau) ** 2)


SCENARIOS = {
    "flat": _piecewise([0, 1], [E * 1.1]),  # every tau is invalid: any pass is a violation
    "steep": _steep(),
    # Good at the top, a bad band at 0.6-0.8, good again below: the valid taus are not an
    # interval, and a test without its stopping rule wanders past the bad band.
    "non-monotone": _piecewise([0, 0.3, 0.6, 0.8, 1], [0.5, 0.02, 0.2, 0.02]),
}


def _upper_tail(v: int, reps: int, rate: float) -> float:
    """P(Bin(reps, rate) >= v): how surprising v violations are if the true rate is ``rate``."""
    return 1.0 - ltt.binom_cdf(v - 1, reps, rate)


def _coverage(r, risk, choosers):
    """Violations of E per chooser over REPS fresh calibration sets, and the mean share the
    first chooser accepts."""
    violations, accepted = np.zeros(len(choosers), int), 0.0
    for rep in range(REPS):
        rng = np.random.default_rng(rep)
        conf = rng.random(N)
        wrong = rng.random(N) < r(conf)
        scan = ltt.ltt_scan(conf, wrong, E, DELTA, n_grid=100)
        for i, choose in enumerate(choosers):
            j = choose(scan)
            if j >= 0:
                violations[i] += risk(scan.taus[j]) > E
                accepted += (i == 0) * scan.accepted[j] / N / REPS
    return violations, accepted


def _with_stopping_rule(scan):
    return ltt.fixed_sequence_choice(scan, DELTA)[0]


def _without_stopping_rule(scan):
    """The broken variant: every testable candidate tested at delta, the largest-acceptance
    rejection kept (no stop at the first failure)."""
    ok = np.flatnonzero(scan.testable & (scan.pvalues <= DELTA))
    return int(ok[-1]) if ok.size else -1


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_coverage_at_the_claimed_level(name):
    r, risk = SCENARIOS[name]
    (violations, broken), accepted = _coverage(
        r, risk, [_with_stopping_rule, _without_stopping_rule]
    )
    # One-sided binomial check: a true violation rate of delta makes this count unsurprising.
    assert _upper_tail(violations, REPS, DELTA) > 1e-3, (name, violations / REPS)
    if name == "steep":
        assert accepted > 0.3  # not vacuous: the best valid tau (0.42) accepts 58%
    if name == "flat":  # the same check catches the test without its stopping rule
        assert _upper_tail(broken, REPS, DELTA) < 1e-6, broken / REPS
    assert broken >= violations


def test_scan_choice_is_ltt_max_error():
    r, _ = SCENARIOS["non-monotone"]
    for rep in range(20):
        rng = np.random.default_rng(rep)
        conf = rng.random(N)
        wrong = rng.random(N) < r(conf)
        scan = ltt.ltt_scan(conf, wrong, E, DELTA, n_grid=100)
        j, tested = ltt.fixed_sequence_choice(scan, DELTA)
        res = ltt.ltt_max_error(conf, wrong, E, DELTA, n_grid=100)
        assert res.tau == (scan.taus[j] if j >= 0 else ltt.NO_TAU) and res.tested == tested


def test_vectorised_pvalues_equal_exact():
    rng = np.random.default_rng(0)
    for n in (7, 300, 2000):  # table and per-row paths
        m = rng.integers(0, n + 1, 300)
        k = rng.integers(-1, n + 1, 300) % (m + 1)
        got = ltt.binom_pvalues(k, m, 0.07)
        ref = [ltt.binom_pvalue(int(a), int(b), 0.07) for a, b in zip(k, m, strict=True)]
        np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-300)


def test_family_wise_selection_keeps_the_guarantee():
    """Eight configurations on flat risk just above E: keeping any that passes at delta each
    violates far more often than delta; testing each at delta/8 (Bonferroni) does not."""
    reps, configs = 500, 8
    naive = bonf = 0
    for rep in range(reps):
        rng = np.random.default_rng(10_000 + rep)
        wrong = rng.random(N) < E * 1.1
        confs = [rng.random(N) for _ in range(configs)]  # K/agg reorder the same answers
        at = [
            [ltt.ltt_max_error(c, wrong, E, d, n_grid=50) for c in confs]
            for d in (DELTA, DELTA / configs)
        ]
        naive += ltt.choose_in_family(at[0]) >= 0
        bonf += ltt.choose_in_family(at[1]) >= 0
    assert _upper_tail(bonf, reps, DELTA) > 1e-3, bonf / reps
    assert _upper_tail(naive, reps, DELTA) < 1e-6, naive / reps


def test_relative_accuracy_guarantee_holds_over_repetitions():
    ratio, confidence, reps = 0.97, 0.9, 100

    def draw(rng, n):
        conf = rng.random(n)
        tool_free = rng.random(n) < 0.8
        small = rng.random(n) < 0.45 + 0.55 * conf
        agent = rng.random(n) < 0.8
        return conf, tool_free, small, agent

    fresh = draw(np.random.default_rng(99), 400_000)

    def funnel_ratio(tau):
        conf, tool_free, small, agent = fresh
        accepted = tool_free & (conf > tau)
        return np.mean(np.where(accepted, small, agent)) / np.mean(agent)

    violations, taus = 0, []
    for rep in range(reps):
        res = ltt.ltt_relative_accuracy(
            *draw(np.random.default_rng(rep), 2000), ratio, 1 - confidence, n_grid=100
        )
        violations += funnel_ratio(res.tau) < ratio
        taus.append(res.tau)
    assert violations / reps <= 1 - confidence
    assert np.median(taus) < 0.9  # accepts a real share


def test_no_valid_tau_accepts_nothing():
    conf = np.linspace(0, 1, 300)
    res = ltt.ltt_max_error(conf, np.ones(300, bool), 0.05, 0.1)
    assert (res.tau, res.passed, res.n_accepted) == (ltt.NO_TAU, False, 0)
    assert math.isnan(res.bound)
    res = ltt.ltt_max_error(conf[:5], np.zeros(5, bool), 0.05, 0.1)  # too few to test anything
    assert res.tau == ltt.NO_TAU and res.tested == 0


def test_more_tolerance_accepts_more():
    conf, wrong = _draw(np.random.default_rng(7), 5000)
    taus = [ltt.ltt_max_error(conf, wrong, e, 0.1).tau for e in (0.03, 0.06, 0.1, 0.2, 0.3)]
    assert taus == sorted(taus, reverse=True) and taus[-1] < taus[0]
    looser = [ltt.ltt_max_error(conf, wrong, 0.1, d).tau for d in (0.01, 0.05, 0.2)]
    assert looser == sorted(looser, reverse=True)


def test_explicit_taus_are_used_in_order():
    conf, wrong = _draw(np.random.default_rng(8), 3000)
    grid = [0.2, 0.9, 0.5, 0.7]  # any order in, tested from high to low
    res = ltt.ltt_max_error(conf, wrong, 0.1, 0.1, taus=grid)
    assert res.tau in grid and res.tau >= 0.5
