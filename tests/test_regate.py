"""Loading run logs and re-gating them offline (speceyes.bench.runlog / regate)."""

import json
import math
import warnings

import numpy as np
import pytest

from speceyes import gate
from speceyes.bench import occupancy
from speceyes.bench import regate as rg
from speceyes.bench.runlog import load_run
from speceyes.rundir import RunDirError, TruncatedLogWarning
from tests.tools.synthetic_run import write_synthetic_run


@pytest.fixture(scope="module")
def both_dir(tmp_path_factory):
    # K logged 24, run gated at K=16: re-gating must pick the run's own K.
    d = tmp_path_factory.mktemp("runs") / "both"
    return write_synthetic_run(d, 400, seed=3, mode="both", k_logged=24, top_k=16, tau=0.98)


@pytest.fixture(scope="module")
def both_run(both_dir):
    return load_run(both_dir)


def _row(z1: float) -> list[float]:
    """A top-3 row whose separability is z1: competitors 1, -1 have mean 0, std 1."""
    return [z1, 1.0, -1.0]


def _write(d, samples, config=None, **results):
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "samples.jsonl", "w") as f:
        for s in samples:
            f.write(json.dumps(s) + "\n")
    cfg = {"mode": "both", "tau": 0.9, "top_k": 3, "agg": "min", "alpha": 0.6} | (config or {})
    (d / "results.json").write_text(json.dumps({"config": cfg, "metrics": {}} | results))
    return d


def _sample(i, judge_tool, z1, small_ok, agent_ok, timings, category="a", **extra):
    s = {
        "id": f"s{i}", "category": category, "meta": {}, "answer": "A", "mode": "both",
        "route": "agent_after_judge", "p_tool": None, "judge_tool": judge_tool,
        "small_answer": "A", "small_correct": small_ok, "confidence": None,
        "small_topk": None if z1 is None else [_row(z1)], "agent_answer": "A",
        "agent_correct": agent_ok, "prediction": "A", "correct": True, "tool_calls": 1,
        "timings": timings, "error": None,
    }  # fmt: skip
    return s | extra


# ------------------------------------------------------------------------------- loading


def test_load_views(both_run):
    run = both_run
    assert run.n == 400 and run.mode == "both" and run.k_logged == 24
    assert (run.tau, run.top_k, run.agg, run.scale) == (0.98, 16, "min", 0.6)
    assert run.has_small.all() and run.has_agent.all() and not run.is_error.any()
    assert set(run.categories) == {"direct_attributes", "relative_position"}
    assert set(np.unique(run.judge_tool)) <= {0.0, 1.0}
    for phase in ("judge", "small", "agent"):
        assert run.timings[phase].shape == (400,) and not np.isnan(run.timings[phase]).any()
    assert all(a.ndim == 2 and a.shape[1] == 24 for a in run.small_topk)


def test_fast_parse_is_exact(both_dir, both_run):
    lines = (both_dir / "samples.jsonl").read_text().splitlines()
    for i, line in enumerate(lines):
        ref = json.loads(line)
        np.testing.assert_array_equal(np.array(ref["small_topk"]), both_run.small_topk[i])
        assert both_run.samples[i]["id"] == ref["id"]
        assert both_run.samples[i]["meta"] == ref["meta"]


