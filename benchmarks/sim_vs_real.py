"""The simulator against the real engine: predicted and measured throughput ratios per mode and C.

Reads a ``benchmarks/bench_load_vllm.py`` results file (rows of mode, concurrency, qps,
small_share, ...) and a costs file (``benchmarks/measure_vllm_costs.py``), and runs
``speceyes simulate``'s engine for the same modes and concurrencies the way the benchmark ran
them: each cell is ``--batches`` closed-loop batches of the benchmark's size (max(4C, 8)
requests from C clients; the wall time includes each batch's drain), throughput = requests over
the batches' summed makespans.

Rates per mode: the points file gives each judge variant's beta (the share its judge calls
tool-free) and alpha; the share the small model answered in the real row (``small_share``) then
sets alpha = share / beta (``none``: the share the gate accepts among the queries a judge would
send to tools, alpha_tool, takes the rest), so the simulated share skipping the agent is the
measured one. ``speceyes/auto`` is predicted as the mix of its points that the row records:
its throughput is the harmonic mean of the static variants' predictions, weighted by the share
of queries each point answered (the agent-only point is agent-only).

Prints, per C and mode, the measured and predicted ratio to agent-only at the same C, the
relative error and whether it is within ``--tolerance`` (15%); also the absolute queries/s,
and for each static mode the mean latency of the small model's answers and of the agent's,
measured and simulated, which says which route's cost a cell's error comes from, and where
the small model's answers spent their time by the app's own clocks.

    python benchmarks/sim_vs_real.py --real runs/bench-load-auto9/results.json \\
        --costs runs/vllm-costs/costs.json [--points runs/pts/points-lp-0.1.json] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
for folder in (ROOT, ROOT / "benchmarks"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from bench_load_vllm import SMALL_ROUTE, TWIN  # noqa: E402

AGENT_ONLY = "agent-only"
AUTO = "speceyes/auto"


def rates_for(judge: str, share: float, point: dict[str, Any] | None) -> tuple[float, float, float]:
    """(beta, alpha, alpha_tool) whose share skipping the agent is ``share``."""
    beta = float(point["beta"]) if point else 0.5
    alpha = float(point["alpha"]) if point else 1.0
    share = min(max(share, 0.0), 1.0)
    if judge == "none":
        if share <= beta * alpha:  # the gate accepts less than its calibrated rate
            return beta, share / beta if beta else 0.0, 0.0
        return beta, alpha, min((share - beta * alpha) / (1 - beta), 1.0) if beta < 1 else 0.0
    if share > beta:  # more answered than judged tool-free: the judge called more tool-free
        return share, 1.0, 0.0
    return beta, share / beta if beta else 0.0, 0.0


# requests per mode and round at each C, read from the real run (its --requests / the default
# of the benchmark version that made it); a cell's drain depends on it
PER_ROUND: dict[int, int] = {}


def simulate_cell(
    costs: Any, judge: str | None, c: int, rates: tuple[float, float, float], batches: int,
    seed: int,
) -> float:
    """Queries/s of agent-only (judge None) or ours with ``judge`` over ``batches`` batches
    of the benchmark's size at concurrency ``c``."""
    return simulate_routes(costs, judge, c, rates, batches, seed)[0]


def simulate_routes(
    costs: Any, judge: str | None, c: int, rates: tuple[float, float, float], batches: int,
    seed: int,
) -> tuple[float, float | None, float | None]:
    """:func:`simulate_cell`'s queries/s, and the mean latency of the queries the small model
    answered and of those the agent answered (None where no query took that route)."""
    from speceyes.simulate import draw, simulate_one

    n = PER_ROUND.get(c, max(4 * c, 8))
    beta, alpha, alpha_tool = rates
    total_s = 0.0
    early: list[float] = []
    agent: list[float] = []
    for b in range(batches):
        d = draw(costs, n, beta, alpha, seed + b, alpha_tool)
        if judge is None:
            r = simulate_one("agent-only", costs, d, c)
        else:
            r = simulate_one("speceyes", costs, d, c, judge=judge)
        total_s += r.makespan
        answered = r.early if r.early is not None else np.zeros(n, dtype=bool)
        early += r.latencies[answered].tolist()
        agent += r.latencies[~answered].tolist()
    return (n * batches / total_s, float(np.mean(early)) if early else None,
            float(np.mean(agent)) if agent else None)  # fmt: skip


