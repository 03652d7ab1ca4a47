"""Operating points and ``--judge auto``: the choice by expected throughput, its files, and the
simulator's auto rows."""

from __future__ import annotations

import json

import pytest

from speceyes import simulate as sm
from speceyes.operating_points import (
    AGENT_POINT,
    OperatingPoint,
    PointCosts,
    _mva,
    choose,
    expected_throughput,
    read_points,
    write_points,
)
from speceyes.simulate.auto import choose_point, point_costs

FLAT = PointCosts(front_latency=0.5, large_front=0.5, small_front=0.1, agent_latency=6.0,
                  agent_demand=1.0)


def test_mva_lies_under_both_asymptotic_bounds_and_meets_them_at_the_ends():
    demands, delay = [0.4, 0.1], 2.0
    r0 = delay + sum(demands)
    assert _mva(demands, delay, 1) == pytest.approx(1 / r0)
    for n in (2, 4, 16, 64):
        x = _mva(demands, delay, n)
        assert x <= min(n / r0, 1 / max(demands)) + 1e-12
    assert _mva(demands, delay, 2000) == pytest.approx(1 / 0.4, rel=1e-3)


def test_more_skipped_is_faster_at_equal_costs_and_the_judge_costs_work_under_load():
    judged = OperatingPoint("large", 0.9, beta=0.8, alpha=0.7)
    better = OperatingPoint("large", 0.9, beta=0.8, alpha=0.9)
    assert expected_throughput(better, FLAT, 8, True) > expected_throughput(judged, FLAT, 8, True)
    # no judge, fewer skipped: slower alone (the agent's latency), faster when the large
    # model is the bottleneck (no judge prefill on it)
    free = replace_costs(FLAT, large_front=0.0)
    none = OperatingPoint("none", 0.95, beta=0.8, alpha=0.6, alpha_tool=0.1)
    costs = {"large": FLAT, "none": free}
    pick = [choose([judged, none], lambda p, n: costs[p.judge], n, False).judge
            for n in (1, 256)]
    assert pick == ["large", "none"]


def replace_costs(c: PointCosts, **kw: float) -> PointCosts:
    return PointCosts(**{**c.__dict__, **kw})


def test_ties_go_to_less_total_work_then_to_the_first_point():
    a = OperatingPoint("small")
    b = OperatingPoint("small-prefix")
    heavy = replace_costs(FLAT, small_front=0.3)
    costs = {"small": heavy, "small-prefix": FLAT}
    # two devices and the large one the bottleneck: equal bounds; less small-model work wins
    assert choose([a, b], lambda p, n: costs[p.judge], 256, False).judge == "small-prefix"
    same = {"small": FLAT, "small-prefix": FLAT}
    assert choose([a, b], lambda p, n: same[p.judge], 256, False).judge == "small"


def test_points_validate_and_files_round_trip(tmp_path):
    with pytest.raises(ValueError, match="unknown judge"):
        OperatingPoint("oracle")
    with pytest.raises(ValueError, match="alpha must be in"):
        OperatingPoint("large", alpha=1.5)
    pts = [OperatingPoint("large", 0.9, 0.8, 0.7), OperatingPoint("none", 0.95, 1.0, 0.6)]
    path = write_points(tmp_path / "p.json", pts, note="x")
    assert read_points(path) == pts
    (tmp_path / "bad.json").write_text(json.dumps([{"judge": "large", "speed": 2}]))
    with pytest.raises(ValueError, match="unknown keys: speed"):
        read_points(tmp_path / "bad.json")
    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(ValueError, match="non-empty list"):
        read_points(tmp_path / "empty.json")


def test_simulated_auto_is_the_chosen_static_variant_run_on_the_same_draws():
    costs = sm.bench_costs("vstar")
    pts = [OperatingPoint("large", 0.9, 0.8, 0.75), OperatingPoint("none", 0.95, 0.8, 0.5, 0.1)]
    cs = (1, 64)
    rows = sm.simulate(costs, ["agent-only", "speceyes"], cs, 600, judges=["large", "none", "auto"],
                       points=pts)
    ours = {(r.concurrency, r.judge): r for r in rows if r.schedule == "speceyes"}
    picks = {c: choose_point(costs, pts, c).judge for c in cs}
    assert picks == {1: "large", 64: "none"}  # the choice moves with load
    for c, judge in picks.items():
        auto = ours[(c, f"auto:{judge}")]
        assert auto.throughput == ours[(c, judge)].throughput
        assert auto.vs_agent_only >= max(ours[(c, "large")].vs_agent_only,
                                         ours[(c, "none")].vs_agent_only) * 0.97


def test_simulated_auto_skips_the_front_where_it_saves_nothing():
    """A judge whose tau accepts almost nothing only adds work: auto takes the agent-only
    point, and its row is agent-only's, run on the same draws."""
    costs = sm.bench_costs("vstar", shared_gpu=True)
    pts = [OperatingPoint("large", 0.99, 0.8, 0.02), OperatingPoint(AGENT_POINT)]
    assert pts[1].skipped == 0.0 and point_costs(costs, pts[1], 16).front_latency == 0.0
    rows = sm.simulate(costs, ["agent-only", "speceyes"], (16,), 600,
                       judges=["large", "auto"], points=pts)  # fmt: skip
    by = {(r.schedule, r.judge): r for r in rows}
    auto = by[("speceyes", f"auto:{AGENT_POINT}")]
    assert auto.throughput == pytest.approx(by[("agent-only", "-")].throughput)
    assert auto.throughput > by[("speceyes", "large")].throughput


def test_static_variants_run_at_their_points_rates():
    costs = sm.bench_costs("vstar")
    low, high = OperatingPoint("large", None, 0.8, 0.3), OperatingPoint("large", None, 0.8, 0.9)
    x = [sm.simulate(costs, ["speceyes"], (4,), 600, judges=["large"], points=[p])[0].throughput
         for p in (low, high)]
    assert x[1] > x[0] * 1.3
    with pytest.raises(ValueError, match="no operating point"):
        sm.simulate(costs, ["speceyes"], (4,), 100, judges=["prefix"], points=[low])


def test_point_costs_follow_the_engine_layout():
    costs = sm.bench_costs("vstar")
    p = OperatingPoint("large", None, 0.8, 0.7)
    two = point_costs(costs, p, 8)
    costs.shared_gpu = True
    one = point_costs(costs, p, 8)
    # one GPU: the judge's and the answer's prefills share steps, so the front is their sum
    assert one.front_latency == pytest.approx(costs.judge_s() + costs.small_s())
    assert two.front_latency == pytest.approx(max(costs.judge_s(), costs.small_s()))
    # under load the agent's decode steps are shared: less work per loop than alone
    assert point_costs(costs, p, 64).agent_demand < one.agent_latency
    assert point_costs(costs, OperatingPoint("none"), 8).large_front == 0.0
