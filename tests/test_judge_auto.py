"""``--judge auto`` in the funnel: each batch at the operating point the load favours, with the
point's own judge and threshold; on the bundled mini-world models."""

from __future__ import annotations

import argparse
import json

import pytest

from speceyes.bench.datasets import load_jsonl
from speceyes.cli.options import add_funnel_args, add_model_args
from speceyes.factory import Settings
from speceyes.funnel import Funnel, FunnelConfig
from speceyes.miniworld.splits import level_defaults, make_split
from speceyes.operating_points import AGENT_POINT, OperatingPoint, PointChooser
from tests.test_cascade_funnel import models  # noqa: F401, F811  the bundled models, one zoom

POINTS = [
    {"judge": "large", "tau": 0.9, "beta": 0.8, "alpha": 0.9},
    {"judge": "none", "tau": 0.95, "beta": 1.0, "alpha": 0.6},
]


def test_the_chooser_tries_each_point_then_follows_the_load():
    large, none = (OperatingPoint(**p) for p in POINTS)
    chooser = PointChooser([large, none], shared_device=False)
    assert chooser.choose(1) == large  # untried: run it to measure it
    chooser.observe_front(large, judge_s=0.6, small_s=0.3)
    assert chooser.choose(1) == none
    chooser.observe_front(none, judge_s=0.0, small_s=0.3)
    # An agent loop of 6 s, sharing the engine with 31 others: its share of the engine is a
    # 32nd of that (drive_loops reports the share), while the judge's prefill is not shared.
    chooser.observe_agent(6.0 / 32, 32)
    # alone, the judge sends more queries past the agent (latency); under load its
    # prefill is large-model work that the none point does not spend
    assert chooser.choose(1) == large
    assert chooser.choose(256) == none


def test_the_chooser_learns_what_each_point_skips_and_when_to_skip_the_front():
    """A point whose tau accepts less than calibrated loses to the one that delivers; and
    where the front costs more than the loops it saves, the agent-only point wins."""
    large, none = (OperatingPoint(**p) for p in POINTS)
    agent = OperatingPoint(AGENT_POINT)
    chooser = PointChooser([large, none, agent], shared_device=False)
    for p, judge in ((large, 0.05), (none, 0.0), (agent, 0.0)):
        assert chooser.choose(16) == p
        chooser.observe_front(p, judge_s=judge, small_s=0.0 if p is agent else 0.1,
                              skipped=0.0 if p is agent else 0.7)  # fmt: skip
    chooser.observe_agent(6.0 / 16, 16)
    assert chooser.choose(64) == none  # both skip 70%: none spends no judge
    for _ in range(20):  # none's tau turns out to accept only 10% of these queries
        chooser.observe_front(none, judge_s=0.0, small_s=0.1, skipped=0.1)
    assert chooser.choose(64) == large
    # a front that saves nothing: agent-only serves more
    slow = PointChooser([large, agent], shared_device=False)
    for p in (large, agent):
        slow.choose(16)
        slow.observe_front(p, judge_s=0.0 if p is agent else 1.0, small_s=0.0, skipped=0.0)
    slow.observe_agent(6.0 / 16, 16)
    assert slow.choose(16) == agent


def test_front_seconds_count_only_the_batchs_share_of_the_engine():
    """A judge batch's wall time under load includes the agent loops the engine served in the
    same steps; counted whole, it would make the front look dearer than it is."""
    large, agent = OperatingPoint(**POINTS[0]), OperatingPoint(AGENT_POINT)

    def pick(share: float) -> OperatingPoint:
        c = PointChooser([large, agent], shared_device=False)
        for p in (large, agent):
            c.choose(64)
            if p is agent:
                c.observe_front(p, judge_s=0.0, small_s=0.0, skipped=0.0)
            else:
                c.observe_front(p, judge_s=0.5, small_s=0.1, skipped=0.7, engine_share=share)
        c.observe_agent(6.0 / 32, 32)  # 6 s of wall, one 32nd of the engine
        return c.choose(64)

    assert pick(1.0) == agent  # 0.5 s of the engine per judged query: dearer than it saves
    assert pick(16 / 80) == large  # 16 judged beside 64 loops: a fifth of that


