"""The cascade replayed offline from a both-log (speceyes.bench.cascade_replay) and the
``regate --cascade`` / ``calibrate --cascade`` commands."""

import json

import numpy as np
import pytest

from speceyes import gate
from speceyes.bench import cascade_replay as cr
from speceyes.bench import regate as rg
from speceyes.bench.runlog import load_run
from speceyes.rundir import RunDir
from tests.tools.synthetic_cascade import write_synthetic_cascade_run


@pytest.fixture(scope="module")
def cascade_dir(tmp_path_factory):
    return write_synthetic_cascade_run(tmp_path_factory.mktemp("cascade"), 400, seed=3)


def _with_schedule(path):
    """The same run logged as batched in eights: the agent phase replays on its schedule."""
    rd = RunDir(path)
    results = rd.read_results()
    results["config"] |= {"schedule": "batched", "batch_size": 8}
    rd.write_results(results)
    return path


def _by_hand(run, taus):
    """Route and price every query with a plain loop over its logged stages (GPU-time model)."""
    order = ["small@0", "small@1", "small@2", "large_direct"]
    total, accepted, wrong, routes = 0.0, 0, 0, dict.fromkeys([*order, "agent"], 0)
    for s in run.samples:
        stages = {e["stage"]: e for e in s["stages"]}
        stages.setdefault(
            "small@0",
            {
                "confidence": s["confidence"],
                "correct": s["small_correct"],
                "seconds": s["timings"]["small"],
            },
        )
        total += s["timings"]["judge"]
        route = "agent"
        for name in order:
            if name not in taus or name not in stages or (name == "small@0" and s["judge_tool"]):
                continue  # not in the cascade, did not run for this query, or not eligible
            e = stages[name]
            total += e["seconds"]
            if gate.accept(e["confidence"], taus[name]):
                route = name
                accepted += 1
                wrong += not e["correct"]
                break
        routes[route] += 1
        if route == "agent":
            total += s["timings"]["agent"]
    agent_only = sum(s["timings"]["agent"] for s in run.samples)
    return routes, wrong / accepted, agent_only / total


def test_replay_matches_a_plain_loop(cascade_dir):
    run = load_run(cascade_dir)
    taus = {"small@0": 0.97, "small@1": 0.9, "large_direct": 0.95}  # small@2 not run
    r = cr.replay_cascade(run, taus)
    routes, err, speedup = _by_hand(run, taus)
    assert r.routes == routes and r.routes["small@2"] == 0
    assert r.accepted_error == pytest.approx(err) and r.speedup == pytest.approx(speedup)
    assert r.stages[2].reached == 0 and r.stages[2].seconds == 0.0
    first = r.stages[0]
    assert first.reached == int(np.sum(run.judge_tool == 0))  # small@0: judged tool-free only
    assert r.stages[1].reached == run.n - first.accepted  # later stages: every query left
    assert sum(r.routes.values()) == run.n
    assert "small@1" in cr.format_replay(r)


def test_a_stage_that_did_not_run_costs_nothing(tmp_path):
    """A small loop that ended early logs no deeper stage: that stage neither answers nor costs."""
    path = write_synthetic_cascade_run(tmp_path / "run", 300, seed=6)
    rd = RunDir(path)
    samples = rd.records()
    for s in samples[::3]:
        s["stages"] = [e for e in s["stages"] if e["stage"] != "small@2"]
    rd.rewrite(samples)
    run = load_run(path)
    taus = {"small@1": 0.95, "small@2": 0.3, "large_direct": 0.9}
    r = cr.replay_cascade(run, taus)
    routes, err, speedup = _by_hand(run, taus)
    assert r.routes == routes and r.speedup == pytest.approx(speedup)
    assert r.accepted_error == pytest.approx(err)
    log = cr.cascade_log(run)
    assert np.all(np.isnan(log.conf[::3, 2])) and np.all(log.seconds[::3, 2] == 0.0)


@pytest.mark.parametrize("schedule", [False, True], ids=["gpu-time", "batched"])
def test_small0_alone_is_regate(tmp_path, schedule):
    path = write_synthetic_cascade_run(tmp_path / "run", 300, seed=4)
    run = load_run(_with_schedule(path) if schedule else path)
    assert rg.speedup_model(run).fitted == schedule
    for tau in (0.5, 0.95, 0.99):
        row = rg.regate(run, [tau])[0]
        r = cr.replay_cascade(run, {"small@0": tau})
        assert r.accuracy == pytest.approx(row.accuracy)
        assert r.accepted_error == pytest.approx(row.accepted_error, nan_ok=True)
        assert r.speedup == pytest.approx(row.speedup)
        assert r.time_per_query == pytest.approx(row.time_per_query)
        assert r.per_category == pytest.approx(row.per_category)


