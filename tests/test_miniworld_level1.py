"""Level 1 of the mini-world: one target among pastel clutter, and the demo's checks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from speceyes.miniworld.level1 import (
    LEVEL1_CANVAS,
    generate_level1_scene,
    level1_rng,
    level1_sides,
)
from speceyes.miniworld.splits import make_split
from speceyes.miniworld.sprites import COLORS, PALETTE, SHAPES, load_pool
from speceyes.miniworld.targets import (
    accuracy_vs_tau,
    auroc,
    check_targets,
    gate_auroc,
    judge_routing,
)


@pytest.fixture(scope="module")
def pool():
    return load_pool("test")


@pytest.mark.parametrize("regime", ["small", "large"])
def test_scene_has_one_target_and_questions_true_by_construction(pool, regime):
    for i in range(6):
        scene = generate_level1_scene(level1_rng("test", 0, i), pool, regime=regime)
        (obj,) = scene.objects
        lo, hi = level1_sides(LEVEL1_CANVAS)[regime]
        assert lo - 1 <= obj.side <= hi + 1 and obj.size == regime
        # The target's pixels carry its palette colour; the clutter never does.
        arr = np.asarray(scene.image).astype(int)
        x1, y1, x2, y2 = obj.bbox
        patch = arr[y1:y2, x1:x2].reshape(-1, 3)
        assert (np.abs(patch - np.array(PALETTE[obj.color])).max(1) <= 2).sum() >= 10
        mask = np.ones(arr.shape[:2], bool)
        mask[max(0, y1 - 2) : y2 + 2, max(0, x1 - 2) : x2 + 2] = False
        if obj.color not in ("gray",):  # a pastel blob never matches a saturated colour
            hits = (np.abs(arr[mask] - np.array(PALETTE[obj.color])).max(1) <= 30).sum()
            assert hits == 0
        cats = [q.category for q in scene.questions]
        assert cats.count("attribute") == 2 and len(scene.questions) == 8
        for q in scene.questions:
            if q.options is not None:
                picked = q.options["ABCDEFGHIJ".index(q.answer)]
                assert picked in (obj.color, obj.shape)
                assert set(q.options) <= set(COLORS) | set(SHAPES)
            else:
                pair = q.question.removeprefix("Is there a ").removesuffix(" in the image?")
                c, s = pair.split()
                assert q.answer == ("yes" if (c, s) == (obj.color, obj.shape) else "no")


def test_scenes_are_deterministic_and_differ_by_index(pool):
    a = generate_level1_scene(level1_rng("test", 3, 1), pool, regime="small")
    b = generate_level1_scene(level1_rng("test", 3, 1), pool, regime="small")
    c = generate_level1_scene(level1_rng("test", 3, 2), pool, regime="small")
    assert a.image.tobytes() == b.image.tobytes() and a.objects == b.objects
    assert a.image.tobytes() != c.image.tobytes()


def test_small_targets_are_dots_in_the_view_and_readable_after_a_depth_three_search_cell():
    from speceyes.agents.search import grid_boxes
    from speceyes.images import smart_resize

    vh, vw = smart_resize(*LEVEL1_CANVAS, factor=28, min_pixels=4 * 28 * 28, max_pixels=224 * 224)
    scale = vw / LEVEL1_CANVAS[0]
    lo, hi = level1_sides(LEVEL1_CANVAS)["small"]
    assert hi * scale < 5  # a few view pixels: shape unreadable
    cell = (0, 0, *LEVEL1_CANVAS)
    for _ in range(3):
        cells = grid_boxes(cell, 3, 0.25)
        cell = cells[0]
    assert lo * 224 / (cell[2] - cell[0]) >= 40  # a depth-3 cell shown at the view: readable
    # Neighbouring depth-3 cells overlap by more than a small target's side, so some cell
    # always holds it whole.
    assert cells[0][2] - cells[1][0] >= hi
    lo_l, _ = level1_sides(LEVEL1_CANVAS)["large"]
    assert lo_l * scale >= 40


def test_make_split_level1_writes_its_manifest(tmp_path):
    man = make_split(tmp_path, "test", 2, seed=0, canvas=LEVEL1_CANVAS, clutter=1, level=1)
    assert man["level"] == 1 and man["generator"].startswith("miniworld-level1")
    rows = [json.loads(x) for x in (tmp_path / "questions.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and all(len(r["objects"]) == 1 for r in rows)
    assert {r["target_size"] for r in rows} == {"small", "large"}
    with pytest.raises(ValueError, match="level"):
        make_split(tmp_path / "x", "test", 1, level=3)


def test_auroc_matches_the_pairwise_definition():
    rng = np.random.default_rng(0)
    s = rng.normal(size=40).round(1)  # ties included
    y = rng.random(40) < 0.5
    pos, neg = s[y], s[~y]
    pairs = [(p > n) + 0.5 * (p == n) for p in pos for n in neg]
    assert auroc(s, y) == pytest.approx(np.mean(pairs))
    assert auroc([0.1, 0.9], [False, True]) == 1.0
    assert auroc([0.3, 0.3], [True, True]) is None


def _rec(i, size, judge_tool, conf, small_ok, correct=True):
    return {
        "id": f"q{i}",
        "meta": {"target_size": size},
        "judge_tool": judge_tool,
        "confidence": conf,
        "small_correct": small_ok,
        "correct": correct,
    }


def test_routing_auroc_and_replayed_tau_curve():
    spec = [
        _rec(0, "small", True, None, None),
        _rec(1, "small", False, 0.95, False),
        _rec(2, "large", False, 0.99, True),
        _rec(3, "large", False, 0.5, True),
    ]
    agent = [_rec(i, "x", None, None, None, correct=(i != 2)) for i in range(4)]
    r = judge_routing(spec)
    assert r["small"] == {"n": 2, "to_agent": 1, "share_to_agent": 0.5}
    assert r["large"]["share_to_agent"] == 0.0
    g = gate_auroc(spec)
    assert g["n"] == 3 and g["auroc"] == pytest.approx(0.5)
    curve = accuracy_vs_tau(spec, agent, np.array([0.4, 0.9, 0.98, 0.999]))
    # tau 0.4: q1 (wrong), q2, q3 by the small model; q0 by the agent (right) -> 3/4
    # tau 0.9: q1 wrong, q2 right, q3 -> agent right, q0 agent right -> 3/4
    # tau 0.98: q1 -> agent right, q2 small right -> 4/4; tau 0.999: q2 -> agent wrong -> 3/4
    assert curve["accuracy"] == [0.75, 0.75, 1.0, 0.75]
    assert curve["small_share"] == [0.75, 0.5, 0.25, 0.0]


def test_targets_report_met_and_missed():
    cell = {"accuracy": 0.9, "speedup": 3.5, "share_of_analytic": 0.95}
    summary = {
        "rows": {
            "small-targets": {"agent": {"accuracy": 0.85}, "small": {"accuracy": 0.5}},
            "large-targets": {"small": {"accuracy": 0.9}, "speceyes": cell},
            "all": {
                "agent": {"accuracy": 0.86},
                "small": {"accuracy": 0.7},
                "speceyes": {**cell, "accuracy": 0.84, "speedup": 1.5},
            },
        },
        "gate_auroc": {"auroc": 0.79},
        "judge_routing": {
            "small": {"share_to_agent": 0.95},
            "large": {"share_to_agent": 0.1},
        },
    }
    got = {t["target"]: t["met"] for t in check_targets(summary)}
    assert got["small-only on large targets >= 0.85"] is True
    assert got["agent-only - small-only on small targets >= +0.30"] is True
    assert got["SpecEyes - agent-only, all questions >= -0.01"] is False  # -0.02
    assert got["speedup over all questions >= 1.6x"] is False
    assert got["gate AUROC on the small model's answers >= 0.80"] is False
    assert got["judge: large-target questions to the small model >= 80%"] is True
