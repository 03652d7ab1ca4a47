"""``--judge auto`` in the funnel: each batch at the operating point the load favours, with the
point's own judge and threshold; on the bundled mini-world models."""

from __future__ import annotations

import argparse
import json
import math
import random

import pytest

from speceyes.bench.datasets import load_jsonl
from speceyes.cli.options import add_funnel_args, add_model_args
from speceyes.factory import Settings
from speceyes.funnel import Funnel, FunnelConfig
from speceyes.miniworld.splits import level_defaults, make_split
from speceyes.operating_points import (
    AGENT_POINT,
    OperatingPoint,
    PointChooser,
    _Recent,
    load_level,
)
from tests.test_cascade_funnel import models  # noqa: F401, F811  the bundled models, one zoom

POINTS = [
    {"judge": "large", "tau": 0.9, "beta": 0.8, "alpha": 0.9},
    {"judge": "none", "tau": 0.95, "beta": 1.0, "alpha": 0.6},
]


@pytest.fixture
def one_batch_trials(monkeypatch):
    """The rule alone, without the stretches a point is measured in under load (tested on
    their own below): a trial is one batch and every query of it counts."""
    monkeypatch.setattr(PointChooser, "TRIAL_MAX_BATCHES", 1)
    monkeypatch.setattr(PointChooser, "HEAD_TURNOVERS", 0.0)


def serve(chooser: PointChooser, in_flight: int, seconds: dict[str, float], n: int = 4) -> str:
    """One batch: the chooser picks, and each of its ``n`` queries takes the point's time."""
    p = chooser.choose(in_flight)
    for _ in range(n):
        chooser.observe(p, in_flight, seconds[p.name])
    return p.name


@pytest.mark.usefixtures("one_batch_trials")
def test_the_chooser_tries_each_point_then_takes_the_one_whose_queries_wait_least():
    """By Little's law, with N in flight the point whose queries leave soonest serves most."""
    large, none = (OperatingPoint(**p) for p in POINTS)
    agent = OperatingPoint(AGENT_POINT)
    chooser = PointChooser([large, none, agent])
    times = {"large": 2.0, "none": 1.5, "agent": 3.0}
    picks = [serve(chooser, 16, times) for _ in range(6)]
    assert picks == ["large", "none", "agent", "none", "none", "none"]  # each once, then the best
    assert chooser.seconds(none, load_level(16)) == pytest.approx(1.5)


@pytest.mark.usefixtures("one_batch_trials")
def test_each_load_band_is_measured_on_its_own():
    """Alone, the judge's point may be quicker; under load, none's: a time measured at one
    load says nothing of another, so each band tries each point before trusting times."""
    large, none = (OperatingPoint(**p) for p in POINTS)
    chooser = PointChooser([large, none])
    loaded, alone = {"large": 8.0, "none": 5.0}, {"large": 1.0, "none": 1.4}
    assert [serve(chooser, 64, loaded) for _ in range(3)] == ["large", "none", "none"]
    assert [serve(chooser, 1, alone) for _ in range(3)] == ["large", "none", "large"]
    assert serve(chooser, 64, loaded) == "none"  # back under load: its own band's times
    assert serve(chooser, 60, loaded) == "none"  # 60 in flight is 64's band: no new trial
    assert [load_level(n) for n in (1, 2, 4, 7, 8, 16, 31, 32, 64, 127, 128)] == [
        0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4]  # fmt: skip


@pytest.mark.usefixtures("one_batch_trials")
def test_a_point_whose_queries_start_waiting_longer_loses_the_lead():
    large, none = (OperatingPoint(**p) for p in POINTS)
    chooser = PointChooser([large, none])
    times = {"large": 2.0, "none": 1.5}
    for _ in range(3):
        serve(chooser, 16, times)
    times["none"] = 4.0  # none's tau turns out to accept few of these queries
    picks = [serve(chooser, 16, times) for _ in range(20)]
    assert picks[-1] == "large" and picks.count("none") < 10


@pytest.mark.usefixtures("one_batch_trials")
def test_times_are_compared_route_by_route_not_by_the_luck_of_a_batch():
    """A batch's mean time is mostly its queries' (one the agent answers takes many times
    longer): each point's time is kept per route and weighed by its share answered early."""
    a = OperatingPoint("large", 0.9, beta=1.0, alpha=0.5)
    b = OperatingPoint("none", 0.9, beta=1.0, alpha=0.5)
    chooser = PointChooser([a, b])
    chooser.choose(16)  # a's batch: 7 of 8 answered early, but each route slower than b's
    for k in range(8):
        chooser.observe(a, 16, 1.2 if k else 12.0, early=bool(k))
    chooser.choose(16)  # b's batch: 1 of 8 answered early
    for k in range(8):
        chooser.observe(b, 16, 1.0 if k == 0 else 10.0, early=k == 0)
    assert chooser.choose(16) == b  # by batch means a (2.55 s) would beat b (8.9 s)
    # the share answered early starts at the calibrated rate and follows what is measured
    assert chooser.skipped(a) == pytest.approx((64 * 0.5 + 7) / (64 + 8))
    fresh = PointChooser([a])
    assert fresh.skipped(a) == 0.5
    for _ in range(1000):
        fresh.observe(a, 16, 1.0, early=False)
    assert fresh.skipped(a) < 0.05


