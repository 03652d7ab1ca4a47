"""One guarantee over the cascade (speceyes.bench.cascade_calibration): coverage over repetitions
on fresh data, a naive per-stage procedure that breaks it, the cheapest-valid choice, per-category
thresholds, and the calibration file."""

import json

import numpy as np
import pytest

from speceyes.bench import cascade_calibration as cc
from speceyes.bench import cascade_replay as cr
from speceyes.bench import ltt
from speceyes.bench.calibration_file import read_calibration
from speceyes.bench.runlog import load_run
from speceyes.bench.splits import parse_split
from tests.tools.synthetic_cascade import Scenario, draw_cascade_log, write_synthetic_cascade_run

E, DELTA, REPS, N, GRID = 0.1, 0.1, 1000, 600, 50
FLAT = Scenario(flat_error=E + 0.002)  # every stage errs just above E: any acceptance violates
CORRELATED = Scenario()  # a latent ease drives every stage: stages' errors are correlated


def _upper_tail(v: int, reps: int, rate: float) -> float:
    """P(Bin(reps, rate) >= v): how surprising v violations are if the true rate is ``rate``."""
    return 1.0 - ltt.binom_cdf(v - 1, reps, rate)


@pytest.fixture(scope="module")
def fresh():
    """A large fresh sample of the correlated scenario: the truth any thresholds are judged on."""
    return draw_cascade_log(np.random.default_rng(10**6), 200_000, CORRELATED)


def _true_risk(scenario, fresh_log, taus):
    """Error among all accepted answers at ``taus`` on fresh data (exact for the flat one)."""
    if all(t >= ltt.NO_TAU for t in taus.values()):
        return 0.0
    if scenario.flat_error is not None:
        return scenario.flat_error
    idx = cr.accepted_stage(fresh_log, cr.tau_matrix(fresh_log.stages, taus))
    m, k = cr.accepted_wrong(fresh_log, idx)
    return float(k[0] / m[0]) if m[0] else 0.0


def _naive_per_stage(log, max_error, delta):
    """The broken procedure: each stage in order tested at delta (no correction) on the queries
    the earlier stages leave it, all on the same data."""
    taus = np.full(len(log.stages), np.inf)
    for j in range(len(log.stages)):
        reach = (cr.accepted_stage(log, taus[None, :])[:, 0] < 0) & log.eligible[:, j]
        res = ltt.ltt_max_error(
            log.conf[reach, j], log.wrong[reach, j], max_error, delta, n_grid=GRID
        )
        taus[j] = res.tau
    return dict(zip(log.stages, taus.tolist(), strict=True))


def _naive_paths(log, max_error, delta):
    """The joint test without its correction over paths: every path at delta."""
    dirs = cc.default_directions(len(log.stages))
    best = {s: ltt.NO_TAU for s in log.stages}
    for w in dirs:
        ch = cc.certify_cascade(log, max_error, delta, directions=w[None, :], n_grid=GRID)
        if ch.passed:
            best = ch.taus
    return best


def _violations(scenario, fresh_log, choose, reps=REPS, n=N):
    bad, accepted = 0, 0.0
    for rep in range(reps):
        log = draw_cascade_log(np.random.default_rng(rep), n, scenario)
        taus = choose(log)
        bad += _true_risk(scenario, fresh_log, taus) > E
        idx = cr.accepted_stage(log, cr.tau_matrix(log.stages, taus))
        accepted += float(np.mean(idx >= 0)) / reps
    return bad, accepted


@pytest.mark.slow
@pytest.mark.parametrize("family", cc.PATH_FAMILIES)
@pytest.mark.parametrize("scenario", [FLAT, CORRELATED], ids=["flat", "correlated"])
def test_fixed_sequence_coverage(scenario, family, fresh):
    def choose(log):
        paths = cc.path_family(family, len(log.stages))
        return cc.certify_cascade(log, E, DELTA, directions=paths, n_grid=GRID).taus

    bad, accepted = _violations(scenario, fresh, choose)
    # One-sided binomial check: a true violation rate of delta makes this count unsurprising.
    assert _upper_tail(bad, REPS, DELTA) > 1e-3, bad / REPS
    if scenario is CORRELATED:
        assert accepted > 0.2  # not vacuous: the cascade answers a real share itself


