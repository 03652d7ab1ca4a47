"""Calibrating tau on a logged run (speceyes.bench.calibrate) and the calibration file
(speceyes.bench.calibration_file)."""

import json

import numpy as np
import pytest

from speceyes.bench import calibrate as cb
from speceyes.bench import calibration_file as cf
from speceyes.bench import regate as rg
from speceyes.bench.runlog import load_run
from speceyes.bench.splits import parse_split, split_indices, subset_run
from tests.tools.synthetic_run import write_synthetic_run

# ------------------------------------------------------------------------------- on a run


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("cal") / "both"
    return load_run(write_synthetic_run(d, 3000, seed=11, mode="both", k_logged=16))


def test_calibrate_run_and_roundtrip(run, tmp_path):
    cal = cb.calibrate(run, max_error=0.15, confidence=0.9)
    assert cal.method == "ltt-fixed-sequence-clopper-pearson" and cal.passed
    assert 0 < cal.tau < 1 and cal.bound <= 0.15
    assert (cal.top_k, cal.agg, cal.scale) == (16, "min", 0.6)
    assert cal.n == int(np.sum(run.judge_tool == 0)) and cal.n_accepted > 0
    assert 0 < cal.expected_acceptance <= 1 and cal.expected_speedup > 1
    path = cf.write_calibration(cal, tmp_path / "cal" / "tau.json")
    data = json.loads(path.read_text())
    for key in ("tau", "top_k", "agg", "scale", "max_error", "confidence", "method", "n"):
        assert key in data
    back = cf.read_calibration(path)
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
    assert cf.read_calibration(cf.write_calibration(cal, tmp_path / "c.json")).tau == 1.0


def test_read_calibration_errors(tmp_path):
    p = tmp_path / "c.json"
    with pytest.raises(FileNotFoundError):
        cf.read_calibration(p)
    p.write_text("{oops")
    with pytest.raises(ValueError, match="not valid JSON"):
        cf.read_calibration(p)
    p.write_text(json.dumps({"tau": 0.9}))
    with pytest.raises(ValueError, match="missing required keys: top_k, agg"):
        cf.read_calibration(p)
    p.write_text(json.dumps({"tau": 0.9, "top_k": 64, "agg": "max"}))
    with pytest.raises(ValueError, match="unknown aggregation"):
        cf.read_calibration(p)
    p.write_text(json.dumps({"tau": 0.9, "top_k": 20, "agg": "log", "extra": 1}))
    cal = cf.read_calibration(p)
    assert (cal.tau, cal.top_k, cal.agg, cal.scale) == (0.9, 20, "log", 0.6)


def test_old_key_alpha_still_reads_as_the_scale(tmp_path):
    """Files and runs written before the rename call the sigmoid scale "alpha"."""
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"tau": 0.9, "top_k": 20, "agg": "log", "alpha": 0.45}))
    assert cf.read_calibration(p).scale == 0.45
    p.write_text(json.dumps({"tau": 0.9, "top_k": 20, "agg": "log", "scale": 0.35}))
    assert cf.read_calibration(p).scale == 0.35
    old = write_synthetic_run(tmp_path / "old", 50, seed=1, scale=0.45)
    results = json.loads((old / "results.json").read_text())
    results["config"]["alpha"] = results["config"].pop("scale")
    (old / "results.json").write_text(json.dumps(results))
    assert load_run(old).scale == 0.45


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

    d = _with_setup(write_synthetic_run(tmp_path / "r", 2000, seed=5, k_logged=16, scale=0.5))
    cal = cb.calibrate(load_run(d), max_error=0.15)
    path = cf.write_calibration(cal, tmp_path / "cal.json")
    back = cf.read_calibration(path)
    assert back == cal and back.models == {"small": "models/small", "large": "models/large"}
    assert (back.agent, back.judge_mode, back.judge_threshold, back.scale) == (
        "deepeyes", "decode", 0.4, 0.5,
    )  # fmt: skip

    def config(small, large, *extra):
        args = build_parser().parse_args(
            ["eval", "--bench", "jsonl", "--data", "x", "--small", small, "--large", large,
             "--calibration", str(path), *extra]
        )  # fmt: skip
        return Settings.from_args(args).resolved().funnel

    fc = config("models/small", "models/large/")
    assert (fc.tau, fc.top_k, fc.agg, fc.scale) == (cal.tau, 16, "min", 0.5)
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
    return cf.write_calibration(cal, root / "cal.json")


def _eval_config(path, *extra):
    from speceyes.cli import build_parser
    from speceyes.factory import Settings

    args = build_parser().parse_args(
        ["eval", "--bench", "jsonl", "--data", "x", "--small", SETUP[0], "--large", SETUP[1],
         "--calibration", str(path), *extra]
    )  # fmt: skip
    return Settings.from_args(args).resolved().funnel


def test_file_records_the_judge_and_refuses_another(small_judge_cal, tmp_path):
    cal = cf.read_calibration(small_judge_cal)
    assert (cal.judge, cal.judge_max_pixels, cal.version) == ("small", 200704, 3)
    assert "valid with --judge small on --judge-max-pixels 200704" in cb.format_calibration(cal)
    cf.check_setup(cal, *SETUP, judge="small", judge_max_pixels=200704)  # its own judge: passes
    for judge, pixels in (("large", None), ("small", None), ("small", 100352), ("none", None)):
        with pytest.raises(ValueError) as exc:
            cf.check_setup(cal, *SETUP, judge=judge, judge_max_pixels=pixels)
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
    cal = cf.read_calibration(old)
    assert (cal.judge, cal.judge_max_pixels, cal.version) == ("large", None, 2)
    cf.check_setup(cal, *SETUP)  # the funnel's default judge
    assert _eval_config(old).judge == "large"
    with pytest.raises(ValueError, match="made with --judge large on the full image, not"):
        cf.check_setup(cal, *SETUP, judge="prefix")
    for bad, message in (
        ({"judge": "medium"}, "unknown judge 'medium'"),
        ({"judge_max_pixels": -1}, "judge_max_pixels must be a positive integer"),
        ({"judge_max_pixels": "200704"}, "judge_max_pixels must be a positive integer"),
    ):
        old.write_text(json.dumps(data | bad))
        with pytest.raises(ValueError, match=message):
            cf.read_calibration(old)