def test_a_lone_query_waits_for_its_whole_front_batch():
    """Per-query front seconds measured on a batch of 16 are a 16th of what a lone query
    waits there; the batch's wall time is what R0 needs, and with it agent-only wins alone."""
    large = OperatingPoint("large", 0.9, beta=1.0, alpha=0.5)  # half answered without the agent
    agent = OperatingPoint(AGENT_POINT)

    def pick(front_wall: float | None) -> OperatingPoint:
        c = PointChooser([large, agent], shared_device=False)
        for p in (large, agent):
            c.choose(16)
            if p is agent:
                c.observe_front(p, judge_s=0.0, small_s=0.0, skipped=0.0, front_wall_s=0.0)
            else:  # a batch of 16 in 1.5 s, half of it answered without the agent
                c.observe_front(p, judge_s=1.2 / 16, small_s=0.3 / 16, skipped=0.5,
                                front_wall_s=front_wall)  # fmt: skip
        c.observe_agent(2.0, 1)  # a 2 s loop alone
        return c.choose(1)

    assert pick(None) == large  # 0.09 s of front for half of 2 s saved: it looked cheap
    assert pick(1.5) == agent  # 1.5 s of front for 1 s saved: agent-only is faster alone


def test_servers_on_one_device_add_up(models):  # noqa: F811
    """--shared-device tells auto that the two engines' work falls on one device (two servers
    on one GPU or CPU): a URL does not say where it runs."""
    small, large, agent = models
    ap = argparse.ArgumentParser()
    add_model_args(ap)
    add_funnel_args(ap)
    ns = ap.parse_args(["--small", "s", "--large", "l", "--shared-device"])
    assert Settings.from_args(ns).funnel.shared_device is True
    assert ap.parse_args(["--small", "s", "--large", "l"]).shared_device is None
    for shared in (True, False):
        cfg = FunnelConfig(judge="auto", points=POINTS, shared_device=shared)
        assert Funnel(small, large, agent, cfg)._chooser.shared_device is shared
    # unset: the in-process models' own devices decide (the bundled ones share the CPU)
    assert small.device == large.device == "cpu"
    f = Funnel(small, large, agent, FunnelConfig(judge="auto", points=POINTS))
    assert f._chooser.shared_device is True
    with pytest.raises(ValueError, match="--shared-device"):
        FunnelConfig(judge="large", shared_device=True).validate()
    assert "shared_device" not in FunnelConfig().to_dict()  # runs without it log as before
    at = FunnelConfig(judge="auto", points=POINTS, shared_device=True).at_point(
        OperatingPoint("large", 0.9))
    at.validate()  # a batch's own configuration is a static judge's


def measured_large_and_none() -> tuple[OperatingPoint, OperatingPoint, PointChooser]:
    """A chooser that has run both points once, with agent loops sharing the engine by 32:
    under load none wins, alone the judge's point does."""
    large, none = (OperatingPoint(**p) for p in POINTS)
    chooser = PointChooser([large, none], shared_device=False)
    for p in (large, none):
        chooser.choose(1)
        chooser.observe_front(p, judge_s=0.6 if p is large else 0.0, small_s=0.3)
    chooser.observe_agent(6.0 / 32, 32)
    return large, none, chooser


def test_a_point_not_run_for_a_while_runs_again():
    large, none, chooser = measured_large_and_none()
    picks = [chooser.choose(256) for _ in range(PointChooser.EXPLORE_EVERY + 2)]
    assert picks.count(large) == 1 and picks.count(none) == len(picks) - 1


def test_a_point_that_keeps_losing_is_rerun_ever_more_rarely_until_the_load_favours_it():
    """Re-runs of a losing point back off (each wait twice the last, up to EXPLORE_MAX), so
    at a steady load their cost fades; once the load favours it, the rule takes it at once."""
    large, none, chooser = measured_large_and_none()
    batches = 2000
    picks = [chooser.choose(256) for _ in range(batches)]  # under load none wins
    runs = [i for i, p in enumerate(picks) if p == large]
    gaps = [b - a for a, b in zip([-1, *runs], runs, strict=False)]  # batch 0 here is batch 3
    every, most = PointChooser.EXPLORE_EVERY, PointChooser.EXPLORE_MAX
    waits = [min(every * 2**k, most) for k in range(len(gaps))]
    assert gaps[1:] == [w + 1 for w in waits[1:]]
    assert len(runs) <= 10 < batches // every  # a fixed period would have run it 80 times
    # the load drops: alone, the judge's point is the faster one, and it is followed
    picks = [chooser.choose(1) for _ in range(5)]
    assert picks == [large] * 5
    assert chooser.choose(256) == none  # and under load again, none at once (measured)


