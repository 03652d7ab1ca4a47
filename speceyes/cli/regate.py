"""``speceyes regate``: the gate replayed offline from a ``--mode both`` run."""

from __future__ import annotations

import argparse
import json
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    rg = sub.add_parser(
        "regate",
        help="replay the gate offline from a --mode both run, for any tau, K and aggregation",
    )
    rg.add_argument("run", help="run folder of a --mode both eval")
    rg.add_argument(
        "--tau", default=None, help="'0.9,0.98' or 'start:stop:count' (default: a grid)"
    )
    rg.add_argument("--top-k", default=None, help="K values up to the logged K, e.g. '20,64'")
    rg.add_argument("--agg", default=None, help="aggregations, e.g. 'min,mean,bottom,log'")
    rg.add_argument(
        "--split",
        default=None,
        help="replay only one part of the run: weights sweep:calib:test (e.g. 40:30:30) or "
        "calib:test, stratified by category; the same --split and --seed as calibrate",
    )
    rg.add_argument("--part", default="sweep", help="with --split: sweep | calib | test | 1-3")
    rg.add_argument("--seed", type=int, default=0, help="with --split: the split's seed")
    rg.add_argument("--json", action="store_true")
    rg.add_argument(
        "--cascade",
        default=None,
        metavar="THRESHOLDS",
        help="replay the cascade instead: 'small@0=0.9,small@1=0.85,large_direct=0.95' (a stage "
        "left out accepts nothing), or a calibration file written by calibrate --cascade",
    )
    rg.set_defaults(func=run)


def floats(text: str) -> list[float]:
    """'0.9,0.95,0.98' or a range 'start:stop:count' (inclusive)."""
    import numpy as np

    if ":" in text:
        a, b, n = text.split(":")
        return [float(x) for x in np.linspace(float(a), float(b), int(n))]
    return [float(x) for x in text.split(",") if x.strip()]


def run(args: argparse.Namespace) -> int:
    from speceyes.bench.regate import default_taus, format_table, in_sample_note, regate
    from speceyes.bench.runlog import load_run

    run = load_run(args.run, require_results=False)
    if args.split:
        from speceyes.bench.splits import parse_split, split_run

        split = parse_split(args.split, args.seed)
        run = split_run(run, split)[split.names[split.index(args.part)]]
    if args.cascade:
        return _run_cascade(args, run)
    taus = floats(args.tau) if args.tau else list(default_taus())
    ks = [int(k) for k in args.top_k.split(",")] if args.top_k else [None]
    aggs = args.agg.split(",") if args.agg else [None]
    rows = []
    for k in ks:
        for agg in aggs:
            rows.extend(regate(run, taus, top_k=k, agg=agg))
    if args.json:
        from dataclasses import asdict

        print(json.dumps([asdict(r) for r in rows], indent=2, default=float))
    else:
        print(format_table(rows))
    print(in_sample_note(run, len(rows)), file=sys.stderr if args.json else sys.stdout)
    return 0


def _run_cascade(args: argparse.Namespace, run) -> int:
    from dataclasses import asdict
    from pathlib import Path

    from speceyes.bench import cascade_calibration as cc
    from speceyes.bench import cascade_replay as cr
    from speceyes.bench.regate import in_sample_note

    if Path(args.cascade).is_file():
        taus, per_cat = cc.read_stage_taus(args.cascade), cc.read_category_taus(args.cascade)
    else:
        taus, per_cat = cr.parse_stage_taus(args.cascade), {}
    result = cr.replay_cascade(run, taus, per_cat or None)
    if args.json:
        print(json.dumps(asdict(result), indent=2, default=float))
    else:
        print(cr.format_replay(result))
    print(in_sample_note(run, 1), file=sys.stderr if args.json else sys.stdout)
    return 0
