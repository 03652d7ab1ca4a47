"""``speceyes table1``: a reproduction's run folders laid out as Table 1 of the paper, beside
the published numbers (:mod:`speceyes.bench.paper_table1`), with the difference per cell.

Each run's place comes from its config (what ``eval`` logs): the row from ``mode``
(``agent`` is the backbone's own row, ``speceyes`` the SpecEyes row of its ``agg``, ``small``
the draft-only row, ``specreason`` SpecReason), the backbone from ``agent`` (``deepeyes`` or
``thyme``; SpecReason runs the DeepEyes loop), and the columns from ``bench`` and its data: a
V* run fills Attr. and Pos. from its two categories; an HR-Bench run fills 4K or 8K, told by
``4k`` / ``8k`` in the data file's name (as in ``hr_bench_4k.tsv``); a POPE run fills its
``--split``, or all three splits from its categories when it ran without one.

Accuracy is scored by the rules of the run's own protocol (``published``: the authors' judge
scripts, errors dropped; ``fair``: errors count wrong), or by the ``scoring`` given, with
:func:`speceyes.bench.report.rescore`. Speedup is ``speceyes report``'s measured speedup
(:func:`speceyes.bench.report.report_rows`: the agent-only run's seconds per query over this
run's) against the agent-only run of the same backbone on the same benchmark split; the
draft-only row is measured against DeepEyes'. A run over several columns (V*, a POPE run of
all splits) has one wall time, so its one speedup fills each of its columns, marked ``*``.
A cell without its agent-only run gets no speedup, and a note says which run is missing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from speceyes.bench import paper_table1 as paper
from speceyes.bench.report import report_rows, rescore
from speceyes.bench.runlog import Run, load_run

__all__ = [
    "SCORINGS",
    "Cell",
    "Placement",
    "Table1",
    "Table1Error",
    "TableRow",
    "build_table1",
    "format_markdown",
    "place_run",
]

SCORINGS = ("run", "fair", "published")
VSTAR_COLUMNS = {"direct_attributes": "vstar_attr", "relative_position": "vstar_pos"}
HR_COLUMNS = {"4": "hr_4k", "8": "hr_8k"}
POPE_COLUMNS = {"adversarial": "pope_adv", "popular": "pope_pop", "random": "pope_rand"}
DRAFT_BASELINE = "deepeyes"  # the draft-only row sits above both blocks; measured against this
POOLED_MARK = "*"
_HR_SIZE = re.compile(r"(?<!\d)([48])k", re.IGNORECASE)


class Table1Error(ValueError):
    """Runs that cannot be laid out as one Table 1 (two runs claim one cell)."""


@dataclass(frozen=True)
class Placement:
    """Where a run goes: its paper row and the columns it fills (category -> column)."""

    row: tuple[str | None, str, str | None]  # (backbone, method, agg) as paper_table1 keys it
    scope: str  # the benchmark split(s) the run covers, e.g. "pope/adversarial", "vstar"
    columns: dict[str, str]  # column key -> the category of the run that scores it ("" = all)


@dataclass
class Cell:
    """One column of one row: ours beside the paper's (accuracy in percent)."""

    column: str
    paper_accuracy: float | None
    paper_speedup: float | None
    ours_accuracy: float | None = None
    ours_speedup: float | None = None
    pooled_speedup: bool = False  # one speedup of a run over several columns
    run: str | None = None
    baseline: str | None = None
    scoring: str | None = None

    @property
    def diff_accuracy(self) -> float | None:
        return _diff(self.ours_accuracy, self.paper_accuracy)

    @property
    def diff_speedup(self) -> float | None:
        return _diff(self.ours_speedup, self.paper_speedup)


@dataclass
class TableRow:
    paper: paper.PaperRow
    cells: list[Cell]

    @property
    def has_ours(self) -> bool:
        return any(c.run is not None for c in self.cells)

    @property
    def ours_avg_accuracy(self) -> float | None:
        return _mean([c.ours_accuracy for c in self.cells])

    @property
    def ours_avg_speedup(self) -> float | None:
        return _mean([c.ours_speedup for c in self.cells])


