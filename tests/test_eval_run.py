"""`speceyes eval` as a user runs it: a V*-layout folder, a real kill, a resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from speceyes.cli import main
from speceyes.rundir import RunDir, RunDirError
from tests.conftest import make_scene

N_PER_CAT = 4


@pytest.fixture(scope="module")
def vstar(tmp_path_factory):
    root = tmp_path_factory.mktemp("vstar")
    colors = {"red": (220, 30, 30), "blue": (30, 30, 220)}
    for cat in ("direct_attributes", "relative_position"):
        (root / cat).mkdir()
        for i in range(N_PER_CAT):
            name = list(colors)[i % 2]
            make_scene(box=(30 + 20 * i, 40, 120 + 20 * i, 130), color=colors[name]).save(
                root / cat / f"img{i}.jpg"
            )
            other = [c for c in colors if c != name]
            meta = {
                "question": "What color is the square?",
                "options": [name, *other],
                "target_object": "square",
                "bbox": [30, 40, 90, 90],
            }
            (root / cat / f"img{i}.json").write_text(json.dumps(meta))
    return root


def _args(tiny_dirs, vstar, out, *extra):
    return [
        "eval",
        "--bench",
        "vstar",
        "--data",
        str(vstar),
        "--output",
        str(out),
        "--small",
        str(tiny_dirs["qwen3_vl"]),
        "--large",
        str(tiny_dirs["qwen2_5_vl"]),
        "--mode",
        "both",
        "--tau",
        "0.5",
        "--batch-size",
        "2",
        "--agent-max-tokens",
        "12",
        "--no-progress",
        *extra,
    ]


def _comparable(records):
    keys = ("id", "route", "prediction", "correct", "small_answer", "agent_answer", "tool_calls")
    return sorted(tuple(r[k] for k in keys) for r in records)


def test_eval_writes_samples_results_and_plots(tiny_dirs, vstar, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_args(tiny_dirs, vstar, out)) == 0
    records = RunDir(out).records()
    assert len(records) == 2 * N_PER_CAT and len({r["id"] for r in records}) == len(records)
    r0 = records[0]
    assert r0["small_topk"] and len(r0["small_topk"][0]) == 64
    assert r0["agent_answer"] is not None and r0["small_correct"] is not None
    res = json.loads((out / "results.json").read_text())
    assert res["n"] == 2 * N_PER_CAT and res["config"]["mode"] == "both"
    assert set(res["metrics"]["per_category"]) == {"direct_attributes", "relative_position"}
    assert res["beta"] is not None and res["qps"] > 0
    assert res["versions"]["transformers"]
    # A second run into the same folder without --resume refuses, losing nothing.
    assert main(_args(tiny_dirs, vstar, out)) == 2
    assert "--resume" in capsys.readouterr().err
    assert len(RunDir(out).records()) == 2 * N_PER_CAT


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_results(tiny_dirs, vstar, tmp_path):
    full = tmp_path / "full"
    assert main(_args(tiny_dirs, vstar, full)) == 0

    killed = tmp_path / "killed"
    cmd = [sys.executable, "-m", "speceyes", *_args(tiny_dirs, vstar, killed)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    samples = killed / "samples.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if samples.exists() and samples.read_bytes().count(b"\n") >= 2:
            break
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    partial = RunDir(killed).records()
    assert 2 <= len(partial) < 2 * N_PER_CAT, "the kill should land mid-run"
    assert not (killed / "results.json").exists()

    assert main(_args(tiny_dirs, vstar, killed, "--resume")) == 0
    resumed = RunDir(killed).records()
    assert len(resumed) == 2 * N_PER_CAT
    assert _comparable(resumed) == _comparable(RunDir(full).records())
    res = json.loads((killed / "results.json").read_text())
    assert len(res["segments"]) == 2 and res["n"] == 2 * N_PER_CAT


def test_resume_refuses_a_different_configuration(tiny_dirs, vstar, tmp_path):
    out = tmp_path / "run"
    assert main(_args(tiny_dirs, vstar, out, "--limit", "2")) == 0
    with pytest.raises(RunDirError, match="tau"):
        from speceyes.cli import build_parser
        from speceyes.cli.eval import run as cmd_eval

        cmd_eval(
            build_parser().parse_args(
                _args(tiny_dirs, vstar, out, "--limit", "2", "--resume", "--tau", "0.9")
            )
        )


def test_torn_last_line_is_dropped(tmp_path):
    p = tmp_path / "samples.jsonl"
    p.write_text('{"id": "a"}\n{"id": "b"}\n{"id": "c", "rou')
    assert [r["id"] for r in RunDir(tmp_path).records()] == ["a", "b"]
    p.write_text('{"id": "a"}\nnot json\n{"id": "b"}\n')
    with pytest.raises(RunDirError, match=r"samples.jsonl:2: corrupt JSON line"):
        RunDir(tmp_path).records()


def test_missing_data_is_a_clear_error(tiny_dirs, tmp_path, capsys):
    assert main(_args(tiny_dirs, tmp_path / "nope", tmp_path / "o")) == 2
    assert "nope" in capsys.readouterr().err
    assert not Path(tmp_path / "o").exists()


def test_report_regate_calibrate_on_a_real_run(tiny_dirs, vstar, tmp_path, capsys):
    run = tmp_path / "both"
    assert main(_args(tiny_dirs, vstar, run)) == 0
    assert (run / "plots" / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    assert main(["regate", str(run), "--tau", "0.5", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)[0]
    logged = RunDir(run).records()
    # Replaying the run's own tau reproduces its routing decisions.
    assert row["small_share"] == pytest.approx(sum(r["route"] == "small" for r in logged) / len(logged))
    # 8 queries are too few for any tau to pass: calibrate says so and exits 1.
    assert main(["calibrate", str(run), "--max-error", "0.2", "--output", str(tmp_path / "cal.json")]) == 1
    cal = json.loads((tmp_path / "cal.json").read_text())
    assert cal["method"].startswith("ltt") and not cal["passed"]
    assert main(["report", str(run), "--output", str(tmp_path / "rep")]) == 0
    assert "both" in (tmp_path / "rep" / "report.md").read_text()
    out2 = tmp_path / "calibrated"
    args = _args(tiny_dirs, vstar, out2, "--limit", "2", "--calibration", str(tmp_path / "cal.json"))
    args[args.index("--tau") : args.index("--tau") + 2] = []
    capsys.readouterr()
    assert main(args) == 2 and "accepts nothing" in capsys.readouterr().err  # refused
    # A passing file made for these models is applied.
    (tmp_path / "cal.json").write_text(json.dumps(cal | {"passed": True, "tau": 0.5}))
    assert main(args) == 0
    cal_tau = json.loads((tmp_path / "cal.json").read_text())["tau"]
    assert json.loads((out2 / "results.json").read_text())["config"]["tau"] == cal_tau