def measured_routes(row: dict[str, Any]) -> tuple[float | None, float | None]:
    """A benchmark row's mean client latency of the small model's answers and of the agent's
    (every agent route together, weighted by its queries)."""
    by_route = row.get("mean_s_by_route") or {}
    early = by_route.get(SMALL_ROUTE)
    agent = [(v["n"], v["client"]) for k, v in by_route.items() if k not in (SMALL_ROUTE, "error")]
    n = sum(k for k, _ in agent)
    return (early["client"] if early else None,
            sum(k * x for k, x in agent) / n if n else None)  # fmt: skip


def compare(
    rows: list[dict[str, Any]], costs: Any, points: dict[str, dict[str, Any]], batches: int,
    seed: int, tolerance: float,
) -> list[dict[str, Any]]:
    """One line per real row: measured and predicted queries/s and ratio to agent-only."""
    out: list[dict[str, Any]] = []
    for c in sorted({int(r["concurrency"]) for r in rows}):
        here = {r["mode"]: r for r in rows if int(r["concurrency"]) == c and r.get("qps")}
        if AGENT_ONLY not in here:
            continue
        base_real = float(here[AGENT_ONLY]["qps"])
        base_sim, _, base_agent = simulate_routes(costs, None, c, (1.0, 0.0, 0.0), batches, seed)
        predicted: dict[str, float] = {AGENT_ONLY: base_sim, "speceyes/agent": base_sim}
        routes: dict[str, tuple[float | None, float | None]] = {AGENT_ONLY: (None, base_agent)}
        for mode, r in here.items():
            if not mode.startswith("speceyes/") or mode == AUTO:
                continue
            judge, _, variant = mode.split("/", 1)[1].partition("@")
            judge = judge.removesuffix(TWIN)  # bench_load_vllm --twin: its original's work
            cell_costs = costs
            if variant.startswith("early="):  # bench_load_vllm --waiting: early_agent 0
                cell_costs = replace(costs, early_agent=int(variant.split("=", 1)[1]))
            elif variant:
                continue  # another variant (auto@hold=M): not modelled
            rates = rates_for(judge, float(r.get("small_share") or 0.0), points.get(judge))
            qps, early_s, agent_s = simulate_routes(cell_costs, judge, c, rates, batches, seed)
            predicted[mode], routes[mode] = qps, (early_s, agent_s)
        if AUTO in here:
            predicted[AUTO] = _auto_mix(here[AUTO], predicted, costs, c, points, batches, seed)
        for mode, r in here.items():
            if mode not in predicted or math.isnan(predicted[mode]):
                continue
            real = float(r["qps"]) / base_real
            sim = predicted[mode] / base_sim
            err = sim / real - 1.0
            out.append({
                "concurrency": c, "mode": mode, "real_qps": float(r["qps"]),
                "sim_qps": predicted[mode], "real_ratio": real, "sim_ratio": sim,
                "rel_error": err, "within": abs(err) <= tolerance,
                "small_share": r.get("small_share"),
                # mean latency per route, measured and simulated (static modes only)
                "routes": {"measured": measured_routes(r), "simulated": routes[mode]}
                if mode in routes else None,
            })  # fmt: skip
    return out


def _auto_mix(
    row: dict[str, Any], predicted: dict[str, float], costs: Any, c: int,
    points: dict[str, dict[str, Any]], batches: int, seed: int,
) -> float:
    """Harmonic mix of the points auto ran (a query served at a point costs what it costs
    there); a point the static modes did not cover runs at its calibrated rates."""
    counts = {str(k): int(v) for k, v in (row.get("points") or {}).items()}
    total = sum(counts.values())
    if not total:
        return math.nan
    inv = 0.0
    for name, k in counts.items():
        key = f"speceyes/{name}"
        if key not in predicted:
            p = points.get(name)
            share = float(p["beta"]) * float(p["alpha"]) if p else 0.0
            predicted[key] = simulate_cell(costs, name, c, rates_for(name, share, p), batches,
                                           seed)
        inv += k / total / predicted[key]
    return 1.0 / inv


