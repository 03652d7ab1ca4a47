"""``speceyes demo``: the mini-world benchmark on the two bundled trained models."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    from speceyes.miniworld.demo import EPILOG, add_args

    p = sub.add_parser(
        "demo",
        help="the mini-world benchmark on the two bundled trained models: agent-only, "
        "small-only and SpecEyes side by side (offline)",
        description="Generates (or reuses) a mini-world test split in OUT/data, splits it by "
        "target size, and runs agent-only, small-only and SpecEyes on both size splits, taking "
        "turns batch by batch on worker processes (--workers), through the evaluation harness (run folders OUT/runs/{small,large}-targets/MODE "
        "with samples.jsonl, results.json and plots/, readable by speceyes report and regate). "
        "Prints a table per split and pooled (accuracy, seconds per query, speedup over "
        "agent-only, beta, alpha, the analytic speedup L_agent / (c_J + beta*c_S + "
        "(1 - beta*alpha)*L_agent) from the measured per-phase costs, and the measured share of "
        "it) plus accuracy per question category, and writes OUT/summary.md and summary.json. "
        "Settings (canvas, tau, aggregation, agent, test split) come from MODELS/manifest.json. "
        "Re-running resumes runs made with the same settings; runs made with other settings are "
        "moved aside, never deleted.",
        epilog=EPILOG,
    )
    add_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from speceyes.miniworld.demo import run as run_demo

    return run_demo(args)
