"""``--judge auto`` against every static judge variant, in the simulator.

For each scenario (a set of operating points: each judge variant with its own beta, alpha and,
for ``none``, alpha_tool) and each engine layout (one GPU shared by both models, or one each),
one simulator run per concurrency gives every static variant and ``auto`` on the same seeded
draws. It prints, per C, what ``auto`` picked, its throughput over agent-only, the best static
variant's, and their ratio; then the worst ratio over everything.

Scenarios: the rates measured on the mini world (docs/throughput.md, "Mini world"; only the
variants within 1 point of the published judge's accuracy: large, prefix, none), every variant
at the simulator's default rates, a stricter ``none`` (its own tau accepts less), and random
point sets (``--random``) that move each variant's rates independently.

    python benchmarks/bench_judge_auto.py [--bench vstar] [--queries 1500] [--random 20]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from speceyes import simulate as sm  # noqa: E402
from speceyes.operating_points import AUTO, OperatingPoint  # noqa: E402
from speceyes.types import JUDGES  # noqa: E402

CONCURRENCIES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TARGET = 0.97  # auto's throughput at least this share of the best static variant's

# docs/throughput.md, "Mini world (measured)": beta and alpha per variant at tau 0.9 (none:
# every query judged tool-free, alpha its overall acceptance); small and small-prefix lost
# 1.7 and 5.8 points there, so they are no operating point that keeps accuracy.
MINIWORLD = [
    OperatingPoint("large", 0.9, 0.67, 1.00),
    OperatingPoint("prefix", 0.9, 0.67, 1.00),
    OperatingPoint("none", 0.9, 1.00, 0.82),
]


def scenarios(rng: np.random.Generator, n_random: int) -> list[tuple[str, list[OperatingPoint]]]:
    b, a, at = sm.DEFAULT_BETA, sm.DEFAULT_ALPHA, sm.DEFAULT_ALPHA_TOOL
    default = [OperatingPoint(j, None, b, a, at if j == "none" else 0.0) for j in JUDGES]
    strict = [p if p.judge != "none" else OperatingPoint("none", None, b, 0.45, 0.15)
              for p in default]
    out = [("mini world (measured)", MINIWORLD), ("default rates", default),
           ("strict none", strict)]
    for i in range(n_random):
        pts = [OperatingPoint(j, None, float(rng.uniform(0.3, 0.95)),
                              float(rng.uniform(0.3, 0.95)),
                              float(rng.uniform(0.0, 0.6)) if j == "none" else 0.0)
               for j in JUDGES]
        out.append((f"random {i}", pts))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", default="vstar", choices=sorted(sm.BENCH_IMAGES))
    ap.add_argument("--queries", type=int, default=1500)
    ap.add_argument("--random", type=int, default=20, help="random point sets")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet", action="store_true", help="only the summary per scenario")
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    worst = (np.inf, "")
    cells = below = 0
    print(f"{args.bench} images, {args.queries} queries per run, C = {list(CONCURRENCIES)}\n")
    print("| scenario | GPUs | C | auto picks | auto x agent-only | best static | x agent-only "
          "| auto / best |")
    print("|---|---|---|---|---|---|---|---|")
    for name, points in scenarios(rng, args.random):
        for shared in (True, False):
            costs = sm.bench_costs(args.bench)
            costs.shared_gpu = shared
            judges = [*dict.fromkeys(p.judge for p in points), AUTO]
            rows = sm.simulate(costs, ["agent-only", "speceyes"], CONCURRENCIES, args.queries,
                               seed=args.seed, judges=judges, points=points)
            gpus = "1 shared" if shared else "2"
            ratios = []
            for c in CONCURRENCIES:
                here = {r.judge: r.vs_agent_only for r in rows
                        if r.schedule == "speceyes" and r.concurrency == c}
                auto = next(k for k in here if k.startswith(AUTO))
                static = {k: v for k, v in here.items() if k != auto}
                best = max(static, key=static.__getitem__)
                ratio = here[auto] / static[best]
                ratios.append(ratio)
                cells += 1
                below += ratio < TARGET
                if ratio < worst[0]:
                    worst = (ratio, f"{name}, {gpus} GPU(s), C={c}")
                if not args.quiet or c in (16, 64):
                    print(f"| {name} | {gpus} | {c} | {auto.split(':', 1)[1]} | "
                          f"{here[auto]:.2f} | {best} | {static[best]:.2f} | {ratio:.3f} |")
            if args.quiet:
                print(f"| {name} | {gpus} | all | - | - | - | - | min {min(ratios):.3f} |")
    print(f"\nworst auto / best static: {worst[0]:.3f} ({worst[1]}); under {TARGET}: "
          f"{below} of {cells} cells; {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
