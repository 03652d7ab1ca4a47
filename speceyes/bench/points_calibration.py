"""Operating points calibrated as one family (``speceyes calibrate --operating-points``).

``--judge auto`` picks, per batch, one operating point (a judge variant with its own tau) by
the load at that moment. For the printed guarantee to hold whichever point answers, every
point's guarantee must hold at once: each point is tested at level delta / P (Bonferroni over
the P points), so with probability at least C every point's error among its accepted answers
is at most E. The choice among points depends on load, never on the labels, so any mixture of
batches served at different points also has error among accepted answers at most E.

Each point comes from a ``--mode both`` run of the same models, agent and gate with that
point's judge variant. ``none`` (no judge: the gate decides on every query) needs no run of its
own: a both run logs the small model's answer on every query, so the judged run's log is also
the ``none`` log, and its judge decisions give ``none``'s rates split by what a judge would have
said (beta, alpha among the judged tool-free, alpha_tool among the judged tool queries).
The rates are cost estimates for the chooser, measured on the whole run; only the taus carry
the guarantee. The file also holds the agent-only point (``agent``: phases I-III skipped), so
auto can send a batch straight to the agent where the front costs more than it saves; it
accepts no small answer, so it needs no test and does not count among the P.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from speceyes.bench import regate as rg
from speceyes.bench.calibrate import calibrate
from speceyes.bench.calibration_file import Calibration, judge_words, run_setup
from speceyes.bench.runlog import Run
from speceyes.bench.splits import Split
from speceyes.operating_points import AGENT_POINT, OperatingPoint, write_points

METHOD = "bonferroni-over-points"


@dataclass
class PointsCalibration:
    """The calibrated points (those whose test passed) and every point's calibration."""

    points: list[OperatingPoint]
    calibrations: list[Calibration]  # one per tested point, in the order tested
    max_error: float
    confidence: float  # C over the whole family
    models: dict[str, str | None] | None
    agent: str | None
    top_k: int
    agg: str
    scale: float
    judge_mode: str | None
    judge_threshold: float | None
    sources: list[str] = field(default_factory=list)
    split: str | None = None

    @property
    def family(self) -> int:
        return len(self.calibrations)

    @property
    def point_delta(self) -> float:
        return (1.0 - self.confidence) / max(1, self.family)

    @property
    def dropped(self) -> list[Calibration]:
        return [c for c in self.calibrations if not c.passed]

    def guarantee(self) -> dict[str, Any]:
        return {
            "max_error": self.max_error,
            "confidence": self.confidence,
            "points_tested": self.family,
            "delta_per_point": self.point_delta,
            "method": METHOD,
            "statement": (
                f"with probability >= {self.confidence:g}, the error among accepted small "
                f"answers is <= {self.max_error:g} at every point at once, so under --judge "
                "auto whichever points answer"
            ),
        }


def calibrate_points(
    runs: Sequence[Run],
    max_error: float = 0.05,
    confidence: float = 0.9,
    *,
    top_k: int | None = None,
    agg: str | None = None,
    split: Split | None = None,
    with_none: bool = True,
    with_agent: bool = True,
) -> PointsCalibration:
    """One operating point per run's judge variant (plus ``none`` from the first judged run
    unless a run has it or ``with_none`` is False), each tested at (1 - C) / P; and, unless
    ``with_agent`` is False, the agent-only point, which accepts no small answer and so needs
    no test (it is not one of the P)."""
    if not runs:
        raise ValueError("give at least one --mode both run")
    for r in runs:
        if r.mode != "both":
            raise ValueError(
                f"{r.path}: operating points need --mode both runs (the small model's answer "
                f"and confidence on every query), not --mode {r.mode}"
            )
    first = runs[0]
    g = rg.resolve_gate(first, top_k, agg, None)
    setups = [run_setup(r.config) for r in runs]
    for r, s in zip(runs[1:], setups[1:], strict=True):
        # the same models (spec or folder) and agent; the judge is what the runs vary
        differ = setups[0].differences(
            dataclasses.replace(
                s, judge=setups[0].judge, judge_max_pixels=setups[0].judge_max_pixels
            )
        )
        if (r.config.get("judge_mode"), r.config.get("judge_threshold")) != (
            first.config.get("judge_mode"),
            first.config.get("judge_threshold"),
        ):
            differ.append("judge mode")
        if rg.resolve_gate(r, top_k, agg, None).scale != g.scale:
            differ.append("sigmoid scale")
        if differ:
            raise ValueError(
                f"{r.path} and {first.path} differ in {', '.join(differ)}: operating points "
                "are alternatives for one setup"
            )
    # (judge, view budget, the log the gate is calibrated on, the judge decisions for rates)
    variants: list[tuple[str, int | None, Run, np.ndarray]] = []
    for r, s in zip(runs, setups, strict=True):
        key = (s.judge, s.judge_max_pixels)
        if key in [(j, px) for j, px, _, _ in variants]:
            raise ValueError(f"two runs with {judge_words(*key)}: give one run per judge variant")
        variants.append((s.judge, s.judge_max_pixels, r, r.judge_tool))
    judged = [r for j, _, r, _ in variants if j != "none"]
    if with_none and "none" not in [v[0] for v in variants] and judged:
        variants.append(("none", None, _without_judge(judged[0]), judged[0].judge_tool))

    level = 1.0 - (1.0 - confidence) / len(variants)
    cals: list[Calibration] = []
    points: list[OperatingPoint] = []
    for judge, pixels, view, decisions in variants:
        cal = calibrate(view, max_error, level, top_k=g.top_k, agg=g.agg, scale=g.scale,
                        split=split)  # fmt: skip
        cal = dataclasses.replace(cal, judge=judge, judge_max_pixels=pixels)
        cals.append(cal)
        if cal.passed:
            points.append(_point(view, decisions, judge, pixels, cal.tau, g))
    if with_agent and points:
        points.append(OperatingPoint(AGENT_POINT))
    return PointsCalibration(
        points=points,
        calibrations=cals,
        max_error=max_error,
        confidence=confidence,
        models=setups[0].models,
        agent=setups[0].agent,
        top_k=g.top_k,
        agg=g.agg,
        scale=g.scale,
        judge_mode=first.config.get("judge_mode"),
        judge_threshold=first.config.get("judge_threshold"),
        sources=[str(r.path) for r in runs],
        split=None if split is None else str(split),
    )