@pytest.mark.usefixtures("one_batch_trials")
def test_a_route_not_yet_seen_takes_the_bands_time_on_it():
    """After one query answered at once, a point is not as quick as that query: the agent
    route takes the band's time until its own queries come back from the agent."""
    a = OperatingPoint("large", 0.9, beta=1.0, alpha=0.5)
    b = OperatingPoint("none", 0.9, beta=1.0, alpha=0.5)
    chooser = PointChooser([a, b], clock=lambda: 0.0)  # requests back to back, no gap
    chooser.choose(1)
    chooser.observe(a, 1, 0.5, early=True)  # a's one query: answered at once
    chooser.choose(1)
    chooser.observe(b, 1, 0.4, early=True)
    chooser.observe(b, 1, 6.0, early=False)
    s = chooser.skipped(a)  # 33 of 65 with the prior
    assert chooser.seconds(a, 0) == pytest.approx(s * 0.5 + (1 - s) * 6.0)
    assert chooser.choose(1) == b  # 0.45 s early beats 0.5, at the same agent time


def test_a_batch_still_under_way_does_not_stall_the_choice(monkeypatch):
    """Before any query has finished, the chooser keeps to the point it is trying."""
    monkeypatch.setattr(PointChooser, "HEAD_TURNOVERS", 0.0)  # every query counts
    large, none = (OperatingPoint(**p) for p in POINTS)
    chooser = PointChooser([large, none])
    assert [chooser.choose(16) for _ in range(4)] == [large] * 4
    chooser.observe(large, 16, 1.0)  # large's first queries come back
    assert chooser.choose(16) == large
    assert chooser.seconds(large, load_level(16)) == pytest.approx(1.0)


def measured_large_and_none() -> tuple[OperatingPoint, OperatingPoint, PointChooser]:
    """A chooser that has run both points once at 256 in flight, and alone: under load none
    wins, alone the judge's point does."""
    large, none = (OperatingPoint(**p) for p in POINTS)
    chooser = PointChooser([large, none])
    for in_flight, times in ((1, {"large": 1.0, "none": 1.4}), (256, {"large": 8.0, "none": 5.0})):
        for p in (large, none):
            assert chooser.choose(in_flight) == p
            chooser.observe(p, in_flight, times[p.name])
    return large, none, chooser


@pytest.mark.usefixtures("one_batch_trials")
def test_a_point_not_run_for_a_while_runs_again():
    """A point close behind the quickest runs one batch again after EXPLORE_EVERY batches; one
    far behind waits until its re-runs' excess is worth EXPLORE_COST of the time."""
    large, none = (OperatingPoint(**p) for p in POINTS)
    every = PointChooser.EXPLORE_EVERY
    assert PointChooser.EXPLORE_COST == 0.005  # 1.6 s against 1.0: 0.6 / 0.005 = 120 batches
    for t_large, wait in ((1.01, every), (1.6, 120)):
        chooser = PointChooser([large, none])
        times = {"large": t_large, "none": 1.0}
        picks = [serve(chooser, 1, times) for _ in range(wait + 8)]
        # close behind, large has a second trial (batch 3) after none's (batch 2), and then
        # leaves the contest: its trials' times do not vary, so 1% behind is behind
        last = 3 if t_large < 1.0 / (1 - PointChooser.HOLD_MARGIN) else 0
        reruns = [i for i, p in enumerate(picks) if p == "large" and i > last]
        assert reruns == [last + 1 + wait], (t_large, reruns)  # a wait after its last trial


