"""The outputs of a sweep: the markdown table, simulate.md with the settings and the analytic
check, simulate.csv and the throughput and latency plot simulate.png."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, fields
from pathlib import Path

from speceyes.simulate.costs import LARGE, SMALL, CostModel, analytic, judge_costs
from speceyes.simulate.runs import IDEAL, Row

MD_FILE, CSV_FILE, PNG_FILE = "simulate.md", "simulate.csv", "simulate.png"


def _f(x: float, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def format_table(rows: Sequence[Row]) -> str:
    head = (
        "| schedule | C | judge | GPUs | queries/s | x agent-only | per GPU | x agent-only 2 GPUs "
        "| of ideal | p50 s | p95 s | large batch | large util | small batch | small util |"
    )
    lines = [head, "|" + "---|" * 15]
    for r in rows:
        lines.append(
            f"| {r.schedule} | {r.concurrency} | {r.judge} | {r.gpus} | "
            f"{_f(r.throughput, '.3f')} | {_f(r.vs_agent_only, '.2f')} | "
            f"{_f(r.per_gpu_vs_agent_only, '.2f')} | {_f(r.vs_agent_only_2gpu, '.2f')} | "
            f"{_f(r.of_ideal, '.0%')} | {_f(r.p50_s, '.2f')} | "
            f"{_f(r.p95_s, '.2f')} | {_f(r.large_batch, '.1f')} | {_f(r.large_util, '.0%')} | "
            f"{_f(r.small_batch, '.1f')} | {_f(r.small_util, '.0%')} |"
        )
    return "\n".join(lines)


_COLORS = {"agent-only": "tab:gray", "agent-only-2gpu": "tab:brown", "published": "tab:red",
           IDEAL: "black"}
_JUDGE_COLORS = {"large": "tab:blue", "prefix": "tab:cyan", "small": "tab:green",
                 "small-prefix": "tab:olive", "none": "tab:purple"}


def plot(rows: Sequence[Row], path: str | Path, title: str = "") -> Path:
    """Throughput vs concurrency (log2 x) per schedule plus the ideal; p50/p95 latency."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    series = list(dict.fromkeys((r.schedule, r.judge) for r in rows))
    for s, j in series:
        rs = sorted((r for r in rows if r.schedule == s and r.judge == j),
                    key=lambda r: r.concurrency)
        cs = [r.concurrency for r in rs]
        color = _JUDGE_COLORS.get(j, "tab:blue") if s == "speceyes" else _COLORS[s]
        style = "--" if s == IDEAL else "-"
        label = (
            "ideal: agent-only / (1 - beta*alpha)" if s == IDEAL
            else f"speceyes, judge {j}" if s == "speceyes" else s
        )
        ax1.plot(cs, [r.throughput for r in rs], style, marker="o", ms=3, color=color,
                 label=label)
        if s != IDEAL:
            ax2.plot(cs, [r.p50_s for r in rs], "-", marker="o", ms=3, color=color,
                     label=f"{label} p50")
            ax2.plot(cs, [r.p95_s for r in rs], ":", marker="^", ms=3, color=color,
                     label=f"{label} p95")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (clients in a closed loop)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    ax1.set_yscale("log")
    ax1.set_ylabel("throughput (queries/s)")
    ax2.set_yscale("log")
    ax2.set_ylabel("latency (s)")
    ax1.set_title("throughput")
    ax2.set_title("latency (p50 solid, p95 dotted)")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_outputs(
    rows: Sequence[Row], out_dir: str | Path, costs: CostModel, beta: float, alpha: float,
    n_queries: int, seed: int, note: str = "",
) -> list[Path]:
    """simulate.md (settings, analytic check, table), simulate.csv and simulate.png."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    a = analytic(costs, beta, alpha)
    jc = judge_costs(costs)
    md = [
        "# speceyes simulate",
        "",
        f"{n_queries} queries per run, closed loop, beta={beta}, alpha={alpha}, seed={seed}"
        + (f"; {note}" if note else "") + ".",
        "",
        f"Batch-1 costs: judge c_J={a.c_judge:.3f} s, small answer c_S={a.c_small:.3f} s, "
        f"agent loop L_agent={a.l_agent:.2f} s.",
        f"E[L] = c_J + beta*c_S + (1 - beta*alpha)*L_agent = {a.expected_latency:.3f} s "
        f"(overlapped phases I+II: {a.expected_latency_overlap:.3f} s); "
        f"ideal gain 1/(1 - beta*alpha) = {a.ideal_gain:.3f}.",
        "Judge variants at batch 1: "
        + "; ".join(f"{j} {v['s']:.3f} s on the {v['model']} model ({v['tokens']} prefill tokens)"
                    for j, v in jc.items() if j != "none")
        + f"; the prefix judge saves {jc['prefix']['saves_agent_s']:.3f} s of the agent's first "
        "turn.",
        f"KV cache: {costs.kv_tokens(LARGE)} tokens (large), {costs.kv_tokens(SMALL)} (small); "
        f"{'one GPU for both models' if costs.shared_gpu else 'one GPU per model'}; prefix "
        f"caching {'on' if costs.prefix_caching else 'off'}.",
        "",
        format_table(rows),
        "",
        "## Cost model",
        "",
        "```json",
        json.dumps(asdict(costs), indent=2),
        "```",
        "",
    ]
    paths = [out / MD_FILE, out / CSV_FILE, out / PNG_FILE]
    paths[0].write_text("\n".join(md))
    with paths[1].open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=[f.name for f in fields(Row)])
        w.writeheader()
        for r in rows:
            w.writerow(asdict(r))
    plot(rows, paths[2], title=f"beta={beta}, alpha={alpha}, {n_queries} queries"
         + (f", {note}" if note else ""))
    return paths
