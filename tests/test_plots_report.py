"""Plots and the side-by-side report (speceyes.bench.plots / report)."""

import csv
import io
import json
import math

import numpy as np
import pytest
from PIL import Image

from speceyes.bench import plots, report
from speceyes.bench.runlog import load_run
from tests.tools.synthetic_run import write_synthetic_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    kw = {"k_logged": 12, "seed": 4}
    return {
        "agent": write_synthetic_run(root / "agent_run", 150, mode="agent", wall_time=10.0, **kw),
        "speceyes": write_synthetic_run(root / "spec_run", 150, mode="speceyes", wall_time=5.0, **kw),
        "both": write_synthetic_run(root / "both_run", 150, mode="both", wall_time=30.0, **kw),
    }  # fmt: skip


def _assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 10_000
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size[0] > 300 and im.size[1] > 200


# ------------------------------------------------------------------------------- KDE


def test_scott_bandwidth_and_kde_formula():
    x = np.random.default_rng(0).normal(0.5, 0.1, 400)
    h = plots.scott_bandwidth(x)
    assert h == pytest.approx(np.std(x, ddof=1) * 400 ** (-0.2))
    grid = np.linspace(-1, 2, 3001)
    dens = plots.gaussian_kde(x, grid, chunk=64)
    assert np.sum(dens) * (grid[1] - grid[0]) == pytest.approx(1.0, abs=1e-6)
    at = 0.55
    ref = np.mean(np.exp(-0.5 * ((at - x) / h) ** 2)) / (h * math.sqrt(2 * math.pi))
    assert plots.gaussian_kde(x, np.array([at]))[0] == pytest.approx(ref, rel=1e-12)


def test_kde_degenerate_inputs():
    grid = np.linspace(0, 1, 101)
    assert not plots.gaussian_kde(np.array([]), grid).any()
    spike = plots.gaussian_kde(np.array([0.5, 0.5, 0.5]), grid)
    assert np.isfinite(spike).all() and spike.argmax() == 50
    assert math.isnan(plots.scott_bandwidth(np.array([1.0])))


# ------------------------------------------------------------------------------- plots


def test_write_run_plots_both(runs, tmp_path):
    paths = plots.write_run_plots(runs["both"])
    assert [p.name for p in paths] == ["confidence_kde.png", "acceptance.png", "pareto.png"]
    assert all(p.parent == runs["both"] / "plots" for p in paths)
    for p in paths:
        _assert_png(p)


def test_plots_only_what_the_data_supports(runs, tmp_path):
    notes: list[str] = []
    paths = plots.write_run_plots(runs["speceyes"], tmp_path / "spec", notes)
    assert [p.name for p in paths] == ["confidence_kde.png", "acceptance.png"]
    assert len(notes) == 1 and "Pareto" in notes[0] and "without an agent answer" in notes[0]
    notes.clear()
    assert plots.write_run_plots(runs["agent"], tmp_path / "agent", notes) == []
    assert len(notes) == 3


# ------------------------------------------------------------------------------- report


def test_report_table_and_speedup(runs):
    md, csv_text = report.report([runs["agent"], runs["speceyes"], runs["both"]])
    assert "| agent_run (agent) |" in md and "| spec_run (speceyes) |" in md
    assert "| both_run (both) |" in md
    spec_line = next(line for line in md.splitlines() if line.startswith("| spec_run"))
    assert "2.00x" in spec_line  # agent 10 s vs speceyes 5 s for the same n
    agent_line = next(line for line in md.splitlines() if line.startswith("| agent_run"))
    assert "1.00x" in agent_line and "0.067" in agent_line  # 10 s / 150 queries
    rows = {r["run"]: r for r in csv.DictReader(io.StringIO(csv_text))}
    spec = rows["spec_run (speceyes)"]
    assert float(spec["speedup"]) == pytest.approx(2.0) and spec["speedup_source"] == "measured"
    results = json.loads((runs["speceyes"] / "results.json").read_text())
    assert float(spec["acc_overall"]) == pytest.approx(results["metrics"]["overall"], abs=1e-6)
    assert float(spec["beta"]) == pytest.approx(results["beta"], abs=1e-6)
    both = rows["both_run (both)"]
    assert float(both["speedup"]) == pytest.approx(10.0 / 30.0, rel=1e-5)
    assert float(both["replay_speedup"]) > 1.0  # the estimate of what gating would save
    assert set(rows["agent_run (agent)"]) >= {"acc_direct_attributes", "acc_relative_position"}


def test_report_without_agent_run_estimates(runs, tmp_path):
    md, csv_text = report.report([runs["speceyes"], runs["both"]])
    rows = {r["run"]: r for r in csv.DictReader(io.StringIO(csv_text))}
    assert rows["spec_run (speceyes)"]["speedup_source"] == "estimated (logged agent times)"
    assert rows["both_run (both)"]["speedup_source"] == "estimated (replay)"
    assert "~" in md and "estimates" in md
    # A small-only run has no agent timings at all: blank speedup.
    small = write_synthetic_run(tmp_path / "small_run", 50, mode="small", k_logged=12, seed=1)
    _, csv_small = report.report([small])
    row = next(csv.DictReader(io.StringIO(csv_small)))
    assert row["speedup"] == "" and row["beta"] == ""


def test_report_accuracy_from_samples_when_metrics_missing(tmp_path):
    d = write_synthetic_run(tmp_path / "r", 60, mode="speceyes", k_logged=12, seed=2)
    results = json.loads((d / "results.json").read_text())
    results["metrics"] = {"overall": {"accuracy": 55.0}}  # percent, in a dict
    (d / "results.json").write_text(json.dumps(results))
    run = load_run(d)
    rows = report.report_rows([run])
    assert rows[0].overall == pytest.approx(0.55)
    in_a = run.categories == "direct_attributes"
    assert rows[0].per_category["direct_attributes"] == pytest.approx(np.mean(run.correct[in_a]))
    results["metrics"] = {}
    (d / "results.json").write_text(json.dumps(results))
    row = report.report_rows([load_run(d)])[0]
    assert row.overall == pytest.approx(np.mean(run.correct))
    assert set(row.per_category) == {"direct_attributes", "relative_position"}


def test_write_report(runs, tmp_path):
    out = tmp_path / "out"
    paths = report.write_report([runs["agent"], runs["speceyes"]], out)
    assert paths[:2] == [out / "report.md", out / "report.csv"]
    md = paths[0].read_text()
    assert "2.00x" in md and "## Plots" in md and "skipped Pareto" in md
    assert "plots/spec_run_speceyes/acceptance.png" in md
    assert len(paths) == 4
    for p in paths[2:]:
        _assert_png(p)
    with pytest.raises(ValueError):
        report.report([])
