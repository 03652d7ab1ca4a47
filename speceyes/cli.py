"""Command line: speceyes ask | demo | eval | report | view | regate | calibrate | serve."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from speceyes import gate, limits
from speceyes.factory import AGENTS
from speceyes.funnel import JUDGES, MODES, SCHEDULES
from speceyes.protocols import PROTOCOLS

ROUTE_TEXT = {
    "small": "small model (judged tool-free, accepted by the gate)",
    "agent_after_judge": "agent (the judge asked for tools)",
    "agent_after_gate": "agent (judged tool-free, rejected by the gate)",
    "agent_only": "agent (agent-only mode)",
    "small_only": "small model (small-only mode)",
    "specreason": "agent (SpecReason: small-model steps scored by the large model)",
    "error": "error",
}


def add_model_args(p: argparse.ArgumentParser, *, required: bool = True) -> None:
    g = p.add_argument_group("models")
    g.add_argument(
        "--small",
        required=required,
        help="small tool-free VLM: folder, hub id, or OpenAI-compatible URL(s) "
        "(http://host:8000/v1, comma-separated for replicas)",
    )
    g.add_argument(
        "--large", required=required, help="agentic VLM (DeepEyes): folder, hub id, or URL(s)"
    )
    g.add_argument(
        "--engine",
        default="hf",
        choices=["hf", "vllm"],
        help="runtime for folders/hub ids: transformers in-process (default) or vLLM offline",
    )
    g.add_argument("--dtype", default="auto", help="torch dtype for both models (default: auto)")
    g.add_argument("--device-map", default=None, help='e.g. "auto" or "cuda:0" (default: CPU)')
    g.add_argument("--attn", default=None, help="attention implementation, e.g. sdpa")
    g.add_argument("--tensor-parallel-size", type=int, default=1, help="vLLM engine only")
    g.add_argument("--small-family", default="qwen3_vl", help="model family behind a --small URL")
    g.add_argument("--large-family", default="qwen2_5_vl", help="model family behind a --large URL")
    g.add_argument(
        "--max-logprobs",
        type=int,
        default=20,
        help="top_logprobs cap of the servers behind URLs (vLLM: --max-logprobs)",
    )
    # A URL does not say its model's image limits; a folder's preprocessor_config.json does.
    g.add_argument(
        "--min-pixels",
        type=int,
        default=None,
        help="smallest image (pixels) the models behind URLs see (default: the family's, 4 "
        "visual tokens); a checkpoint states it as size.shortest_edge",
    )
    g.add_argument(
        "--max-pixels",
        type=int,
        default=None,
        help="largest image (pixels) the models behind URLs see (default: the family's, 16384 "
        "visual tokens); a checkpoint states it as size.longest_edge",
    )


def add_funnel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("funnel")
    g.add_argument(
        "--mode",
        default="speceyes",
        choices=MODES,
        help="speceyes (default), agent only, small only, both (log everything), or the "
        "SpecReason baseline (small model proposes each agent step, large model scores it)",
    )
    g.add_argument(
        "--agent",
        default="deepeyes",
        choices=AGENTS,
        help="agent loop of the large model: deepeyes (zoom tool calls, default), thyme "
        "(Python code run in a process sandbox), or search (training-free zoom search scored "
        "by the model's own P(yes) per region)",
    )
    g.add_argument(
        "--search",
        default="depth=2,grid=2",
        metavar="K=V,...",
        help="--agent search settings: depth (zoom steps), grid (cells per side), overlap "
        "(0-1), min_region (stop below this side in px; default the model's view side), "
        "answer_prompt (deepeyes: DeepEyes conversation with the crop; small: the small prompt "
        "on the crop), stay (1: also score the current region and stop zooming where it beats every cell), beam "
        "(regions kept per depth; their cells all compete at the next depth), fill_view (1: "
        "show each crop with as many pixels as the full image's view, upscaled, as the "
        "mini-world models were trained), "
        "min_box (smallest zoom box side in pixels of the full image's view; default 28, the "
        "DeepEyes check). "
        "Default depth=2,grid=2",
    )
    g.add_argument(
        "--tau", type=float, default=None, help="gate threshold (default 0.98; thyme: 0.95)"
    )
    g.add_argument("--top-k", type=int, default=gate.DEFAULT_TOP_K, help="K for separability")
    g.add_argument("--agg", default="min", choices=list(gate.AGGREGATIONS), help="aggregation")
    g.add_argument(
        "--judge-mode",
        default="logit",
        choices=["logit", "decode"],
        help="logit: one forward step, P(yes) vs P(no); decode: published 10-token rule",
    )
    g.add_argument(
        "--judge",
        default="large",
        choices=JUDGES,
        help="phase I: large (published: the large model's judge prompt), prefix (the large "
        "model, the judge question after the agent's own first-turn prompt, so a server with "
        "prefix caching reuses that prefill for the agent), small (the small model's judge), "
        "small-prefix (the small model, after its own answer prompt), none (no judge: the "
        "gate alone decides); see docs/throughput.md",
    )
    g.add_argument(
        "--judge-max-pixels",
        type=int,
        default=None,
        help="judge view budget: the large or small judge sees the image at most this many "
        "pixels (e.g. 200704 = 256 visual tokens of Qwen2.5-VL)",
    )
    g.add_argument(
        "--protocol",
        default="fair",
        choices=PROTOCOLS,
        help="fair (default): our prompts and rules; published: the released SpecEyes code's "
        "question blocks, prompts, judge rule, view cap, loop rules and batch size 6 (see README "
        "'What is exact')",
    )
    g.add_argument(
        "--batch-size", type=int, default=None, help="queries per phase I-III batch (8; published: 6)"
    )
    g.add_argument(
        "--schedule",
        default="batched",
        choices=SCHEDULES,
        help="pipelined: phases I-III of later batches run while agent loops continue, and "
        "agent loops join one continuous batch (results in completion order)",
    )
    g.add_argument(
        "--overlap", action="store_true", help="run phase II beside phase I (separate devices)"
    )
    g.add_argument("--max-agent-loops", type=int, default=32, help="agent loops in flight")
    g.add_argument(
        "--max-tool-calls",
        type=int,
        default=None,
        help="agent tool-call budget (5; published: 6 DeepEyes generations, 5 Thyme ones)",
    )
    g.add_argument(
        "--agent-max-tokens",
        type=int,
        default=None,
        help="new tokens per agent turn (1024; published: 512 DeepEyes, 2048 Thyme)",
    )
    g.add_argument("--calibration", default=None, help="tau file written by speceyes calibrate")


def funnel_config(args: argparse.Namespace):
    from speceyes.funnel import FunnelConfig

    tau, top_k, agg = args.tau, args.top_k, args.agg
    gate_kw: dict = {
        "judge_mode": args.judge_mode,
        "judge": getattr(args, "judge", "large"),
        "judge_max_pixels": getattr(args, "judge_max_pixels", None),
    }
    if getattr(args, "calibration", None):
        from speceyes.bench.calibrate import check_setup, read_calibration

        # The file holds the whole gate and judge setting it was calibrated with, and must
        # have been made for these models (a tau is only valid for its setup).
        cal = read_calibration(args.calibration)
        check_setup(
            cal,
            args.small,
            args.large,
            getattr(args, "agent", None),
            gate_kw["judge"],
            gate_kw["judge_max_pixels"],
        )
        tau = cal.tau if tau is None else tau
        top_k, agg, gate_kw["alpha"] = cal.top_k, cal.agg, cal.alpha
        if cal.judge_mode:
            gate_kw["judge_mode"] = cal.judge_mode
        if cal.judge_threshold is not None:
            gate_kw["judge_threshold"] = cal.judge_threshold
    _protocol_defaults(args)
    return FunnelConfig(
        mode=args.mode,
        tau=gate.DEFAULT_TAU[getattr(args, "agent", "deepeyes")] if tau is None else tau,
        top_k=top_k,
        agg=agg,
        **gate_kw,
        batch_size=args.batch_size,
        schedule=args.schedule,
        overlap=args.overlap,
        max_agent_loops=args.max_agent_loops,
        protocol=args.protocol,
    )


def _protocol_defaults(args: argparse.Namespace) -> None:
    """Fill the loop settings left unset with the protocol's defaults (speceyes.protocols)."""
    from speceyes import protocols

    kind = getattr(args, "agent", "deepeyes")
    family = kind if kind in protocols.FAMILIES else "deepeyes"
    budget = protocols.loop_settings(getattr(args, "protocol", "fair"), family)
    for name, value in (
        ("batch_size", budget.batch_size),
        ("max_tool_calls", budget.max_tool_calls),
        ("agent_max_tokens", budget.agent_max_tokens),
    ):
        if getattr(args, name, None) is None:
            setattr(args, name, value)