@pytest.mark.usefixtures("one_batch_trials")
def test_re_runs_are_paced_by_their_own_bands_batches():
    """A band's points wait for re-runs in that band's batches: a load that has been at four
    clients for a while finds its band's times where it left them, and does not re-run every
    point on its return (in the load benchmark, batches at one client had aged band 1's
    points, and 31% of the next load's timed queries went to re-runs)."""
    large, none = (OperatingPoint(**p) for p in POINTS)
    every = PointChooser.EXPLORE_EVERY
    chooser = PointChooser([large, none])
    times = {"large": 1.01, "none": 1.0}
    assert [serve(chooser, 4, times) for _ in range(5)] == ["large", "none", "none", "large",
                                                            "none"]  # fmt: skip
    for _ in range(10 * every):  # another load, in another band, for many waits' worth
        serve(chooser, 1, times)
    picks = [serve(chooser, 4, times) for _ in range(every - 2)]
    assert picks == ["none"] * (every - 2)  # held: large's wait in band 1 has not run out
    picks = [serve(chooser, 4, times) for _ in range(4)]
    assert "large" in picks  # and then it has: band 1's own re-run


@pytest.mark.usefixtures("one_batch_trials")
def test_re_runs_spend_at_most_the_explore_cost_on_their_excess():
    """At one client a batch is one query: agent-only, 1.5x slower there, costs its excess on
    every re-run; the losers together spend at most EXPLORE_COST of the time on theirs."""
    large, none = (OperatingPoint(**p) for p in POINTS)
    agent = OperatingPoint(AGENT_POINT)
    chooser = PointChooser([large, none, agent])
    times = {"large": 1.01, "none": 1.0, "agent": 1.5}
    picks = [serve(chooser, 1, times, n=1) for _ in range(2000)]
    excess = sum(times[p] - 1.0 for p in picks[3:])  # after the first trial of each
    assert excess / len(picks[3:]) <= PointChooser.EXPLORE_COST
    assert 1 <= picks[3:].count("agent") <= 2000 * PointChooser.EXPLORE_COST / 0.5 / 2
    assert picks.count("none") > 0.97 * len(picks)


@pytest.mark.usefixtures("one_batch_trials")
def test_a_point_that_keeps_losing_is_rerun_ever_more_rarely_until_the_load_favours_it():
    """Re-runs of a losing point back off (each wait twice the last, never shorter than its
    excess allows, up to EXPLORE_MAX), so at a steady load their cost fades; once the load
    favours it, the rule takes it at once."""
    large, none, chooser = measured_large_and_none()
    batches = 2000
    picks = [chooser.choose(256) for _ in range(batches)]  # under load none wins
    runs = [i for i, p in enumerate(picks) if p == large]
    gaps = [b - a for a, b in zip([-1, *runs], runs, strict=False)]
    every, most = PointChooser.EXPLORE_EVERY, PointChooser.EXPLORE_MAX
    by_cost = math.ceil(round(0.6 / PointChooser.EXPLORE_COST, 6))  # 8 s against 5, one other
    waits = [min(max(every * 2**k, by_cost), most) for k in range(len(gaps))]
    assert gaps[1:] == [w + 1 for w in waits[1:]]
    assert len(runs) <= 10 < batches // every  # a fixed period would have run it 80 times
    # the load drops: alone, the judge's point is the faster one, and it is followed
    picks = [chooser.choose(1) for _ in range(5)]
    assert picks == [large] * 5
    assert chooser.choose(256) == none  # and under load again, none at once (measured)


@pytest.mark.usefixtures("one_batch_trials")
def test_the_points_close_to_the_quickest_take_turns_until_one_is_held():
    """While a band's first trials run the load still settles (here every query is 5% quicker
    than the one a batch before): by its first trial alone the point tried first looks slower
    than the one after it, which is 4% slower in truth. The points close to the quickest take
    turns, every other pass in reverse order (A B, B A, A B, ...: the drift weighs on both
    alike), and while their trials' spread leaves their gap unresolved the contest runs its
    CONTEST_TRIALS passes; then the quicker is held. One far behind takes no part, and
    without a margin there is no contest."""
    a = OperatingPoint("large", 0.9, beta=1.0, alpha=0.5)
    b = OperatingPoint("none", 0.9, beta=1.0, alpha=0.5)
    agent = OperatingPoint(AGENT_POINT)
    true = {"large": 1.0, "none": 1.04, AGENT_POINT: 2.0}
    n = PointChooser.CONTEST_TRIALS
    for margin, expected in ((PointChooser.HOLD_MARGIN, "large"), (0.0, "none")):
        chooser = PointChooser([a, b, agent], margin)
        picks = []
        for k in range(2 * n + 6):
            drift = 1.0 + 0.05 * max(0, 4 - k)  # settled from the fifth batch on
            picks.append(serve(chooser, 16, {n: t * drift for n, t in true.items()}))
        trials = ["large", "none", AGENT_POINT]
        if margin:  # the contenders' further passes: B A, A B, B A, ...
            trials += [x for k in range(1, n) for x in
                       (("none", "large") if k % 2 else ("large", "none"))]
        assert picks == [*trials, *[expected] * (len(picks) - len(trials))], margin