@dataclass
class Table1:
    rows: list[TableRow]
    notes: list[str] = field(default_factory=list)
    schedules: list[str] = field(default_factory=list)  # the agent-loop schedules of its runs

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": paper.SOURCE,
            "columns": [asdict(c) for c in paper.COLUMNS],
            "rows": [_row_dict(r) for r in self.rows],
            "notes": list(self.notes),
            "schedules": list(self.schedules),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def _diff(ours: float | None, published: float | None) -> float | None:
    return None if ours is None or published is None else ours - published


def _mean(values: list[float | None]) -> float | None:
    """The paper's Avg.: the mean of all seven columns (None unless every one is there)."""
    if not values or any(v is None for v in values):
        return None
    return sum(values) / len(values)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- placing a run


def place_run(run: Run) -> tuple[Placement | None, str]:
    """The run's place in Table 1, or None and why it has none."""
    config = run.config
    mode = run.mode
    agent = config.get("agent")
    if mode == "agent":
        row: tuple[str | None, str, str | None] = (agent, "agent", None)
    elif mode == "speceyes":
        row = (agent, "speceyes", run.agg)
    elif mode == "small":
        row = (None, "draft", None)
    elif mode == "specreason":
        row = ("deepeyes", "specreason", None)  # SpecReason drafts the DeepEyes loop's steps
    else:
        return None, f"mode {mode!r} is no Table 1 row (its wall time covers both models)"
    if paper.paper_row(*row) is None:
        return None, f"agent {agent!r} with mode {mode!r} is no Table 1 row"
    bench = str(config.get("bench") or "")
    if bench == "vstar":
        cats = (config.get("loader") or {}).get("categories")
        if not cats or len(cats) > 1:
            return Placement(row, "vstar", {col: cat for cat, col in VSTAR_COLUMNS.items()}), ""
        if cats[0] not in VSTAR_COLUMNS:
            return None, f"V* category {cats[0]!r} is not in Table 1"
        # one split per run, as the released scripts run it: its own column and its own time
        return Placement(row, f"vstar/{cats[0]}", {VSTAR_COLUMNS[cats[0]]: ""}), ""
    if bench == "hrbench":
        name = Path(str(config.get("data") or "")).name
        sizes = {m.group(1) for m in _HR_SIZE.finditer(name)}
        if len(sizes) != 1:
            return None, (
                f"cannot tell HR-Bench 4K from 8K by the data file's name {name!r} (name it "
                "with 4k or 8k, as hr_bench_4k.tsv)"
            )
        size = sizes.pop()
        return Placement(row, f"hrbench/{size}k", {HR_COLUMNS[size]: ""}), ""
    if bench == "pope":
        split = (config.get("loader") or {}).get("split")
        if split is None:
            return Placement(row, "pope", {col: s for s, col in POPE_COLUMNS.items()}), ""
        if split not in POPE_COLUMNS:
            return None, f"POPE split {split!r} is not in Table 1"
        return Placement(row, f"pope/{split}", {POPE_COLUMNS[split]: ""}), ""
    return None, f"benchmark {bench or '(none)'!r} is not in Table 1"


# ---------------------------------------------------------------------------- the table


@dataclass
class _Placed:
    run: Run
    place: Placement
    scoring: str
    accuracy: dict[str, float | None]  # column -> percent


def _scored(run: Run, place: Placement, scoring: str, ask: Any, notes: list[str]) -> _Placed:
    protocol = (run.config.get("protocol") or "fair") if scoring == "run" else scoring
    scored = rescore([run], protocol, ask)[1][0]
    accuracy: dict[str, float | None] = {}
    for col, category in place.columns.items():
        value = scored["per_category"].get(category) if category else scored["accuracy"]
        accuracy[col] = None if value is None else 100.0 * float(value)
    if scored["needs_llm_judge"]:
        notes.append(
            f"{run.path}: {len(scored['needs_llm_judge'])} answers need the LLM judge of the "
            "published rules and count as wrong (pass --llm-judge URL)"
        )
    return _Placed(run, place, protocol, accuracy)


