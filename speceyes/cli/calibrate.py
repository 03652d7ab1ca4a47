"""``speceyes calibrate``: a tau with a finite-sample guarantee, from a ``--mode both`` run."""

from __future__ import annotations

import argparse
import sys

from speceyes.cli.simulate import SIM_BENCHES
from speceyes.types import DIRECT_PROMPTS, JUDGES


def add_parser(sub: argparse._SubParsersAction) -> None:
    cal = sub.add_parser(
        "calibrate",
        help="choose tau with a finite-sample guarantee on the error of accepted answers",
        description="Learn-then-test with fixed-sequence testing and exact binomial bounds: the "
        "error rate among accepted speculative answers is at most --max-error with probability "
        "at least --confidence (over the calibration sample). Several --top-k/--agg values are "
        "tested as one family (Bonferroni across them), so the guarantee holds for the one "
        "kept. --split or --holdout measure accuracy, error among accepted and speedup on "
        "queries the test never saw. Exits 1 when no tau passes.",
    )
    cal.add_argument(
        "run",
        nargs="+",
        help="run folder of a --mode both eval (--operating-points: one per judge variant)",
    )
    cal.add_argument("--max-error", type=float, default=0.05)
    cal.add_argument("--confidence", type=float, default=0.9)
    cal.add_argument(
        "--min-relative-accuracy",
        type=float,
        default=None,
        help="instead: funnel accuracy >= r x agent-only accuracy",
    )
    cal.add_argument("--top-k", default=None, help="K, or several ('20,64') tested as a family")
    cal.add_argument("--agg", default=None, help="aggregation, or several ('min,mean')")
    cal.add_argument(
        "--split",
        default=None,
        help="calib:test (e.g. 50:50) or sweep:calib:test weights: calibrate on the calib part, "
        "measure on the test part (seeded, stratified by category)",
    )
    cal.add_argument("--seed", type=int, default=0, help="seed of --split")
    cal.add_argument("--holdout", default=None, help="run folder (same setup) to measure on")
    cal.add_argument("--output", default=None, help="default RUN/calibration.json")
    cal.add_argument(
        "--operating-points",
        action="store_true",
        help="--judge auto's operating points in one call: one point per run's judge variant "
        "(plus none, read from the first judged run's log), all tested as one family so the "
        "guarantee holds whichever point answers; writes RUN/points.json for --points",
    )
    _add_cascade_options(cal)
    cal.set_defaults(func=run)


def _add_cascade_options(cal: argparse.ArgumentParser) -> None:
    cas = cal.add_argument_group("cascade (docs/cascade.md)")
    cas.add_argument(
        "--cascade",
        action="store_true",
        help="one threshold per logged stage (small@0, small@1.., large_direct) with the "
        "guarantee on the error of ALL accepted answers together",
    )
    cas.add_argument(
        "--cascade-method",
        default="fixed-sequence",
        choices=["fixed-sequence", "bonferroni"],
        help="fixed-sequence: joint threshold vectors along fixed paths, all the data; "
        "bonferroni: stage by stage at delta/S, each on its own part of the queries",
    )
    cas.add_argument(
        "--cascade-paths",
        default="basic",
        choices=["basic", "subsets"],
        help="fixed-sequence: the paths through threshold space, fixed before the labels are "
        "seen: basic (every stage alike and each alone; S + 1 paths) or subsets (one per subset "
        "of the stages, so a stage can be off while the others stay on; 2^S - 1 paths, each "
        "tested at a smaller share of delta)",
    )
    cas.add_argument(
        "--per-category",
        action="store_true",
        help="also thresholds per category (adaptive gating), each category at delta/G",
    )
    price = cal.add_argument_group(
        "cascade: which certified vector to keep",
        "Every threshold vector the test certifies holds the guarantee, so any one may be kept. "
        "By default the one whose replayed seconds on the run are least; with --price-bench the "
        "one a simulated deployment serves fastest: each vector's stage mix (judge share, each "
        "stage's acceptance) through `speceyes simulate --cascade` on that benchmark's images.",
    )
    price.add_argument(
        "--price-bench", default=None, choices=SIM_BENCHES,
        help="price the vectors on this benchmark's image sizes (GPU cost model)",
    )
    price.add_argument(
        "--price-judge", default=None, choices=list(JUDGES),
        help="the judge variant of the deployment (default: the run's); its routing is taken "
        "to be the run's judge's, as the simulator takes one beta for every variant",
    )
    price.add_argument(
        "--price-concurrency", type=int, default=16, help="clients, closed loop (default 16)"
    )
    price.add_argument(
        "--price-shared-gpu", action="store_true", help="both models on one GPU (default: one each)"
    )
    price.add_argument(
        "--price-costs", default=None, metavar="JSON",
        help="measured engine costs over the benchmark's (as simulate --costs)",
    )


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from speceyes.bench.calibrate import calibrate, format_calibration, write_calibration
    from speceyes.bench.runlog import load_run
    from speceyes.bench.splits import parse_split

    if args.operating_points:
        return _run_points(args)
    if len(args.run) > 1:
        raise ValueError("give one run folder (several are for --operating-points)")
    run_dir = args.run[0]
    run = load_run(run_dir, require_results=False)
    if args.cascade:
        return _run_cascade(args, run, run_dir)
    cal = calibrate(
        run,
        max_error=args.max_error,
        confidence=args.confidence,
        top_k=[int(k) for k in args.top_k.split(",")] if args.top_k else None,
        agg=[a.strip() for a in args.agg.split(",")] if args.agg else None,
        min_relative_accuracy=args.min_relative_accuracy,
        split=parse_split(args.split, args.seed) if args.split else None,
        holdout=load_run(args.holdout, require_results=False) if args.holdout else None,
    )
    out = Path(args.output or Path(run_dir) / "calibration.json")
    write_calibration(cal, out)
    print(format_calibration(cal))
    if not cal.passed:
        print(f"wrote {out} (a record only: eval and serve refuse it)", file=sys.stderr)
        return 1
    print(f"wrote {out} (pass it to eval or serve with --calibration)")
    return 0