@pytest.mark.usefixtures("one_batch_trials")
def test_a_contender_clearly_behind_leaves_the_contest():
    """From the second pass on, a contender behind the quickest by more than Student's t times
    the gap's standard error (from the trials' spread) leaves: here each point's trials vary
    by 1% and `none` is 4% behind, so the contest ends after three passes (after two, with two
    degrees of freedom, t is 4.3), where 1% apart it runs them all."""
    a = OperatingPoint("large", 0.9, beta=1.0, alpha=0.5)
    b = OperatingPoint("none", 0.9, beta=1.0, alpha=0.5)
    n = PointChooser.CONTEST_TRIALS
    for gap, trials in ((0.04, 6), (0.01, 2 * n)):
        chooser = PointChooser([a, b])
        picks: list[str] = []
        for _ in range(2 * n + 4):  # each point's trials 1% quicker and slower in turn
            wobble = {k: 1.0 + (0.01 if picks.count(k) % 2 else -0.01) for k in ("large", "none")}
            picks.append(serve(chooser, 16, {"large": wobble["large"],
                                             "none": (1.0 + gap) * wobble["none"]}))
        assert picks[trials:] == ["large"] * (len(picks) - trials), (gap, picks)
        assert picks[:trials].count("none") == trials // 2


def held_a_over_b(
    margin: float = PointChooser.HOLD_MARGIN,
) -> tuple[OperatingPoint, OperatingPoint, PointChooser, dict[str, float]]:
    """Two points a little apart, each run twice at C=16 (the second trials in reverse order;
    none without a margin); the rule then holds the quicker."""
    a = OperatingPoint("large", 0.9, beta=1.0, alpha=0.5)
    b = OperatingPoint("none", 0.9, beta=1.0, alpha=0.5)
    chooser = PointChooser([a, b], margin)
    times = {"large": 1.0, "none": 1.05}
    trials = ["large", "none", "none", "large"] if margin else ["large", "none"]
    assert [serve(chooser, 16, times) for _ in range(len(trials) + 1)] == [*trials, "large"]
    return a, b, chooser, times


@pytest.mark.usefixtures("one_batch_trials")
def test_points_within_the_margin_do_not_displace_the_one_held():
    """Switching mixes two points in the engine's queue for a gap one run cannot see: the
    held point stays until another's time is HOLD_MARGIN less."""
    every = PointChooser.EXPLORE_EVERY
    a, b, chooser, times = held_a_over_b()
    times["none"] = 0.95  # b is now a little quicker (5%): its re-runs show it, a stays
    picks = [serve(chooser, 16, times) for _ in range(8 * every)]
    assert picks.count("none") >= 2 and picks[-1] == "large"
    times["none"] = 0.8  # 20% quicker: after its next re-run b is taken, and held
    trial = PointChooser.TRIAL_QUERIES  # a re-run's queries, as many as a trial counts
    picks = [serve(chooser, 16, times, n=trial) for _ in range(32 * every)]
    assert picks[-every:].count("none") >= every - 1
    a, b, chooser, times = held_a_over_b(margin=0.0)  # no margin: the least time, always
    times["none"] = 0.9
    picks = [serve(chooser, 16, times) for _ in range(2 * every)]
    assert picks[-every:].count("none") >= every - 1  # taken at its re-run (and a's re-run)
    with pytest.raises(ValueError, match="hold margin"):
        PointChooser([a], 1.0)


@pytest.mark.usefixtures("one_batch_trials")
def test_with_noisy_trials_the_contest_holds_the_quicker_point_far_more_often():
    """Trials about as noisy as the real engine's (5%, log-normal), one point 6% quicker: held
    after the whole contest in at least 94% of 300 runs. Two trials each, the rule before the
    contest, hold it in about 88% (the gap is 1.2 standard errors of two trials each, and
    Phi(1.2) = 0.885)."""
    a = OperatingPoint("large", 0.9, beta=1.0, alpha=0.5)
    b = OperatingPoint("none", 0.9, beta=1.0, alpha=0.5)
    rng = random.Random(0)
    true = {"large": 1.06, "none": 1.0}
    held = 0
    for _ in range(300):
        chooser = PointChooser([a, b])
        for _ in range(2 * PointChooser.CONTEST_TRIALS + 2):
            p = chooser.choose(16)
            t = true[p.name] * rng.lognormvariate(0.0, 0.05)  # one trial's luck
            for _ in range(4):
                chooser.observe(p, 16, t)
        held += chooser._held.get(load_level(16)) == "none"
    assert held >= 0.94 * 300, held


