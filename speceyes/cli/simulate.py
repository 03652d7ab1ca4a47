"""``speceyes simulate``: a discrete-event model of serving the funnel (no GPU)."""

from __future__ import annotations

import argparse

from speceyes.types import DIRECT_PROMPTS

# the simulator's image profiles (speceyes.bench.benchmarks.image_profiles; named here so that
# --help does not import the benchmark registry)
SIM_BENCHES = ("vstar", "hrbench4k", "hrbench8k", "pope", "miniworld")


def add_parser(sub: argparse._SubParsersAction) -> None:
    sim = sub.add_parser(
        "simulate",
        help="discrete-event model of serving the funnel: compare schedules at scale, no GPU",
        description="Closed-loop clients over continuous-batching engines; schedules agent-only, "
        "published (batched phases I-II, phase IV one query at a time) and speceyes (ours). "
        "Writes simulate.md, simulate.csv and simulate.png into --output.",
    )
    sim.add_argument("--queries", type=int, default=10_000, help="queries per run")
    sim.add_argument("--concurrency", default="1,2,4,8,16,32,64,128,256", help="client counts")
    sim.add_argument("--beta", type=float, default=0.8, help="share judged tool-free")
    sim.add_argument("--alpha", type=float, default=0.71, help="gate acceptance among them")
    sim.add_argument("--costs", default=None, help="JSON of CostModel fields / measured seconds")
    sim.add_argument(
        "--schedules",
        default="agent-only,agent-only-2gpu,published,speceyes",
        help="agent-only (one GPU), agent-only-2gpu (two, data parallel), published, speceyes",
    )
    sim.add_argument("--published-batch", type=int, default=None, help="default: the concurrency")
    sim.add_argument(
        "--shared-gpu", action="store_true",
        help="both models on one GPU (default: one GPU each; agent-only always gets one)",
    )
    sim.add_argument(
        "--bench", default=None, choices=SIM_BENCHES,
        help="image and crop tokens from smart_resize of this benchmark's images (default: V*)",
    )
    sim.add_argument(
        "--judge", default="large",
        help="ours' judge variants, comma-separated: large (published), prefix, small, "
        "small-prefix, none, or auto (picks per C among the operating points by expected "
        "throughput; see --points)",
    )
    sim.add_argument(
        "--points", default=None, metavar="JSON",
        help="operating points: a JSON list of {judge, tau, beta, alpha, alpha_tool} (each "
        "variant's rates measured at its own tau); every static variant runs at its "
        "point's rates and auto picks among them (default: every variant at --beta/--alpha, "
        "none also at --alpha-tool)",
    )
    sim.add_argument(
        "--judge-max-pixels", type=int, default=None,
        help="judge view budget in pixels for the large and small judges",
    )
    sim.add_argument(
        "--alpha-tool", type=float, default=None,
        help="--judge none: gate acceptance among the queries the judge would send to tools "
        "(default 0.5)",
    )
    sim.add_argument(
        "--no-prefix-caching", action="store_true",
        help="engines without prefix caching: every agent turn prefills its whole history",
    )
    cas = sim.add_argument_group("cascade (docs/cascade.md)")
    cas.add_argument(
        "--cascade", action="store_true",
        help="agent-only, the two-stage funnel and the cascade (small@0, small@1..d, "
        "large_direct, agent) per --judge; writes cascade.md and cascade.csv",
    )
    cas.add_argument("--speculate-depth", type=int, default=1, help="small@1..small@d")
    cas.add_argument("--no-middle-tier", action="store_true", help="no large_direct stage")
    cas.add_argument(
        "--stage-accept", default=None,
        help="acceptance among the queries reaching each stage, e.g. "
        "small@0=0.71,small@1=0.4,large_direct=0.3 (small@0 sets --alpha; default: assumed "
        "small@1=0.4, large_direct=0.3)",
    )
    cas.add_argument(
        "--mix-from", default=None, metavar="CALIBRATION",
        help="a cascade calibration file (calibrate --cascade): the kept thresholds' stage mix "
        "as measured on its run (judge share, each stage's acceptance) and its stages and "
        "direct prompt, in place of --beta, --alpha, --stage-accept, --speculate-depth, "
        "--no-middle-tier and --direct-prompt; --alpha-tool defaults to 0 (a judged log does "
        "not measure it)",
    )
    cas.add_argument(
        "--direct-prompt", default=DIRECT_PROMPTS[0], choices=DIRECT_PROMPTS,
        help="large_direct's prompt, as the funnel's --direct-prompt: the speculative-answer "
        "prompt, or the agent's first-turn prompt plus a direct question (shares the agent's "
        "prefix cache)",
    )
    sim.add_argument("--output", default="runs/simulate", help="output folder")
    sim.add_argument("--seed", type=int, default=0)
    sim.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from speceyes import simulate as sm

    costs = sm.bench_costs(args.bench) if args.bench else sm.CostModel()
    if args.costs:  # the file's fields over the benchmark's token counts
        costs = sm.CostModel.from_file(args.costs, base=costs)
    if args.shared_gpu:
        costs.shared_gpu = True
    if args.no_prefix_caching:
        costs.prefix_caching = False
    if args.judge_max_pixels is not None:
        costs.judge_max_pixels = args.judge_max_pixels
    costs.validate()
    cs = [int(c) for c in args.concurrency.split(",") if c.strip()]
    schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    judges = [j.strip() for j in args.judge.split(",") if j.strip()]
    if args.cascade:
        return _run_cascade(args, costs, cs, judges)
    points = None
    if args.points:
        from speceyes.operating_points import read_points

        points = read_points(args.points)
    rows = sm.simulate(
        costs, schedules, cs, args.queries, args.beta, args.alpha, args.seed, args.published_batch,
        judges=judges,
        alpha_tool=sm.DEFAULT_ALPHA_TOOL if args.alpha_tool is None else args.alpha_tool,
        points=points,
    )
    print(sm.format_table(rows))
    note = ", ".join(
        x for x in (
            f"{args.bench} images" if args.bench else "",
            "one GPU for both models" if costs.shared_gpu else "",
            "no prefix caching" if not costs.prefix_caching else "",
            f"judge view {costs.judge_max_pixels} px" if costs.judge_max_pixels else "",
        ) if x
    )
    paths = sm.write_outputs(
        rows, Path(args.output), costs, args.beta, args.alpha, args.queries, args.seed, note
    )
    print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0


