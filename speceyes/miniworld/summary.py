"""The demo's summary: rows per size split, pooled and per category, from the run folders'
logs and results; the checks beyond accuracy and time (:mod:`speceyes.miniworld.targets`); the
one figure; and the markdown text of it all.

Layout of a demo's output folder: ``runs/{small-targets,large-targets}/{agent,small,speceyes}/``,
one ordinary ``speceyes eval`` run folder per size split and mode.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from speceyes.rates import analytic_latency

MODES = ("agent", "small", "speceyes")
MODE_LABEL = {"agent": "agent-only", "small": "small-only", "speceyes": "SpecEyes"}
SPLITS = (("small-targets", "small"), ("large-targets", "large"))  # (folder, target size)
SPLIT_LABEL = {"small-targets": "small targets", "large-targets": "large targets", "all": "all"}
RUNS_DIR = "runs"


def _counts(records: list[dict]) -> dict[str, int]:
    judged = [r for r in records if r.get("judge_tool") is not None]
    free = [r for r in judged if not r["judge_tool"]]
    return {
        "judged": len(judged),
        "tool_free": len(free),
        "accepted": sum(1 for r in free if r["route"] == "small"),
    }


def zoom_on_target(records: list[dict]) -> dict[str, Any]:
    """How often the agent's last zoom holds the whole target box of the question (the
    relative-position target, the attribute object, a POPE positive), over the agent runs that
    zoomed on a question with a known target: the search's localisation, measured."""
    hits = n = 0
    for r in records:
        box = (r.get("meta") or {}).get("target_bbox")
        zooms = [t for t in r.get("trace") or [] if t.get("type") == "zoom"]
        if box is None or not zooms:
            continue
        c = zooms[-1]["crop_box"]
        n += 1
        hits += c[0] <= box[0] and c[1] <= box[1] and c[2] >= box[2] and c[3] >= box[3]
    return {"n": n, "hits": hits, "share": hits / n if n else None}


def _cell(records: list[dict], wall: float, cpu: float | None = None) -> dict[str, Any]:
    """Accuracy, time, phase costs and funnel counts of a set of records run in ``wall`` s
    (``cpu`` s of process CPU time; None when a run folder did not record it)."""
    from speceyes.bench.runner import summarize

    s = summarize(records, "jsonl")
    c = _counts(records)
    n = len(records)
    tp = s["time_by_phase"]
    return {
        "n": n,
        "accuracy": s["accuracy"],
        "n_errors": s["n_errors"],
        "wall_time": wall,
        "time_per_query": wall / n if n else None,
        "cpu_time": cpu,
        "cpu_time_per_query": cpu / n if (n and cpu is not None) else None,
        **c,
        "beta": s["beta"],
        "alpha": s["alpha_accept"],
        "time_by_phase": tp,
        # c_J: judge seconds per query; c_S: small model + gate seconds per query it answered.
        "c_J": tp["judge"] / n if n and c["judged"] else None,
        "c_S": (tp["small"] + tp["gate"]) / c["tool_free"] if c["tool_free"] else None,
        "zoom_on_target": zoom_on_target(records),
    }


def _analytic_times(row: dict[str, dict]) -> tuple[float, float] | None:
    """(agent-only seconds, SpecEyes' analytic seconds) over a split's questions: ``n * L_agent``
    and ``n * E[L]``, ``E[L] = c_J + beta*c_S + (1 - beta*alpha)*L_agent`` from the split's
    measured costs; None without both modes or a judged query."""
    agent, spec = row.get("agent"), row.get("speceyes")
    L = agent["time_per_query"] if agent else None
    if not (spec and L and spec["c_J"] is not None):
        return None
    beta, alpha = spec["beta"] or 0.0, spec["alpha"] or 0.0
    e_l = float(analytic_latency(spec["c_J"], spec["c_S"] or 0.0, L, beta, alpha))
    return spec["n"] * L, spec["n"] * e_l


def _add_speedups(row: dict[str, dict], analytic: tuple[float, float] | None) -> None:
    """Each mode's speedup over agent-only (wall and CPU seconds per query over the same
    questions, so total agent-only time / total time of the mode), and SpecEyes' analytic
    speedup ``analytic[0] / analytic[1]`` (:func:`_analytic_times`) with the measured share."""
    agent = row.get("agent")
    L = agent["time_per_query"] if agent else None
    L_cpu = agent["cpu_time_per_query"] if agent else None
    for mode, cell in row.items():
        tpq, cpq = cell["time_per_query"], cell["cpu_time_per_query"]
        cell["speedup"] = L / tpq if (L and tpq) else None
        cell["cpu_speedup"] = L_cpu / cpq if (L_cpu and cpq) else None
        if mode == "speceyes":
            cell["L_agent"] = L
            an = analytic[0] / analytic[1] if (analytic and analytic[1]) else None
            cell["analytic_speedup"] = an
            cell["share_of_analytic"] = cell["speedup"] / an if (an and cell["speedup"]) else None


