"""Calibrating tau with a finite-sample guarantee (speceyes.bench.calibrate)."""

import json
import math
from fractions import Fraction

import numpy as np
import pytest

from speceyes.bench import calibrate as cb
from speceyes.bench import regate as rg
from speceyes.bench.runlog import load_run
from speceyes.bench.splits import parse_split, split_indices, subset_run
from tests.tools.synthetic_run import write_synthetic_run

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
    return 1.0 - cb.binom_cdf(v - 1, reps, rate)


def _coverage(r, risk, choosers):
    """Violations of E per chooser over REPS fresh calibration sets, and the mean share the
    first chooser accepts."""
    violations, accepted = np.zeros(len(choosers), int), 0.0
    for rep in range(REPS):
        rng = np.random.default_rng(rep)
        conf = rng.random(N)
        wrong = rng.random(N) < r(conf)
        scan = cb.ltt_scan(conf, wrong, E, DELTA, n_grid=100)
        for i, choose in enumerate(choosers):
            j = choose(scan)
            if j >= 0:
                violations[i] += risk(scan.taus[j]) > E
                accepted += (i == 0) * scan.accepted[j] / N / REPS
    return violations, accepted


def _with_stopping_rule(scan):
    return cb.fixed_sequence_choice(scan, DELTA)[0]


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
        scan = cb.ltt_scan(conf, wrong, E, DELTA, n_grid=100)
        j, tested = cb.fixed_sequence_choice(scan, DELTA)
        res = cb.ltt_max_error(conf, wrong, E, DELTA, n_grid=100)
        assert res.tau == (scan.taus[j] if j >= 0 else cb.NO_TAU) and res.tested == tested


def test_vectorised_pvalues_equal_exact():
    rng = np.random.default_rng(0)
    for n in (7, 300, 2000):  # table and per-row paths
        m = rng.integers(0, n + 1, 300)
        k = rng.integers(-1, n + 1, 300) % (m + 1)
        got = cb.binom_pvalues(k, m, 0.07)
        ref = [cb.binom_pvalue(int(a), int(b), 0.07) for a, b in zip(k, m, strict=True)]
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
            [cb.ltt_max_error(c, wrong, E, d, n_grid=50) for c in confs]
            for d in (DELTA, DELTA / configs)
        ]
        naive += cb.choose_in_family(at[0]) >= 0
        bonf += cb.choose_in_family(at[1]) >= 0
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


# ------------------------------------------------------------------------------- splits, setup


def _with_setup(run_dir, small="models/small", large="models/large", **judge):
    """Record a setup in a synthetic run's config, as eval does (``judge``: the judge variant
    keys, absent as in runs from before the variants unless given)."""
    res = json.loads((run_dir / "results.json").read_text())
    res["config"] |= {"models": {"small": small, "large": large}, "agent": "deepeyes"}
    res["config"] |= {"judge_mode": "decode", "judge_threshold": 0.4, **judge}
    (run_dir / "results.json").write_text(json.dumps(res))
    return run_dir


def test_split_is_stratified_seeded_and_order_free(run):
    split = parse_split("40:30:30", seed=3)
    parts = split_indices(run.ids, run.categories, split)
    assert sorted(np.concatenate(parts).tolist()) == list(range(run.n))
    for cat in run.category_names:
        in_cat = int(np.sum(run.categories == cat))
        sizes = [int(np.sum(run.categories[p] == cat)) for p in parts]
        assert all(abs(s - w / 100 * in_cat) <= 1 for s, w in zip(sizes, (40, 30, 30), strict=True))
    # The same ids land in the same parts whatever the log order; another seed cuts otherwise.
    rev = split_indices(run.ids[::-1], run.categories[::-1], split)
    assert [sorted(run.ids[i] for i in p) for p in parts] == [
        sorted(run.ids[::-1][i] for i in p) for p in rev
    ]
    other = split_indices(run.ids, run.categories, parse_split("40:30:30", seed=4))
    assert not np.array_equal(parts[0], other[0])
    for bad in ("50", "1:2:3:4", "a:b", "0:1", "-1:2"):
        with pytest.raises(ValueError, match="--split"):
            parse_split(bad)
    assert split.index("calib") == 1 and split.index("3") == 2
    with pytest.raises(ValueError, match="unknown part"):
        split.index("train")


def test_calibrate_on_split_reports_held_out(run):
    cal = cb.calibrate(run, max_error=0.15, confidence=0.9, split=parse_split("50:50"))
    assert cal.passed and cal.split == "50:50 (seed 0)"
    calib, test = split_indices(run.ids, run.categories, parse_split("50:50"))
    assert cal.n_queries == len(calib)
    h = cal.held_out
    assert h["n"] == len(test)
    # The held-out numbers are those of the test part replayed at the calibrated tau.
    test_run = subset_run(run, test)
    row = rg.regate(test_run, [cal.tau], cal.top_k, cal.agg)[0]
    assert h["accuracy"] == pytest.approx(row.accuracy) and h["speedup"] == pytest.approx(
        row.speedup
    )
    assert h["accepted_error"] == pytest.approx(row.accepted_error)
    assert "held out (test part" in cb.format_calibration(cal)
    assert "in-sample" in cb.format_calibration(cb.calibrate(run, max_error=0.15))