@pytest.mark.slow
@pytest.mark.parametrize("scenario", [FLAT, CORRELATED], ids=["flat", "correlated"])
def test_bonferroni_split_coverage(scenario, fresh):
    n = 2000 if scenario is CORRELATED else N  # each stage sees a quarter of the queries

    def choose(log):
        return cc.certify_cascade(log, E, DELTA, method=cc.BONFERRONI, n_grid=GRID).taus

    bad, accepted = _violations(scenario, fresh, choose, n=n)
    assert _upper_tail(bad, REPS, DELTA) > 1e-3, bad / REPS
    if scenario is CORRELATED:
        assert accepted > 0.1


@pytest.mark.slow
def test_naive_procedures_violate(fresh):
    """Without the correction over stages (or over paths) the same check fails: the test can
    fail."""
    per_stage, _ = _violations(FLAT, fresh, lambda log: _naive_per_stage(log, E, DELTA))
    assert _upper_tail(per_stage, REPS, DELTA) < 1e-6, per_stage / REPS
    paths, _ = _violations(FLAT, fresh, lambda log: _naive_paths(log, E, DELTA), reps=400)
    assert _upper_tail(paths, 400, DELTA) < 1e-6, paths / 400


@pytest.mark.slow
def test_per_category_guarantee_holds_in_every_category():
    """Category b errs just above E everywhere, a is easy: pooled thresholds often let b's
    answers through; per-category thresholds at delta / 2 accept any of b's in at most delta of
    the repetitions."""
    reps, n, pooled_b, per_cat_b, a_accepted = 500, 1600, 0, 0, 0.0
    for rep in range(reps):
        rng = np.random.default_rng(50_000 + rep)
        good = draw_cascade_log(rng, n, CORRELATED)
        bad = draw_cascade_log(rng, n, FLAT)
        cats = np.where(np.arange(n) % 2 == 0, "a", "b").astype(object)
        log = _mix(good, bad, cats)
        in_b = log.categories == "b"
        pooled = cc.certify_cascade(log, E, DELTA, n_grid=GRID)
        idx = cr.accepted_stage(log, cr.tau_matrix(log.stages, pooled.taus))[:, 0]
        pooled_b += bool(np.any(idx[in_b] >= 0))
        per = cc.certify_per_category(log, E, DELTA, n_grid=GRID)
        assert all(c.delta == DELTA / 2 for c in per.values())
        per_cat_b += per["b"].passed
        a_accepted += per["a"].n_accepted / np.sum(~in_b) / reps
    assert _upper_tail(per_cat_b, reps, DELTA) > 1e-3, per_cat_b / reps
    assert pooled_b > 2 * per_cat_b  # the pooled guarantee says nothing about b alone
    assert a_accepted > 0.05


def _mix(good, bad, cats):
    """Rows of ``good`` where cats is 'a', of ``bad`` where 'b'."""
    take_bad = (cats == "b")[:, None]
    pick = lambda x, y: np.where(take_bad if x.ndim == 2 else take_bad[:, 0], y, x)  # noqa: E731
    return cr.CascadeLog(
        good.stages,
        pick(good.conf, bad.conf),
        pick(good.wrong, bad.wrong),
        pick(good.eligible, bad.eligible),
        good.seconds,
        good.judge_seconds,
        good.agent_seconds,
        good.agent_correct,
        cats,
    )


def test_keeps_the_cheapest_certified_vector():
    log = draw_cascade_log(np.random.default_rng(3), 3000, CORRELATED)
    cost = cr.gpu_time_cost(log)
    ch = cc.certify_cascade(log, E, DELTA, n_grid=GRID)
    assert ch.passed and ch.valid > 1
    idx = cr.accepted_stage(log, cr.tau_matrix(log.stages, ch.taus))
    assert cost(idx, cr.tau_matrix(log.stages, ch.taus))[0] == pytest.approx(ch.cost)
    # Each path's own last certified vector is no cheaper than the one kept.
    paths = cc.default_directions(len(log.stages))
    for w in paths:
        alone = cc.certify_cascade(log, E, DELTA / len(paths), directions=w[None, :], n_grid=GRID)
        if alone.passed:
            assert ch.cost <= alone.cost + 1e-9
    m, k = cr.accepted_wrong(log, idx)
    assert (int(m[0]), int(k[0])) == (ch.n_accepted, ch.errors)
    assert ch.bound == pytest.approx(
        ltt.clopper_pearson_upper(ch.errors, ch.n_accepted, DELTA / len(paths))
    )


