"""``speceyes calibrate --operating-points``: the points of ``--judge auto`` calibrated as one
family, the file ``--points`` reads, and the guarantee over whichever point answers."""

import json

import numpy as np
import pytest

from speceyes.bench import ltt
from speceyes.bench import points_calibration as pcal
from speceyes.bench import regate as rg
from speceyes.bench.runlog import load_run
from speceyes.operating_points import AUTO, read_points_file
from tests.tools.synthetic_run import write_synthetic_run

MODELS = ("models/small", "models/large")


def _with_judge(run_dir, judge, mode="both"):
    """Record a setup and a judge variant in a synthetic run's config, as eval does."""
    res = json.loads((run_dir / "results.json").read_text())
    res["config"] |= {
        "models": {"small": MODELS[0], "large": MODELS[1]},
        "agent": "deepeyes",
        "judge": judge,
        "judge_mode": "logit",
    }
    (run_dir / "results.json").write_text(json.dumps(res))
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("points")
    large = write_synthetic_run(root / "large", 2000, seed=3, k_logged=16, p_tool=0.3)
    small = write_synthetic_run(root / "small", 2000, seed=4, k_logged=16, p_tool=0.5)
    return _with_judge(large, "large"), _with_judge(small, "small")


def test_one_point_per_run_plus_none_each_at_delta_over_p(runs, tmp_path):
    pc = pcal.calibrate_points([load_run(r) for r in runs], max_error=0.15, confidence=0.9)
    assert [c.judge for c in pc.calibrations] == ["large", "small", "none"]
    assert pc.family == 3 and pc.point_delta == pytest.approx(0.1 / 3)
    for c in pc.calibrations:
        assert c.confidence == pytest.approx(1 - 0.1 / 3) and c.passed and c.bound <= 0.15
    large_run = load_run(runs[0])
    # "none" is calibrated on every small answer of the first judged run, not only the
    # judged tool-free ones, so it is tested on more queries
    none = pc.calibrations[2]
    assert none.n == int(large_run.has_small.sum()) > pc.calibrations[0].n
    path = pcal.write_points_calibration(pc, tmp_path / "points.json")
    pf = read_points_file(path)
    # and the agent-only point, which accepts no small answer (not one of the tested three)
    assert [p.judge for p in pf.points] == ["large", "small", "none", "agent"]
    assert pf.points[-1].skipped == 0.0 and pf.points[-1].tau is None
    assert pf.setup == {"models": dict(zip(("small", "large"), MODELS, strict=True)),
                        "agent": "deepeyes"}  # fmt: skip
    assert pf.gate == {"top_k": 16, "agg": "min", "scale": 0.6}
    assert pf.guarantee["confidence"] == 0.9 and pf.guarantee["points_tested"] == 3
    text = pcal.format_points_calibration(pc)
    assert "each at delta/3" in text and "whichever points answer" in text


def test_point_rates_are_measured_at_each_points_own_tau(runs):
    pc = pcal.calibrate_points([load_run(runs[0])], max_error=0.15, confidence=0.9)
    run = load_run(runs[0])
    conf = np.nan_to_num(rg.confidences(run, 16, "min", 0.6), nan=-np.inf)
    tool_free, tool = run.judge_tool == 0, run.judge_tool == 1
    large, none, _agent = pc.points
    assert large.beta == pytest.approx(tool_free.mean())
    assert large.alpha == pytest.approx((conf[tool_free] > large.tau).mean())
    assert none.alpha == pytest.approx((conf[tool_free] > none.tau).mean())
    assert none.alpha_tool == pytest.approx((conf[tool] > none.tau).mean())
    # what none skips is the gate's acceptance over every query
    assert none.skipped == pytest.approx((conf > none.tau).mean())