def _pooled_analytic_times(
    per_split: list[tuple[float, float] | None],
) -> tuple[float, float] | None:
    """The splits' analytic times summed: the pooled analytic speedup is total agent-only time /
    the sum of each split's analytic SpecEyes time, as the measured one is total agent-only
    time / total SpecEyes time (one L_agent for both splits would blur their costs)."""
    if not per_split or any(t is None for t in per_split):
        return None
    return sum(t[0] for t in per_split), sum(t[1] for t in per_split)


def summarize_demo(out: Path, modes: list[str]) -> dict[str, Any]:
    """Rows per split, pooled, and per category, from the run folders' logs and results."""
    from speceyes.bench.scoring import record_correct
    from speceyes.rundir import RunDir

    rows: dict[str, dict[str, dict]] = {}
    pooled: dict[str, tuple[list, float, float | None]] = {}
    for split, _ in SPLITS:
        rows[split] = {}
        for mode in modes:
            d = out / RUNS_DIR / split / mode
            res, recs = RunDir(d).read_results(), RunDir(d).records()
            wall, cpu = float(res["wall_time"]), res.get("cpu_time")  # no CPU time: older runs
            rows[split][mode] = {**_cell(recs, wall, cpu), "run": str(d)}
            prev_recs, prev_wall, prev_cpu = pooled.get(mode, ([], 0.0, 0.0))
            both = None if prev_cpu is None or cpu is None else prev_cpu + float(cpu)
            pooled[mode] = (prev_recs + recs, prev_wall + wall, both)
    rows["all"] = {m: _cell(recs, wall, cpu) for m, (recs, wall, cpu) in pooled.items()}
    per_split = {split: _analytic_times(rows[split]) for split, _ in SPLITS}
    for split, times in per_split.items():
        _add_speedups(rows[split], times)
    _add_speedups(rows["all"], _pooled_analytic_times(list(per_split.values())))
    cats: dict[str, dict[str, dict]] = {}
    for mode, (recs, _, _) in pooled.items():
        by: dict[str, list[bool]] = {}
        for r in recs:
            by.setdefault(r.get("category") or "(none)", []).append(record_correct(r))
        for cat, ok in by.items():
            cats.setdefault(cat, {})[mode] = {"n": len(ok), "accuracy": sum(ok) / len(ok)}
    from speceyes.miniworld.scenes import CATEGORIES

    order = [c for c in CATEGORIES if c in cats] + sorted(c for c in cats if c not in CATEGORIES)
    return {"modes": modes, "rows": rows, "categories": {c: cats[c] for c in order}}


def _pooled(out: Path, mode: str) -> list[dict]:
    from speceyes.rundir import RunDir

    return [r for split, _ in SPLITS for r in RunDir(out / RUNS_DIR / split / mode).records()]


def checks(out: Path, modes: list[str], tau: float, summary: dict[str, Any]) -> dict[str, Any]:
    """The gate's AUROC, the judge's routing by target size, accuracy against tau (replayed
    from the logs), the figure and the targets, from the run folders."""
    import numpy as np

    from speceyes.miniworld import targets as T

    extra: dict[str, Any] = {}
    # AUROC over the small model's answers: the small-only run answers every question.
    source = "small" if "small" in modes else ("speceyes" if "speceyes" in modes else None)
    if source:
        extra["gate_auroc"] = {"run": source, **T.gate_auroc(_pooled(out, source))}
    if "speceyes" in modes:
        spec = _pooled(out, "speceyes")
        extra["judge_routing"] = T.judge_routing(spec)
        curve = None
        if "agent" in modes:
            taus = np.round(np.concatenate([np.linspace(0.5, 0.95, 10), [0.97, 0.98, 0.99]]), 4)
            curve = T.accuracy_vs_tau(spec, _pooled(out, "agent"), taus)
            extra["accuracy_vs_tau"] = curve
        extra["plot"] = str(plot_demo(summary, curve, tau, out / "demo.png"))
    extra["targets"] = T.check_targets({**summary, **extra})
    return extra


def label_log_axis(axis: Any) -> None:
    """Ticks of a log ``axis`` labelled in plain decimals at 1, 2 and 5 per decade, the others
    unlabelled: matplotlib's default labels every minor tick of a short log range (the demo's
    0.03-0.6 s) in scientific notation, and the labels overlapped."""
    from matplotlib.ticker import LogLocator, NullFormatter, StrMethodFormatter

    axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(StrMethodFormatter("{x:g}"))
    axis.set_minor_formatter(NullFormatter())


