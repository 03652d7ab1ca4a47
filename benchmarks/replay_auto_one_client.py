"""``--judge auto``'s choices at one client, replayed on a load run's measured static cells.

At one client queries run one after another, so a query's time does not depend on the points
of other queries: what auto would have measured, had it run point P on question q, is a time
the static cell of P measured on q. This replays :class:`speceyes.operating_points.PointChooser`
over the question order of a ``benchmarks/bench_load_vllm.py`` run at C=1 (its untimed settle,
then its timed rounds), answering each of its choices with a time drawn from that point's
static cell on that question. It scores auto by the cells' mean time per question, so the
ratio it prints (the best static mode's time over auto's, on the same questions) measures the
chooser's decisions alone, without the run's noise between cells.

``--drift SD``: the machine's speed drifts as a log-normal process with this standard
deviation and a one-minute time constant (an Ornstein-Uhlenbeck process sampled at each
query), which multiplies the times auto sees but not the ones it is scored by. On this
machine a mode's block of requests at one client ran 5-12% off its own mean (the sd of the
log, runs 58-60), mostly slow spells of a minute or two. Times measured at different moments
then differ by more than the points do (2-9% at one client), which is what auto's rule has to
see through.

    python benchmarks/replay_auto_one_client.py runs/bench-load-auto60 [--points FILE] \\
        [--replays 30] [--drift 0,0.05,0.1,0.2] [--set SERIAL_HOLD_MARGIN=0.1] [--seed 0]

Prints, per drift, the median and 10th / 90th percentile of the ratio over the replays, the
share of replays at or above 0.97 (the load issue's bar) and the points auto ran.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for folder in (ROOT, ROOT / "benchmarks"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import bench_load_vllm as blv  # noqa: E402

from speceyes.operating_points import OperatingPoint, PointChooser, read_points  # noqa: E402

BAR = 0.97  # the load issue's target: auto >= 0.97 x the best other mode
DRIFT_TIME_S = 60.0  # the drift's time constant: this machine's slow spells last a minute or two
CLIENT_GAP_S = 0.005  # from one answer to the next request at one client (the client's own time)
IDLE_S = 60.0  # between two of auto's rounds, the other modes' turns


def mode_of(point: OperatingPoint) -> str:
    """The load benchmark's static mode that runs ``point``."""
    return blv.AGENT_ONLY if point.name == "agent" else f"speceyes/{point.name}"


@dataclass
class Plan:
    """How the run sent its requests at one client."""

    questions: int
    per_round: int  # scored requests per round (one unscored before them)
    rounds: int
    settle: int  # auto's untimed requests before the rounds