@pytest.mark.usefixtures("one_batch_trials")
def test_run_50s_lucky_trial_no_longer_decides():
    """Run 50 at 16 clients: `none` came out quickest in both its trials, the published
    judge's point then had a lucky second trial and was held, and `none`, 9% quicker from
    then on, never got the hold margin ahead of it. Two trials each no longer decide: the
    spread of these four leaves their 0.5% gap unresolved, so the points take turns, and
    `none`, quicker in each later pass, is held."""
    a = OperatingPoint("large", 0.9, beta=1.0, alpha=0.5)
    b = OperatingPoint("none", 0.9, beta=1.0, alpha=0.5)
    chooser = PointChooser([a, b])
    runs = [("large", 1.34), ("none", 1.235), ("none", 1.26), ("large", 1.15)]
    for name, t in runs:  # the first trials, then the second ones in reverse order
        assert serve(chooser, 16, {"large": t, "none": t}) == name
    times = {"large": 1.40, "none": 1.29}
    picks = [serve(chooser, 16, times) for _ in range(40)]
    assert picks[:2] == ["large", "none"]  # the third pass: the contest goes on
    assert picks[-20:].count("none") >= 19, picks  # (one re-run of the other at most)


@pytest.mark.usefixtures("one_batch_trials")
def test_a_point_that_keeps_coming_out_quickest_needs_less_than_the_margin():
    """After the contest, a re-run that comes out quickest in trial after trial halves the
    margin it must beat each time (down to SERIAL_HOLD_MARGIN): here `none` takes over once
    the held point's time has risen, and a point only as far ahead as noise does not."""
    for b_later, expected in ((1.29, "none"), (1.38, "large")):
        a, b, chooser, times = held_a_over_b()
        times.update(large=1.40, none=b_later)
        picks = [serve(chooser, 16, times) for _ in range(400)]
        assert picks[-100:].count(expected) >= 98, (b_later, picks)  # (the other's re-runs)


@pytest.mark.usefixtures("one_batch_trials")
def test_the_others_run_again_once_the_held_points_time_has_moved():
    """While the held point runs, the queue the points share fills and its time rises; the
    others' times are of a quieter moment, so they run again before any switch: when their
    time rose as well, the rule stays, and no point is taken for the moment's difference."""
    a, b, chooser, times = held_a_over_b()
    times.update(large=2.0, none=2.1)  # the queue fills: every point's queries wait longer
    picks = [serve(chooser, 16, times) for _ in range(20)]
    assert picks.count("none") == 1  # one re-run, then the held point again
    assert picks[-1] == "large" and picks.index("none") > 0
    times.update(large=4.0)  # now only the held point slows: the re-run shows it
    picks = [serve(chooser, 16, times) for _ in range(20)]
    assert picks[-1] == "none" and picks.count("large") < 10


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_one_in_flight_a_querys_time_runs_on_to_the_next_batch_that_follows_it():
    """Alone, queries follow one another: what a query leaves the engines to finish after its
    answer delays the next request, so its time runs on to the next batch's opening, unless
    the server sat idle in between (a gap longer than the query itself)."""
    a = OperatingPoint("large", 0.9, beta=1.0, alpha=0.5)
    clock = Clock()
    chooser = PointChooser([a], clock=clock)
    chooser.choose(1)
    chooser.observe(a, 1, 0.10, early=True)
    clock.now += 0.03  # the next request arrives 30 ms after the answer
    chooser.choose(1)
    assert chooser.seconds(a, 0) == pytest.approx(0.13)
    chooser.observe(a, 1, 0.10, early=True)
    clock.now += 5.0  # an idle server: the next request came much later
    chooser.choose(1)
    w = _Recent.DECAY
    assert chooser.seconds(a, 0) == pytest.approx((w * 0.13 + 0.10) / (w + 1))
    chooser.observe(a, 16, 0.10, early=True)  # under load batches overlap: no cycle to add
    clock.now += 0.03
    chooser.choose(16)
    chooser.choose(1)
    assert chooser.seconds(a, load_level(16)) == pytest.approx(0.10)


@pytest.mark.usefixtures("one_batch_trials")
def test_one_in_flight_a_point_a_little_quicker_displaces_the_one_held():
    """No queue mixes points when queries run one at a time: there the held point keeps its
    place only against a difference within SERIAL_HOLD_MARGIN (under load, HOLD_MARGIN)."""
    a = OperatingPoint("large", 0.9, beta=1.0, alpha=0.5)
    b = OperatingPoint("none", 0.9, beta=1.0, alpha=0.5)
    for in_flight, expected in ((16, a), (1, b)):
        chooser = PointChooser([a, b], clock=lambda: 0.0)
        times = {"large": 1.0, "none": 1.05}
        assert [serve(chooser, in_flight, times, n=1) for _ in range(5)] == [
            "large", "none", "none", "large", "large"]  # fmt: skip
        for _ in range(64):
            chooser.observe(b, in_flight, 0.95)  # b is now 5% quicker
        assert chooser.choose(in_flight) == expected
    assert PointChooser.SERIAL_HOLD_MARGIN < 0.05 < PointChooser.HOLD_MARGIN