def format_table(lines: list[dict[str, Any]], tolerance: float) -> str:
    out = [
        "| C | mode | measured q/s | simulated q/s | measured x agent-only | simulated x "
        f"agent-only | error | within {tolerance:.0%} |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for x in lines:
        out.append(
            f"| {x['concurrency']} | {x['mode']} | {x['real_qps']:.2f} | {x['sim_qps']:.2f} "
            f"| {x['real_ratio']:.2f} | {x['sim_ratio']:.2f} | {x['rel_error']:+.1%} | "
            f"{'yes' if x['within'] else 'no'} |"
        )
    cs = sorted({x["concurrency"] for x in lines})
    out.append("")
    for c in cs:
        mine = [x for x in lines if x["concurrency"] == c and x["mode"] != AGENT_ONLY]
        worst = max(mine, key=lambda x: abs(x["rel_error"])) if mine else None
        ok = all(x["within"] for x in mine)
        out.append(
            f"C={c}: {'met' if ok else 'missed'} ({sum(x['within'] for x in mine)}/{len(mine)}"
            f" modes within {tolerance:.0%}"
            + (f"; largest error {worst['rel_error']:+.1%}, {worst['mode']}" if worst else "")
            + ")"
        )
    return "\n".join(out + route_lines(lines))


def route_lines(lines: list[dict[str, Any]]) -> list[str]:
    """Per C and static mode: each route's mean latency, measured and simulated, so a cell's
    error can be traced to the route whose cost is off."""

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{1000 * x:.0f}"

    def err(real: float | None, sim: float | None) -> str:
        return "-" if not real or sim is None else f"{sim / real - 1:+.0%}"

    out = ["", "Mean latency per route (ms), measured / simulated (error):", "",
           "| C | mode | small model's answer | the agent's |", "|---|---|---|---|"]  # fmt: skip
    for x in lines:
        if not x.get("routes"):
            continue
        (me, ma), (se, sa) = x["routes"]["measured"], x["routes"]["simulated"]
        out.append(f"| {x['concurrency']} | {x['mode']} | {ms(me)} / {ms(se)} ({err(me, se)}) "
                   f"| {ms(ma)} / {ms(sa)} ({err(ma, sa)}) |")  # fmt: skip
    return out


PHASES = ("outside", "intake", "queue", "judge", "small", "gate")  # a query's way, in order


def phase_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Per C and mode, where the small model's answers spent their time, measured: the
    benchmark's ``mean_ms_by_route_phase`` (the app's own clocks; ``outside``: the client's
    latency beyond the app's total). ``outside``, ``intake`` and ``queue`` are each query's
    own; the funnel's phases (judge, small, gate) are its share of its batch's phase, the
    phase's time divided among the batch's queries, which is the phase's time only at one
    client. Rows from before the phases were recorded are skipped."""
    out = ["", "The small model's answers, measured, by phase (mean ms; judge, small and gate "
           "a query's share of its batch's):", "",
           "| C | mode | " + " | ".join(PHASES) + " | client |",
           "|---|---|" + "---|" * (len(PHASES) + 1)]  # fmt: skip
    got = False
    for r in rows:
        ph = (r.get("mean_ms_by_route_phase") or {}).get(SMALL_ROUTE)
        client = ((r.get("mean_s_by_route") or {}).get(SMALL_ROUTE) or {}).get("client")
        if not ph or client is None:
            continue
        got = True
        cells = " | ".join(f"{ph[k]:.1f}" if k in ph else "-" for k in PHASES)
        out.append(f"| {r['concurrency']} | {r['mode']} | {cells} | {1000 * client:.1f} |")
    return out if got else []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--real", type=Path, default=ROOT / "runs" / "bench-load-auto9" / "results.json")
    ap.add_argument("--costs", type=Path, default=ROOT / "runs" / "vllm-costs" / "costs.json")
    ap.add_argument("--points", type=Path, default=ROOT / "runs" / "pts" / "points-lp-0.1.json")
    ap.add_argument("--batches", type=int, default=16, help="simulated batches per cell")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tolerance", type=float, default=0.15)
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=JSON",
                    help="override a cost field for a what-if (e.g. phase_overlap=true)")
    ap.add_argument("--out", type=Path, default=None, help="also write the lines as JSON")
    args = ap.parse_args()

    from speceyes.simulate import CostModel

    real = json.loads(args.real.read_text())
    rows = real["rows"]
    rounds = int((real.get("args") or {}).get("rounds") or 1)
    for r in rows:
        if r["mode"] == AGENT_ONLY and r.get("requests"):
            per = int(r.get("rounds") or rounds)  # a row's own rounds (--short-rounds)
            PER_ROUND[int(r["concurrency"])] = max(1, int(r["requests"]) // per)
    costs = CostModel.from_file(args.costs)
    for item in args.set:
        key, _, value = item.partition("=")
        costs = replace(costs, **{key: json.loads(value)})
    costs.validate()
    points: dict[str, dict[str, Any]] = {}
    if args.points and args.points.is_file():
        for p in json.loads(args.points.read_text())["points"]:
            points.setdefault(p["judge"], p)
    lines = compare(rows, costs, points, args.batches, args.seed, args.tolerance)
    print(f"real: {args.real}; costs: {args.costs}; {args.batches} simulated batches per cell")
    print(format_table(lines, args.tolerance))
    print("\n".join(phase_lines(rows)))
    if args.out:
        args.out.write_text(json.dumps(lines, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