def settings_from_args(args: argparse.Namespace):
    """The factory's settings from the model, funnel and agent flags."""
    from speceyes import factory

    config = funnel_config(args)  # fills the protocol's loop budgets into args first
    kind = getattr(args, "agent", "deepeyes")
    search = factory.parse_search(getattr(args, "search", "")) if kind == "search" else {}
    return factory.Settings(
        small=args.small,
        large=args.large,
        small_family=args.small_family,
        large_family=args.large_family,
        backend=factory.BackendSettings(
            engine=args.engine,
            dtype=args.dtype,
            device_map=args.device_map,
            attn=args.attn,
            tensor_parallel_size=args.tensor_parallel_size,
            max_logprobs=args.max_logprobs,
            min_pixels=getattr(args, "min_pixels", None),
            max_pixels=getattr(args, "max_pixels", None),
        ),
        agent=factory.AgentSettings(
            kind=kind,
            max_tool_calls=args.max_tool_calls,
            max_new_tokens=args.agent_max_tokens,
            search=search,
        ),
        funnel=config,
    )


def build_funnel(args: argparse.Namespace):
    from speceyes import factory

    return factory.build_funnel(settings_from_args(args))


def _print_result(r, tau: float) -> None:
    print(f"answer:      {r.answer}")
    print(f"route:       {r.route} - {ROUTE_TEXT.get(r.route, r.route)}")
    if r.p_tool is not None:
        print(f"P(tool):     {r.p_tool:.3f}")
    if r.small_answer is not None:
        conf = "n/a (empty answer)" if r.confidence is None else f"{r.confidence:.4f}"
        print(f"small model: {r.small_answer!r}  confidence {conf}  (tau {tau})")
    print(
        f"tool calls:  {r.tool_calls}"
        + (f" (+{r.invalid_tool_calls} invalid)" if r.invalid_tool_calls else "")
    )
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
    elif bench == "pope":
        loader_kw = {k: v for k, v in (("split", args.split), ("image_dir", args.image_dir)) if v}
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
        retry_errors=args.retry_errors,
        llm_judge=args.llm_judge,
        llm_judge_model=args.llm_judge_model,
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