def closed_loop(
    chooser: PointChooser, clock: Clock, clients: int, batches: int, drag: float
) -> list[str]:
    """``clients`` closed-loop clients of one engine (its time on ``clock``, which the chooser
    reads), each query its own batch: a query takes its point's time plus ``drag`` times the
    share of the queries in flight beside it that run the judge's point (whose full-image
    prefills slow every agent step), half of that on the early route and 1.5 times on the
    agent's (the routes alternate). The points' picks."""
    import heapq

    base = {"large": 0.9, "none": 1.0, AGENT_POINT: 4.0}  # alone none: 1.0 s against 0.9 + drag
    running: list[tuple[float, int, OperatingPoint, float, bool]] = []
    picks: list[str] = []

    def open_one() -> None:
        p = chooser.choose(clients)
        picks.append(p.name)
        judged = sum(q[2].judge == "large" for q in running) + (p.judge == "large")
        early = len(picks) % 2 == 0 and p.judge != AGENT_POINT
        t = (base[p.name] + drag * judged / (len(running) + 1)) * (0.5 if early else 1.5)
        heapq.heappush(running, (clock.now + t, len(picks), p, t, early))

    for _ in range(clients):
        open_one()
    while len(picks) < batches:
        settled, _, p, t, early = heapq.heappop(running)
        clock.now = settled
        chooser.observe(p, clients, t, early=early)
        open_one()
    return picks


def test_under_load_a_point_is_timed_in_its_own_queue():
    """Beside the judge's prefills every query is slower, `none`'s too: alone `none` is the
    quicker point (1.0 s against 0.9 + 0.3), but among the judge's point's queries it takes
    1.3 s. Run in stretches, each point is timed after its own queue has turned over, and
    `none` is found and held, at every load."""
    a = OperatingPoint("large", 0.9, beta=1.0, alpha=0.5)
    b = OperatingPoint("none", 0.9, beta=1.0, alpha=0.5)
    agent = OperatingPoint(AGENT_POINT)  # its loops outlast many turnovers of the others' queue
    for clients in (4, 16, 64):
        clock = Clock()
        chooser = PointChooser([a, b, agent], clock=clock)
        picks = closed_loop(chooser, clock, clients, 3000, drag=0.3)
        assert picks[-500:].count("none") > 0.9 * 500, clients
        assert chooser.seconds(agent, load_level(clients)) == pytest.approx(6.0)  # measured
        assert picks[-2000:].count(AGENT_POINT) < 0.05 * 2000  # and rarely run again


def test_a_bands_first_stretch_counts_once_its_queue_has_turned_over():
    """The load rises to 64 clients: the first queries of the band's first stretch ran in the
    lighter queue the old load left, and would time its point as quick as an empty server
    (on the real engine the point tried first at 64 in flight timed at half the others' time
    and was held for the whole run). They count from one turnover of the new queue on, which
    the first query back from the agent loop measures."""
    a = OperatingPoint("large", 0.9, beta=1.0, alpha=0.5)
    clock = Clock()
    chooser = PointChooser([a], clock=clock)
    start = clock.now
    assert chooser.choose(64) == a
    clock.now = start + 0.5
    chooser.observe(a, 64, 0.5, early=True)  # answered early while the queue fills: uncounted
    clock.now = start + 2.5
    chooser.observe(a, 64, 2.5, early=False)  # the first agent query back: the turnover, 2.5 s
    assert chooser.seconds(a, load_level(64)) is None
    clock.now = start + 12.5
    chooser.observe(a, 64, 1.5, early=True)  # arrived at start + 11: counted
    chooser.observe(a, 64, 8.0, early=False)  # arrived at start + 4.5: counted
    chooser.observe(a, 64, 12.0, early=False)  # arrived at start + 0.5, in the old queue
    s = chooser.skipped(a)
    assert chooser.seconds(a, load_level(64)) == pytest.approx(s * 1.5 + (1 - s) * 8.0)


