"""Calibrating tau with a finite-sample guarantee (speceyes.bench.calibrate)."""

import json
import math
from fractions import Fraction

import numpy as np
import pytest

from speceyes.bench import calibrate as cb
from speceyes.bench.runlog import load_run, write_synthetic_run

# ------------------------------------------------------------------------------- binomial


def _brute_cdf(k: int, n: int, p: float) -> float:
    q = Fraction(p)
    return float(sum(math.comb(n, i) * q**i * (1 - q) ** (n - i) for i in range(k + 1)))


@pytest.mark.parametrize("n", [1, 2, 7, 30, 60])
@pytest.mark.parametrize("p", [0.001, 0.05, 0.3, 0.5, 0.93])
def test_binom_cdf_equals_brute_force(n, p):
    for k in range(-1, n + 1):
        expected = 0.0 if k < 0 else _brute_cdf(k, n, p)
        assert cb.binom_cdf(k, n, p) == pytest.approx(expected, rel=1e-10, abs=1e-300)


def test_binom_cdf_large_n_and_edges():
    n, p = 100_000, 0.01
    pmf = np.exp(cb.binom_logpmf(np.arange(n + 1), n, p))
    assert pmf.sum() == pytest.approx(1.0, abs=1e-9)
    assert cb.binom_cdf(1000, n, p) == pytest.approx(pmf[:1001].sum(), rel=1e-9)
    assert 0.5 < cb.binom_cdf(1000, n, p) < 0.56  # just above the mean
    assert cb.binom_cdf(900, n, p) < 1e-3 and cb.binom_cdf(1100, n, p) > 0.999
    assert (cb.binom_cdf(3, 10, 0.0), cb.binom_cdf(3, 10, 1.0), cb.binom_cdf(10, 10, 0.4)) == (
        1.0,
        0.0,
        1.0,
    )
    with pytest.raises(ValueError):
        cb.binom_cdf(1, 10, 1.5)


def test_clopper_pearson_upper():
    for n in (5, 50, 500):
        for delta in (0.01, 0.1):
            assert cb.clopper_pearson_upper(0, n, delta) == pytest.approx(
                1 - delta ** (1 / n), rel=1e-9
            )
    u = cb.clopper_pearson_upper(7, 120, 0.05)
    assert cb.binom_cdf(7, 120, u) == pytest.approx(0.05, rel=1e-6)
    bounds = [cb.clopper_pearson_upper(k, 100, 0.1) for k in range(0, 101, 10)]
    assert bounds == sorted(bounds) and bounds[-1] == 1.0
    assert cb.clopper_pearson_upper(10, 1000, 0.1) < cb.clopper_pearson_upper(1, 100, 0.1)
    # Reject H0 (risk > E) exactly when the upper bound is <= E.
    for k in range(0, 15):
        assert (cb.binom_pvalue(k, 100, 0.1) <= 0.05) == (
            cb.clopper_pearson_upper(k, 100, 0.05) <= 0.1 + 1e-12
        )


def test_pvalue_monotone():
    ps = [cb.binom_pvalue(k, 200, 0.1) for k in range(0, 40)]
    assert ps == sorted(ps)
    es = [cb.binom_pvalue(10, 200, e) for e in (0.02, 0.05, 0.1, 0.2)]
    assert es == sorted(es, reverse=True)
    assert cb.binom_pvalue(0, 0, 0.1) == 1.0


def test_fixed_sequence_and_start():
    assert cb.fixed_sequence([True, True, False, True]) == 2
    assert cb.fixed_sequence([False, True]) == 0
    m = cb.min_accepted(0.1, 0.1, start_rate=0.0)
    assert m == 22 and 0.9**22 <= 0.1 < 0.9**21
    m_half = cb.min_accepted(0.1, 0.1)
    assert m_half > m
    assert cb.binom_cdf(math.floor(0.05 * m_half), m_half, 0.1) <= 0.1


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


def test_max_error_guarantee_holds_over_repetitions():
    max_error, confidence, reps = 0.1, 0.9, 200
    rng = np.random.default_rng(2024)
    risk = _risk_on(*_draw(rng, 400_000))
    violations, accepted = 0, []
    for rep in range(reps):
        conf, wrong = _draw(np.random.default_rng(rep), 400)
        res = cb.ltt_max_error(conf, wrong, max_error, 1 - confidence, n_grid=100)
        violations += risk(res.tau) > max_error
        accepted.append(res.n_accepted / 400)
        if res.passed:
            assert res.bound <= max_error + 1e-9
    assert violations / reps <= 1 - confidence
    # Not vacuous: the true best tau (risk = E) is about 0.42, accepting 58%.
    assert np.mean(accepted) > 0.3


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
        res = cb.ltt_relative_accuracy(
            *draw(np.random.default_rng(rep), 2000), ratio, 1 - confidence, n_grid=100
        )
        violations += funnel_ratio(res.tau) < ratio
        taus.append(res.tau)
    assert violations / reps <= 1 - confidence
    assert np.median(taus) < 0.9  # accepts a real share


