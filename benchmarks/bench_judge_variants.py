"""Judge variants on a benchmark folder: time, routing agreement with the published judge, accuracy.

Runs the SpecEyes funnel once per judge variant (``--judges``; default all of
``speceyes.funnel.JUDGES``, plus the large judge at each ``--view-budgets`` pixel budget) over the
same queries with the same loaded models, and prints per variant:

- accuracy, and its difference from the published judge (``large``) in points;
- seconds per query for the whole funnel and for phase I alone (wall time; the first query is
  run once before, untimed, so no variant pays the models' first-call set-up);
- the share of queries answered by the small model, beta and alpha;
- judge agreement: the share of queries whose tool/no-tool verdict equals the published
  judge's (``none`` counts as "no tool" for every query), and route agreement: the share routed
  the same way (small model vs agent) as under the published judge.

It also prints alpha_tool, the gate's acceptance among the queries the published judge sends to
tools (from the ``none`` run), the number ``speceyes simulate --judge none`` needs.

Times are those of the backends given: the transformers backend has no prefix cache, so the
``prefix`` and ``small-prefix`` judges cost a full prefill there; point ``--large`` / ``--small``
at vLLM (``--enable-prefix-caching``, on by default in V1) or SGLang (radix cache on by
default) servers to measure what prefix sharing saves.

    # the mini world with its bundled models (agent, tau and aggregation from their manifest)
    speceyes miniworld --out runs/mw-test --split test --scenes 30 --seed 0
    python benchmarks/bench_judge_variants.py --data runs/mw-test/questions.jsonl \\
        --models speceyes/miniworld/models
    # real checkpoints or servers, any benchmark `speceyes eval` reads
    python benchmarks/bench_judge_variants.py --bench vstar --data vstar_bench/ \\
        --small http://gpu:8001/v1 --large http://gpu:8000/v1 --limit 100
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(HERE.parent))

from speceyes.bench import scoring  # noqa: E402
from speceyes.cli.options import add_funnel_args, add_model_args  # noqa: E402
from speceyes.factory import Settings, build_funnel, make_agent  # noqa: E402
from speceyes.funnel import JUDGES, Funnel, FunnelConfig  # noqa: E402
from speceyes.types import Query, Result  # noqa: E402

REFERENCE = "large"


@dataclass
class VariantRow:
    variant: str
    judge: str
    judge_max_pixels: int | None
    n: int
    accuracy: float
    points_vs_published: float
    s_per_query: float
    judge_s_per_query: float
    to_small: float  # share answered by the small model
    beta: float | None
    alpha: float | None
    judge_agreement: float
    route_agreement: float
    errors: int


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--bench", default="jsonl", help="vstar | hrbench | pope | jsonl")
    ap.add_argument("--data", required=True, help="what `speceyes eval --data` takes")
    ap.add_argument("--limit", type=int, default=None, help="only the first N queries")
    ap.add_argument(
        "--judges", default=",".join(JUDGES), help=f"variants, from {', '.join(JUDGES)}"
    )
    ap.add_argument(
        "--view-budgets", default="",
        help="also the large judge at these pixel budgets, e.g. 200704 (256 visual tokens)",
    )
    ap.add_argument(
        "--models", default=None,
        help="a mini-world models folder (small/, large/, manifest.json): the models and the "
        "funnel's agent, tau, aggregation and batch size come from its manifest",
    )
    ap.add_argument("--json", default=None, help="also write the rows here as JSON")
    add_model_args(ap, required=False)
    add_funnel_args(ap)  # its --judge/--judge-max-pixels are ignored: every variant is run
    args = ap.parse_args(argv)
    if args.models is None and (args.small is None or args.large is None):
        ap.error("give --models DIR, or both --small and --large")
    return args


def _setup(args: argparse.Namespace) -> tuple[Any, Any, Any, FunnelConfig]:
    """(small, large, agent, base config) loaded once for every variant."""
    if args.models is None:
        f = build_funnel(Settings.from_args(args))
        return f.small, f.large, f.agent, f.config
    from speceyes.backends.hf import HFBackend
    from speceyes.miniworld import demo

    folder = Path(args.models)
    paths = demo.find_models(folder)
    s = Settings.from_manifest(folder / demo.MANIFEST).resolved()
    small, large = HFBackend(paths["small"]), HFBackend(paths["large"])
    agent = make_agent(s.agent, large)
    return small, large, agent, s.funnel


def _queries(args: argparse.Namespace) -> list[Query]:
    from speceyes.bench.benchmarks import get

    out = []
    for q in get(args.bench).load(args.data):
        if args.limit is not None and len(out) >= args.limit:
            break
        out.append(q)
    if not out:
        raise SystemExit(f"no queries found in {args.data}")
    return out


def _to_small(r: Result) -> bool:
    return r.route == "small"


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def run_variants(
    small: Any, large: Any, agent: Any, base: FunnelConfig, queries: list[Query],
    variants: list[tuple[str, str, int | None]], progress: bool = False,
) -> tuple[list[VariantRow], float | None]:
    """Every variant over ``queries``; rows in the order given, the reference first."""
    cfg0 = replace(base, mode="speceyes", judge=REFERENCE, judge_max_pixels=None)
    Funnel(small, large, agent, cfg0).run(queries[:1])  # warm-up, untimed
    runs: dict[str, tuple[list[Result], float, Funnel]] = {}
    order = [v for v in variants if v[0] == REFERENCE] + [v for v in variants if v[0] != REFERENCE]
    if not any(v[0] == REFERENCE for v in variants):
        order = [(REFERENCE, REFERENCE, None), *order]
    for label, judge, px in order:
        f = Funnel(small, large, agent, replace(cfg0, judge=judge, judge_max_pixels=px))
        t0 = time.perf_counter()
        res = f.run(queries)
        runs[label] = (res, time.perf_counter() - t0, f)
        if progress:
            print(f"  {label}: {runs[label][1]:.1f} s", file=sys.stderr, flush=True)
    ref = {r.id: r for r in runs[REFERENCE][0]}
    ref_acc = _mean([float(scoring.is_correct(q, ref[q.id].answer)) for q in queries])
    rows = []
    for label, judge, px in variants:
        res, wall, f = runs[label]
        by = {r.id: r for r in res}
        acc = _mean([float(not by[q.id].error and scoring.is_correct(q, by[q.id].answer))
                     for q in queries])
        jt = [bool(by[q.id].judge_tool) == bool(ref[q.id].judge_tool) for q in queries]
        rt = [_to_small(by[q.id]) == _to_small(ref[q.id]) for q in queries]
        rows.append(VariantRow(
            variant=label, judge=judge, judge_max_pixels=px, n=len(queries), accuracy=acc,
            points_vs_published=100 * (acc - ref_acc), s_per_query=wall / len(queries),
            judge_s_per_query=_mean([r.timings.get("judge", 0.0) for r in res]),
            to_small=_mean([float(_to_small(r)) for r in res]), beta=f.stats.beta,
            alpha=f.stats.alpha, judge_agreement=_mean([float(x) for x in jt]),
            route_agreement=_mean([float(x) for x in rt]),
            errors=sum(1 for r in res if r.route == "error"),
        ))
    alpha_tool = None
    if "none" in runs:
        none = {r.id: r for r in runs["none"][0]}
        tool = [q.id for q in queries if ref[q.id].judge_tool]
        if tool:
            alpha_tool = _mean([float(_to_small(none[i])) for i in tool])
    return rows, alpha_tool


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def format_rows(rows: list[VariantRow]) -> str:
    lines = [
        "| judge | accuracy | vs published | s/query | phase I s/query | to small | beta | "
        "alpha | judge agreement | route agreement | errors |",
        "|" + "---|" * 11,
    ]
    for r in rows:
        lines.append(
            f"| {r.variant} | {r.accuracy:.3f} | {r.points_vs_published:+.1f} pt | "
            f"{r.s_per_query:.3f} | {r.judge_s_per_query:.4f} | {r.to_small:.2f} | "
            f"{_f(r.beta, '.2f')} | {_f(r.alpha, '.2f')} | {r.judge_agreement:.2f} | "
            f"{r.route_agreement:.2f} | {r.errors} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    judges = [j.strip() for j in args.judges.split(",") if j.strip()]
    bad = [j for j in judges if j not in JUDGES]
    if bad:
        raise SystemExit(f"unknown judge {bad[0]!r}; choose from {', '.join(JUDGES)}")
    variants: list[tuple[str, str, int | None]] = [(j, j, None) for j in judges]
    for px in (int(p) for p in args.view_budgets.split(",") if p.strip()):
        variants.append((f"large@{px}px", "large", px))
    small, large, agent, base = _setup(args)
    queries = _queries(args)
    t0 = time.perf_counter()
    rows, alpha_tool = run_variants(small, large, agent, base, queries, variants, progress=True)
    print(f"{len(queries)} queries from {args.data}; agent {getattr(agent, 'name', '?')}, "
          f"tau {base.tau}, aggregation {base.agg}")
    print(format_rows(rows))
    print("gate acceptance among the queries the published judge sends to tools (alpha_tool, "
          "from the none run): "
          + ("- (no none run, or no query sent to tools)" if alpha_tool is None
             else f"{alpha_tool:.2f}"))
    ok = [r.variant for r in rows if r.variant != REFERENCE and r.points_vs_published >= -1.0]
    print("within 1 point of the published judge's accuracy: " + (", ".join(ok) or "none"))
    print(f"all variants in {time.perf_counter() - t0:.1f} s")
    if args.json:
        from dataclasses import asdict

        Path(args.json).write_text(json.dumps(
            {"queries": len(queries), "data": str(args.data), "alpha_tool": alpha_tool,
             "rows": [asdict(r) for r in rows]}, indent=2,
        ))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
