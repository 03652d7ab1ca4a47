"""Side-by-side comparison of evaluation runs (a "Table 1"): markdown and CSV.

One row per run: accuracy per category and overall, seconds per query (wall_time / n), speedup
over the agent-only run among the given runs, and the funnel's beta and alpha.

Speedup is measured (agent run's seconds per query / this run's) when an agent-mode run is
given, preferring one on the same benchmark. Without one it is estimated, and marked "~": for a
``both`` run by replaying its own gate setting (see regate.py), else from the logged per-query
agent timings (mean agent time / mean logged time per query). ``both`` runs also get the replay
estimate in its own column, since their wall time covers running both models.
"""

from __future__ import annotations

import csv
import io
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from speceyes.bench import regate as rg
from speceyes.bench.plots import write_run_plots
from speceyes.bench.runlog import NO_CATEGORY, Run, load_run
from speceyes.rates import beta_alpha

AGENT_MODE = "agent"
MEASURED = "measured"
EST_REPLAY = "estimated (replay)"
EST_TIMINGS = "estimated (logged agent times)"


@dataclass
class ReportRow:
    name: str
    run: Run
    overall: float | None
    per_category: dict[str, float] = field(default_factory=dict)
    time_per_query: float | None = None
    speedup: float | None = None
    speedup_source: str = ""
    replay_speedup: float | None = None
    beta: float | None = None
    alpha: float | None = None


def _as_accuracy(value: Any) -> float | None:
    """A metric as a fraction: plain number (percent if > 1) or a dict with accuracy/acc."""
    if isinstance(value, dict):
        value = value.get("accuracy", value.get("acc"))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    if not math.isfinite(value):
        return None
    return value / 100.0 if value > 1.0 else value


def _accuracies(run: Run) -> tuple[float | None, dict[str, float]]:
    metrics = run.results.get("metrics") or {}
    overall = _as_accuracy(metrics.get("overall"))
    if overall is None:
        overall = float(np.mean(run.correct)) if run.n else None
    per_cat_raw = metrics.get("per_category")
    per_cat: dict[str, float] = {}
    if isinstance(per_cat_raw, dict):
        per_cat = {str(k): a for k, v in per_cat_raw.items() if (a := _as_accuracy(v)) is not None}
    elif set(run.category_names) - {NO_CATEGORY}:
        per_cat = {c: float(np.mean(run.correct[run.categories == c])) for c in run.category_names}
    return overall, per_cat


def _time_per_query(run: Run) -> float | None:
    wall = run.results.get("wall_time")
    n = run.results.get("n") or run.n
    if wall is None or not n:
        return None
    return float(wall) / float(n)


def _replay_row(run: Run) -> rg.RegateRow | None:
    """The run's own gate setting replayed, for a run that supports it."""
    if run.tau is None:
        return None
    try:
        return rg.regate(run, [run.tau])[0]
    except ValueError:
        return None


def _beta_alpha(run: Run, replayed: rg.RegateRow | None) -> tuple[float | None, float | None]:
    beta, alpha = run.results.get("beta"), run.results.get("alpha_accept")
    if beta is not None or alpha is not None:
        return _num(beta), _num(alpha)
    if replayed is not None:
        return replayed.beta, replayed.alpha
    known = ~np.isnan(run.judge_tool)
    if run.mode != "speceyes" or not known.any():
        return None, None
    tool_free = run.judge_tool == 0
    accepted = int(np.sum(run.routes[tool_free] == rg.ROUTE_SMALL))
    return beta_alpha(int(known.sum()), int(tool_free.sum()), accepted)


def _num(x: Any) -> float | None:
    return None if x is None or not math.isfinite(float(x)) else float(x)


def _timing_estimate(run: Run) -> float | None:
    """Mean logged agent time / mean logged time per query (phases present summed)."""
    agent = run.timings.get("agent")
    if agent is None or np.all(np.isnan(agent)):
        return None
    total = sum(np.nan_to_num(t, nan=0.0) for t in run.timings.values())
    mean_total = float(np.mean(total))
    return float(np.nanmean(agent)) / mean_total if mean_total > 0 else None


def _reference(run: Run, agents: list[ReportRow]) -> ReportRow | None:
    """The agent-only run to compare against: same benchmark if there is one."""
    same = [a for a in agents if a.run.config.get("bench") == run.config.get("bench")]
    for row in same + agents:
        if row.time_per_query:
            return row
    return None