def test_no_valid_tau_accepts_nothing():
    conf = np.linspace(0, 1, 300)
    res = cb.ltt_max_error(conf, np.ones(300, bool), 0.05, 0.1)
    assert (res.tau, res.passed, res.n_accepted) == (cb.NO_TAU, False, 0)
    assert math.isnan(res.bound)
    res = cb.ltt_max_error(conf[:5], np.zeros(5, bool), 0.05, 0.1)  # too few to test anything
    assert res.tau == cb.NO_TAU and res.tested == 0


def test_more_tolerance_accepts_more():
    conf, wrong = _draw(np.random.default_rng(7), 5000)
    taus = [cb.ltt_max_error(conf, wrong, e, 0.1).tau for e in (0.03, 0.06, 0.1, 0.2, 0.3)]
    assert taus == sorted(taus, reverse=True) and taus[-1] < taus[0]
    looser = [cb.ltt_max_error(conf, wrong, 0.1, d).tau for d in (0.01, 0.05, 0.2)]
    assert looser == sorted(looser, reverse=True)


def test_explicit_taus_are_used_in_order():
    conf, wrong = _draw(np.random.default_rng(8), 3000)
    grid = [0.2, 0.9, 0.5, 0.7]  # any order in, tested from high to low
    res = cb.ltt_max_error(conf, wrong, 0.1, 0.1, taus=grid)
    assert res.tau in grid and res.tau >= 0.5


# ------------------------------------------------------------------------------- on a run


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("cal") / "both"
    return load_run(write_synthetic_run(d, 3000, seed=11, mode="both", k_logged=16))


def test_calibrate_run_and_roundtrip(run, tmp_path):
    cal = cb.calibrate(run, max_error=0.15, confidence=0.9)
    assert cal.method == "ltt-fixed-sequence-clopper-pearson" and cal.passed
    assert 0 < cal.tau < 1 and cal.bound <= 0.15
    assert (cal.top_k, cal.agg, cal.alpha) == (16, "min", 0.6)
    assert cal.n == int(np.sum(run.judge_tool == 0)) and cal.n_accepted > 0
    assert 0 < cal.expected_acceptance <= 1 and cal.expected_speedup > 1
    path = cb.write_calibration(cal, tmp_path / "cal" / "tau.json")
    data = json.loads(path.read_text())
    for key in ("tau", "top_k", "agg", "alpha", "max_error", "confidence", "method", "n"):
        assert key in data
    back = cb.read_calibration(path)
    assert back == cal


def test_calibrate_relative_on_run(run):
    cal = cb.calibrate(run, confidence=0.9, min_relative_accuracy=0.95)
    assert cal.method == "ltt-fixed-sequence-empirical-bernstein"
    assert cal.max_error is None and cal.min_relative_accuracy == 0.95
    assert cal.passed and cal.bound <= 0 and cal.n == run.n


def test_calibrate_impossible_target_is_a_result(run, tmp_path):
    cal = cb.calibrate(run, max_error=0.001, confidence=0.99)
    assert cal.tau == 1.0 and not cal.passed and cal.n_accepted == 0
    assert "accept nothing" in cal.note
    assert cb.read_calibration(cb.write_calibration(cal, tmp_path / "c.json")).tau == 1.0


def test_read_calibration_errors(tmp_path):
    p = tmp_path / "c.json"
    with pytest.raises(FileNotFoundError):
        cb.read_calibration(p)
    p.write_text("{oops")
    with pytest.raises(ValueError, match="not valid JSON"):
        cb.read_calibration(p)
    p.write_text(json.dumps({"tau": 0.9}))
    with pytest.raises(ValueError, match="missing required keys: top_k, agg"):
        cb.read_calibration(p)
    p.write_text(json.dumps({"tau": 0.9, "top_k": 64, "agg": "max"}))
    with pytest.raises(ValueError, match="unknown aggregation"):
        cb.read_calibration(p)
    p.write_text(json.dumps({"tau": 0.9, "top_k": 20, "agg": "log", "extra": 1}))
    cal = cb.read_calibration(p)
    assert (cal.tau, cal.top_k, cal.agg, cal.alpha) == (0.9, 20, "log", 0.6)


def test_calibrate_speceyes_mode_run(tmp_path):
    # The small model ran on every judged tool-free query, so max-error calibration works; the
    # relative variant needs agent answers for all and says so.
    d = write_synthetic_run(tmp_path / "spec", 2000, seed=12, mode="speceyes", k_logged=16)
    run = load_run(d)
    cal = cb.calibrate(run, max_error=0.15, confidence=0.9)
    assert cal.passed and cal.n == int(np.sum(run.judge_tool == 0))
    assert cal.expected_speedup is not None and cal.expected_speedup > 1  # analytic form
    with pytest.raises(ValueError, match="needs a `speceyes eval --mode both` run"):
        cb.calibrate(run, min_relative_accuracy=0.95)