def test_a_costlier_stage_is_used_less():
    """Make large_direct cost as much as the agent: the kept vector then accepts little there."""
    log = draw_cascade_log(np.random.default_rng(4), 4000, CORRELATED)
    cheap = cc.certify_cascade(log, E, DELTA, n_grid=GRID)
    seconds = log.seconds.copy()
    seconds[:, -1] = 5.9
    dear = cr.CascadeLog(**{**log.__dict__, "seconds": seconds})
    costly = cc.certify_cascade(dear, E, DELTA, n_grid=GRID)
    share = [
        np.mean(cr.accepted_stage(x, cr.tau_matrix(x.stages, c.taus))[:, 0] == 3)
        for x, c in ((log, cheap), (dear, costly))
    ]
    assert share[1] <= share[0]


def test_stage_parts_are_disjoint_and_label_free():
    log = draw_cascade_log(np.random.default_rng(5), 401, CORRELATED)
    parts = cc.stage_parts(log, seed=0)
    assert len(parts) == 4 and sorted(np.concatenate(parts).tolist()) == list(range(401))
    flipped = cr.CascadeLog(**{**log.__dict__, "wrong": ~log.wrong})
    assert all(np.array_equal(a, b) for a, b in zip(parts, cc.stage_parts(flipped, 0), strict=True))


def test_no_valid_vector_accepts_nothing():
    log = draw_cascade_log(np.random.default_rng(6), 500, Scenario(flat_error=0.5))
    for method in cc.CASCADE_METHODS:
        ch = cc.certify_cascade(log, E, DELTA, method=method, n_grid=GRID)
        assert not ch.passed and all(t == ltt.NO_TAU for t in ch.taus.values())
    with pytest.raises(ValueError, match="unknown cascade method"):
        cc.certify_cascade(log, E, DELTA, method="holm")


# ------------------------------------------------------------------------------- a run, the file


def test_calibrate_run_writes_the_file(tmp_path):
    run_dir = write_synthetic_cascade_run(tmp_path / "run", 800, seed=2, small0_in_stages=True)
    run = load_run(run_dir)
    cal = cc.calibrate_cascade(run, 0.1, 0.9, per_category=True, split=parse_split("60:40"))
    path = cc.write_cascade_calibration(cal, tmp_path / "cal.json")
    data = json.loads(path.read_text())
    assert data["cascade_method"] == "fixed-sequence"
    taus = cc.read_stage_taus(path)
    assert list(taus) == ["small@0", "small@1", "small@2", "large_direct"]
    assert taus == cal.stages == cc.read_stage_taus(data)
    per = cc.read_category_taus(path)
    assert set(per) == {"direct_attributes", "relative_position"} and per == cal.per_category
    old = read_calibration(path)  # the single-stage reader still reads it; tau is small@0's
    assert old.tau == taus["small@0"] and old.passed
    assert data["cascade"]["speculate_depth"] == 2 and data["cascade"]["middle_tier"] is True
    held = data["cascade"]["held_out"]
    assert held["n"] == pytest.approx(320, abs=2) and data["held_out"]["n"] == held["n"]
    text = cc.format_cascade_calibration(cal)
    assert "ALL accepted answers" in text and "held out" in text


def test_readers_refuse_bad_files(tmp_path):
    assert cc.read_stage_taus({"tau": 0.9, "top_k": 20, "agg": "min"}) == {}
    assert cc.read_category_taus({"tau": 0.9}) == {}
    with pytest.raises(ValueError, match="unknown cascade stage"):
        cc.read_stage_taus({"stages": {"small@x": 0.5}})
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        cc.read_stage_taus({"stages": {"small@1": 1.5}})
    with pytest.raises(ValueError, match="must be an object"):
        cc.read_category_taus({"per_category": {"a": [0.5]}})
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"stages": {"large_direct": 0.9, "small@0": 0.8}}))
    assert list(cc.read_stage_taus(p)) == ["small@0", "large_direct"]
