"""Table 1 of the SpecEyes paper (arXiv 2603.23483), as published: the numbers ``speceyes
table1`` sets a reproduction beside.

Source: github.com/MAC-AutoML/SpecEyes at commit 90d950f, ``figures/result.png`` (the table as
an image; there is no text copy in the repository), read cell by cell. The agent-only and
SpecEyes (min) rows of both backbones also appear as text in ``vis/vis_ablation_thres.py``
(lines 122-215, the "baseline" entry and the threshold each min cell was run at: DeepEyes
V* 0.98, HR-Bench 0.97, POPE 0.97; Thyme V* 0.98, HR-Bench 0.98, POPE 0.97) and agree with the
image. Every row's published Avg. equals the mean of its seven cells to the printed precision
(``tests/test_table1.py`` checks this), which guards the transcription.

Accuracy is in percent, speedup a factor over the backbone's agent-only run (1.00x in its own
row). A cell the paper leaves empty would be None; Table 1 has none.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BACKBONE_TITLES", "COLUMNS", "ROWS", "SOURCE", "Column", "PaperRow", "paper_row"]

SOURCE = (
    "SpecEyes (arXiv 2603.23483), Table 1: github.com/MAC-AutoML/SpecEyes@90d950f "
    "figures/result.png; agent-only and SpecEyes (min) rows also in vis/vis_ablation_thres.py"
)


@dataclass(frozen=True)
class Column:
    """One benchmark split of Table 1."""

    key: str
    group: str  # the header above it: V*, HR-Bench, POPE
    title: str  # its own header: Attr., 4K, Adv., ...


COLUMNS: tuple[Column, ...] = (
    Column("vstar_attr", "V*", "Attr."),
    Column("vstar_pos", "V*", "Pos."),
    Column("hr_4k", "HR-Bench", "4K"),
    Column("hr_8k", "HR-Bench", "8K"),
    Column("pope_adv", "POPE", "Adv."),
    Column("pope_pop", "POPE", "Pop."),
    Column("pope_rand", "POPE", "Rand."),
)

Cells = tuple[float | None, ...]  # one per column of COLUMNS


@dataclass(frozen=True)
class PaperRow:
    """One method row. ``backbone`` None is the draft-only row above both backbones' blocks;
    ``method`` is draft | agent | specreason | speceyes, ``agg`` the SpecEyes aggregation."""

    backbone: str | None
    method: str
    agg: str | None
    label: str
    accuracy: Cells  # per COLUMNS, percent
    speedup: Cells  # per COLUMNS
    avg_accuracy: float | None  # the paper's Avg. column (mean of the seven)
    avg_speedup: float | None

    @property
    def key(self) -> tuple[str | None, str, str | None]:
        return (self.backbone, self.method, self.agg)


def _row(
    backbone: str | None,
    method: str,
    agg: str | None,
    label: str,
    cells: list[tuple[float, float]],
    avg: tuple[float, float],
) -> PaperRow:
    acc = tuple(a for a, _ in cells)
    spd = tuple(s for _, s in cells)
    return PaperRow(backbone, method, agg, label, acc, spd, avg[0], avg[1])


_ONE = 1.00
# (accuracy, speedup) per column, in COLUMNS order, then the Avg. pair.
# fmt: off
ROWS: tuple[PaperRow, ...] = (
    _row(None, "draft", None, "Qwen3-VL-2B (draft only)",
         [(77.39, 5.44), (82.89, 5.31), (71.38, 3.20), (68.00, 2.90), (82.56, 4.20),
          (83.80, 3.78), (86.47, 4.07)], (78.93, 4.13)),
    _row("deepeyes", "agent", None, "DeepEyes",
         [(90.43, _ONE), (82.89, _ONE), (75.85, _ONE), (71.43, _ONE), (78.43, _ONE),
          (81.90, _ONE), (88.83, _ONE)], (81.39, _ONE)),
    _row("deepeyes", "specreason", None, "SpecReason",
         [(80.19, 0.61), (73.91, 0.38), (80.43, 0.44), (72.54, 0.42), (49.10, 0.38),
          (51.55, 0.38), (60.20, 0.37)], (66.85, 0.43)),
    _row("deepeyes", "speceyes", "log", "SpecEyes (log)",
         [(83.48, 2.06), (88.16, 2.05), (73.71, 1.35), (69.67, 1.28), (83.97, 1.89),
          (86.70, 1.95), (90.50, 2.05)], (82.31, 1.80)),
    _row("deepeyes", "speceyes", "mean", "SpecEyes (mean)",
         [(78.26, 2.89), (84.21, 3.35), (71.62, 1.88), (67.38, 1.77), (85.13, 2.06),
          (87.00, 2.10), (90.13, 2.14)], (80.53, 2.31)),
    _row("deepeyes", "speceyes", "bottom", "SpecEyes (bottom)",
         [(83.48, 2.13), (84.21, 2.12), (75.22, 1.20), (71.18, 1.04), (85.13, 2.08),
          (87.00, 2.08), (90.13, 2.11)], (82.34, 1.82)),
    _row("deepeyes", "speceyes", "min", "SpecEyes (min)",
         [(90.43, 1.53), (89.47, 1.90), (75.85, 1.13), (71.80, 1.08), (85.13, 2.13),
          (87.00, 2.15), (90.13, 2.19)], (84.26, 1.73)),
    _row("thyme", "agent", None, "Thyme",
         [(86.96, _ONE), (82.89, _ONE), (77.72, _ONE), (72.43, _ONE), (81.32, _ONE),
          (84.53, _ONE), (90.17, _ONE)], (82.29, _ONE)),
    _row("thyme", "specreason", None, "SpecReason",
         [(89.57, 0.48), (75.00, 0.53), (80.01, 0.52), (81.02, 0.51), (84.62, 0.46),
          (85.97, 0.43), (90.27, 0.46)], (83.78, 0.48)),
    _row("thyme", "speceyes", "log", "SpecEyes (log)",
         [(80.87, 1.82), (82.89, 1.45), (74.97, 1.13), (70.84, 1.06), (85.76, 1.68),
          (87.80, 1.67), (91.47, 1.59)], (82.09, 1.49)),
    _row("thyme", "speceyes", "mean", "SpecEyes (mean)",
         [(77.39, 2.34), (80.26, 1.83), (72.62, 1.27), (68.00, 1.21), (85.89, 1.78),
          (88.30, 1.80), (91.27, 1.65)], (80.53, 1.70)),
    _row("thyme", "speceyes", "bottom", "SpecEyes (bottom)",
         [(78.26, 2.18), (80.26, 1.84), (77.35, 1.05), (72.31, 0.99), (85.89, 1.81),
          (88.30, 1.81), (91.27, 1.73)], (81.95, 1.63)),
    _row("thyme", "speceyes", "min", "SpecEyes (min)",
         [(87.83, 1.32), (82.89, 1.42), (78.47, 1.01), (73.31, 0.95), (85.87, 1.77),
          (88.30, 1.78), (91.27, 1.70)], (83.99, 1.42)),
)
# fmt: on

BACKBONE_TITLES = {"deepeyes": "Based on DeepEyes", "thyme": "Based on Thyme"}


def paper_row(backbone: str | None, method: str, agg: str | None) -> PaperRow | None:
    """The published row for a backbone / method / aggregation (None: not in Table 1)."""
    for row in ROWS:
        if row.key == (backbone, method, agg):
            return row
    return None
