"""Which certified vector a cascade calibration keeps: the paths over every subset of stages,
the stage mix a vector has on its log, and the price of a simulated deployment
(speceyes.simulate.cascade_price; ``calibrate --price-bench``, ``simulate --mix-from``)."""

import json

import numpy as np
import pytest

from speceyes.bench import cascade_calibration as cc
from speceyes.bench import cascade_replay as cr
from speceyes.bench.benchmarks import image_profiles
from speceyes.bench.ltt import NO_TAU
from speceyes.bench.runlog import load_run
from speceyes.cli import main
from speceyes.cli.simulate import SIM_BENCHES
from speceyes.simulate import cascade_price as cp
from speceyes.simulate.costs import bench_costs
from tests.tools.synthetic_cascade import Scenario, draw_cascade_log, write_synthetic_cascade_run


def test_path_families():
    assert cc.path_family("basic", 3).tolist() == cc.default_directions(3).tolist()
    assert cc.default_directions(3).shape == (4, 3)  # every stage alike, each alone


def test_paths_cover_every_subset_of_stages():
    dirs = cc.path_family("subsets", 3)
    assert dirs.shape == (7, 3)
    assert {tuple(r) for r in dirs.tolist()} == {
        (a, b, c) for a in (0.0, 1.0) for b in (0.0, 1.0) for c in (0.0, 1.0)
    } - {(0.0, 0.0, 0.0)}
    many = cc.MAX_SUBSET_STAGES + 1  # beyond it: all, each alone, all but one
    wide = cc.subset_directions(many)
    assert wide.shape == (2 * many + 1, many) and len({tuple(r) for r in wide.tolist()}) == len(wide)


def test_a_pair_of_stages_is_certified_without_the_third():
    """A middle stage that is confidently wrong: no vector with it on passes, but small@0 and
    large_direct together do, which "every stage alike" and "each alone" could not offer."""
    log = draw_cascade_log(np.random.default_rng(1), 3000, Scenario(), stages=("small@0",
                           "small@1", "large_direct"))
    wrong = log.wrong.copy()
    wrong[:, 1] = True  # small@1 is always wrong, whatever its confidence
    log = cr.CascadeLog(**{**log.__dict__, "wrong": wrong})
    found = cc.certified_vectors(log, 0.1, 0.1, cc.subset_directions(3), n_grid=50)
    on = found.taus < NO_TAU
    assert len(found.taus) and not on[:, 1].any()
    assert (on[:, 0] & on[:, 2]).any()
    assert found.path_delta == pytest.approx(0.1 / 7)
    basic = cc.certified_vectors(log, 0.1, 0.1, cc.path_family("basic", 3), n_grid=50)
    on = basic.taus < NO_TAU
    assert len(basic.taus) and not (on[:, 0] & on[:, 2]).any()
    assert basic.path_delta == pytest.approx(0.1 / 4)
    with pytest.raises(ValueError, match="unknown path family"):
        cc.path_family("all", 3)


def test_stage_mix_counts_acceptance_among_the_queries_reaching_each_stage():
    log = draw_cascade_log(np.random.default_rng(2), 2000, Scenario(), stages=("small@0",
                           "small@1", "large_direct"))
    taus = np.array([0.8, NO_TAU, 0.6])
    idx = cr.accepted_stage(log, taus[None, :])[:, 0]
    mix = cr.stage_mix(log, taus, idx)
    tool_free = log.eligible[:, 0]
    assert mix["beta"] == pytest.approx(tool_free.mean())
    passed0 = tool_free & (log.conf[:, 0] > 0.8)
    assert mix["accept"]["small@0"] == pytest.approx(passed0.sum() / tool_free.sum())
    assert "small@1" not in mix["accept"]  # off: skipped
    left = ~passed0
    assert mix["accept"]["large_direct"] == pytest.approx(
        (left & (log.conf[:, 2] > 0.6)).sum() / left.sum()
    )
    spec = cp.mix_from_file(mix).spec("agent-prefix")
    assert (spec.depth, spec.middle_tier, spec.direct_prompt) == (0, True, "agent-prefix")


