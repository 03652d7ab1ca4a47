"""``speceyes merge RUN... --output DIR``: join the shard run folders of one eval."""

from __future__ import annotations

import argparse
import sys

HELP = "join the run folders of a sharded eval (--shard i/N) into one run folder"
DESCRIPTION = (
    "Checks that the folders are all N shards of one run (same run.json apart from the shard "
    "and the time, every shard once, no query twice, none missing from the benchmark), then "
    "writes DIR/run.json, samples.jsonl and results.json recomputed from the merged records, "
    "which report, regate, calibrate and view read as one run. wall_time is the sum of the "
    "shards' wall times (device time, comparable with an unsharded run); wall_time_elapsed, "
    "the longest shard's, is recorded beside it."
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("merge", help=HELP, description=DESCRIPTION)
    parser.add_argument("runs", nargs="+", help="the shards' run folders (speceyes eval --shard)")
    parser.add_argument("--output", required=True, help="the merged run folder (must be new)")
    parser.add_argument(
        "--data",
        default=None,
        help="the benchmark's location if it moved since the shards ran (default: as logged); "
        "gives the query order and the check for missing queries",
    )
    parser.add_argument("--no-plots", action="store_true", help="do not write plots/")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from speceyes.bench.merge import merge_runs

    res = merge_runs(args.runs, args.output, data=args.data, plots=not args.no_plots)
    for note in res.notes:
        print(f"note: {note}", file=sys.stderr)
    print(
        f"merged {len(res.shards)} shard(s) ({', '.join(res.shards)}) into {res.output}: "
        f"{res.n} queries, wall time {res.wall_time:.1f} s summed over shards "
        f"({res.wall_time_elapsed:.1f} s the longest shard)"
    )
    return 0