def _baseline_for(p: _Placed, placed: list[_Placed]) -> _Placed | None:
    backbone = p.place.row[0] if p.place.row[1] != "draft" else DRAFT_BASELINE
    for q in placed:
        if q.place.row == (backbone, "agent", None) and q.place.scope == p.place.scope:
            return q
    return None


def _measured_speedup(p: _Placed, base: _Placed) -> float | None:
    """report's speedup of ``p`` over ``base`` (the agent-only run of its backbone and split)."""
    rows = report_rows([base.run, p.run]) if base is not p else report_rows([p.run])
    return rows[-1].speedup


def _setting_notes(p: _Placed, base: _Placed) -> list[str]:
    differs = [
        key
        for key in ("protocol", "limit", "data", "schedule")
        if p.run.config.get(key) != base.run.config.get(key)
    ]
    if not differs:
        return []
    return [f"{p.run.path} and its agent-only run {base.run.path} differ in {', '.join(differs)}"]


def build_table1(
    run_dirs: Sequence[str | Path | Run],
    *,
    scoring: str = "run",
    ask: Callable[[str, str], str] | None = None,
) -> Table1:
    """Table 1 from the runs: every paper row, with ours where a run fills its cells.

    ``scoring``: ``run`` (each run by its own protocol's rules), ``fair`` or ``published``;
    ``ask`` is the LLM judge for the published rules' fallbacks.
    """
    if scoring not in SCORINGS:
        raise ValueError(f"unknown scoring {scoring!r}; choose from {', '.join(SCORINGS)}")
    if not run_dirs:
        raise ValueError("give the run folders of the reproduction")
    notes: list[str] = []
    placed: list[_Placed] = []
    for item in run_dirs:
        run = item if isinstance(item, Run) else load_run(item)
        place, why = place_run(run)
        if place is None:
            notes.append(f"{run.path}: left out: {why}")
            continue
        placed.append(_scored(run, place, scoring, ask, notes))
    claimed: dict[tuple[Any, str], _Placed] = {}
    for p in placed:
        for col in p.place.columns:
            other = claimed.get((p.place.row, col))
            if other is not None:
                label = paper.paper_row(*p.place.row).label  # type: ignore[union-attr]
                raise Table1Error(
                    f"two runs give {label} ({p.place.row[0] or 'draft'}) {_title(col)}: "
                    f"{other.run.path} and {p.run.path}"
                )
            claimed[(p.place.row, col)] = p
    rows = []
    for prow in paper.ROWS:
        cells = []
        for i, col in enumerate(paper.COLUMNS):
            cell = Cell(col.key, prow.accuracy[i], prow.speedup[i])
            p = claimed.get((prow.key, col.key))
            if p is not None:
                _fill(cell, p, placed, notes)
            cells.append(cell)
        rows.append(TableRow(prow, cells))
    schedules = sorted({str(p.run.config["schedule"]) for p in claimed.values()
                        if p.run.config.get("schedule")})
    return Table1(rows, list(dict.fromkeys(notes)), schedules)


def _fill(cell: Cell, p: _Placed, placed: list[_Placed], notes: list[str]) -> None:
    cell.ours_accuracy = p.accuracy[cell.column]
    cell.run, cell.scoring = str(p.run.path), p.scoring
    is_baseline = p.place.row[1] == "agent"
    cell.pooled_speedup = len(p.place.columns) > 1 and not is_baseline  # 1.00x by definition
    base = p if is_baseline else _baseline_for(p, placed)
    if base is None:
        backbone = DRAFT_BASELINE if p.place.row[1] == "draft" else p.place.row[0]
        notes.append(f"{p.run.path}: no agent-only {backbone} run on {p.place.scope}: no speedup")
        return
    cell.baseline = str(base.run.path)
    cell.ours_speedup = _measured_speedup(p, base)
    notes.extend(_setting_notes(p, base))


# ---------------------------------------------------------------------------- output


def _title(col: str) -> str:
    c = next(c for c in paper.COLUMNS if c.key == col)
    return f"{c.group} {c.title}"


