"""The mini-world's shared training loop and checkpoint, with trivial step functions, and the
training config against the command line's parser."""

from __future__ import annotations

import json
import math
from dataclasses import FrozenInstanceError, fields
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from speceyes.miniworld.loop import Checkpoint, run_loop
from speceyes.miniworld.tinymodel import load_ckpt
from speceyes.miniworld.train import build_parser
from speceyes.miniworld.trainconfig import TrainConfig


def _log(role_dir: Path) -> list[dict]:
    path = role_dir / "log.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _ckpt(role_dir: Path, **modules) -> Checkpoint:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return Checkpoint(role_dir / "stage_X" / "ckpt.pt", SimpleNamespace(model=model), opt, modules)


def _counting(values):
    """A step function returning ``values[k]`` on its k-th call, and the list of its calls."""
    calls: list[int] = []

    def step_fn():
        calls.append(len(calls) + 1)
        return values[len(calls) - 1]

    return step_fn, calls


def test_max_steps_stops_the_loop_logs_averages_and_saves_at_the_end(tmp_path):
    cfg = TrainConfig(stage="X", max_steps=5, log_every=2, minutes=5.0, save_every=1e9)
    step_fn, calls = _counting([{"loss": float(k), "aux": None} for k in range(1, 10)])
    ck = _ckpt(tmp_path)
    rec = run_loop(cfg, tmp_path, "X", ck, step_fn)
    assert calls == [1, 2, 3, 4, 5]
    assert rec["event"] == "end" and rec["step"] == 5
    lines = [r for r in _log(tmp_path) if "loss" in r]
    assert [(r["step"], r["loss"], r["aux"]) for r in lines] == [(2, 1.5, None), (4, 3.5, None)]
    assert list(lines[0]) == ["time", "stage", "step", "loss", "aux", "seconds"]
    assert _log(tmp_path)[-1] == {**rec, "time": _log(tmp_path)[-1]["time"]}
    saved = load_ckpt(ck.path)
    assert saved["step"] == 5 and saved["head"] is None and "seconds" in saved
    assert ck.backend.model.training


def test_resumed_loop_counts_on_from_its_step(tmp_path):
    cfg = TrainConfig(stage="X", max_steps=5, log_every=1)
    step_fn, calls = _counting([{"loss": 1.0}] * 5)
    rec = run_loop(cfg, tmp_path, "X", _ckpt(tmp_path), step_fn, step=3, seconds=100.0)
    assert calls == [1, 2] and rec["step"] == 5
    assert [r["step"] for r in _log(tmp_path) if "loss" in r] == [4, 5]
    assert rec["seconds"] >= 100.0  # earlier training time carries over


def test_a_loss_missing_on_some_steps_averages_over_those_that_have_it(tmp_path):
    cfg = TrainConfig(stage="X", max_steps=3, log_every=3)
    values = [{"loss": 1.0, "aux": 2.0}, {"loss": 2.0, "aux": None}, {"loss": 3.0, "aux": 4.0}]
    run_loop(cfg, tmp_path, "X", _ckpt(tmp_path), _counting(values)[0])
    (line,) = [r for r in _log(tmp_path) if "loss" in r]
    assert line["loss"] == 2.0 and line["aux"] == 3.0


def test_a_non_finite_loss_raises_with_its_step(tmp_path):
    cfg = TrainConfig(stage="X", max_steps=10, log_every=100)
    step_fn, calls = _counting([{"loss": 1.0}, {"loss": 0.5}, {"loss": math.nan}, {"loss": 1.0}])
    ck = _ckpt(tmp_path)
    with pytest.raises(RuntimeError, match="loss is nan at step 3"):
        run_loop(cfg, tmp_path, "X", ck, step_fn, step=0)
    assert calls == [1, 2, 3]
    assert not any(r.get("event") == "end" for r in _log(tmp_path))
    assert not ck.path.exists()  # no end checkpoint of a diverged model


def test_checkpoints_every_save_every_seconds(tmp_path):
    cfg = TrainConfig(stage="X", max_steps=4, log_every=100, save_every=0.0)
    ck = _ckpt(tmp_path)
    seen: list[int | None] = []

    def step_fn():
        seen.append(load_ckpt(ck.path)["step"] if ck.path.exists() else None)
        return {"loss": 1.0}

    run_loop(cfg, tmp_path, "X", ck, step_fn)
    assert seen == [None, 1, 2, 3]  # each step finds the previous one saved
    assert load_ckpt(ck.path)["step"] == 4


def test_deadline_and_hooks(tmp_path):
    # minutes=0: no step at all, but still the end hook, a checkpoint and the end record.
    cfg = TrainConfig(stage="X", minutes=0.0)
    ck = _ckpt(tmp_path)
    ends: list[bool] = []

    def on_end():
        ends.append(ck.path.exists())
        return {"val": 0.5}

    rec = run_loop(cfg, tmp_path, "X", ck, _counting([])[0], on_end=on_end)
    assert ends == [False]  # the end evaluation comes before the last checkpoint
    assert rec["step"] == 0 and rec["val"] == 0.5 and load_ckpt(ck.path)["step"] == 0

    # on_log's fields (stage A's evaluations) go after the losses, on the lines it returns them.
    b = tmp_path / "b"
    b.mkdir()
    cfg = TrainConfig(stage="X", max_steps=4, log_every=2)
    step_fn = _counting([{"loss": 1.0}] * 4)[0]
    run_loop(cfg, b, "X", _ckpt(b), step_fn, on_log=lambda s: {"val": s} if s == 4 else {})
    lines = [r for r in _log(b) if "loss" in r]
    assert [r.get("val") for r in lines] == [None, 4]
    assert list(lines[1])[-2:] == ["seconds", "val"]


def test_checkpoint_saves_and_restores_its_modules(tmp_path):
    torch.manual_seed(1)
    ck = _ckpt(tmp_path, head=torch.nn.Linear(2, 2), aux=torch.nn.Linear(2, 3))
    ck.save(7, 12.5)
    saved = load_ckpt(ck.path)
    assert set(saved) == {"model", "head", "opt", "step", "rng", "seconds", "aux"}
    assert saved["step"] == 7 and saved["seconds"] == 12.5

    other = _ckpt(tmp_path, head=torch.nn.Linear(2, 2), aux=torch.nn.Linear(2, 3))
    assert other.seed_or_resume(0, False, tmp_path, "X") == (0, 0.0, False)
    assert other.seed_or_resume(0, True, tmp_path, "X") == (7, 12.5, True)
    for name in ("head", "aux"):
        for k, v in ck.modules[name].state_dict().items():
            assert torch.equal(other.modules[name].state_dict()[k], v)
    for k, v in ck.backend.model.state_dict().items():
        assert torch.equal(other.backend.model.state_dict()[k], v)
    assert _log(tmp_path)[-1]["event"] == "resume" and _log(tmp_path)[-1]["step"] == 7


def test_config_defaults_are_the_command_lines():
    ns = build_parser().parse_args(["--stage", "B"])
    assert TrainConfig.from_args(ns) == TrainConfig(stage="B")
    assert set(vars(ns)) == {f.name for f in fields(TrainConfig)}
    cfg = TrainConfig.from_args(build_parser().parse_args(["--stage", "A", "--max-steps", "3"]))
    assert cfg.max_steps == 3 and cfg.minutes == 5.0 and cfg.lr == 3e-4 and cfg.threads == 2
    with pytest.raises(FrozenInstanceError):
        cfg.max_steps = 4  # type: ignore[misc]