def _run_cascade(args: argparse.Namespace, costs, cs: list[int], judges: list[str]) -> int:
    from speceyes.simulate import cascade as sc

    beta, alpha_tool = args.beta, args.alpha_tool
    if args.mix_from:
        if args.stage_accept:
            raise ValueError("--mix-from sets the stages' acceptance: drop --stage-accept")
        spec, beta, alpha = _mix_of(args.mix_from)
        alpha_tool = 0.0 if alpha_tool is None else alpha_tool
    else:
        accept = sc.parse_stage_accept(args.stage_accept) if args.stage_accept else None
        alpha = args.alpha if accept is None else accept.pop("small@0", args.alpha)
        spec = sc.CascadeSpec(
            args.speculate_depth, not args.no_middle_tier, accept, args.direct_prompt
        )
    alpha_tool = sc.DEFAULT_ALPHA_TOOL if alpha_tool is None else alpha_tool
    rows = sc.compare(costs, spec, cs, args.queries, beta, alpha, args.seed, judges, alpha_tool)
    print(sc.format_table(rows))
    note = f"{args.bench} images" if args.bench else ""
    note += ", one GPU for both models" if costs.shared_gpu else ""
    note += f", the stage mix of {args.mix_from}" if args.mix_from else ""
    paths = sc.write_outputs(
        rows, args.output, costs, spec, beta, alpha, args.queries, args.seed, note
    )
    print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0


def _mix_of(path: str):
    """(cascade spec, beta, small@0's alpha) of a cascade calibration file's kept thresholds."""
    import json
    from pathlib import Path

    from speceyes.simulate.cascade_price import mix_from_file

    raw = json.loads(Path(path).read_text(encoding="utf-8"))
    block = raw.get("cascade") if isinstance(raw, dict) else None
    if not isinstance(block, dict) or "mix" not in block:
        raise ValueError(
            f"{path}: no stage mix (a cascade calibration file written by calibrate --cascade)"
        )
    mix = mix_from_file(block["mix"])
    return mix.spec(str(block.get("direct_prompt", DIRECT_PROMPTS[0]))), mix.beta, mix.alpha