def test_a_stage_entry_for_small0_is_read(tmp_path):
    a = load_run(write_synthetic_cascade_run(tmp_path / "a", 200, seed=5))
    b = load_run(write_synthetic_cascade_run(tmp_path / "b", 200, seed=5, small0_in_stages=True))
    la, lb = cr.cascade_log(a), cr.cascade_log(b)
    assert la.stages == lb.stages == ("small@0", "small@1", "small@2", "large_direct")
    np.testing.assert_allclose(la.conf, lb.conf, rtol=1e-6)
    assert np.array_equal(la.wrong, lb.wrong)


def test_per_category_thresholds_replace_the_global_ones(cascade_dir):
    run = load_run(cascade_dir)
    cat = run.category_names[0]
    base = {"small@0": 0.97, "small@1": 0.9}
    r = cr.replay_cascade(run, base, {cat: {"small@0": 0.5, "small@1": 0.5}})
    loose = cr.replay_cascade(run, {"small@0": 0.5, "small@1": 0.5})
    tight = cr.replay_cascade(run, base)
    assert tight.accepted < r.accepted < loose.accepted
    in_cat = run.categories == cat
    assert r.per_category[cat] == pytest.approx(loose.per_category[cat])
    other = run.category_names[1]
    assert r.per_category[other] == pytest.approx(tight.per_category[other])
    assert in_cat.any()


def test_bad_thresholds_are_refused(cascade_dir):
    run = load_run(cascade_dir)
    with pytest.raises(ValueError, match="does not hold"):
        cr.replay_cascade(run, {"small@7": 0.9})
    with pytest.raises(ValueError, match="unknown cascade stage"):
        cr.parse_stage_taus("small=0.9")
    assert cr.parse_stage_taus("small@0=0.9, large_direct=0.5") == {
        "small@0": 0.9,
        "large_direct": 0.5,
    }


def test_cli_calibrate_then_regate(cascade_dir, tmp_path, capsys):
    from speceyes.cli import main

    out = tmp_path / "cal.json"
    code = main(
        ["calibrate", str(cascade_dir), "--cascade", "--max-error", "0.15", "--split", "60:40",
         "--output", str(out)]
    )  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0 and "ALL accepted answers" in text and "held out" in text
    data = json.loads(out.read_text())
    assert set(data["stages"]) == {"small@0", "small@1", "small@2", "large_direct"}
    assert main(["regate", str(cascade_dir), "--cascade", str(out), "--json"]) == 0
    replay = json.loads(capsys.readouterr().out)
    direct = cr.replay_cascade(load_run(cascade_dir), data["stages"])
    assert replay["accepted"] == direct.accepted
    assert replay["speedup"] == pytest.approx(direct.speedup)
    assert main(["regate", str(cascade_dir), "--cascade", "small@0=0.9,small@1=0.9"]) == 0
    assert "| small@1 |" in capsys.readouterr().out
    assert main(["calibrate", str(cascade_dir), "--cascade", "--top-k", "8"]) == 2
    assert "does not take --top-k" in capsys.readouterr().err
    # eval and serve apply the file's cascade as a whole: its stages, depth and middle tier
    from speceyes.factory import Settings

    data["models"], data["agent"] = {"small": "s", "large": "l"}, "deepeyes"  # the run's setup
    out.write_text(json.dumps(data))
    base = Settings(small="s", large="l")
    applied = base.with_calibration(out).funnel
    assert (applied.speculate_depth, applied.middle_tier) == (2, True)
    assert applied.stage_taus == data["stages"]
    assert applied.stage_tau("small@0") == data["stages"]["small@0"]
    with pytest.raises(ValueError, match="certifies the cascade with --speculate-depth 2"):
        base.with_funnel(speculate_depth=1).with_calibration(out)
    # the middle tier's prompt is part of what the file certifies, and applied with it
    assert data["cascade"]["direct_prompt"] == applied.direct_prompt == "speculative"
    with pytest.raises(ValueError, match="certifies the middle tier with --direct-prompt spec"):
        base.with_funnel(middle_tier=True, direct_prompt="agent-prefix").with_calibration(out)
    shared = {**data, "cascade": {**data["cascade"], "direct_prompt": "agent-prefix"}}
    out.write_text(json.dumps(shared))
    assert base.with_calibration(out).funnel.direct_prompt == "agent-prefix"
    out.write_text(json.dumps(data))
    assert applied.category_taus is None  # no --per-category: every query the overall ones
    # with --per-category, each category's thresholds reach the funnel with the overall ones
    assert main(["calibrate", str(cascade_dir), "--cascade", "--per-category",
                 "--max-error", "0.15", "--output", str(out)]) == 0  # fmt: skip
    capsys.readouterr()
    per = json.loads(out.read_text())
    assert per["per_category"]
    per["models"], per["agent"] = {"small": "s", "large": "l"}, "deepeyes"
    out.write_text(json.dumps(per))
    applied = base.with_calibration(out).funnel
    assert applied.category_taus == per["per_category"]
    assert applied.stage_taus == per["stages"]
    cat, taus = next(iter(per["per_category"].items()))
    assert all(applied.stage_tau(s, cat) == t for s, t in taus.items())
