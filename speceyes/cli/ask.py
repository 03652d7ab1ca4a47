"""``speceyes ask``: one visual question through the funnel."""

from __future__ import annotations

import argparse
import json

from speceyes.cli.options import add_funnel_args, add_model_args

ROUTE_TEXT = {
    "small": "small model (judged tool-free, accepted by the gate)",
    "agent_after_judge": "agent (the judge asked for tools)",
    "agent_after_gate": "agent (judged tool-free, rejected by the gate)",
    "agent_only": "agent (agent-only mode)",
    "small_only": "small model (small-only mode)",
    "specreason": "agent (SpecReason: small-model steps scored by the large model)",
    "error": "error",
    "small_deep": "small model after its own tool calls, accepted by that stage's gate",
    "large_direct": "large model without tools (middle tier), accepted by its gate",
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ask", help="answer one visual question through the funnel")
    p.add_argument("image", help="image file")
    p.add_argument("question")
    p.add_argument("--option", action="append", help="a multiple-choice option (repeat)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    add_model_args(p)
    add_funnel_args(p)
    p.set_defaults(func=run)


def _print_result(r, tau: float) -> None:
    print(f"answer:      {r.answer}")
    print(f"route:       {r.route} - {ROUTE_TEXT.get(r.route, r.route)}")
    point = r.operating_point()
    if point is not None:  # --judge auto: the point's judge and its own tau answered it
        tau = point["tau"]
        print(f"point:       {point['point']} (judge {point['judge']}, tau {tau})")
    if r.p_tool is not None:
        print(f"P(tool):     {r.p_tool:.3f}")
    if r.small_answer is not None:
        conf = "n/a (empty answer)" if r.confidence is None else f"{r.confidence:.4f}"
        print(f"small model: {r.small_answer!r}  confidence {conf}  (tau {tau})")
    for s in r.stages:  # the cascade's stages, in order
        conf = "n/a" if s["confidence"] is None else f"{s['confidence']:.4f}"
        verdict = "accepted" if s["accepted"] else "refused"
        print(f"  stage {s['stage']}: {s['answer']!r} confidence {conf} (tau {s['tau']}) {verdict}")
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


def run(args: argparse.Namespace) -> int:
    from speceyes.factory import Settings, build_funnel
    from speceyes.images import load_image
    from speceyes.types import Query
    from speceyes.usertext import check_question

    check_question(args.question, args.option)  # no chat-template control tokens
    image = load_image(args.image)  # fail fast on a missing or corrupt image, before loading models
    funnel = build_funnel(Settings.from_args(args))
    q = Query(id="ask", image=image, question=args.question, options=args.option or None)
    r = funnel.run_batch([q])[0]
    if args.json:
        d = r.to_dict()
        d["small_topk"] = None
        print(json.dumps(d, indent=2, default=str))
    else:
        _print_result(r, funnel.config.tau)
    return 1 if r.route == "error" else 0
