"""``speceyes report``: a Table-1 style comparison of run folders."""

from __future__ import annotations

import argparse

from speceyes.protocols import PROTOCOLS


def add_parser(sub: argparse._SubParsersAction) -> None:
    rep = sub.add_parser("report", help="Table-1 style comparison of run folders")
    rep.add_argument("runs", nargs="+", help="run folders written by speceyes eval")
    rep.add_argument("--output", default=None, help="write report.md, report.csv and plots here")
    rep.add_argument(
        "--protocol",
        default=None,
        choices=PROTOCOLS,
        help="rescore the logged answers by the fair rules or by the published judge scripts' "
        "rules (errors dropped, loose letter matching, LLM-judge fallbacks)",
    )
    rep.add_argument(
        "--llm-judge", default=None, help="OpenAI-compatible URL (published fallbacks)"
    )
    rep.add_argument("--llm-judge-model", default=None, help="model name at --llm-judge")
    rep.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from speceyes.bench.report import report, write_report

    if args.protocol:  # one run scored by the fair or the published rules
        from speceyes.bench.published_scoring import openai_judge
        from speceyes.bench.report import rescore

        ask = openai_judge(args.llm_judge, args.llm_judge_model) if args.llm_judge else None
        print(rescore(args.runs, args.protocol, ask)[0])
        return 0
    md, _ = report(args.runs)
    print(md)
    if args.output:
        paths = write_report(args.runs, Path(args.output))
        print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0
