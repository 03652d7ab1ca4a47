"""The run folder (speceyes.rundir): appending, the one torn-last-line rule, atomic rewrites."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from speceyes import rundir
from speceyes.rundir import RunDir, RunDirError, ScanReport, scan_lines

A, B, C = ('{"id": "a"}', '{"id": "b", "x": [1, 2]}', '{"id": "c", "y": 3}')


def _write(run: RunDir, text: str) -> bytes:
    run.path.mkdir(parents=True, exist_ok=True)
    run.samples_file.write_bytes(text.encode())
    return text.encode()


def _ids(run: RunDir) -> list[str]:
    return [r["id"] for r in run.records()]


def test_the_torn_line_rule(tmp_path):
    run = RunDir(tmp_path)
    _write(run, f"{A}\n\n{B}\n{C[:9]}")  # killed mid-write: the last line is cut off
    assert _ids(run) == ["a", "b"]
    _write(run, f"{A}\n{B}\n{C[:9]}\n\n")  # blank lines after it do not make it a middle line
    assert _ids(run) == ["a", "b"]
    _write(run, f"{A}\n[1, 2]\n")  # not an object, last: torn as well
    assert _ids(run) == ["a"]
    _write(run, f"{A}\n{C[:9]}\n{B}\n")  # anywhere else: corruption, named
    with pytest.raises(RunDirError, match=r"samples.jsonl:2: corrupt JSON line"):
        run.records()
    assert RunDir(tmp_path / "none").records() == []


def test_lenient_scan_reports_corrupt_and_torn_lines(tmp_path):
    lines = enumerate(f"{A}\nnope\n{B}\n\n{C[:5]}".encode().split(b"\n"), 1)
    report = ScanReport()
    got = list(scan_lines(lines, tmp_path / "s.jsonl", strict=False, report=report))
    assert [(n, r["id"]) for n, r in got] == [(1, "a"), (3, "b")]
    assert report.corrupt == [2] and report.torn is not None and report.torn[0] == 5


def test_repair_drops_only_the_torn_line(tmp_path):
    run = RunDir(tmp_path)
    _write(run, f"{A}\n{B}\n{C[:9]}")
    assert run.repair()
    assert run.samples_file.read_text() == f"{A}\n{B}\n"  # the kept bytes are the same bytes
    assert not run.repair()  # clean now: nothing to do
    _write(run, f"{A}\n{B}")  # complete, only the newline missing: kept, newline added
    assert run.repair() and run.samples_file.read_text() == f"{A}\n{B}\n"
    _write(run, "")
    assert not run.repair()
    assert not RunDir(tmp_path / "none").repair()
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_a_failed_rewrite_leaves_the_original_whole(tmp_path, monkeypatch, failing):
    run = RunDir(tmp_path)
    original = _write(run, f"{A}\n{B}\n{C[:9]}")

    def crash(*args, **kwargs):
        raise OSError("disk gone")

    monkeypatch.setattr(rundir.os, failing, crash)  # the write stops half way through
    with pytest.raises(OSError, match="disk gone"):
        run.repair()
    assert run.samples_file.read_bytes() == original
    with pytest.raises(OSError, match="disk gone"):
        run.rewrite([{"id": "a"}])
    assert run.samples_file.read_bytes() == original
    assert not list(tmp_path.glob("*.tmp"))  # no half-written file left beside it
    monkeypatch.undo()
    run.rewrite([{"id": "z"}])
    assert _ids(run) == ["z"]


@pytest.mark.parametrize("step", ["fsync", "replace"])
def test_a_kill_during_the_rewrite_leaves_the_original_whole(tmp_path, step):
    """The process dies (SIGKILL, no cleanup) at a step of the rewrite after a torn line."""
    run = RunDir(tmp_path)
    original = _write(run, "".join(json.dumps({"id": str(i), "pad": "x" * 500}) + "\n"
                                   for i in range(2000)) + C[:9])  # fmt: skip
    code = (
        "import os, signal, sys; from speceyes import rundir\n"
        f"setattr(rundir.os, {step!r}, lambda *a: os.kill(os.getpid(), signal.SIGKILL))\n"
        "rundir.RunDir(sys.argv[1]).repair()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=os.environ)
    assert proc.returncode == -9  # killed, not finished
    assert run.samples_file.read_bytes() == original
    assert len(run.records()) == 2000
    run.repair()  # the next resume repairs it over the stale temporary file
    assert run.samples_file.read_bytes() == original[: original.rindex(b"\n") + 1]
    assert not list(tmp_path.glob("*.tmp"))


def test_appended_lines_are_readable_before_close(tmp_path):
    run = RunDir(tmp_path)
    with run.writer() as log:
        log.append({"id": "a", "x": np.float32(0.5), "v": np.arange(2), "p": Path("/x")})
        # Flushed per line: another process (a viewer, a kill) sees it at once.
        assert json.loads(run.samples_file.read_text()) == {
            "id": "a", "x": 0.5, "v": [0, 1], "p": "/x"
        }  # fmt: skip
        log.append({"id": "b"})
    assert _ids(run) == ["a", "b"]
    with pytest.raises(TypeError, match="not JSON serialisable: object"), run.writer() as log:
        log.append({"id": "c", "bad": object()})


def test_json_files(tmp_path):
    run = RunDir(tmp_path)
    assert not run.holds_run() and run.read_state() is None
    with pytest.raises(FileNotFoundError, match="results.json is missing"):
        run.read_results()
    run.write_state({"config": {"tau": 0.5}, "segments": []})
    assert run.holds_run() and run.read_state() == {"config": {"tau": 0.5}, "segments": []}
    run.results_file.write_text("{not json")
    with pytest.raises(RunDirError, match="results.json: not valid JSON"):
        run.read_results()
    run.results_file.write_text("[1]")
    with pytest.raises(RunDirError, match="expected a JSON object, got list"):
        run.read_results()
    run.write_results({"n": 2})
    assert run.read_results() == {"n": 2}


def test_no_numpy():
    code = "import sys, speceyes.rundir; sys.exit('numpy' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], env=os.environ).returncode == 0