def test_family_is_recorded_with_bonferroni_levels(run):
    cal = cb.calibrate(run, max_error=0.15, top_k=[8, 16], agg=["min", "mean"])
    assert len(cal.family) == 4 and all(m["delta"] == pytest.approx(0.1 / 4) for m in cal.family)
    kept = [m for m in cal.family if m["passed"]]
    assert (cal.top_k, cal.agg) in {(m["top_k"], m["agg"]) for m in kept}
    assert cal.n_accepted == max(m["n_accepted"] for m in kept)
    # A single configuration is tested at the full delta, and accepts at least as much.
    one = cb.calibrate(run, max_error=0.15, top_k=cal.top_k, agg=cal.agg)
    assert one.family[0]["delta"] == pytest.approx(0.1) and one.n_accepted >= cal.n_accepted


def test_holdout_run_must_be_another_run_of_the_same_setup(tmp_path):
    a = load_run(_with_setup(write_synthetic_run(tmp_path / "a", 1500, seed=1, k_logged=16)))
    b_dir = _with_setup(write_synthetic_run(tmp_path / "b", 800, seed=2, k_logged=16))
    ids = {"q": "h"}  # synthetic ids repeat across runs: rename the held-out ones
    text = (b_dir / "samples.jsonl").read_text().replace('"id": "q', f'"id": "{ids["q"]}')
    (b_dir / "samples.jsonl").write_text(text)
    cal = cb.calibrate(a, max_error=0.15, holdout=load_run(b_dir))
    assert cal.holdout == str(b_dir) and cal.held_out["n"] == 800
    with pytest.raises(ValueError, match="shares 1500 queries"):
        cb.calibrate(a, max_error=0.15, holdout=a)
    c_dir = _with_setup(write_synthetic_run(tmp_path / "c", 300, seed=3, k_logged=16), small="x")
    with pytest.raises(ValueError, match="another models"):
        cb.calibrate(a, max_error=0.15, holdout=load_run(c_dir))
    # A run without the judge keys had the large judge on the full image: the same judge as one
    # that records it, another judge than the small one or a smaller view.
    b_large = _with_setup(b_dir, judge="large", judge_max_pixels=None)
    assert cb.calibrate(a, max_error=0.15, holdout=load_run(b_large)).judge == "large"
    for judge in ({"judge": "small"}, {"judge": "large", "judge_max_pixels": 200704}):
        other = load_run(_with_setup(b_dir, **judge))
        with pytest.raises(ValueError, match="another judge"):
            cb.calibrate(a, max_error=0.15, holdout=other)
    with pytest.raises(ValueError, match="either a split or a holdout"):
        cb.calibrate(a, split=parse_split("50:50"), holdout=load_run(b_dir))


def test_file_records_the_setup_and_eval_checks_it(tmp_path):
    from speceyes.cli import build_parser
    from speceyes.factory import Settings

    d = _with_setup(write_synthetic_run(tmp_path / "r", 2000, seed=5, k_logged=16, alpha=0.5))
    cal = cb.calibrate(load_run(d), max_error=0.15)
    path = cb.write_calibration(cal, tmp_path / "cal.json")
    back = cb.read_calibration(path)
    assert back == cal and back.models == {"small": "models/small", "large": "models/large"}
    assert (back.agent, back.judge_mode, back.judge_threshold, back.alpha) == (
        "deepeyes", "decode", 0.4, 0.5,
    )  # fmt: skip

    def config(small, large, *extra):
        args = build_parser().parse_args(
            ["eval", "--bench", "jsonl", "--data", "x", "--small", small, "--large", large,
             "--calibration", str(path), *extra]
        )  # fmt: skip
        return Settings.from_args(args).resolved().funnel

    fc = config("models/small", "models/large/")
    assert (fc.tau, fc.top_k, fc.agg, fc.alpha) == (cal.tau, 16, "min", 0.5)
    assert (fc.judge_mode, fc.judge_threshold) == ("decode", 0.4)
    with pytest.raises(ValueError, match="made for --large 'models/large', not 'other'"):
        config("models/small", "other")
    with pytest.raises(ValueError, match="made with --agent deepeyes, not thyme"):
        config("models/small", "models/large", "--agent", "thyme")
    path.write_text(json.dumps(cal.to_dict() | {"models": None}))
    with pytest.raises(ValueError, match="records no models"):
        config("models/small", "models/large")
    path.write_text(json.dumps(cal.to_dict() | {"passed": False, "tau": 1.0}))
    with pytest.raises(ValueError, match="accepts nothing"):
        config("models/small", "models/large")