def test_a_stretch_counts_once_the_last_points_agent_loops_are_back():
    """The point before leaves its agent loops in the queue, the slowest of its queries: a new
    stretch counts from one agent-route time of that point on, not from its mean time, which
    its quick early answers shorten."""
    a = OperatingPoint("large", 0.9, beta=1.0, alpha=0.5)
    b = OperatingPoint("none", 0.9, beta=1.0, alpha=0.5)
    clock = Clock()
    chooser = PointChooser([a, b], clock=clock)
    band, half = load_level(64), PointChooser.TRIAL_QUERIES // 2
    t0 = clock.now
    assert chooser.choose(64) == a
    clock.now = t0 + 9.0
    chooser.observe(a, 64, 9.0, early=False)  # the band's turnover
    clock.now = t0 + 30.0
    for early, seconds in ((True, 1.0), (False, 9.0)):
        for _ in range(half):
            chooser.observe(a, 64, seconds, early=early)
    assert chooser.seconds(a, band) < 6.0  # its mean: half of its queries take 1 s
    assert chooser.choose(64) == b
    start = clock.now
    clock.now = start + 7.0
    chooser.observe(b, 64, 1.0, early=True)  # arrived 6 s in: a's loops still run
    assert chooser.seconds(b, band) is None
    clock.now = start + 11.0
    chooser.observe(b, 64, 1.0, early=True)  # arrived 10 s in: counted
    s = chooser.skipped(b)
    assert chooser.seconds(b, band) == pytest.approx(s * 1.0 + (1 - s) * 9.0)


def test_after_the_queue_ran_dry_a_stretch_counts_again_one_turnover_on():
    """A server idle for minutes, then a burst: the burst's first queries meet idle engines
    and finish in a fraction of the time they take under the load (load benchmark run 54: 4-6 s
    against 13 s, and the point whose trial spanned the idle minutes was held on them). When no
    batch has opened and no query settled for IDLE_TURNOVERS turnovers, the stretch goes on
    afresh and counts again from one turnover on; in steady state it does not restart."""
    a = OperatingPoint("large", 0.9, beta=1.0, alpha=0.5)
    clock = Clock()
    chooser = PointChooser([a], clock=clock)
    band = load_level(64)
    t0 = clock.now
    assert chooser.choose(64) == a
    clock.now = t0 + 10.0
    chooser.observe(a, 64, 10.0, early=False)  # the band's turnover: 10 s
    for k in range(40):  # steady: a batch every second, agent queries of 12 s
        clock.now = t0 + 20.0 + k
        chooser.choose(64)
        chooser.observe(a, 64, 12.0, early=False)
    assert chooser.seconds(a, band) == pytest.approx(12.0)
    assert len(chooser._stretches[band]) == 1  # no restart in steady state
    clock.now += 200.0  # idle
    idle_end = clock.now
    chooser.choose(64)  # the burst
    clock.now = idle_end + 4.0
    chooser.observe(a, 64, 4.0, early=False)  # on idle engines: not counted
    chooser.observe(a, 64, 4.0, early=False)
    assert chooser.seconds(a, band) == pytest.approx(12.0)
    clock.now = idle_end + 25.0
    chooser.observe(a, 64, 13.0, early=False)  # arrived 12 s after the burst: counted
    assert chooser.seconds(a, band) > 12.0
    assert len(chooser._stretches[band]) == 2


def test_a_trial_ends_once_each_route_of_its_point_has_counted():
    """Early answers come back first: a trial that ended on them would time its point by its
    quick route. It runs until half of TRIAL_QUERIES have counted on each route the point has
    (agent-only has one)."""
    a = OperatingPoint("large", 0.9, beta=1.0, alpha=0.5)
    agent = OperatingPoint(AGENT_POINT)
    clock = Clock()
    chooser = PointChooser([a, agent], clock=clock)
    half = PointChooser.TRIAL_QUERIES // 2
    assert chooser.choose(16) == a
    clock.now += 2.0  # the band's first agent query is back: its queue has turned over
    chooser.observe(a, 16, 2.0, early=False)
    assert chooser.seconds(a, load_level(16)) is None  # it ran in the old load's queue
    clock.now += 1.0
    for _ in range(3 * half):
        chooser.observe(a, 16, 0.2, early=True)
    assert chooser.choose(16) == a  # still its trial: no agent-route query has counted
    for _ in range(half):
        chooser.observe(a, 16, 0.5, early=False)
    assert chooser.choose(16) == agent  # measured: the next point's first trial
    clock.now += 10.0  # its queries arrived after a's queue had turned over
    for _ in range(half):
        chooser.observe(agent, 16, 1.5)
    assert chooser.choose(16) == a  # agent-only has no early route: measured on one


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
    assert "auto_hold" not in FunnelConfig().to_dict()
    with pytest.raises(ValueError, match="--auto-hold"):
        FunnelConfig(auto_hold=-0.1).validate()


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
    assert funnel.auto_hold == PointChooser.HOLD_MARGIN
    ns = ap.parse_args(["--small", "s", "--large", "l", "--points", str(path), "--auto-hold", "0"])
    assert Settings.from_args(ns).funnel.auto_hold == 0.0


