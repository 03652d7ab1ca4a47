"""What the demo checks beyond accuracy and time: the gate's AUROC, the judge's routing by target
size, accuracy against tau replayed from the logs, and the mini world's targets as met/missed.
Pure functions of logged records and the summary; the figure is drawn by
:mod:`speceyes.miniworld.summary`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from speceyes import gate


def auroc(scores: Sequence[float], labels: Sequence[bool]) -> float | None:
    """Area under the ROC curve of ``scores`` predicting ``labels`` (ties count one half): the
    probability that a right answer gets a higher confidence than a wrong one. None without
    both classes."""
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels, dtype=bool)
    pos, neg = s[y], s[~y]
    if len(pos) == 0 or len(neg) == 0:
        return None
    # Rank statistic (Mann-Whitney U) with average ranks for ties.
    order = np.argsort(np.concatenate([pos, neg]), kind="mergesort")
    allv = np.concatenate([pos, neg])[order]
    ranks = np.empty(len(allv))
    i = 0
    while i < len(allv):
        j = i
        while j + 1 < len(allv) and allv[j + 1] == allv[i]:
            j += 1
        ranks[i : j + 1] = (i + j) / 2 + 1
        i = j + 1
    r = np.empty(len(allv))
    r[order] = ranks
    u = r[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2
    return float(u / (len(pos) * len(neg)))


def gate_auroc(records: Sequence[dict]) -> dict[str, Any]:
    """AUROC of the gate's confidence as a predictor of the small model's correctness, over the
    records that hold both (a small-only run holds every question)."""
    pts = [
        (float(r["confidence"]), bool(r["small_correct"]))
        for r in records
        if r.get("confidence") is not None and r.get("small_correct") is not None
    ]
    return {
        "n": len(pts),
        "right": sum(ok for _, ok in pts),
        "auroc": auroc([c for c, _ in pts], [ok for _, ok in pts]) if pts else None,
    }


def judge_routing(records: Sequence[dict]) -> dict[str, Any]:
    """Per target size: questions judged, and the share the judge sent to the agent."""
    out: dict[str, Any] = {}
    for size in ("small", "large"):
        judged = [
            r
            for r in records
            if (r.get("meta") or {}).get("target_size") == size and r.get("judge_tool") is not None
        ]
        to_agent = sum(1 for r in judged if r["judge_tool"])
        out[size] = {
            "n": len(judged),
            "to_agent": to_agent,
            "share_to_agent": to_agent / len(judged) if judged else None,
        }
    return out


def accuracy_vs_tau(
    speceyes: Sequence[dict], agent: Sequence[dict], taus: np.ndarray
) -> dict[str, list[float]]:
    """SpecEyes' accuracy at each tau, replayed from its log: a question the judge kept
    tool-free is answered by the small model when its logged confidence passes tau, and by the
    agent otherwise (the agent-only run's answer to the same question: greedy and deterministic,
    it is the answer the fallback gives). Also the share answered by the small model."""
    agent_ok = {r["id"]: bool(r.get("correct")) for r in agent}
    acc, share = [], []
    rows = [r for r in speceyes if r["id"] in agent_ok]
    for tau in taus:
        ok = small = 0
        for r in rows:
            conf = r.get("confidence")
            if r.get("judge_tool") is False and conf is not None and gate.accept(conf, float(tau)):
                ok += bool(r.get("small_correct"))
                small += 1
            else:
                ok += agent_ok[r["id"]]
        acc.append(ok / len(rows) if rows else float("nan"))
        share.append(small / len(rows) if rows else float("nan"))
    return {"tau": [float(t) for t in taus], "accuracy": acc, "small_share": share}


def check_targets(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The mini world's targets, each with its measured value and met/missed."""
    rows = summary["rows"]

    def acc(split: str, mode: str) -> float | None:
        c = rows.get(split, {}).get(mode)
        return None if c is None else c.get("accuracy")

    def val(split: str, mode: str, key: str) -> float | None:
        c = rows.get(split, {}).get(mode)
        return None if c is None else c.get(key)

    out: list[dict[str, Any]] = []

    def add(name: str, measured: float | None, ok: bool | None, fmt: str = ".3f") -> None:
        out.append(
            {
                "target": name,
                "measured": None if measured is None else float(measured),
                "text": "-" if measured is None else format(measured, fmt),
                "met": ok,
            }
        )

    def ge(a: float | None, b: float | None) -> bool | None:
        return None if a is None or b is None else a >= b - 1e-12

    s_large = acc("large-targets", "small")
    add("small-only on large targets >= 0.85", s_large, ge(s_large, 0.85))
    a_small, s_small = acc("small-targets", "agent"), acc("small-targets", "small")
    add("agent-only on small targets >= 0.80", a_small, ge(a_small, 0.80))
    gap = None if a_small is None or s_small is None else a_small - s_small
    add("agent-only - small-only on small targets >= +0.30", gap, ge(gap, 0.30), "+.3f")
    se, ag, sm = acc("all", "speceyes"), acc("all", "agent"), acc("all", "small")
    d_agent = None if se is None or ag is None else se - ag
    add("SpecEyes - agent-only, all questions >= -0.01", d_agent, ge(d_agent, -0.01), "+.3f")
    d_small = None if se is None or sm is None else se - sm
    add("SpecEyes - small-only, all questions >= +0.15", d_small, ge(d_small, 0.15), "+.3f")
    sp_l = val("large-targets", "speceyes", "speedup")
    add("speedup on large targets >= 3x", sp_l, ge(sp_l, 3.0), ".2f")
    sp_a = val("all", "speceyes", "speedup")
    add("speedup over all questions >= 1.6x", sp_a, ge(sp_a, 1.6), ".2f")
    share = val("all", "speceyes", "share_of_analytic")
    add("measured share of the analytic speedup (all) >= 90%", share, ge(share, 0.9), ".0%")
    au = (summary.get("gate_auroc") or {}).get("auroc")
    add("gate AUROC on the small model's answers >= 0.80", au, ge(au, 0.80))
    routing = summary.get("judge_routing") or {}
    small_to_agent = (routing.get("small") or {}).get("share_to_agent")
    add(
        "judge: small-target questions to the agent >= 90%",
        small_to_agent,
        ge(small_to_agent, 0.90),
        ".0%",
    )
    large_to_agent = (routing.get("large") or {}).get("share_to_agent")
    large_to_small = None if large_to_agent is None else 1 - large_to_agent
    add(
        "judge: large-target questions to the small model >= 80%",
        large_to_small,
        ge(large_to_small, 0.80),
        ".0%",
    )
    return out


def format_targets(targets: Sequence[dict[str, Any]]) -> str:
    lines = ["| target | measured | verdict |", "|---|---|---|"]
    for t in targets:
        verdict = {True: "met", False: "**missed**", None: "not measured"}[t["met"]]
        lines.append(f"| {t['target']} | {t['text']} | {verdict} |")
    return "\n".join(lines) + "\n"