def test_config_checks():
    with pytest.raises(ValueError, match="needs operating points"):
        FunnelConfig(judge="auto").validate()
    with pytest.raises(ValueError, match="for --judge auto"):
        FunnelConfig(judge="large", points=POINTS).validate()
    with pytest.raises(ValueError, match="unknown field"):
        FunnelConfig(judge="auto", points=[{"judge": "large", "speed": 1}]).validate()
    with pytest.raises(ValueError, match="view budget belongs to each point"):
        FunnelConfig(judge="auto", points=POINTS, judge_max_pixels=200704).validate()
    cfg = FunnelConfig(judge="auto", points=POINTS, tau=0.8)
    at = cfg.at_point(OperatingPoint("none", None))
    assert (at.judge, at.tau, at.points) == ("none", 0.8, None)
    deep = FunnelConfig(judge="auto", points=POINTS, speculate_depth=1, middle_tier=True)
    at = deep.at_point(OperatingPoint(AGENT_POINT))  # agent-only: no front, no cascade
    assert (at.mode, at.points, at.cascade) == ("agent", None, False)
    at.validate()
    assert "points" not in FunnelConfig().to_dict()  # a run without auto logs as before


def test_flags_reach_the_config(tmp_path):
    path = tmp_path / "points.json"
    path.write_text(json.dumps({"points": POINTS}))
    ap = argparse.ArgumentParser()
    add_model_args(ap)
    add_funnel_args(ap)
    ns = ap.parse_args(["--small", "s", "--large", "l", "--judge", "auto", "--points", str(path)])
    funnel = Settings.from_args(ns).funnel
    assert funnel.judge == "auto"
    assert [p["judge"] for p in funnel.points] == ["large", "none"]
    assert funnel.operating_points()[1].tau == 0.95


@pytest.fixture(scope="module")
def mw_queries(tmp_path_factory):
    canvas, clutter = level_defaults(1)
    out = tmp_path_factory.mktemp("mw-auto")
    make_split(out, "test", 1, seed=0, canvas=canvas, clutter=clutter, level=1)
    return list(load_jsonl(out / "questions.jsonl"))[:6]


def test_each_batch_runs_at_its_point_with_its_judge_and_tau(models, mw_queries):  # noqa: F811
    small, large, agent = models
    f = Funnel(small, large, agent, FunnelConfig(judge="auto", points=POINTS, batch_size=2))
    results = f.run(mw_queries)
    points = [next(t for t in r.trace if t["type"] == "operating_point") for r in results]
    # the first two batches measure each point; every query records the one that answered it
    assert [p["point"] for p in points[:4]] == ["large", "large", "none", "none"]
    assert sum(f.stats.points.values()) == len(mw_queries)
    for r, p in zip(results, points, strict=True):
        assert p["tau"] == (0.9 if p["judge"] == "large" else 0.95)
        if p["judge"] == "none":  # no judge: every query is the gate's to decide
            assert r.p_tool is None and r.judge_tool is False
        else:
            assert r.p_tool is not None
        if r.judge_tool is False and r.confidence is not None:
            assert (r.route == "small") == (r.confidence > p["tau"])  # the point's own tau
    # results.json: queries and accuracy per point
    from speceyes.bench.runner import sample_record, summarize

    records = [sample_record(q, r, "speceyes") for q, r in zip(mw_queries, results, strict=True)]
    summary = summarize(records, "jsonl")["operating_points"]
    assert {k: v["n"] for k, v in summary.items()} == f.stats.points
    for name, v in summary.items():
        mine = [rec for rec, p in zip(records, points, strict=True) if p["point"] == name]
        assert v["accuracy"] == pytest.approx(sum(rec["correct"] for rec in mine) / len(mine))
    # the agent-only point: its batches skip phases I-III and go straight to the agent
    f = Funnel(small, large, agent, FunnelConfig(
        judge="auto", points=[*POINTS, {"judge": AGENT_POINT}], batch_size=2))  # fmt: skip
    results = f.run(mw_queries)
    by_agent = [r for r in results if r.operating_point()["point"] == AGENT_POINT]
    assert len(by_agent) == 2  # the third batch measures it
    for r in by_agent:
        assert r.route == "agent_only" and r.answer == r.agent_answer
        assert "judge" not in r.timings and "small" not in r.timings and r.p_tool is None
    # the viewer's card shows it
    from speceyes.view import _card

    assert _card(records[0], None, None)["op"] == "large, tau 0.9"
    assert "op" not in _card({**records[0], "trace": []}, None, None)