@pytest.fixture(scope="module")
def mw_queries(tmp_path_factory):
    canvas, clutter = level_defaults(1)
    out = tmp_path_factory.mktemp("mw-auto")
    make_split(out, "test", 1, seed=0, canvas=canvas, clutter=clutter, level=1)
    return list(load_jsonl(out / "questions.jsonl"))[:6]


@pytest.mark.usefixtures("one_batch_trials")
def test_each_batch_runs_at_its_point_with_its_judge_and_tau(models, mw_queries):  # noqa: F811
    small, large, agent = models
    f = Funnel(small, large, agent, FunnelConfig(judge="auto", points=POINTS, batch_size=2))
    results = f.run(mw_queries)
    points = [next(t for t in r.trace if t["type"] == "operating_point") for r in results]
    # the first two batches measure each point; every query records the one that answered it
    assert [p["point"] for p in points[:4]] == ["large", "large", "none", "none"]
    assert sum(f.stats.points.values()) == len(mw_queries)
    assert points[0]["in_flight"] == 2  # the load its point was chosen at: the first batch
    for r, p in zip(results, points, strict=True):
        assert p["tau"] == (0.9 if p["judge"] == "large" else 0.95)
        assert p["in_flight"] >= 2 and p["load_band"] == load_level(p["in_flight"])
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

    assert _card(records[0], None, None)["op"] == "large, tau 0.9, 2 in flight"
    assert "op" not in _card({**records[0], "trace": []}, None, None)


def test_a_servers_queue_counts_in_the_load_and_in_each_querys_time(
    models, mw_queries, monkeypatch  # noqa: F811
):
    """A slow front keeps the next batch's queries waiting in the server's queue: that wait is
    time in the system (Little's law), and the queue is load, whatever point made it."""
    from dataclasses import replace

    monkeypatch.setattr(PointChooser, "HEAD_TURNOVERS", 0.0)  # one batch: every query counts
    small, large, agent = models
    f = Funnel(small, large, agent, FunnelConfig(judge="auto", points=POINTS[:1], batch_size=2))
    f.waiting = lambda: 10  # ten more queries wait in a server's queue
    queued = [replace(q, queued_s=30.0) for q in mw_queries[:2]]
    results = f.run(queued)
    point = results[0].operating_point()
    assert point["in_flight"] == 12 and point["load_band"] == load_level(12)
    # each query's time counts its 30 s in the queue (alone, the batch takes seconds)
    t = f._chooser.seconds(f._chooser.points[0], load_level(12))
    assert 30.0 < t < 30.0 + max(r.timings.get("total", 60.0) for r in results) + 60.0


def test_serve_stamps_each_querys_wait_and_lends_the_funnel_its_queue(models, mw_queries):  # noqa: F811
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    from speceyes.images import load_image, to_data_uri
    from speceyes.serve import STATE_KEY, create_app
    from tests.tools.hostile import image_part, text_part, user_request
    from tests.tools.server_thread import ServerThread

    small, large, agent = models
    f = Funnel(small, large, agent, FunnelConfig(judge="auto", points=POINTS[:1], batch_size=1))
    seen: list = []
    opened = f._open
    f._open = lambda qs: (seen.extend(qs), opened(qs))[1]  # type: ignore[method-assign]
    app = create_app(f, max_wait_ms=0)
    q = mw_queries[0]
    body = user_request(image_part(to_data_uri(load_image(q.image))), text_part(q.question))
    data = json.dumps(body).encode()

    def post(url: str) -> dict:
        headers = {"Content-Type": "application/json"}
        req = urllib.request.Request(url + "/v1/chat/completions", data, headers)
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())

    srv = ServerThread(app).start()
    try:
        assert f.waiting is not None and f.waiting() == app[STATE_KEY].admitted == 0
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(post, [srv.url] * 3))
    finally:
        srv.stop()
    assert all(a["speceyes"]["load_band"] is not None for a in answers)
    queues = sorted(a["speceyes"]["timings"]["queue"] for a in answers)
    assert queues[-1] > 0.05  # one batch at a time: someone waited for the others' fronts
    # the funnel saw each query with its own wait (the chooser adds it to the query's time),
    # counted from the request's arrival: its decoding as well as its queue
    assert len(seen) == 3 and max(x.queued_s for x in seen) > 0.05
    waits = sorted(x.queued_s for x in seen)  # each query's own >= its queue's: so sorted too
    assert all(w >= q for w, q in zip(waits, queues, strict=True)) and sum(waits) > sum(queues)