def test_nothing_passes_exits_nonzero_and_sizes_the_need(tmp_path, capsys):
    from speceyes.cli import main

    d = write_synthetic_run(tmp_path / "vstar-sized", 191, seed=3, k_logged=16)
    assert (
        main(["calibrate", str(d), "--max-error", "0.05", "--output", str(tmp_path / "c.json")])
        == 1
    )
    out = capsys.readouterr()
    assert "NO tau passed" in out.out and "eval and serve refuse it" in out.err
    cal = cf.read_calibration(tmp_path / "c.json")
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
    assert cf.read_calibration(tmp_path / "c.json").needed_n is None


# ------------------------------------------------------------------------------- the setup value


def _with_settings(run_dir, settings):
    """Record ``settings`` in a synthetic run's config as eval does today (under "settings",
    beside the flat keys, which here say something else: the settings are what is read)."""
    res = json.loads((run_dir / "results.json").read_text())
    res["config"] |= {"models": {"small": "flat/small", "large": "flat/large"}, "agent": "thyme"}
    res["config"][cf.SETTINGS_KEY] = json.loads(json.dumps(settings.resolved().to_dict()))
    (run_dir / "results.json").write_text(json.dumps(res))
    return run_dir


def _settings(**changes):
    from dataclasses import replace

    from speceyes.factory import Settings

    base = Settings(small="models/small", large="models/large")
    base = base.with_funnel(judge="small", judge_max_pixels=200704)
    return replace(base, **changes)


def test_a_run_with_settings_is_calibrated_for_the_setup_they_give(tmp_path):
    from speceyes.factory import AgentSettings

    settings = _settings()
    d = _with_settings(write_synthetic_run(tmp_path / "r", 2000, seed=5, k_logged=16), settings)
    cal = cb.calibrate(load_run(d), max_error=0.15)
    assert cal.setup == cf.setup_of(settings) == cf.run_setup(load_run(d).config)
    assert (cal.models, cal.agent, cal.judge, cal.judge_max_pixels) == (
        {"small": "models/small", "large": "models/large"}, "deepeyes", "small", 200704,
    )  # fmt: skip
    path = cf.write_calibration(cal, tmp_path / "cal.json")
    # The file keeps the setup's keys where every version wrote them.
    data = json.loads(path.read_text())
    assert {k: data[k] for k in cal.setup.to_dict()} == cal.setup.to_dict()
    back = cf.read_calibration(path)
    assert back.setup == cal.setup
    # The same settings take the calibration (its gate and judge mode applied)...
    applied = settings.with_calibration(path)
    assert (applied.funnel.tau, applied.funnel.top_k) == (cal.tau, cal.top_k)
    # ...other settings are refused with every differing field named.
    other = _settings(large="other", agent=AgentSettings(kind="thyme")).with_funnel(judge="large")
    with pytest.raises(ValueError) as exc:
        other.with_calibration(path)
    message = str(exc.value)
    assert "another setup (large, agent, judge differ)" in message
    assert "made for --large 'models/large', not 'other'" in message
    assert "made with --agent deepeyes, not thyme" in message
    assert "made with --judge small on --judge-max-pixels 200704, not --judge large" in message
    with pytest.raises(ValueError, match=r"another setup \(judge_max_pixels differ\)"):
        settings.with_funnel(judge_max_pixels=100352).with_calibration(path)


def test_a_run_without_settings_gives_its_flat_keys_as_before(tmp_path):
    d = _with_setup(write_synthetic_run(tmp_path / "r", 500, seed=5, k_logged=16))
    assert cf.run_setup(load_run(d).config) == cf.CalibrationSetup(
        {"small": "models/small", "large": "models/large"}, "deepeyes", "large", None
    )
    bare = write_synthetic_run(tmp_path / "bare", 200, seed=5, k_logged=16)
    assert cf.run_setup(load_run(bare).config) == cf.CalibrationSetup(None, None, "large", None)


def test_a_version_3_file_is_checked_as_before(tmp_path):
    from speceyes.factory import Settings

    old = {
        "tau": 0.7, "top_k": 16, "agg": "min", "alpha": 0.5, "max_error": 0.1, "confidence": 0.9,
        "method": "ltt-fixed-sequence-clopper-pearson", "n": 100, "passed": True,
        "models": {"small": "models/small", "large": "models/large"}, "agent": "deepeyes",
        "judge_mode": "decode", "judge_threshold": 0.4, "judge": "small",
        "judge_max_pixels": 200704, "version": 3,
    }  # fmt: skip
    path = tmp_path / "v3.json"
    path.write_text(json.dumps(old))
    cal = cf.read_calibration(path)
    assert cal.setup == cf.setup_of(_settings())
    applied = _settings().with_calibration(path).funnel
    assert (applied.tau, applied.scale, applied.judge_mode) == (0.7, 0.5, "decode")
    with pytest.raises(ValueError, match="made with --agent deepeyes, not thyme"):
        cf.check_setup(cal, "models/small", "models/large", "thyme", "small", 200704)
    with pytest.raises(ValueError, match="records no models"):
        path.write_text(json.dumps(old | {"models": None}))
        Settings(small="models/small", large="models/large").with_calibration(path)
