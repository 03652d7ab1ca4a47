"""Smoke test of the mini-world training stages: a few steps each on a very small config.

Never the real training: it checks that every stage runs, its loss is finite, a checkpoint is
saved and resumed (the step count goes on), and the export loads through HFBackend.
"""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("easy_vqa")

from speceyes.miniworld import train as T  # noqa: E402


def _log(role_dir):
    return [json.loads(line) for line in (role_dir / "log.jsonl").read_text().splitlines()]


def _run(out, *extra):
    common = [
        "--out",
        str(out),
        "--tiny",
        "--batch",
        "2",
        "--log-every",
        "1",
        "--eval-every",
        "1",
        "--seed",
        "0",
        "--threads",
        "1",
    ]
    assert T.main([*common, *extra]) == 0


def test_stages_run_save_and_resume(tmp_path):
    small = tmp_path / "small"
    a = ["--stage", "A", "--object-view", "64", "--val-n", "4", "--sprite-limit", "24"]
    _run(tmp_path, *a, "--max-steps", "2")
    assert T.load_ckpt(small / "stage_A" / "ckpt.pt")["step"] == 2
    _run(tmp_path, *a, "--max-steps", "3", "--resume")
    log = _log(small)
    steps = [r for r in log if r.get("stage") == "A" and "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in steps)
    assert any(r.get("event") == "resume" and r["step"] == 2 for r in log)
    assert 0.0 <= steps[-1]["val_shape"] <= 1.0

    _run(tmp_path, "--stage", "B", "--scenes", "1", "--max-steps", "2")
    log = _log(small)
    assert any(r.get("event") == "init_from" for r in log)  # B starts from A's weights
    b = [r for r in log if r.get("stage") == "B" and "loss" in r]
    assert len(b) == 2 and all(math.isfinite(r["loss"]) for r in b)
    assert T.load_ckpt(small / "stage_B" / "ckpt.pt")["step"] == 2

    # The export is a real checkpoint folder: HFBackend loads it and answers.
    dest = T.export(small, "B", tmp_path / "export")
    be = T.load_backend(dest)
    assert be.family == "qwen3_vl" and be.max_pixels == T.VIEW_PIXELS["small"]


def test_large_role_trains_judge_and_zoom_turns(tmp_path):
    _run(
        tmp_path, "--role", "large", "--stage", "B", "--scenes", "2", "--max-steps", "1", "--boxes"
    )
    log = _log(tmp_path / "large")
    data = next(r for r in log if r.get("event") == "data")
    # Per question: a judge example, plus the answer turn(s); small targets add a tool call.
    assert data["examples"] > data["questions"] * 2
    rec = next(r for r in log if r.get("stage") == "B" and "loss" in r)
    assert math.isfinite(rec["loss"])


def test_answer_labels_cover_only_the_answer(tmp_path):
    base = T.build_base(tmp_path, "small", T.TINY, 0)
    be = T.load_backend(base)
    rows = T.make_questions("train", 0, 1, be, crops=False)
    pairs = [p for r in rows[:2] for p in T.examples_for(r, "small", False)]
    inputs = T.batch_inputs(be, pairs)
    for b, (_, ans) in enumerate(pairs):
        lab = [t for t in inputs["labels"][b].tolist() if t != -100]
        assert be.tokenizer.decode(lab) == ans + "<|im_end|>"
