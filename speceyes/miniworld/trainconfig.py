"""The settings of one ``speceyes miniworld train`` run, as one frozen value.

The defaults here are the command line's defaults (its parser takes them from this class), so a
config built in code and one parsed from the same flags are equal.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

from speceyes.miniworld.demo import MODELS_DIR


@dataclass(frozen=True)
class TrainConfig:
    stage: str  # "A" (vision warm-start), "B" (answers), "eval" or "bundle"
    out: Path | None = None  # run folder: stages A, B and eval write under out/role
    role: str = "small"  # one of tinymodel.ROLES
    minutes: float = 5.0  # wall-clock budget of a training stage (data building not counted)
    max_steps: int | None = None  # stop at this step; steps count on across --resume
    seed: int = 0
    resume: bool = False  # continue from the stage's ckpt.pt when there is one
    lr: float = 3e-4
    vision_lr_mult: float = 0.3  # stage B: the vision tower learns at lr * this
    batch: int = 16
    scenes: int = 600  # stage B: training scenes
    val_scenes: int = 60  # eval: held-out scenes
    val_n: int = 300  # stage A: held-out sprites
    object_view: int = 128  # stage A: image side (px)
    object_min: int = 10  # stage A: smallest object side (px)
    object_max: int = 80  # stage A: largest object side (px)
    sprite_limit: int | None = None  # stage A: at most N sprites per pool, spread evenly
    init_from: Path | None = None  # stage B: a ckpt.pt, or a model folder that becomes the base
    level: int = 1  # mini-world level of the training and eval scenes (1 or 2)
    small_dir: Path | None = None  # bundle: the small role's folder
    large_dir: Path | None = None  # bundle: the large role's folder
    dest: Path = MODELS_DIR  # bundle: where to write
    settings: Path | None = None  # bundle: JSON of demo settings (tau, agent)
    aux_weight: float = 0.5  # stage B: weight of the per-token auxiliary loss (0: off)
    word_align: float = 0.0  # stage B: weight of aligning object tokens to their words
    zoom_max: float = 12.0  # stage B: widest random zoom (x object side)
    zoom_crops: int = 2  # stage B: random zooms per scene
    search_cells: int = 0  # stage B: search-grid cells per depth with existence questions
    cell_near_misses: int = 0  # stage B: extra no-questions per cell about near misses
    cell_elsewhere: int = 4  # stage B: cap on no-questions per cell about objects outside it
    search_depth: int = 2  # stage B: search depths that get search-cell questions
    pack: int = 1  # stage B: questions per conversation
    deepeyes: bool = False  # large role: train DeepEyes turns too
    boxes: bool = False  # large role: train the <tool_call> box too
    direct_turns: bool = False  # large role: the middle tier's direct answer after the agent's
    # first turn (--direct-prompt agent-prefix)
    from_stage: str = "B"  # eval: which stage's checkpoint
    log_every: int = 10  # steps per log line (losses averaged over them)
    eval_every: int = 5  # stage A: evaluate every N log lines
    save_every: float = 120.0  # seconds between checkpoints
    family: str | None = None  # override the role's architecture when its base is first built
    vision_pos: str = "random"  # a fresh Qwen3-VL base's vision position grid: random or sincos
    tiny: bool = False  # a very small model (smoke tests)
    threads: int = 2  # torch CPU threads

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Every field that has a default, with it (what the parser's flags default to)."""
        return {f.name: f.default for f in fields(cls) if f.default is not MISSING}

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> TrainConfig:
        """The config of parsed command-line arguments (one attribute per field)."""
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls)})
