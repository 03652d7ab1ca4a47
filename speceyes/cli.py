"""Command line: speceyes ask | demo | eval | report | regate | calibrate."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from speceyes import gate

ROUTE_TEXT = {
    "small": "small model (judged tool-free, accepted by the gate)",
    "agent_after_judge": "agent (the judge asked for tools)",
    "agent_after_gate": "agent (judged tool-free, rejected by the gate)",
    "agent_only": "agent (agent-only mode)",
    "small_only": "small model (small-only mode)",
    "error": "error",
}


def add_model_args(p: argparse.ArgumentParser, *, required: bool = True) -> None:
    g = p.add_argument_group("models")
    g.add_argument("--small", required=required, help="small tool-free VLM: folder or hub id")
    g.add_argument("--large", required=required, help="agentic VLM (DeepEyes): folder or hub id")
    g.add_argument("--dtype", default="auto", help="torch dtype for both models (default: auto)")
    g.add_argument("--device-map", default=None, help='e.g. "auto" or "cuda:0" (default: CPU)')
    g.add_argument("--attn", default=None, help="attention implementation, e.g. sdpa")


def add_funnel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("funnel")
    g.add_argument(
        "--mode",
        default="speceyes",
        choices=["speceyes", "agent", "small", "both"],
        help="speceyes (default), agent only, small only, or both (log everything)",
    )
    g.add_argument("--tau", type=float, default=None, help="gate threshold (default 0.98)")
    g.add_argument("--top-k", type=int, default=gate.DEFAULT_TOP_K, help="K for separability")
    g.add_argument("--agg", default="min", choices=list(gate.AGGREGATIONS), help="aggregation")
    g.add_argument(
        "--judge-mode",
        default="logit",
        choices=["logit", "decode"],
        help="logit: one forward step, P(yes) vs P(no); decode: published 10-token rule",
    )
    g.add_argument("--batch-size", type=int, default=8)
    g.add_argument("--max-tool-calls", type=int, default=5)
    g.add_argument("--calibration", default=None, help="tau file written by speceyes calibrate")


def funnel_config(args: argparse.Namespace):
    from speceyes.funnel import FunnelConfig

    tau, top_k, agg = args.tau, args.top_k, args.agg
    if getattr(args, "calibration", None):
        from speceyes.bench.calibrate import read_calibration

        cal = read_calibration(args.calibration)
        tau = cal.tau if tau is None else tau
        top_k, agg = cal.top_k, cal.agg
    return FunnelConfig(
        mode=args.mode,
        tau=gate.DEFAULT_TAU["deepeyes"] if tau is None else tau,
        top_k=top_k,
        agg=agg,
        judge_mode=args.judge_mode,
        batch_size=args.batch_size,
    )


def build_funnel(args: argparse.Namespace):
    from speceyes.agents.zoom import ZoomAgent
    from speceyes.backends.hf import HFBackend
    from speceyes.funnel import Funnel

    config = funnel_config(args)
    kw = {"dtype": args.dtype, "device_map": args.device_map, "attn_implementation": args.attn}
    small = HFBackend(args.small, **kw) if config.mode != "agent" else None
    large = None
    if config.mode != "small":
        large = small if args.large == args.small and small is not None else HFBackend(args.large, **kw)
    agent = ZoomAgent(large, max_tool_calls=args.max_tool_calls) if large is not None else None
    return Funnel(small, large, agent, config)


def _print_result(r, tau: float) -> None:
    print(f"answer:      {r.answer}")
    print(f"route:       {r.route} - {ROUTE_TEXT.get(r.route, r.route)}")
    if r.p_tool is not None:
        print(f"P(tool):     {r.p_tool:.3f}")
    if r.small_answer is not None:
        conf = "n/a (empty answer)" if r.confidence is None else f"{r.confidence:.4f}"
        print(f"small model: {r.small_answer!r}  confidence {conf}  (tau {tau})")
    print(f"tool calls:  {r.tool_calls}" + (f" (+{r.invalid_tool_calls} invalid)" if r.invalid_tool_calls else ""))
    for step in r.trace:
        if step["type"] == "zoom":
            print(f"  zoom {step['bbox_2d']} -> crop {step['crop_box']} of the original")
        elif step["type"] == "tool_error":
            print(f"  invalid tool call: {step['error']}")
    times = ", ".join(f"{k} {v:.3f} s" for k, v in r.timings.items())
    print(f"time:        {times}")
    if r.error:
        print(f"error:       {r.error}")


def cmd_ask(args: argparse.Namespace) -> int:
    from speceyes.images import load_image
    from speceyes.types import Query

    image = load_image(args.image)  # fail fast on a missing or corrupt image, before loading models
    funnel = build_funnel(args)
    q = Query(id="ask", image=image, question=args.question, options=args.option or None)
    r = funnel.run_batch([q])[0]
    if args.json:
        d = r.to_dict()
        d["small_topk"] = None
        print(json.dumps(d, indent=2, default=str))
    else:
        _print_result(r, funnel.config.tau)
    return 1 if r.route == "error" else 0


def cmd_eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from speceyes.bench.datasets import canonical_bench, load_benchmark
    from speceyes.bench.runner import EvalSpec, run_eval

    bench = canonical_bench(args.bench)
    loader_kw: dict = {}
    if bench == "vstar":
        loader_kw = {"shuffle": not args.no_shuffle, "seed": args.seed}
    elif bench == "pope" and args.split:
        loader_kw = {"split": args.split}
    queries = load_benchmark(bench, args.data, **loader_kw)
    first = next(queries, None)  # surface a bad --data before any model is loaded
    if first is None:
        raise ValueError(f"no queries found in {args.data}")
    funnel = build_funnel(args)
    out = Path(args.output or f"runs/{bench}-{funnel.config.mode}")
    spec = EvalSpec(
        bench=bench,
        data=args.data,
        output=out,
        limit=args.limit,
        resume=args.resume,
        models={"small": args.small, "large": args.large},
        loader_kw=loader_kw,
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


def cmd_demo(args: argparse.Namespace) -> int:
    from speceyes.demo import run_demo

    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="speceyes",
        description="Speculative perception and planning for agentic VLMs: a small model answers "
        "first, a separability gate decides, the tool-using agent runs only when needed.",
    )
    sub = p.add_subparsers(dest="command", required=True)

    ask = sub.add_parser("ask", help="answer one visual question through the funnel")
    ask.add_argument("image", help="image file")
    ask.add_argument("question")
    ask.add_argument("--option", action="append", help="a multiple-choice option (repeat)")
    ask.add_argument("--json", action="store_true", help="print the result as JSON")
    add_model_args(ask)
    add_funnel_args(ask)
    ask.set_defaults(func=cmd_ask)

    ev = sub.add_parser(
        "eval",
        help="run a benchmark (V*, HR-Bench, POPE or your JSONL) and log every query",
        description="Writes RUN_DIR/samples.jsonl (one line per query, as it finishes), "
        "results.json (metrics, time, beta, alpha, config, versions) and plots/. "
        "--resume continues a killed run without redoing or losing any sample.",
    )
    ev.add_argument("--bench", required=True, help="vstar | hrbench | pope | jsonl")
    ev.add_argument("--data", required=True, help="V* folder, HR-Bench .tsv, POPE parquet/folder, or .jsonl")
    ev.add_argument("--output", default=None, help="run folder (default runs/BENCH-MODE)")
    ev.add_argument("--limit", type=int, default=None, help="only the first N queries")
    ev.add_argument("--resume", action="store_true", help="continue the run in --output")
    ev.add_argument("--no-shuffle", action="store_true", help="V*: keep published option order (answer always A)")
    ev.add_argument("--seed", type=int, default=0, help="V*: option shuffle seed")
    ev.add_argument("--split", default=None, help="POPE: adversarial | popular | random")
    ev.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_model_args(ev)
    add_funnel_args(ev)
    ev.set_defaults(func=cmd_eval)

    demo = sub.add_parser(
        "demo", help="offline end-to-end run on tiny locally built models (no download)"
    )
    demo.add_argument("--cache", default=None, help="where the tiny models are built")
    demo.add_argument("--n", type=int, default=6, help="number of demo questions")
    demo.set_defaults(func=cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    import logging

    from speceyes.backends.base import BackendError
    from speceyes.backends.hf import ModelLoadError
    from speceyes.images import ImageError

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ImageError, ModelLoadError, BackendError, OSError, ValueError) as e:
        print(f"speceyes {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
