"""``speceyes table1 RUN...``: a reproduction's runs as the paper's Table 1, beside its numbers."""

from __future__ import annotations

import argparse
import sys

HELP = "lay out run folders as Table 1 of the paper, beside its published numbers"
DESCRIPTION = (
    "Places each run by its config (mode and aggregation give the row, agent the backbone, "
    "benchmark and data the columns: V* Attr./Pos., HR-Bench 4K/8K by the data file's name, "
    "POPE by --split), scores accuracy by the run's own protocol and measures speedup against "
    "the agent-only run of the same backbone and split, as speceyes report does. Prints the "
    "paper's line, ours and the difference for each row."
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("table1", help=HELP, description=DESCRIPTION)
    from speceyes.bench.table1 import SCORINGS

    parser.add_argument("runs", nargs="+", help="run folders written by speceyes eval (or merge)")
    parser.add_argument(
        "--scoring",
        default="run",
        choices=SCORINGS,
        help="accuracy by each run's own protocol's rules (run, default), or by the fair or "
        "the published judge scripts' rules for every run",
    )
    parser.add_argument(
        "--llm-judge", default=None, help="OpenAI-compatible URL (published rules' fallbacks)"
    )
    parser.add_argument("--llm-judge-model", default=None, help="model name at --llm-judge")
    parser.add_argument("--json", action="store_true", help="print the table as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from speceyes.bench.table1 import build_table1, format_markdown

    ask = None
    if args.llm_judge:
        from speceyes.bench.published_scoring import openai_judge

        ask = openai_judge(args.llm_judge, args.llm_judge_model)
    table = build_table1(args.runs, scoring=args.scoring, ask=ask)
    if args.json:
        print(table.to_json())
        for note in table.notes:
            print(f"note: {note}", file=sys.stderr)
    else:
        print(format_markdown(table), end="")
    return 0