def _acc(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def _spd(x: float | None, pooled: bool = False) -> str:
    return "" if x is None else f"{x:.2f}x" + (POOLED_MARK if pooled else "")


def _signed(x: float | None) -> str:
    return "" if x is None else f"{x:+.2f}"


def format_markdown(table: Table1) -> str:
    """Table 1's layout: per method a paper line and, where runs fill it, ours and the
    difference (ours - paper: accuracy in points, speedup as a factor)."""
    head = ["Method", ""]
    for c in paper.COLUMNS:
        head += [f"{c.group} {c.title} Acc.", "Spd."]
    head += ["Avg. Acc.", "Spd."]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    blank = [""] * (len(head) - 1)
    section = object()
    for row in table.rows:
        if row.paper.backbone != section:
            section = row.paper.backbone
            if row.paper.backbone in paper.BACKBONE_TITLES:
                title = paper.BACKBONE_TITLES[row.paper.backbone]
                lines.append("| " + " | ".join([f"**{title}**", *blank]) + " |")
        p = row.paper
        published = _interleave([_acc(a) for a in p.accuracy], [_spd(x) for x in p.speedup])
        lines.append(_line(p.label, "paper", published, _acc(p.avg_accuracy), _spd(p.avg_speedup)))
        if not row.has_ours:
            continue
        ours = _interleave(
            [_acc(c.ours_accuracy) for c in row.cells],
            [_spd(c.ours_speedup, c.pooled_speedup) for c in row.cells],
        )
        lines.append(
            _line("", "ours", ours, _acc(row.ours_avg_accuracy), _spd(row.ours_avg_speedup))
        )
        diffs = _interleave(
            [_signed(c.diff_accuracy) for c in row.cells],
            [_signed(c.diff_speedup) for c in row.cells],
        )
        avg_acc = _signed(_diff(row.ours_avg_accuracy, p.avg_accuracy))
        avg_spd = _signed(_diff(row.ours_avg_speedup, p.avg_speedup))
        lines.append(_line("", "diff", diffs, avg_acc, avg_spd))
    notes = [
        "",
        f"Paper: {paper.SOURCE}.",
        "Accuracy in percent; speedup = the agent-only run's seconds per query / this run's "
        "(speceyes report); diff = ours - paper.",
    ]
    if table.schedules:
        # The speedup's denominator: serial agent loops are the released code's (Table 1's);
        # batched or pipelined ones make agent-only faster and every speedup smaller.
        notes.append(
            f"Agent-loop schedule of these runs: {', '.join(table.schedules)} (serial: one loop at a "
            "time, as the released code and Table 1; batched/pipelined: a faster agent-only "
            "baseline, so smaller speedups)."
        )
    if any(c.pooled_speedup and c.ours_speedup is not None for r in table.rows for c in r.cells):
        notes.append(
            f"{POOLED_MARK} one run over several splits: its one speedup fills each of them."
        )
    notes += [f"- {n}" for n in table.notes]
    return "\n".join(lines + notes) + "\n"


def _interleave(accuracy: list[str], speedup: list[str]) -> list[str]:
    """Acc., Spd. cell texts, column by column."""
    return [x for pair in zip(accuracy, speedup, strict=True) for x in pair]


def _line(label: str, kind: str, cells: list[str], avg_acc: str, avg_spd: str) -> str:
    return "| " + " | ".join([label, kind, *cells, avg_acc, avg_spd]) + " |"


def _row_dict(row: TableRow) -> dict[str, Any]:
    p = row.paper
    cells = []
    for c in row.cells:
        d = asdict(c)
        d["diff_accuracy"], d["diff_speedup"] = c.diff_accuracy, c.diff_speedup
        cells.append(d)
    return {
        "label": p.label,
        "backbone": p.backbone,
        "method": p.method,
        "agg": p.agg,
        "cells": cells,
        "paper_avg_accuracy": p.avg_accuracy,
        "paper_avg_speedup": p.avg_speedup,
        "ours_avg_accuracy": row.ours_avg_accuracy,
        "ours_avg_speedup": row.ours_avg_speedup,
    }