def _floats(text: str) -> list[float]:
    """'0.9,0.95,0.98' or a range 'start:stop:count' (inclusive)."""
    import numpy as np

    if ":" in text:
        a, b, n = text.split(":")
        return [float(x) for x in np.linspace(float(a), float(b), int(n))]
    return [float(x) for x in text.split(",") if x.strip()]


def cmd_prompts(args: argparse.Namespace) -> int:
    from speceyes.bench.datasets import canonical_bench, load_benchmark
    from speceyes.prompt_dump import dump_prompts

    bench = canonical_bench(args.bench)
    loader_kw: dict = {}
    if bench == "vstar":
        loader_kw = {"shuffle": not args.no_shuffle, "seed": args.seed}
    elif bench == "pope":
        loader_kw = {k: v for k, v in (("split", args.split), ("image_dir", args.image_dir)) if v}
    queries = load_benchmark(bench, args.data, **loader_kw)
    print(json.dumps(dump_prompts(queries, args.limit, args.protocol, args.agent), indent=1))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
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


def cmd_view(args: argparse.Namespace) -> int:
    from speceyes.view import build_view

    res = build_view(
        args.runs, args.out, data=args.data, thumb_side=args.thumb_size, full_side=args.full_size
    )
    for note in res.notes:
        print(f"note: {note}", file=sys.stderr)
    print(
        f"{res.cards} queries; images: {res.images_made} made, {res.images_reused} reused",
        file=sys.stderr,
    )
    print(res.index.resolve())
    return 0