def test_points_file_sets_auto_applies_the_gate_and_refuses_other_models(runs, tmp_path):
    from speceyes.cli import build_parser
    from speceyes.factory import Settings

    pc = pcal.calibrate_points([load_run(r) for r in runs], max_error=0.15, confidence=0.9)
    path = pcal.write_points_calibration(pc, tmp_path / "points.json")

    def settings(*extra, models=MODELS):
        args = build_parser().parse_args(
            ["serve", "--small", models[0], "--large", models[1], "--agent", "deepeyes", *extra]
        )
        return Settings.from_args(args)

    assert settings().funnel.judge == "large"  # no points: the published judge
    f = settings("--points", str(path)).funnel
    assert f.judge == AUTO and (f.top_k, f.agg, f.judge_mode) == (16, "min", "logit")
    f.validate()
    assert [p.tau for p in f.operating_points()] == [c.tau for c in pc.calibrations] + [None]
    with pytest.raises(ValueError, match="operating points are for --judge auto"):
        settings("--points", str(path), "--judge", "large").funnel.validate()
    with pytest.raises(ValueError, match=r"another setup \(large differ"):
        settings("--points", str(path), models=(MODELS[0], "other/large"))
    with pytest.raises(ValueError, match=r"another setup \(agent differ"):
        Settings.from_args(build_parser().parse_args(
            ["serve", "--small", MODELS[0], "--large", MODELS[1], "--agent", "thyme",
             "--points", str(path)]
        ))  # fmt: skip


def test_cli_writes_the_points_and_refuses_what_it_cannot_certify(runs, tmp_path, capsys):
    from speceyes.cli import main

    out = tmp_path / "p.json"
    assert main(["calibrate", str(runs[0]), str(runs[1]), "--operating-points",
                 "--max-error", "0.15", "--split", "50:50", "--output", str(out)]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "held-out error among accepted" in text and f"wrote {out}" in text
    cals = json.loads(out.read_text())["calibrations"]
    assert all(c["held_out"]["n"] == 1000 for c in cals)  # the same test part for every point
    speceyes_run = write_synthetic_run(tmp_path / "sp", 200, seed=1, mode="speceyes")
    for argv, why in (
        ([str(speceyes_run), "--operating-points"], "need --mode both runs"),
        ([str(runs[0]), str(runs[0]), "--operating-points"], "one run per judge variant"),
        ([str(runs[0]), "--operating-points", "--top-k", "8,16"], "one --top-k and one --agg"),
        ([str(runs[0]), str(runs[1])], "several are for --operating-points"),
    ):
        assert main(["calibrate", *argv]) == 2
        assert why in capsys.readouterr().err
    # nothing passes: exit 1, and --points refuses the record
    assert main(["calibrate", str(runs[0]), "--operating-points", "--max-error", "0.001",
                 "--output", str(tmp_path / "none.json")]) == 1  # fmt: skip
    with pytest.raises(ValueError, match="non-empty list"):
        read_points_file(tmp_path / "none.json")


def test_the_guarantee_holds_whichever_point_answers():
    """Five points (four judge variants, each with its own tool-free share, and none on every
    query) on risk just above E everywhere, so any point that passes breaks the promise for the
    batches it serves. Tested at delta/5 each, the share of calibration sets in which some
    point breaks it stays within delta; tested at delta each, it does not."""
    e, delta, reps, n = 0.1, 0.1, 300, 400
    bonf = naive = 0
    for rep in range(reps):
        rng = np.random.default_rng(50_000 + rep)
        conf = rng.random(n)
        wrong = rng.random(n) < e * 1.05
        populations = [rng.random(n) < share for share in (0.5, 0.6, 0.7, 0.8)]
        populations.append(np.ones(n, bool))
        for level, count in ((delta / len(populations), "bonf"), (delta, "naive")):
            passed = any(
                ltt.ltt_max_error(conf[m], wrong[m], e, level, n_grid=50).passed
                for m in populations
            )
            if count == "bonf":
                bonf += passed
            else:
                naive += passed

    def tail(v):
        return 1.0 - ltt.binom_cdf(v - 1, reps, delta)

    assert tail(bonf) > 1e-3, bonf / reps
    assert tail(naive) < 1e-3, naive / reps


def test_runs_of_another_setup_are_refused(runs, tmp_path):
    other = write_synthetic_run(tmp_path / "other", 300, seed=9, k_logged=16)
    _with_judge(other, "prefix")
    res = json.loads((other / "results.json").read_text())
    res["config"]["models"]["large"] = "models/other-large"
    (other / "results.json").write_text(json.dumps(res))
    with pytest.raises(ValueError, match="differ in large: operating points are alternatives"):
        pcal.calibrate_points([load_run(runs[0]), load_run(other)], max_error=0.15)