def plan_of(results: dict) -> Plan:
    """The run's question count, rounds and settle at C=1, from its results file."""
    rows = [r for r in results["rows"] if r["concurrency"] == 1 and r["mode"] == blv.AGENT_ONLY]
    if not rows:
        raise SystemExit("the run has no agent-only cell at one client")
    args = results.get("args") or {}
    rounds = int(rows[0].get("rounds") or args.get("rounds") or 1)
    settle = int(args.get("settle") or -1)
    if settle < 0:  # the benchmark's default
        settle = blv.settle_requests(1)
    return Plan(int(results["questions"]), int(rows[0]["requests"]) // rounds, rounds, settle)


def cell_times(samples: Path, plan: Plan) -> dict[tuple[str, int], list[tuple[float, bool]]]:
    """(mode, question): each time a static cell measured on it at one client, and whether the
    small model answered."""
    out: dict[tuple[str, int], list[tuple[float, bool]]] = defaultdict(list)
    with samples.open() as f:
        for line in f:
            s = json.loads(line)
            if s["concurrency"] != 1 or not s["scored"] or "auto" in s["mode"]:
                continue
            start = blv.round_start(s["round"], plan.per_round, plan.questions)
            q = (start + s["index"]) % plan.questions
            out[(s["mode"], q)].append((s["latency_s"], s["route"] == blv.SMALL_ROUTE))
    return out


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def replay(
    points: list[OperatingPoint],
    times: dict[tuple[str, int], list[tuple[float, bool]]],
    plan: Plan,
    rng: random.Random,
    drift: float = 0.0,
) -> tuple[float, Counter[str]]:
    """One replay: the best static mode's mean time over auto's, on the timed questions, and the
    points auto ran there."""
    clock = _Clock()
    chooser = PointChooser(points, clock=clock)
    modes = sorted({mode_of(p) for p in points})
    mean = {k: statistics.fmean(t for t, _ in v) for k, v in times.items()}
    log_speed, last = 0.0, 0.0
    auto_s = 0.0
    static_s = dict.fromkeys(modes, 0.0)
    used: Counter[str] = Counter()

    def ask(q: int, timed: bool) -> None:
        nonlocal log_speed, last, auto_s
        point = chooser.choose(1)
        seconds, early = rng.choice(times[(mode_of(point), q)])
        keep = math.exp(-(clock.now - last) / DRIFT_TIME_S)
        log_speed = keep * log_speed + math.sqrt(1 - keep * keep) * drift * rng.gauss(0.0, 1.0)
        last = clock.now
        seen = seconds * math.exp(log_speed)
        clock.now += seen
        chooser.observe(point, 1, seen, early)
        clock.now += CLIENT_GAP_S
        if timed:
            auto_s += mean[(mode_of(point), q)]
            used[point.name] += 1
            for m in modes:
                static_s[m] += mean[(m, q)]

    for i in range(plan.settle):
        ask(i % plan.questions, timed=False)
    for r in range(plan.rounds):
        start = blv.round_start(r, plan.per_round, plan.questions)
        for i in range(plan.per_round + 1):  # the round's first request is unscored
            ask((start + i) % plan.questions, timed=i > 0)
        clock.now += IDLE_S
    return min(static_s.values()) / auto_s, used


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a bench_load_vllm.py output folder (C=1 cells)")
    ap.add_argument("--points", type=Path, default=None,
                    help="the operating points (default: the run's own --points)")
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--drift", default="0,0.05,0.1,0.2", help="comma-separated sd of log speed")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=NUMBER",
                    help="a PointChooser constant for a what-if (e.g. SERIAL_HOLD_MARGIN=0.1)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    results = json.loads((args.run / "results.json").read_text())
    points_file = args.points or Path((results.get("args") or {}).get("points") or "")
    if not points_file.is_file():
        ap.error(f"no points file: {points_file} (give --points)")
    points = read_points(points_file)
    for item in args.set:
        name, _, value = item.partition("=")
        if not hasattr(PointChooser, name) or not name.isupper():
            ap.error(f"--set takes a PointChooser constant, got {name!r}")
        setattr(PointChooser, name, type(getattr(PointChooser, name))(float(value)))
    plan = plan_of(results)
    times = cell_times(args.run / "samples.jsonl", plan)
    missing = [(mode_of(p), q) for p in points for q in range(plan.questions)
               if (mode_of(p), q) not in times]
    if missing:
        ap.error(f"no static time at one client for {missing[0]} (and {len(missing) - 1} more)")
    print(f"{args.run}: {plan.questions} questions, settle {plan.settle}, {plan.rounds} rounds "
          f"of {plan.per_round}; points {', '.join(p.name for p in points)}; "
          f"{args.replays} replays per drift{'; ' + ', '.join(args.set) if args.set else ''}")
    print("| drift | median | p10 | p90 | share >= 0.97 | auto's points |")
    print("|---|---|---|---|---|---|")
    for drift in (float(x) for x in args.drift.split(",")):
        got = [replay(points, times, plan, random.Random(args.seed * 100003 + k), drift)
               for k in range(args.replays)]
        ratios = sorted(r for r, _ in got)
        used: Counter[str] = Counter()
        for _, u in got:
            used.update(u)
        total = sum(used.values())
        q = statistics.quantiles(ratios, n=10) if len(ratios) > 1 else ratios * 9
        mix = ", ".join(f"{k} {v / total:.0%}" for k, v in used.most_common())
        print(f"| {drift:g} | {statistics.median(ratios):.3f} | {q[0]:.3f} | {q[-1]:.3f} | "
              f"{sum(r >= BAR for r in ratios) / len(ratios):.2f} | {mix} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