def test_the_kept_vector_is_the_cheapest_certified_one_by_the_price(tmp_path):
    run = load_run(write_synthetic_cascade_run(tmp_path / "run", 800, seed=2, depth=1))
    price = cp.DeploymentPrice(bench_costs("hrbench8k"), "large", concurrency=8, queries=300)
    cal = cc.calibrate_cascade(run, 0.15, 0.9, price=price.bind, price_info=price.info)
    assert cal.base.passed
    log = cr.cascade_log(run)
    found = cc.certified_vectors(log, 0.15, 0.1)
    prices = price.bind(log)(found.idx, found.taus)
    kept = cr.tau_matrix(log.stages, cal.stages)[0]
    assert any(np.allclose(kept, t) for t in found.taus)  # a certified vector
    assert cal.cascade["cost"] == pytest.approx(prices.min())
    assert cal.cascade["price"]["by"] == "simulated deployment"
    # the run's own seconds keep a vector no cheaper on this deployment
    default = cc.calibrate_cascade(run, 0.15, 0.9)
    mix = cp.mix_from_file(default.cascade["mix"])
    assert price.price(mix) >= prices.min() - 1e-12
    with pytest.raises(ValueError, match="per-category"):
        cc.calibrate_cascade(run, 0.15, 0.9, per_category=True, price=price.bind)


def test_calibrate_prices_and_simulate_replays_the_same_mix(tmp_path, capsys):
    run_dir = write_synthetic_cascade_run(tmp_path / "run", 600, seed=3, depth=1)
    out = tmp_path / "cal.json"
    rc = main(["calibrate", str(run_dir), "--cascade", "--max-error", "0.15",
               "--cascade-paths", "subsets", "--price-bench", "hrbench8k", "--price-judge", "prefix",
               "--price-concurrency", "4", "--output", str(out)])
    assert rc == 0
    assert "kept for a simulated deployment (hrbench8k images, judge prefix, C=4" in (
        capsys.readouterr().out
    )
    data = json.loads(out.read_text())
    price = data["cascade"]["price"]
    assert data["cascade"]["paths"] == "subsets"
    assert price["judge"] == "prefix" and price["x_agent_only"] > 0
    main(["simulate", "--cascade", "--bench", "hrbench8k", "--mix-from", str(out),
          "--judge", "prefix", "--concurrency", "4", "--queries", str(price["queries"]),
          "--output", str(tmp_path / "sim")])
    rows = (tmp_path / "sim" / "cascade.csv").read_text().splitlines()
    cascade = next(r.split(",") for r in rows if r.startswith("cascade,"))
    header = rows[0].split(",")
    thr = float(cascade[header.index("throughput")])
    assert thr == pytest.approx(price["queries_per_s"], rel=1e-9)


def test_clear_errors(tmp_path, capsys):
    run_dir = write_synthetic_cascade_run(tmp_path / "run", 200, seed=4, depth=1)
    assert main(["calibrate", str(run_dir), "--cascade", "--price-judge", "none"]) != 0
    assert "--price-judge: only with --price-bench" in capsys.readouterr().err
    results = json.loads((run_dir / "results.json").read_text())
    results["config"]["judge"] = "auto"
    (run_dir / "results.json").write_text(json.dumps(results))
    assert main(["calibrate", str(run_dir), "--cascade", "--price-bench", "vstar"]) != 0
    assert "give --price-judge" in capsys.readouterr().err
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"tau": 0.9}))
    sim = ["simulate", "--cascade", "--mix-from", str(plain), "--output", str(tmp_path / "s")]
    assert main(sim) != 0
    assert "no stage mix" in capsys.readouterr().err
    assert main([*sim, "--stage-accept", "small@1=0.2"]) != 0
    assert "drop --stage-accept" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        cp.mix_from_file({"beta": 1.5, "accept": {}})
    with pytest.raises(ValueError, match="unknown cascade stage"):
        cp.mix_from_file({"beta": 0.5, "accept": {"medium": 0.2}})


def test_the_simulator_benches_are_the_registered_profiles():
    assert set(SIM_BENCHES) == set(image_profiles())