SETUP = ("models/small", "models/large", "deepeyes")


@pytest.fixture(scope="module")
def small_judge_cal(tmp_path_factory):
    """A calibration file made on a run with the small judge on a 200704-pixel view."""
    root = tmp_path_factory.mktemp("judge")
    run_dir = write_synthetic_run(root / "r", 2000, seed=5, k_logged=16)
    cal = cb.calibrate(
        load_run(_with_setup(run_dir, judge="small", judge_max_pixels=200704)), max_error=0.15
    )
    return cb.write_calibration(cal, root / "cal.json")


def _eval_config(path, *extra):
    from speceyes.cli import build_parser
    from speceyes.factory import Settings

    args = build_parser().parse_args(
        ["eval", "--bench", "jsonl", "--data", "x", "--small", SETUP[0], "--large", SETUP[1],
         "--calibration", str(path), *extra]
    )  # fmt: skip
    return Settings.from_args(args).resolved().funnel


def test_file_records_the_judge_and_refuses_another(small_judge_cal, tmp_path):
    cal = cb.read_calibration(small_judge_cal)
    assert (cal.judge, cal.judge_max_pixels, cal.version) == ("small", 200704, 3)
    assert "valid with --judge small on --judge-max-pixels 200704" in cb.format_calibration(cal)
    cb.check_setup(cal, *SETUP, judge="small", judge_max_pixels=200704)  # its own judge: passes
    for judge, pixels in (("large", None), ("small", None), ("small", 100352), ("none", None)):
        with pytest.raises(ValueError) as exc:
            cb.check_setup(cal, *SETUP, judge=judge, judge_max_pixels=pixels)
        assert "made with --judge small on --judge-max-pixels 200704, not --judge" in str(exc.value)
        assert "the guarantee holds only for the judge it was calibrated with" in str(exc.value)
    # eval without judge options runs the large judge on the full image: refused.
    with pytest.raises(ValueError, match="not --judge large on the full image"):
        _eval_config(small_judge_cal)


def test_eval_with_the_calibrated_judge_is_accepted(small_judge_cal):
    fc = _eval_config(small_judge_cal, "--judge", "small", "--judge-max-pixels", "200704")
    assert (fc.judge, fc.judge_max_pixels) == ("small", 200704)
    with pytest.raises(ValueError, match="not --judge large on --judge-max-pixels 200704"):
        _eval_config(small_judge_cal, "--judge-max-pixels", "200704")


def test_old_files_without_the_judge_mean_the_large_judge(small_judge_cal, tmp_path):
    data = json.loads(small_judge_cal.read_text())
    for key in ("judge", "judge_max_pixels"):
        del data[key]
    old = tmp_path / "v2.json"
    old.write_text(json.dumps(data | {"version": 2}))
    cal = cb.read_calibration(old)
    assert (cal.judge, cal.judge_max_pixels, cal.version) == ("large", None, 2)
    cb.check_setup(cal, *SETUP)  # the funnel's default judge
    assert _eval_config(old).judge == "large"
    with pytest.raises(ValueError, match="made with --judge large on the full image, not"):
        cb.check_setup(cal, *SETUP, judge="prefix")
    for bad, message in (
        ({"judge": "medium"}, "unknown judge 'medium'"),
        ({"judge_max_pixels": -1}, "judge_max_pixels must be a positive integer"),
        ({"judge_max_pixels": "200704"}, "judge_max_pixels must be a positive integer"),
    ):
        old.write_text(json.dumps(data | bad))
        with pytest.raises(ValueError, match=message):
            cb.read_calibration(old)


def test_nothing_passes_exits_nonzero_and_sizes_the_need(tmp_path, capsys):
    from speceyes.cli import main

    d = write_synthetic_run(tmp_path / "vstar-sized", 191, seed=3, k_logged=16)
    assert (
        main(["calibrate", str(d), "--max-error", "0.05", "--output", str(tmp_path / "c.json")])
        == 1
    )
    out = capsys.readouterr()
    assert "NO tau passed" in out.out and "eval and serve refuse it" in out.err
    cal = cb.read_calibration(tmp_path / "c.json")
    assert not cal.passed and cal.needed_n > 191
    assert f"about {cal.needed_n} queries would be needed" in out.out
    # Not an empty promise: a run twice that size from the same source passes.
    big = load_run(write_synthetic_run(tmp_path / "big", 2 * cal.needed_n, seed=5, k_logged=16))
    assert cb.calibrate(big, max_error=0.05).passed
    # Targets no amount of data reaches: recommend agent-only.
    assert (
        main(["calibrate", str(d), "--max-error", "0.001", "--output", str(tmp_path / "c.json")])
        == 1
    )
    assert "agent-only (--mode agent)" in capsys.readouterr().out
    assert cb.read_calibration(tmp_path / "c.json").needed_n is None