def cmd_regate(args: argparse.Namespace) -> int:
    from speceyes.bench.regate import default_taus, format_table, in_sample_note, regate
    from speceyes.bench.runlog import load_run

    run = load_run(args.run, require_results=False)
    if args.split:
        from speceyes.bench.splits import parse_split, split_run

        split = parse_split(args.split, args.seed)
        run = split_run(run, split)[split.names[split.index(args.part)]]
    taus = _floats(args.tau) if args.tau else list(default_taus())
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


def cmd_calibrate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from speceyes.bench.calibrate import calibrate, format_calibration, write_calibration
    from speceyes.bench.runlog import load_run
    from speceyes.bench.splits import parse_split

    run = load_run(args.run, require_results=False)
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
    out = Path(args.output or Path(args.run) / "calibration.json")
    write_calibration(cal, out)
    print(format_calibration(cal))
    if not cal.passed:
        print(f"wrote {out} (a record only: eval and serve refuse it)", file=sys.stderr)
        return 1
    print(f"wrote {out} (pass it to eval or serve with --calibration)")
    return 0


def cmd_miniworld(args: argparse.Namespace) -> int:
    from speceyes.miniworld.splits import main as scenes_main

    return scenes_main(args.rest)


def cmd_demo(args: argparse.Namespace) -> int:
    from speceyes.miniworld.demo import run as run_miniworld_demo

    return run_miniworld_demo(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from speceyes.serve import API_KEY_ENV, serve

    # Fail on bad server settings before minutes of model loading.
    if args.max_queue < 1 or args.max_wait_ms < 0 or args.request_timeout <= 0:
        raise ValueError("need --max-queue >= 1, --max-wait-ms >= 0 and --request-timeout > 0")
    funnel = build_funnel(args)
    return serve(
        funnel,
        host=args.host,
        port=args.port,
        batch_size=args.batch_size,
        max_wait_ms=args.max_wait_ms,
        max_queue=args.max_queue,
        model_name=args.model_name,
        request_timeout=args.request_timeout,
        allow_local_files=args.allow_local_files,
        max_body_mb=args.max_body_mb,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_question_chars=args.max_question_chars,
        max_option_chars=args.max_option_chars,
        max_image_pixels=args.max_image_pixels,
        max_pixels_in_flight=args.max_pixels_in_flight,
        drain_timeout=args.drain_timeout,
    )


def cmd_simulate(args: argparse.Namespace) -> int:
    from dataclasses import asdict
    from pathlib import Path

    from speceyes import simulate as sm

    costs = sm.bench_costs(args.bench) if args.bench else sm.CostModel()
    if args.costs:  # the file's fields over the benchmark's token counts
        data = json.loads(Path(args.costs).read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{args.costs}: expected a JSON object of cost fields")
        base = {k: v for k, v in asdict(costs).items() if k not in data}
        costs = sm.CostModel.from_dict({**base, **data})
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
    rows = sm.simulate(
        costs, schedules, cs, args.queries, args.beta, args.alpha, args.seed, args.published_batch,
        judges=judges,
        alpha_tool=sm.DEFAULT_ALPHA_TOOL if args.alpha_tool is None else args.alpha_tool,
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


def build_parser() -> argparse.ArgumentParser:
    from speceyes.miniworld.demo import EPILOG as DEMO_EPILOG
    from speceyes.miniworld.demo import add_args as add_demo_args

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
    ev.add_argument(
        "--no-shuffle",
        action="store_true",
        help="V*: keep published option order (answer always A)",
    )
    ev.add_argument("--seed", type=int, default=0, help="V*: option shuffle seed")
    ev.add_argument("--split", default=None, help="POPE: adversarial | popular | random")
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
    ev.set_defaults(func=cmd_eval)

    pr = sub.add_parser(
        "prompts", help="print the exact messages each phase sends (JSON; images as sizes)"
    )
    pr.add_argument("--bench", required=True, help="vstar | hrbench | pope | jsonl")
    pr.add_argument("--data", required=True, help="benchmark folder or file")
    pr.add_argument("--limit", type=int, default=1, help="first N queries (default 1)")
    pr.add_argument("--protocol", default="fair", choices=PROTOCOLS)
    pr.add_argument("--agent", default="deepeyes", choices=["deepeyes", "thyme"])
    pr.add_argument("--no-shuffle", action="store_true", help="V*: original option order")
    pr.add_argument("--seed", type=int, default=0, help="V*: option shuffle seed")
    pr.add_argument("--split", default=None, help="POPE split")
    pr.add_argument("--image-dir", default=None, help="POPE: COCO folder of the original JSONL")
    pr.set_defaults(func=cmd_prompts)

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
    rep.add_argument("--llm-judge", default=None, help="OpenAI-compatible URL (published fallbacks)")
    rep.add_argument("--llm-judge-model", default=None, help="model name at --llm-judge")
    rep.set_defaults(func=cmd_report)

    vw = sub.add_parser(
        "view",
        help="static HTML report of run folders: a card per query with its zooms, filters, "
        "two runs side by side (opens from disk, no server)",
    )
    vw.add_argument("runs", nargs="+", help="run folders written by speceyes eval")
    vw.add_argument("--out", required=True, help="output folder (index.html, img/, runs/)")
    vw.add_argument(
        "--data",
        default=None,
        help="the benchmark's path when it moved since the run (default: the path in the run)",
    )
    vw.add_argument("--thumb-size", type=int, default=320, help="thumbnail side in px")
    vw.add_argument("--full-size", type=int, default=3072, help="side of the full view in px")
    vw.set_defaults(func=cmd_view)

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
    rg.set_defaults(func=cmd_regate)

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
    cal.add_argument("run", help="run folder of a --mode both eval")
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
    cal.set_defaults(func=cmd_calibrate)

    mw = sub.add_parser(
        "miniworld",
        help="generate mini-world scenes and questions (see docs/miniworld.md); "
        "'miniworld train' trains the tiny models, 'miniworld probe MODEL' measures their "
        "existence answers on the search agent's cells",
        add_help=False,
    )
    mw.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of the scene generator")
    mw.set_defaults(func=cmd_miniworld)

    demo = sub.add_parser(
        "demo",
        help="the mini-world benchmark on the two bundled trained models: agent-only, "
        "small-only and SpecEyes side by side (offline)",
        description="Generates (or reuses) a mini-world test split in OUT/data, splits it by "
        "target size, and runs agent-only, small-only and SpecEyes on each size split back to "
        "back through the evaluation harness (run folders OUT/runs/{small,large}-targets/MODE "
        "with samples.jsonl, results.json and plots/, readable by speceyes report and regate). "
        "Prints a table per split and pooled (accuracy, seconds per query, speedup over "
        "agent-only, beta, alpha, the analytic speedup L_agent / (c_J + beta*c_S + "
        "(1 - beta*alpha)*L_agent) from the measured per-phase costs, and the measured share of "
        "it) plus accuracy per question category, and writes OUT/summary.md and summary.json. "
        "Settings (canvas, tau, aggregation, agent, test split) come from MODELS/manifest.json. "
        "Re-running resumes runs made with the same settings; runs made with other settings are "
        "moved aside, never deleted.",
        epilog=DEMO_EPILOG,
    )
    add_demo_args(demo)
    demo.set_defaults(func=cmd_demo)

    srv = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server that answers through the funnel",
        description="POST /v1/chat/completions (one image part as a data URI, a text part, "
        'optional "options": [...]), GET /health, /v1/models, /metrics. Concurrent requests '
        "are micro-batched (up to --batch-size, or what arrives within --max-wait-ms).",
    )
    srv.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8000, help="port (0: any free port)")
    srv.add_argument("--max-queue", type=int, default=256, help="queued requests before 429")
    srv.add_argument("--max-wait-ms", type=float, default=10.0, help="micro-batch wait")
    srv.add_argument("--request-timeout", type=float, default=300.0, help="seconds before 504")
    srv.add_argument("--model-name", default="speceyes", help="model id in /v1/models")
    srv.add_argument("--max-body-mb", type=float, default=32.0, help="largest request body")
    srv.add_argument("--allow-local-files", action="store_true", help="accept file:// image URLs")
    srv.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every endpoint but /health (401 otherwise); "
        "default: the SPECEYES_API_KEY environment variable, else no key",
    )
    srv.add_argument(
        "--max-question-chars",
        type=int,
        default=limits.MAX_QUESTION_CHARS,
        help="longest question accepted (413 beyond)",
    )
    srv.add_argument(
        "--max-option-chars",
        type=int,
        default=limits.MAX_OPTION_CHARS,
        help=f"longest option accepted (413 beyond); at most {limits.MAX_OPTIONS} options (400)",
    )
    srv.add_argument(
        "--max-image-pixels",
        type=int,
        default=limits.MAX_IMAGE_PIXELS,
        help="largest image (width x height, read from its header before decoding; 413 beyond)",
    )
    srv.add_argument(
        "--max-pixels-in-flight",
        type=int,
        default=limits.MAX_PIXELS_IN_FLIGHT,
        help="decoded image pixels all admitted requests may hold at once (429 beyond)",
    )
    srv.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM/Ctrl-C: seconds to answer admitted requests before exiting",
    )
    add_model_args(srv)
    add_funnel_args(srv)
    # Accepted answers leave as soon as the gate accepts them, not after their batch-mates.
    srv.set_defaults(func=cmd_serve, schedule="pipelined")

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
        "--bench", default=None, choices=["vstar", "hrbench4k", "hrbench8k", "pope", "miniworld"],
        help="image and crop tokens from smart_resize of this benchmark's images (default: V*)",
    )
    sim.add_argument(
        "--judge", default="large",
        help="ours' judge variants, comma-separated: large (published), prefix, small, "
        "small-prefix, none",
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
    sim.add_argument("--output", default="runs/simulate", help="output folder")
    sim.add_argument("--seed", type=int, default=0)
    sim.set_defaults(func=cmd_simulate)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    import logging

    from speceyes.backends.base import BackendError
    from speceyes.backends.hf import ModelLoadError
    from speceyes.images import ImageError

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["miniworld", "train"]:  # its own parser, --help included
        from speceyes.miniworld.train import main as train_main

        return int(train_main(argv[2:]) or 0)
    if argv[:2] == ["miniworld", "probe"]:
        from speceyes.miniworld.probe import main as probe_main

        return int(probe_main(argv[2:]) or 0)
    if argv[:2] == ["miniworld", "position-probe"]:
        from speceyes.miniworld.position_probe import main as position_probe_main

        return int(position_probe_main(argv[2:]) or 0)
    if argv[:1] == ["miniworld"]:
        from speceyes.miniworld.splits import main as scenes_main

        return int(scenes_main(argv[1:]) or 0)
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