def _names(runs: Sequence[Run]) -> list[str]:
    base = [r.path.name for r in runs]
    names = []
    for r, b in zip(runs, base, strict=True):
        label = b if base.count(b) == 1 else f"{r.path.parent.name}/{b}"
        names.append(f"{label} ({r.mode})")
    return names


def report_rows(runs: Sequence[Run]) -> list[ReportRow]:
    rows = []
    for run, name in zip(runs, _names(runs), strict=True):
        overall, per_cat = _accuracies(run)
        replayed = _replay_row(run) if run.mode == "both" else None
        beta, alpha = _beta_alpha(run, replayed)
        rows.append(
            ReportRow(
                name=name,
                run=run,
                overall=overall,
                per_category=per_cat,
                time_per_query=_time_per_query(run),
                replay_speedup=None if replayed is None else _num(replayed.speedup),
                beta=beta,
                alpha=alpha,
            )
        )
    agents = [r for r in rows if r.run.mode == AGENT_MODE]
    for row in rows:
        _fill_speedup(row, _reference(row.run, agents))
    return rows


def _fill_speedup(row: ReportRow, ref: ReportRow | None) -> None:
    if ref is not None and ref.time_per_query and row.time_per_query:
        row.speedup, row.speedup_source = ref.time_per_query / row.time_per_query, MEASURED
    elif row.run.mode == AGENT_MODE:
        row.speedup, row.speedup_source = 1.0, MEASURED
    elif row.replay_speedup is not None:
        row.speedup, row.speedup_source = row.replay_speedup, EST_REPLAY
    elif (est := _timing_estimate(row.run)) is not None:
        row.speedup, row.speedup_source = est, EST_TIMINGS


def _pct(x: float | None) -> str:
    return "" if x is None else f"{100 * x:.2f}"


def _speed(x: float | None, estimated: bool = False) -> str:
    return "" if x is None else f"{'~' if estimated else ''}{x:.2f}x"


def _categories(rows: Sequence[ReportRow]) -> list[str]:
    return sorted({c for r in rows for c in r.per_category})


def format_markdown(rows: Sequence[ReportRow]) -> str:
    cats = _categories(rows)
    head = ["run", "n", *[f"{c} %" for c in cats], "overall %", "s/query", "speedup"]
    head += ["est. speedup (replay)", "beta", "alpha"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r.name, str(r.run.n), *[_pct(r.per_category.get(c)) for c in cats]]
        cells += [_pct(r.overall), "" if r.time_per_query is None else f"{r.time_per_query:.3f}"]
        cells += [_speed(r.speedup, r.speedup_source not in ("", MEASURED))]
        cells += [_speed(r.replay_speedup, True), _frac(r.beta), _frac(r.alpha)]
        lines.append("| " + " | ".join(cells) + " |")
    notes = ["", "Accuracy in percent; s/query = wall time / n."]
    if any(r.speedup_source == MEASURED for r in rows):
        notes.append("Speedup = agent-only run's s/query / this run's s/query.")
    if any(r.speedup_source not in ("", MEASURED) for r in rows):
        notes.append(
            "~ marks estimates: replay of the run's own gate setting over logged per-query "
            "timings, or mean logged agent time / mean logged time per query."
        )
    return "\n".join(lines + notes) + "\n"


def _frac(x: float | None) -> str:
    return "" if x is None else f"{x:.3f}"


def format_csv(rows: Sequence[ReportRow]) -> str:
    cats = _categories(rows)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(
        ["run", "mode", "n", *[f"acc_{c}" for c in cats], "acc_overall", "time_per_query_s"]
        + ["speedup", "speedup_source", "replay_speedup", "beta", "alpha", "path"]
    )
    for r in rows:
        writer.writerow(
            [r.name, r.run.mode, r.run.n, *[_csv(r.per_category.get(c)) for c in cats]]
            + [_csv(r.overall), _csv(r.time_per_query), _csv(r.speedup), r.speedup_source]
            + [_csv(r.replay_speedup), _csv(r.beta), _csv(r.alpha), str(r.run.path)]
        )
    return buf.getvalue()


def _csv(x: float | None) -> str:
    return "" if x is None else f"{x:.6g}"


def _load_all(run_dirs: Sequence[str | Path | Run]) -> list[Run]:
    if not run_dirs:
        raise ValueError("give at least one run directory")
    return [r if isinstance(r, Run) else load_run(r) for r in run_dirs]