def _run_cascade(args: argparse.Namespace, run, run_dir: str) -> int:
    from pathlib import Path

    from speceyes.bench import cascade_calibration as cc
    from speceyes.bench.splits import parse_split

    given = [
        flag
        for flag, value in (
            ("--top-k", args.top_k),
            ("--agg", args.agg),
            ("--holdout", args.holdout),
            ("--min-relative-accuracy", args.min_relative_accuracy),
        )
        if value is not None
    ]
    if given:  # the stages' confidences are logged at the run's gate setting
        raise ValueError(f"--cascade does not take {', '.join(given)} (use --split to hold out)")
    pricing = _simulated_price(args, run)
    cal = cc.calibrate_cascade(
        run,
        max_error=args.max_error,
        confidence=args.confidence,
        method=args.cascade_method,
        per_category=args.per_category,
        split=parse_split(args.split, args.seed) if args.split else None,
        seed=args.seed,
        paths=args.cascade_paths,
        price=None if pricing is None else pricing.bind,
        price_info=None if pricing is None else pricing.info,
    )
    if pricing is not None and cal.base.passed:
        cal.cascade["price"] |= pricing.report(cal.cascade["mix"])
        print(pricing.describe(cal.cascade["price"]))
    out = Path(args.output or Path(run_dir) / "calibration.json")
    cc.write_cascade_calibration(cal, out)
    print(cc.format_cascade_calibration(cal))
    if not cal.base.passed:
        print(f"wrote {out} (a record only: no stage accepts anything)", file=sys.stderr)
        return 1
    print(f"wrote {out} (pass it to eval or serve with --calibration)")
    return 0


def _simulated_price(args: argparse.Namespace, run):
    """--price-bench: a simulated deployment that prices the certified vectors (None without)."""
    asked = [f for f, v in (("--price-judge", args.price_judge), ("--price-costs", args.price_costs),
                            ("--price-shared-gpu", args.price_shared_gpu or None)) if v is not None]
    if args.price_bench is None:
        if asked:
            raise ValueError(f"{', '.join(asked)}: only with --price-bench")
        return None
    from speceyes.simulate.cascade_price import DeploymentPrice

    judge = args.price_judge or run.config.get("judge") or JUDGES[0]
    if judge not in JUDGES:  # e.g. a run of --judge auto: several variants answered
        raise ValueError(f"the run's judge {judge!r} is not one variant: give --price-judge")
    return DeploymentPrice.from_options(
        bench=args.price_bench,
        judge=judge,
        concurrency=args.price_concurrency,
        shared_gpu=args.price_shared_gpu,
        costs_file=args.price_costs,
        direct_prompt=run.config.get("direct_prompt") or DIRECT_PROMPTS[0],
    )


def _run_points(args: argparse.Namespace) -> int:
    from pathlib import Path

    from speceyes.bench import points_calibration as pcal
    from speceyes.bench.runlog import load_run
    from speceyes.bench.splits import parse_split

    given = [
        flag
        for flag, value in (
            ("--cascade", args.cascade or None),
            ("--holdout", args.holdout),
            ("--min-relative-accuracy", args.min_relative_accuracy),
        )
        if value is not None
    ]
    if given or any("," in str(v) for v in (args.top_k, args.agg) if v):
        raise ValueError(
            f"--operating-points takes one --top-k and one --agg and no {', '.join(given) or 'family'} "
            "(use --split to hold out)"
        )
    pc = pcal.calibrate_points(
        [load_run(r, require_results=False) for r in args.run],
        max_error=args.max_error,
        confidence=args.confidence,
        top_k=int(args.top_k) if args.top_k else None,
        agg=args.agg,
        split=parse_split(args.split, args.seed) if args.split else None,
    )
    out = Path(args.output or Path(args.run[0]) / "points.json")
    pcal.write_points_calibration(pc, out)
    print(pcal.format_points_calibration(pc))
    if not pc.points:
        print(f"wrote {out} (a record only: no point passed; eval and serve refuse it)",
              file=sys.stderr)  # fmt: skip
        return 1
    print(f"wrote {out} (pass it to eval, ask or serve with --points; --judge auto follows)")
    return 0