def test_odd_layouts_fall_back_to_json(tmp_path):
    rows = [[3.0, 1.0, -1.0], [2.5, 0.5, float("-inf")]]
    lines = [
        json.dumps({"id": "compact", "small_topk": rows}, separators=(",", ":")),
        '{"id": "spaced", "small_topk": [ [3.0, 1.0, -1.0] , [2.5, 0.5, -Infinity] ]}',
        json.dumps({"id": "nested", "meta": {"small_topk": [[9.0, 9.0]]}, "small_topk": rows}),
        json.dumps({"id": "nested-first", "meta": {"small_topk": [[9.0, 9.0]]}}),
        json.dumps({"id": "empty", "small_topk": []}),
        json.dumps({"id": "none", "small_topk": None}),
        json.dumps({"id": "text", "small_answer": 'say "small_topk": [[1]]', "small_topk": rows}),
    ]
    (tmp_path / "samples.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "results.json").write_text("{}")
    run = load_run(tmp_path)
    assert run.ids == ["compact", "spaced", "nested", "nested-first", "empty", "none", "text"]
    for i in (0, 1, 2, 6):
        np.testing.assert_array_equal(run.small_topk[i], np.array(rows))
    assert run.samples[2]["meta"] == {"small_topk": [[9.0, 9.0]]}
    assert run.samples[6]["small_answer"] == 'say "small_topk": [[1]]'
    assert list(run.has_small) == [True, True, True, False, True, False, True]
    assert run.small_topk[4].shape == (0, 0) and run.k_logged == 3


def test_ragged_topk_is_a_clear_error(tmp_path):
    line = json.dumps({"id": "x", "small_topk": [[1.0, 2.0, 3.0], [1.0, 2.0]]})
    (tmp_path / "samples.jsonl").write_text(line + "\n")
    (tmp_path / "results.json").write_text("{}")
    with pytest.raises(RunDirError, match=r"samples.jsonl:1: small_topk"):
        load_run(tmp_path)


def test_missing_dir_and_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="run directory not found"):
        load_run(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="samples.jsonl"):
        load_run(tmp_path)
    (tmp_path / "samples.jsonl").write_text(json.dumps({"id": "a"}) + "\n")
    with pytest.raises(FileNotFoundError, match="results.json"):
        load_run(tmp_path)
    with pytest.warns(UserWarning, match="results.json is missing"):
        run = load_run(tmp_path, require_results=False)
    assert run.n == 1 and run.top_k == gate.DEFAULT_TOP_K
    (tmp_path / "results.json").write_text("{not json")
    with pytest.raises(RunDirError, match="results.json: not valid JSON"):
        load_run(tmp_path)