def _without_judge(run: Run) -> Run:
    """The run's log read as a ``none`` run: no judge decisions, so the gate's population is
    every small answer."""
    return dataclasses.replace(run, judge_tool=np.full(run.n, np.nan), _cache=dict(run._cache))


def _point(
    view: Run, judged: np.ndarray, judge: str, pixels: int | None, tau: float, g: rg.GateSetting
) -> OperatingPoint:
    """The point's rates at its tau on the whole run (estimates for the chooser); ``judged``
    holds the judge decisions logged with the run (1 tools, 0 tool-free, NaN none)."""
    conf = np.nan_to_num(rg.confidences(view, g.top_k, g.agg, g.scale), nan=-np.inf)
    accepted = view.has_small & (conf > tau)
    tool_free, tool = judged == 0, judged == 1

    def share(mask: np.ndarray) -> float:
        return float(accepted[mask].mean()) if mask.any() else 0.0

    known = ~np.isnan(judged)
    if not known.any():  # a run made without a judge: every query is the gate's
        return OperatingPoint(judge, tau, beta=1.0, alpha=share(view.has_small))
    beta = float(tool_free.sum() / known.sum())
    alpha_tool = share(tool) if judge == "none" else 0.0
    return OperatingPoint(judge, tau, beta, share(tool_free), alpha_tool, pixels)


def write_points_calibration(pc: PointsCalibration, path: str | Path) -> Path:
    """The points file ``--points`` reads: the passing points, the family's guarantee, the
    setup it holds for (models, agent, gate, judge mode), and every point's calibration."""
    return write_points(
        path,
        pc.points,
        guarantee=pc.guarantee(),
        setup={"models": pc.models, "agent": pc.agent},
        gate={"top_k": pc.top_k, "agg": pc.agg, "scale": pc.scale},
        judge_mode=pc.judge_mode,
        judge_threshold=pc.judge_threshold,
        sources=pc.sources,
        split=pc.split,
        calibrations=[c.to_dict() for c in pc.calibrations],
    )


def _name(cal: Calibration) -> str:
    """A calibrated point's name, as :attr:`OperatingPoint.name` writes it."""
    return OperatingPoint(cal.judge, judge_max_pixels=cal.judge_max_pixels).name


def format_points_calibration(pc: PointsCalibration) -> str:
    g = pc.guarantee()
    lines = [
        f"operating points: {pc.family} tested as one family, each at delta/{pc.family} = "
        f"{pc.point_delta:.4g} (Bonferroni); {g['statement']}",
        f"gate K={pc.top_k} agg={pc.agg} sigmoid scale={pc.scale:g}",
        "",
        "| point | tau | passed | accepted (calib) | bound | held-out error among accepted |",
        "|---|---|---|---|---|---|",
    ]
    for c in pc.calibrations:
        h = c.held_out or {}
        err = h.get("accepted_error")
        held = "-" if err is None else f"{err:.4f} of {h.get('n_accepted')}"
        lines.append(
            f"| {_name(c)} | {c.tau:.6f} | "
            f"{'yes' if c.passed else 'no'} | {c.n_accepted}/{c.n} | "
            f"{'-' if c.bound is None or not math.isfinite(c.bound) else f'{c.bound:.4f}'} | "
            f"{held} |"
        )
    lines.append("")
    lines.append("| point | beta | alpha | alpha_tool | share answered without the agent |")
    lines.append("|---|---|---|---|---|")
    for p in pc.points:
        if p.judge == AGENT_POINT:  # no front: nothing to rate
            lines.append(f"| {p.name} (phases I-III skipped) | - | - | - | 0 |")
            continue
        lines.append(
            f"| {p.name} | {p.beta:.3f} | {p.alpha:.3f} | {p.alpha_tool:.3f} | {p.skipped:.3f} |"
        )
    if pc.dropped:
        names = ", ".join(_name(c) for c in pc.dropped)
        lines.append(f"left out (no tau passed at delta/{pc.family}): {names}")
    lines.append(
        "rates (beta, alpha, alpha_tool) are measured on the whole run: estimates for the "
        "load-aware choice, not part of the guarantee"
    )
    return "\n".join(lines)


__all__ = [
    "METHOD",
    "PointsCalibration",
    "calibrate_points",
    "format_points_calibration",
    "write_points_calibration",
]
