"""Schedules and judge variants in the serving simulator (speceyes.simulate), side by side.

Part 1, the default setting (V* images, vLLM/A100 costs, one GPU per model, the published judge):
ours vs agent-only at C = 1, 16, 64; ours vs the published schedule at C = 16 (target >= 2x);
ours as a fraction of the ideal 1/(1 - beta*alpha).

Part 2, the ranges (``--sweep``, default on): for each benchmark's image size (V*, HR-Bench 4K
and 8K, POPE), each hardware setting (two GPUs, one per model; one GPU for both) and each judge
variant (large = published, large with a 256-token view budget, prefix-shared, small,
small-prefix, none), ours at C = 16 and 64 against agent-only on one GPU, per GPU, and against
agent-only on two GPUs (data parallel).

Part 3, the issue's target: with V*-sized images on one GPU for everything, which variants reach
>= 1.6x agent-only at C = 16 and at C = 64; and how the no-judge variant depends on the gate's
acceptance of the queries the judge would have sent to tools (alpha_tool), and every variant
on prefix caching. Accuracy is not simulated: benchmarks/bench_judge_variants.py measures each
variant's routing and accuracy on a benchmark folder.

    python benchmarks/bench_schedules.py [--queries 3000] [--seed 0] [--costs FILE] [--no-sweep]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from speceyes import simulate as sm

TARGET_OF_IDEAL = 0.90
TARGET_VS_PUBLISHED = 2.0
TARGET_ONE_GPU = 1.6
BUDGET_S = 60.0
BENCHES = ("vstar", "hrbench4k", "hrbench8k", "pope")
VIEW_BUDGET = 256 * 28 * 28  # a 256-token judge view for the large model
# (label, judge variant, judge view budget)
VARIANTS = (
    ("large (published)", "large", None),
    ("large, 256-token view", "large", VIEW_BUDGET),
    ("prefix-shared", "prefix", None),
    ("small", "small", None),
    ("small-prefix", "small-prefix", None),
    ("none (gate alone)", "none", None),
)
CS = (16, 64)


def _get(rows: list[sm.Row], schedule: str, c: int, judge: str | None = None) -> sm.Row:
    return next(
        r for r in rows
        if r.schedule == schedule and r.concurrency == c and (judge is None or r.judge == judge)
    )


def _mark(ok: bool) -> str:
    return "meets target" if ok else "MISSES target"


def variant_rows(
    costs: sm.CostModel, n: int, beta: float, alpha: float, seed: int,
    alpha_tool: float = sm.DEFAULT_ALPHA_TOOL,
) -> dict[str, dict[int, sm.Row]]:
    """Ours per variant at C = 16 and 64 (ratios to agent-only on one and on two GPUs)."""
    out: dict[str, dict[int, sm.Row]] = {}
    plain = [j for _, j, px in VARIANTS if px is None]
    rows = sm.simulate(costs, ["agent-only", "agent-only-2gpu", "speceyes"], CS, n, beta, alpha,
                       seed, judges=plain, alpha_tool=alpha_tool)
    budget = sm.simulate(replace(costs, judge_max_pixels=VIEW_BUDGET),
                         ["agent-only", "agent-only-2gpu", "speceyes"], CS, n, beta, alpha, seed,
                         judges=["large"])
    for label, judge, px in VARIANTS:
        src = budget if px else rows
        out[label] = {c: _get(src, "speceyes", c, judge) for c in CS}
    return out


def sweep(costs: sm.CostModel, n: int, beta: float, alpha: float, seed: int) -> None:
    print("Ranges: ours / agent-only at C=16 and C=64; 'x1' against agent-only on one GPU, "
          "'/GPU' per GPU, 'x2' against agent-only on two GPUs (data parallel).")
    print("| images | GPUs for ours | judge | C=16 x1 | /GPU | x2 | C=64 x1 | /GPU | x2 |")
    print("|---|---|---|---|---|---|---|---|---|")
    spans: dict[tuple[str, str], list[float]] = {}
    for bench in BENCHES:
        base = sm.bench_costs(bench, costs)
        for shared in (False, True):
            c = replace(base, shared_gpu=shared)
            hw = "1 (shared)" if shared else "2 (one each)"
            for label, r in variant_rows(c, n, beta, alpha, seed).items():
                r16, r64 = r[16], r[64]
                print(f"| {bench} | {hw} | {label} | {r16.vs_agent_only:.2f} | "
                      f"{r16.per_gpu_vs_agent_only:.2f} | {r16.vs_agent_only_2gpu:.2f} | "
                      f"{r64.vs_agent_only:.2f} | {r64.per_gpu_vs_agent_only:.2f} | "
                      f"{r64.vs_agent_only_2gpu:.2f} |")
                spans.setdefault((hw, label), []).extend(
                    [r16.vs_agent_only, r64.vs_agent_only]
                )
    print()
    print("Range over the four image sizes and C = 16, 64 (ours / agent-only on one GPU):")
    for (hw, label), v in spans.items():
        print(f"  {hw:13s} {label:22s} {min(v):.2f}-{max(v):.2f}x")


def target(costs: sm.CostModel, n: int, beta: float, alpha: float, seed: int) -> None:
    one = sm.bench_costs("vstar", costs, shared_gpu=True)
    two = sm.bench_costs("vstar", costs, shared_gpu=False)
    print(f"Target: V* images, one GPU for both models, ours >= {TARGET_ONE_GPU}x agent-only at "
          "C=16 and C=64:")
    res = variant_rows(one, n, beta, alpha, seed)
    for label, r in res.items():
        ok = all(r[c].vs_agent_only >= TARGET_ONE_GPU for c in CS)
        print(f"  {label:22s} C=16 {r[16].vs_agent_only:.2f}x  C=64 {r[64].vs_agent_only:.2f}x  "
              f"{_mark(ok)}")
    print("  no judge, by the gate's acceptance of the queries the judge sends to tools:")
    for at in (0.0, 0.3, 0.5, 0.71):
        rows = sm.simulate(one, ["agent-only", "speceyes"], CS, n, beta, alpha, seed,
                           judges=["none"], alpha_tool=at)
        print(f"    alpha_tool={at:.2f}: C=16 {_get(rows, 'speceyes', 16).vs_agent_only:.2f}x  "
              f"C=64 {_get(rows, 'speceyes', 64).vs_agent_only:.2f}x")
    print("  without prefix caching (every agent turn prefills its history; no cache hits):")
    off = variant_rows(replace(one, prefix_caching=False), n, beta, alpha, seed)
    for label, r in off.items():
        print(f"    {label:22s} C=16 {r[16].vs_agent_only:.2f}x  C=64 {r[64].vs_agent_only:.2f}x")
    print()
    print("Second GPU for the small model (V*): ours against agent-only on one GPU and on two "
          "(data parallel):")
    for label, r in variant_rows(two, n, beta, alpha, seed).items():
        print(f"  {label:22s} C=16 {r[16].vs_agent_only:.2f}x / {r[16].vs_agent_only_2gpu:.2f}x"
              f"  C=64 {r[64].vs_agent_only:.2f}x / {r[64].vs_agent_only_2gpu:.2f}x")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--queries", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--beta", type=float, default=sm.DEFAULT_BETA)
    ap.add_argument("--alpha", type=float, default=sm.DEFAULT_ALPHA)
    ap.add_argument("--costs", default=None, help="CostModel JSON (default: the built-in model)")
    ap.add_argument("--no-sweep", action="store_true", help="part 1 only")
    args = ap.parse_args()
    costs = sm.CostModel.from_file(args.costs) if args.costs else sm.CostModel()
    cs = list(sm.DEFAULT_CONCURRENCIES)
    n, b, a, seed = args.queries, args.beta, args.alpha, args.seed

    t0 = time.perf_counter()
    schedules = ["agent-only", "published", "speceyes"]
    rows = sm.simulate(costs, schedules, cs, n, b, a, seed)
    an = sm.analytic(costs, b, a)
    print(f"Part 1: {n} queries x {len(cs)} concurrencies x {len(schedules)} schedules, V* "
          f"images, one GPU per model, the published judge")
    print(f"batch-1 costs: judge {an.c_judge:.3f} s, small {an.c_small:.3f} s, "
          f"agent {an.l_agent:.2f} s; E[L] {an.expected_latency:.2f} s "
          f"(overlapped {an.expected_latency_overlap:.2f} s); ideal gain {an.ideal_gain:.3f}x")
    print("ours vs agent-only (throughput):")
    for c in (1, 16, 64):
        r = _get(rows, "speceyes", c)
        print(f"  C={c:<3d} {r.vs_agent_only:.2f}x  (ideal {an.ideal_gain:.2f}x, "
              f"{r.of_ideal:.0%} of it; p50 {r.p50_s:.2f} s vs agent-only "
              f"{_get(rows, 'agent-only', c).p50_s:.2f} s)")
    ours16, pub16 = _get(rows, "speceyes", 16), _get(rows, "published", 16)
    vs_pub = ours16.throughput / pub16.throughput
    print(f"ours vs published at C=16: {vs_pub:.2f}x ({ours16.throughput:.3f} vs "
          f"{pub16.throughput:.3f} queries/s; large-engine batch {ours16.large_batch:.1f} vs "
          f"{pub16.large_batch:.1f})  target >= {TARGET_VS_PUBLISHED:.0f}x: "
          f"{_mark(vs_pub >= TARGET_VS_PUBLISHED)}")
    high = [_get(rows, "speceyes", c) for c in cs if c >= 16]
    worst = min(r.of_ideal for r in high)
    print("ours as a fraction of the ideal at C >= 16: "
          + ", ".join(f"C={r.concurrency} {r.of_ideal:.0%}" for r in high)
          + f"  (target >= {TARGET_OF_IDEAL:.0%}: {_mark(worst >= TARGET_OF_IDEAL)})")
    print()
    if not args.no_sweep:
        sweep(costs, n, b, a, seed)
        print()
        target(costs, n, b, a, seed)
    wall = time.perf_counter() - t0
    print()
    print(f"simulated in {wall:.1f} s (budget {BUDGET_S:.0f} s: {wall / BUDGET_S:.0%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
