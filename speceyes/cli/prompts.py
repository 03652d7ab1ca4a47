"""``speceyes prompts``: the exact messages each phase sends, as JSON."""

from __future__ import annotations

import argparse
import json

from speceyes.protocols import PROTOCOLS, PUBLISHED_AGENTS


def add_parser(sub: argparse._SubParsersAction) -> None:
    pr = sub.add_parser(
        "prompts", help="print the exact messages each phase sends (JSON; images as sizes)"
    )
    pr.add_argument("--bench", required=True, help="vstar | hrbench | pope | jsonl")
    pr.add_argument("--data", required=True, help="benchmark folder or file")
    pr.add_argument("--limit", type=int, default=1, help="first N queries (default 1)")
    pr.add_argument("--protocol", default="fair", choices=PROTOCOLS)
    # the agents whose prompts the published code has (the dump covers their first turns)
    pr.add_argument("--agent", default=PUBLISHED_AGENTS[0], choices=PUBLISHED_AGENTS)
    pr.add_argument("--no-shuffle", action="store_true", help="V*: original option order")
    pr.add_argument("--shuffle", action="store_true", help="V*: shuffle under published too")
    pr.add_argument("--seed", type=int, default=0, help="V*: option shuffle seed")
    pr.add_argument("--split", default=None, help="POPE split")
    pr.add_argument("--image-dir", default=None, help="POPE: COCO folder of the original JSONL")
    pr.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from speceyes.bench.benchmarks import load_from_args
    from speceyes.prompt_dump import dump_prompts

    queries = load_from_args(args).queries
    print(json.dumps(dump_prompts(queries, args.limit, args.protocol, args.agent), indent=1))
    return 0