def plot_demo(
    summary: dict[str, Any], curve: dict[str, list[float]] | None, tau: float, out_png: Path
) -> Path:
    """Left: accuracy against seconds per query for each mode and split. Right: SpecEyes'
    accuracy against tau (replayed), with agent-only and small-only as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    markers = {"small-targets": "o", "large-targets": "s", "all": "*"}
    colors = {"agent": "tab:red", "small": "tab:blue", "speceyes": "tab:green"}
    for split, row in summary["rows"].items():
        for mode, c in row.items():
            if c.get("time_per_query") is None or c.get("accuracy") is None:
                continue
            ax1.scatter(
                c["time_per_query"],
                c["accuracy"],
                marker=markers.get(split, "o"),
                s=120 if split == "all" else 60,
                color=colors.get(mode, "gray"),
                label=f"{MODE_LABEL[mode]}, {SPLIT_LABEL[split]}",
            )
    ax1.set_xscale("log")
    label_log_axis(ax1.xaxis)
    ax1.set_xlabel("seconds per query (log scale)")
    ax1.set_ylabel("accuracy")
    ax1.set_title("accuracy against time, per mode and split")
    ax1.legend(fontsize=7, loc="lower right")
    ax1.grid(alpha=0.3)
    if curve:
        ax2.plot(curve["tau"], curve["accuracy"], color="tab:green", label="SpecEyes (replayed)")
        ax2b = ax2.twinx()
        ax2b.plot(
            curve["tau"], curve["small_share"], color="tab:green", ls=":",
            label="answered by the small model (right axis)",
        )
        ax2b.set_ylabel("share answered by the small model")
        ax2b.set_ylim(0, 1)
        allrow = summary["rows"].get("all", {})
        for mode in ("agent", "small"):
            if mode in allrow and allrow[mode].get("accuracy") is not None:
                ax2.axhline(
                    allrow[mode]["accuracy"], color=colors[mode], ls="--", label=MODE_LABEL[mode]
                )
        ax2.axvline(tau, color="gray", ls=":", lw=1)
        ax2.set_xlabel("tau (gate threshold)")
        ax2.set_ylabel("accuracy, all questions")
        ax2.set_title(f"accuracy against tau (demo tau {tau:g})")
        lines, labels = ax2.get_legend_handles_labels()
        more, more_labels = ax2b.get_legend_handles_labels()  # the dotted share, on its own axis
        ax2.legend(lines + more, labels + more_labels, fontsize=7, loc="lower left")
        ax2.grid(alpha=0.3)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


def write_viewer(out: Path, modes: list[str]) -> Path | None:
    """The runs as one static HTML report (``speceyes view``); a failure here never costs the
    demo its results, so it is reported and skipped."""
    from speceyes.view import write_view

    runs = [out / RUNS_DIR / split / mode for split, _ in SPLITS for mode in modes]
    try:
        return write_view(runs, out / "view")
    except Exception as e:  # noqa: BLE001 - the report is an extra; the results are written
        print(f"viewer: not written ({type(e).__name__}: {e})")
        return None


def format_checks(summary: dict[str, Any]) -> str:
    lines = []
    au = summary.get("gate_auroc")
    if au and au.get("n"):
        lines.append(
            f"Gate AUROC (confidence as a predictor of the small model being right, "
            f"{au['run']} runs, {au['right']}/{au['n']} right): {fmt(au['auroc'])}."
        )
    jr = summary.get("judge_routing")
    if jr:
        parts = [
            f"{size} targets {v['to_agent']}/{v['n']} to the agent ({fmt(v['share_to_agent'], '.0%')})"
            for size, v in jr.items()
            if v["n"]
        ]
        lines.append("Judge routing: " + "; ".join(parts) + ".")
    return "\n".join(lines) + "\n"


def fmt(x, spec: str = ".3f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def format_table(summary: dict[str, Any]) -> str:
    modes = summary["modes"]
    head = ["questions"]
    for m in modes:
        lab = MODE_LABEL[m]
        head += [f"{lab} acc", f"{lab} s/query", f"{lab} speedup"]
        if m == "speceyes":
            head += ["beta", "alpha", "analytic speedup", "share of analytic"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, row in summary["rows"].items():
        cells = [f"{SPLIT_LABEL[key]} (n={next(iter(row.values()))['n']})" if row else key]
        for m in modes:
            c = row[m]
            cells += [fmt(c["accuracy"]), fmt(c["time_per_query"]), fmt(c["speedup"], ".2f", "x")]
            if m == "speceyes":
                cells += [
                    fmt(c["beta"], ".2f"),
                    fmt(c["alpha"], ".2f"),
                    fmt(c["analytic_speedup"], ".2f", "x"),
                    fmt(c["share_of_analytic"], ".0%"),
                ]
        lines.append("| " + " | ".join(cells) + " |")
    for cat, row in summary["categories"].items():
        n = next(iter(row.values()))["n"]
        cells = [f"{cat} (n={n})"]
        for m in modes:
            cells += [fmt(row[m]["accuracy"] if m in row else None), "", ""]
            if m == "speceyes":
                cells += ["", "", "", ""]
        lines.append("| " + " | ".join(cells) + " |")
    threads = summary.get("threads") or {}
    where = (
        f", on {threads['workers']} worker processes of {threads.get('torch', '?')} thread(s), "
        "one batch each at a time"
        if (threads.get("workers") or 1) > 1
        else ""
    )
    notes = [
        "",
        "s/query: the run's wall time / its questions (batches of "
        f"{summary.get('batch_size', '?')}; every mode of both splits ran in turns, batch by "
        f"batch in one rotating order{where}); 'all' pools both splits: total time / total "
        "questions. "
        "speedup: agent-only s/query / the mode's s/query (over all questions: total "
        "agent-only time / total time of the mode).",
        "beta: share of questions the judge sent to the small model; alpha: share of those the "
        "gate accepted. analytic speedup: L_agent / (c_J + beta*c_S + (1 - beta*alpha)*L_agent) "
        "from the measured costs below; over all questions, total agent-only time / the sum of "
        "each split's analytic SpecEyes time (its questions times that expression's "
        "denominator, with the split's costs); share of analytic: measured / analytic.",
        "Category rows: accuracy only, pooled over both splits; time per query cannot be "
        "attributed to a category, since a batch mixes categories and shares its time.",
    ]
    if "agent" in modes:
        hits = []
        for key, row in summary["rows"].items():
            z = row["agent"].get("zoom_on_target") or {}
            if z.get("n"):
                hits.append(f"{SPLIT_LABEL[key]} {z['hits']}/{z['n']} ({z['share']:.0%})")
        if hits:
            notes.append(
                "Agent-only zooms whose last crop holds the whole target: " + "; ".join(hits) + "."
            )
    if "speceyes" in modes:
        costs = []
        for key, row in summary["rows"].items():
            c = row["speceyes"]
            costs.append(
                f"{SPLIT_LABEL[key]}: c_J {fmt(c['c_J'], '.4f')} s, c_S {fmt(c['c_S'], '.4f')} s, "
                f"L_agent {fmt(c.get('L_agent'), '.4f')} s"
            )
        notes.append(
            "Measured costs per query (c_J: judge; c_S: small model + gate, per question it "
            "answered; L_agent: agent-only s/query): " + "; ".join(costs) + "."
        )
    return "\n".join(lines + notes) + "\n"


def format_cpu_table(summary: dict[str, Any]) -> str:
    """Wall-clock and process CPU seconds per query side by side, and the speedup by each."""
    modes = summary["modes"]
    head = ["questions"]
    for m in modes:
        lab = MODE_LABEL[m]
        head += [f"{lab} wall s/query", f"{lab} CPU s/query"]
        if m != "agent":
            head.append(f"{lab} speedup wall / CPU")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, row in summary["rows"].items():
        cells = [f"{SPLIT_LABEL[key]} (n={next(iter(row.values()))['n']})" if row else key]
        for m in modes:
            c = row[m]
            cells += [fmt(c["time_per_query"]), fmt(c.get("cpu_time_per_query"))]
            if m != "agent":
                wall, cpu = fmt(c["speedup"], ".2f", "x"), fmt(c.get("cpu_speedup"), ".2f", "x")
                cells.append(f"{wall} / {cpu}")
        lines.append("| " + " | ".join(cells) + " |")
    notes = [
        "",
        "CPU s/query: the process CPU time of the mode's batches (all threads) / its questions; "
        "unlike wall time it leaves out the time the process waited for a core. Both are "
        "measured over the same interleaved batches; over all questions, the speedup is total "
        "agent-only time / total time of the mode by either clock.",
    ]
    return "\n".join(lines + notes) + "\n"


def format_report(summary: dict[str, Any]) -> str:
    """The table and the CPU-time table, then (when the targets were checked) the checks and
    the targets' verdicts."""
    from speceyes.miniworld.targets import format_targets

    text = format_table(summary) + "\n" + format_cpu_table(summary)
    if summary.get("targets"):
        text += "\n" + format_checks(summary) + "\n" + format_targets(summary["targets"])
    return text