def report(run_dirs: Sequence[str | Path | Run]) -> tuple[str, str]:
    """(markdown, csv) comparing the runs side by side."""
    rows = report_rows(_load_all(run_dirs))
    return format_markdown(rows), format_csv(rows)


def write_report(run_dirs: Sequence[str | Path | Run], out_dir: str | Path) -> list[Path]:
    """Write report.md, report.csv and each run's plots under out_dir/plots/<run>/."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = report_rows(_load_all(run_dirs))
    notes: list[str] = []
    plot_lines = ["", "## Plots", ""]
    plots: list[Path] = []
    for row in rows:
        sub = out / "plots" / _slug(row.name)
        made = write_run_plots(row.run, sub, notes)
        plots += made
        links = ", ".join(f"[{p.stem}]({p.relative_to(out).as_posix()})" for p in made)
        plot_lines.append(f"- {row.name}: {links or 'none'}")
    plot_lines += [f"- note: {n}" for n in notes]
    md_path, csv_path = out / "report.md", out / "report.csv"
    md_path.write_text(
        "# Run comparison\n\n" + format_markdown(rows) + "\n".join(plot_lines) + "\n"
    )
    csv_path.write_text(format_csv(rows))
    return [md_path, csv_path, *plots]


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "run"


# ---- one run scored by either protocol's rules --------------------------------------------------
def _bench(run: Run) -> str:
    bench = run.config.get("bench") or run.results.get("bench")
    if not bench:
        raise ValueError(f"{run.path}: the run does not name its benchmark (run config 'bench')")
    return str(bench)


def rescore(
    run_dirs: Sequence[str | Path | Run], protocol: str, ask: Any = None
) -> tuple[str, list[dict[str, Any]]]:
    """Score logged runs by ``fair`` rules (errors count wrong, chosen letter parsed) or by the
    ``published`` judge scripts' rules (``bench/published_scoring.py``); markdown and rows.

    ``ask(system, prompt)`` is the LLM judge for the published fallbacks; without it the rows
    that needed it are counted wrong and listed."""
    from speceyes import protocols
    from speceyes.bench import benchmarks

    protocols.check_protocol(protocol)
    rows = []
    for run in _load_all(run_dirs):
        bench = _bench(run)
        if protocol == "fair":
            m = benchmarks.get(bench).metrics(run.samples)
            per = {
                k: v["accuracy"] if isinstance(v, dict) else v
                for k, v in (m.get("per_category") or m.get("per_split") or {}).items()
            }
            rows.append({"run": run.name, "bench": bench, "protocol": protocol, "n": m["n"],
                         "errors": m["n_errors"], "errors_counted": "wrong",
                         "accuracy": m["accuracy"], "per_category": per, "llm_judged": 0,
                         "needs_llm_judge": []})  # fmt: skip
            continue
        s = benchmarks.get(bench).score_published(run.samples, ask)
        d = s.to_dict()
        rows.append({"run": run.name, "bench": bench, "protocol": protocol, "n": s.n,
                     "errors": s.n_errors, "errors_counted": "dropped", "accuracy": s.accuracy,
                     "per_category": {k: v["accuracy"] for k, v in d["per_category"].items()},
                     "llm_judged": s.judged, "needs_llm_judge": s.needs_judge})  # fmt: skip
    lines = [
        "| run | bench | protocol | n scored | errors | accuracy | per category | LLM-judged "
        "| needed an LLM judge |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cats = ", ".join(f"{k} {_pct(v)}" for k, v in r["per_category"].items())
        need = len(r["needs_llm_judge"])
        lines.append(
            f"| {r['run']} | {r['bench']} | {r['protocol']} | {r['n']} | {r['errors']} "
            f"({r['errors_counted']}) | {_pct(r['accuracy'])} | {cats} | {r['llm_judged']} "
            f"| {need} |"
        )
    for r in rows:
        if r["needs_llm_judge"]:
            ids = ", ".join(r["needs_llm_judge"][:50])
            more = len(r["needs_llm_judge"]) - 50
            lines.append(
                f"\n{r['run']}: {len(r['needs_llm_judge'])} rows need the LLM judge (counted "
                f"wrong; pass --llm-judge URL): {ids}" + (f" ... and {more} more" if more > 0 else "")
            )
    return "\n".join(lines), rows
