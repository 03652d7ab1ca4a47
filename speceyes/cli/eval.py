"""``speceyes eval``: a benchmark through the funnel, every query logged."""

from __future__ import annotations

import argparse
import json

from speceyes.bench.shards import add_shard_arg, apply_shard
from speceyes.cli.options import add_funnel_args, add_model_args
from speceyes.scale.ray_eval import add_ray_eval_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    ev = sub.add_parser(
        "eval",
        help="run a benchmark (V*, HR-Bench, POPE or your JSONL) and log every query",
        description="Writes RUN_DIR/samples.jsonl (one line per query, as it finishes), "
        "results.json (metrics, time, beta, alpha, config, versions) and plots/. "
        "--resume continues a killed run without redoing or losing any sample.",
    )
    ev.add_argument("--bench", required=True, help="vstar | hrbench | pope | jsonl")
    ev.add_argument(
        "--data", required=True, help="V* folder, HR-Bench .tsv, POPE parquet/folder, or .jsonl"
    )
    ev.add_argument("--output", default=None, help="run folder (default runs/BENCH-MODE)")
    ev.add_argument("--limit", type=int, default=None, help="only the first N queries")
    ev.add_argument("--resume", action="store_true", help="continue the run in --output")
    ev.add_argument(
        "--retry-errors",
        action="store_true",
        help="with --resume: redo logged queries that ended in an error (e.g. a dead server)",
    )
    order = ev.add_mutually_exclusive_group()
    order.add_argument(
        "--no-shuffle",
        action="store_true",
        help="V*: keep published option order (answer always A; --protocol published does)",
    )
    order.add_argument(
        "--shuffle", action="store_true", help="V*: shuffle the options under published too"
    )
    ev.add_argument("--seed", type=int, default=0, help="V*: option shuffle seed")
    ev.add_argument(
        "--split", default=None,
        help="POPE: adversarial | popular | random; V*: direct_attributes | relative_position "
        "(one category folder, timed on its own as the released scripts time each split)",
    )
    ev.add_argument(
        "--image-dir", default=None, help="POPE: the COCO val2014 folder of the original JSONL"
    )
    ev.add_argument("--no-progress", action="store_true", help="no progress bar")
    ev.add_argument(
        "--llm-judge",
        default=None,
        help="OpenAI-compatible URL of a model that judges free-form answers without an exact "
        "match (off by default; multiple choice and yes/no are always parsed by rule)",
    )
    ev.add_argument("--llm-judge-model", default=None, help="model name at --llm-judge")
    add_model_args(ev)
    add_funnel_args(ev)
    add_shard_arg(ev)
    add_ray_eval_args(ev)
    ev.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace
    from pathlib import Path

    from speceyes.bench.benchmarks import load_from_args
    from speceyes.bench.runner import EvalSpec, run_eval
    from speceyes.factory import Settings, build_funnel

    if getattr(args, "ray", None) is not None:  # the shards as Ray actors, then the merge
        from speceyes.scale.ray_eval import run_ray_eval

        return run_ray_eval(args)
    bench, loader_kw, queries = load_from_args(args)
    queries = apply_shard(args, queries)
    first = next(queries, None)  # surface a bad --data before any model is loaded
    if first is None:
        raise ValueError(f"no queries found in {args.data}")
    # The benchmark's name: the published protocol's tau depends on it.
    settings = replace(Settings.from_args(args), bench=bench).resolved()
    funnel = build_funnel(settings)
    out = Path(args.output or f"runs/{bench}-{funnel.config.mode}")
    spec = EvalSpec(
        bench=bench,
        data=args.data,
        output=out,
        limit=args.limit,
        resume=args.resume,
        retry_errors=args.retry_errors,
        llm_judge=args.llm_judge,
        llm_judge_model=args.llm_judge_model,
        models={"small": args.small, "large": args.large},
        loader_kw=loader_kw,
        shard=args.shard,
        settings=settings,
    )

    def chained():
        yield first
        yield from queries

    res = run_eval(spec, funnel, chained(), progress=not args.no_progress)
    print(f"run folder: {out}")
    acc = res["accuracy"]
    print(
        f"n={res['n']} accuracy={acc:.4f} errors={res['n_errors']} "
        f"time/query={res['time_per_query']:.3f}s beta={_fmt(res['beta'])} alpha={_fmt(res['alpha_accept'])}"
    )
    print(json.dumps(res["metrics"], indent=2))
    return 0


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"