def test_corrupt_middle_line_names_it(tmp_path, both_dir):
    lines = (both_dir / "samples.jsonl").read_text().splitlines()
    lines[6] = lines[6][:100]
    (tmp_path / "samples.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "results.json").write_text((both_dir / "results.json").read_text())
    with pytest.raises(RunDirError, match=r"samples.jsonl:7: corrupt JSON line"):
        load_run(tmp_path)


def test_truncated_last_line_is_skipped(tmp_path, both_dir):
    text = (both_dir / "samples.jsonl").read_text()
    (tmp_path / "samples.jsonl").write_text(text[: len(text) - 2000])  # killed mid-write
    (tmp_path / "results.json").write_text((both_dir / "results.json").read_text())
    with pytest.warns(TruncatedLogWarning, match="samples.jsonl:400: skipping truncated"):
        run = load_run(tmp_path)
    assert run.n == 399 and run.skipped_lines == 1
    assert len(run.small_topk) == 399


# ------------------------------------------------------------------------------- re-gating


def test_own_setting_reproduces_logged_decisions(both_run):
    run = both_run
    conf = rg.confidences(run)
    np.testing.assert_allclose(conf, run.logged_confidence, rtol=0, atol=1e-12)
    rep = rg.replay(run, run.tau)
    assert list(rep.routes) == list(run.routes)
    assert np.array_equal(rep.correct, run.correct)
    row = rg.regate(run, [run.tau])[0]
    res = run.results
    assert row.accuracy == pytest.approx(res["metrics"]["overall"], abs=1e-12)
    for cat, acc in res["metrics"]["per_category"].items():
        assert row.per_category[cat] == pytest.approx(acc, abs=1e-12)
    assert row.beta == pytest.approx(res["beta"]) and row.alpha == pytest.approx(
        res["alpha_accept"]
    )
    assert (row.top_k, row.agg) == (16, "min")
    # The replayed cost is exactly what the synthetic speceyes run would have logged.
    assert row.time_per_query == pytest.approx(rep.cost.mean())


def test_speceyes_mode_log_with_own_setting(tmp_path):
    # A speceyes-mode log: decisions and confidences as the funnel logged them.
    d = write_synthetic_run(tmp_path / "spec", 300, seed=5, mode="speceyes", k_logged=16, tau=0.95)
    run = load_run(d)
    conf = rg.confidences(run)
    logged = ~np.isnan(run.logged_confidence)
    np.testing.assert_allclose(conf[logged], run.logged_confidence[logged], atol=1e-12)
    tool_free = run.judge_tool == 0
    accepted = np.array([gate.accept(float(c), run.tau) for c in conf]) & tool_free
    assert np.array_equal(accepted, run.routes == "small")
    beta, alphas = rg.acceptance(run, [run.tau])
    assert beta == pytest.approx(run.results["beta"])
    assert alphas[0] == pytest.approx(run.results["alpha_accept"])
    with pytest.raises(ValueError, match=r"needs a `speceyes eval --mode both` run"):
        rg.regate(run, [0.9])


@pytest.mark.parametrize("agg", gate.AGGREGATIONS)
def test_vectorised_sweep_equals_per_query_replay(both_run, agg):
    run = both_run
    taus = [0.0, 0.3, 0.9, 0.98, 0.999, 1.0]
    rows = rg.regate(run, taus, top_k=8, agg=agg)
    t = rg.phase_times(run)
    for tau, row in zip(taus, rows, strict=True):
        rep = rg.replay(run, tau, top_k=8, agg=agg)
        assert row.accuracy == pytest.approx(rep.correct.mean(), abs=1e-12)
        assert row.small_share == pytest.approx(rep.accepted.mean(), abs=1e-12)
        assert row.speedup == pytest.approx(t.agent.sum() / rep.cost.sum(), rel=1e-12)
        for cat in run.category_names:
            in_cat = run.categories == cat
            assert row.per_category[cat] == pytest.approx(rep.correct[in_cat].mean(), abs=1e-12)
    assert rows[-1].small_share == 0.0 and rows[-1].accuracy == pytest.approx(
        np.mean(run.agent_correct)
    )
    shares = [r.small_share for r in rows]
    assert shares == sorted(shares, reverse=True)


def test_confidences_equal_gate_per_answer(both_run):
    conf = rg.confidences(both_run, top_k=5, agg="bottom")
    for i in range(0, both_run.n, 37):
        ref = gate.answer_confidence(both_run.small_topk[i][:, :5], top_k=5, agg="bottom")
        assert conf[i] == pytest.approx(ref, rel=1e-12)


def test_confidences_cached_once_per_setting(both_run):
    a = rg.confidences(both_run, top_k=12, agg="mean")
    assert rg.confidences(both_run, top_k=12, agg="mean") is a
    assert rg.confidences(both_run, top_k=12, agg="min") is not a


def test_top_k_limits(both_run):
    rows = rg.regate(both_run, [0.9], top_k=2)
    assert rows[0].top_k == 2
    rg.regate(both_run, [0.9], top_k=24)
    with pytest.raises(ValueError, match=r"top_k=25 is larger than the 24 logits logged"):
        rg.regate(both_run, [0.9], top_k=25)
    with pytest.raises(ValueError, match="unknown aggregation"):
        rg.regate(both_run, [0.9], agg="max")
    with pytest.raises(ValueError, match="NaN"):
        rg.regate(both_run, [float("nan")])


def test_timing_model_by_hand(tmp_path):
    # z1 = separability; tau 0.9 needs separability > ln(9)/0.6 = 3.66.
    samples = [
        _sample(0, False, 6.0, True, False, {"judge": 0.1, "small": 0.2, "agent": 3.0}),
        _sample(1, False, 1.0, True, True, {"judge": 0.1, "small": 0.2, "agent": 5.0}),
        _sample(2, True, 9.0, False, True, {"judge": 0.1, "small": 0.2, "agent": 2.0}),
        _sample(3, False, 8.0, False, True, {"judge": 0.1, "agent": 4.0}, category="b"),
    ]
    run = load_run(_write(tmp_path, samples))
    row = rg.regate(run, [0.9])[0]
    # Query 0 accepted (0.1+0.2), 1 gated to agent (0.1+0.2+5), 2 judge->agent (0.1+2),
    # 3 accepted with its small time missing -> run mean 0.2 (0.1+0.2).
    cost = 0.3 + 5.3 + 2.1 + 0.3
    assert row.speedup == pytest.approx((3 + 5 + 2 + 4) / cost)
    assert row.time_per_query == pytest.approx(cost / 4)
    assert (row.beta, row.alpha, row.small_share) == (0.75, pytest.approx(2 / 3), 0.5)
    assert row.accuracy == pytest.approx(0.75)  # small ok, agent ok, agent ok, small wrong
    assert row.per_category == {"a": pytest.approx(1.0), "b": 0.0}
    assert row.accepted_error == pytest.approx(0.5)
    expected = rg.analytic_latency(0.1, 0.2, 3.5, 0.75, 2 / 3)
    assert expected == pytest.approx(0.1 + 0.75 * 0.2 + 0.5 * 3.5)
    assert row.analytic_time_per_query == pytest.approx(expected)
    assert row.analytic_speedup == pytest.approx(3.5 / expected)
    assert list(rg.replay(run, 0.9).routes) == [
        "small", "agent_after_gate", "agent_after_judge", "small",
    ]  # fmt: skip


def test_errors_count_as_wrong_and_do_not_block(tmp_path):
    t = {"judge": 0.1, "small": 0.2, "agent": 1.0}
    samples = [
        _sample(0, False, 6.0, True, True, t),
        _sample(1, None, None, None, None, {}, route="error", error="timeout", agent_answer=None),
    ]
    run = load_run(_write(tmp_path, samples))
    row = rg.regate(run, [0.9])[0]
    assert row.accuracy == 0.5 and row.n == 2
    assert rg.replay(run, 0.9).routes[1] == "agent_after_judge"
    assert math.isfinite(row.speedup)


def test_format_table(both_run):
    rows = rg.regate(both_run, [0.9, 0.98])
    table = rg.format_table(rows)
    lines = table.strip().splitlines()
    assert lines[0].startswith("| tau | K | agg | beta | alpha")
    assert "direct_attributes %" in lines[0] and len(lines) == 4
    assert "| 0.98 | 16 | min |" in table and "x |" in table


def test_default_taus_dense_near_one():
    taus = rg.default_taus()
    assert taus[0] == 0.0 and taus[-1] < 1.0 and np.all(np.diff(taus) > 0)
    assert np.sum(taus > 0.98) >= 20


def test_no_warnings_on_clean_load(both_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_run(both_dir)


# ------------------------------------------------------------------------------- batch occupancy


def _drive(turns, max_loops, step_cost):
    """The funnel's scheduler, brute force: loops admitted in order while slots are free, one
    batched step for all in flight; returns (wall, each loop's share)."""
    pending, active, shares, wall = list(range(len(turns))), [], np.zeros(len(turns)), 0.0
    left = list(turns)
    while pending or active:
        while pending and len(active) < max_loops:
            active.append(pending.pop(0))
        cost = step_cost(len(active))
        wall += cost
        for i in active:
            shares[i] += cost / len(active)
            left[i] -= 1
        active = [i for i in active if left[i] > 0]
    return wall, shares


FIXED, PER_LOOP = 0.2, 0.05


def _occupancy_run(tmp_path, schedule="batched", batch=8, n=96, seed=0):
    rng = np.random.default_rng(seed)
    turns = rng.integers(1, 6, n)
    step = lambda b: FIXED + PER_LOOP * b  # noqa: E731
    shares = np.zeros(n)
    if schedule == "batched":
        for start in range(0, n, batch):
            shares[start : start + batch] = _drive(turns[start : start + batch], batch, step)[1]
    else:
        shares = _drive(turns, 4, step)[1]
    z1 = rng.uniform(0.0, 10.0, n)
    samples = [
        _sample(
            i, bool(rng.random() < 0.2), float(z1[i]), bool(rng.random() < 0.8), True,
            {"judge": 0.01, "small": 0.02, "agent": float(shares[i])},
            trace=[{"type": "assistant"}] * int(turns[i]) + [{"type": "zoom"}],
        )
        for i in range(n)
    ]  # fmt: skip
    cfg = {"schedule": schedule, "batch_size": batch, "max_agent_loops": 4}
    return load_run(_write(tmp_path, samples, cfg)), turns, step


@pytest.mark.parametrize("schedule", ["batched", "pipelined"])
def test_step_cost_fit_and_replayed_wall(tmp_path, schedule):
    run, turns, step = _occupancy_run(tmp_path, schedule)
    np.testing.assert_array_equal(occupancy.turns(run), turns)
    cost = occupancy.fit_step_cost(run)
    assert cost.fitted and cost.schedule == schedule
    assert (cost.fixed, cost.per_loop) == (pytest.approx(FIXED), pytest.approx(PER_LOOP))
    everyone = np.ones(run.n, bool)
    assert occupancy.agent_wall(run, everyone, cost) == pytest.approx(
        occupancy.measured_agent_wall(run)
    )
    # Routing keeps some loops: the replayed wall is what the scheduler would take for them.
    keep = np.random.default_rng(1).random(run.n) < 0.4
    if schedule == "batched":
        truth = sum(
            _drive(turns[s : s + 8][keep[s : s + 8]], 8, step)[0] for s in range(0, run.n, 8)
        )
    else:
        truth = _drive(turns[keep], 4, step)[0]
    assert occupancy.agent_wall(run, keep, cost) == pytest.approx(truth)
    # Summing the kept loops' logged shares (GPU time) understates their wall clock, by much
    # when routing empties batches (a continuous batch refills its slots from the queue).
    gpu_time = run.timings["agent"][keep].sum()
    assert gpu_time < (0.9 if schedule == "batched" else 1.0) * truth


def test_regate_speedup_models_occupancy(tmp_path):
    run, turns, step = _occupancy_run(tmp_path)
    tau = 0.9
    row = rg.regate(run, [tau])[0]
    rep = rg.replay(run, tau)
    keep = ~rep.accepted
    agent = sum(_drive(turns[s : s + 8][keep[s : s + 8]], 8, step)[0] for s in range(0, run.n, 8))
    total = 0.01 * run.n + 0.02 * np.sum(run.judge_tool == 0) + agent
    assert row.speedup == pytest.approx(run.timings["agent"].sum() / total)
    gpu_time = run.timings["agent"].sum() / rep.cost.sum()  # the old per-query sum
    assert gpu_time > row.speedup * 1.05
    note = rg.in_sample_note(run, 1)
    assert "In-sample" in note and "batched schedule, step cost 200.0 ms + 50.0 ms" in note


def test_equal_occupancy_is_not_fitted(tmp_path):
    """One turn per loop in full batches: fixed and per-loop cost are proportional columns, so
    the fit would be arbitrary; the estimate falls back to GPU time and says why."""
    n, batch = 32, 8
    samples = [
        _sample(
            i, False, 5.0, True, True, {"judge": 0.01, "small": 0.02, "agent": (FIXED + PER_LOOP * batch) / batch},
            trace=[{"type": "assistant"}],
        )
        for i in range(n)
    ]  # fmt: skip
    run = load_run(_write(tmp_path, samples, {"schedule": "batched", "batch_size": batch}))
    cost = occupancy.fit_step_cost(run)
    assert not cost.fitted and "cannot be told apart" in cost.describe()
    # One short loop in one batch gives the spread the fit needs.
    samples[0]["trace"] = [{"type": "assistant"}] * 3
    run = load_run(_write(tmp_path / "b", samples, {"schedule": "batched", "batch_size": batch}))
    assert occupancy.fit_step_cost(run).fitted


def test_gpu_time_model_states_its_assumption(both_run):
    cost = occupancy.fit_step_cost(both_run)
    assert not cost.fitted and "upper bound" in cost.describe()
    assert "no schedule" in cost.describe()


def test_regate_on_a_split_part(both_dir, capsys):
    from speceyes.cli import main

    assert main(["regate", str(both_dir), "--tau", "0.9", "--split", "40:30:30", "--json"]) == 0
    out = capsys.readouterr()
    row = json.loads(out.out)[0]
    assert row["n"] == 160  # the sweep part: 40% of 400
    assert "sweep part of 40:30:30 (seed 0)" in out.err and "In-sample" in out.err
