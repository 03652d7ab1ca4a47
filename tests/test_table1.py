"""`speceyes table1`: runs placed by their config, scored and timed as `speceyes report` does,
beside the paper's published Table 1 (bench/paper_table1.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from speceyes.bench import paper_table1 as paper
from speceyes.bench.table1 import Table1Error, build_table1, format_markdown
from speceyes.cli import build_parser
from speceyes.rundir import RunDir
from tests.test_shards import tiny_vstar
from tests.tools.synthetic_run import write_synthetic_run

VSTAR_CATS = ("direct_attributes", "relative_position")
POPE_SPLITS = ("adversarial", "popular", "random")


def _run(
    path: Path,
    bench: str,
    mode: str,
    *,
    agent: str = "deepeyes",
    wall: float,
    n: int = 60,
    seed: int = 0,
    agg: str = "min",
    data: str = "data",
    loader: dict | None = None,
    categories: tuple[str, ...] = ("all",),
    protocol: str = "fair",
) -> Path:
    """A synthetic run folder whose config names a Table 1 benchmark, as eval logs it."""
    synth_mode = "agent" if mode == "specreason" else mode
    write_synthetic_run(
        path, n, seed=seed, mode=synth_mode, agg=agg, categories=categories, wall_time=wall
    )
    rd = RunDir(path)
    results = rd.read_results()
    results["config"].update(
        bench=bench, mode=mode, agent=agent, data=data, loader=loader or {}, protocol=protocol
    )
    results["config"]["limit"] = None
    rd.write_results(results)
    return path


def _accuracy(path: Path, category: str | None = None) -> float:
    recs = RunDir(path).records()
    recs = [r for r in recs if category is None or r["category"] == category]
    return 100.0 * float(np.mean([r["correct"] for r in recs]))


def _cells(table, label: str, backbone: str | None) -> dict:
    row = next(r for r in table.rows if r.paper.label == label and r.paper.backbone == backbone)
    return {c.column: c for c in row.cells}, row


@pytest.fixture
def deepeyes_block(tmp_path):
    """Agent-only and SpecEyes (min) runs of DeepEyes on every Table 1 split, and the wall
    time of each SpecEyes run (each agent-only run takes 180 s)."""
    runs: dict[str, Path] = {}
    walls: dict[str, float] = {}
    scopes = {
        "vstar": ("vstar", "vstar_bench", {}, VSTAR_CATS),
        "hr4k": ("hrbench", "hr/hr_bench_4k.tsv", {}, ("single", "cross")),
        "hr8k": ("hrbench", "hr/hr_bench_8k.tsv", {}, ("single", "cross")),
        **{f"pope_{s}": ("pope", "pope", {"split": s}, (s,)) for s in POPE_SPLITS},
    }
    for i, (scope, (bench, data, loader, cats)) in enumerate(scopes.items()):
        kw = {"data": data, "loader": loader, "categories": cats, "seed": i}
        runs[f"{scope}-agent"] = _run(tmp_path / f"{scope}-agent", bench, "agent", wall=180.0, **kw)
        walls[scope] = 60.0 + 10 * i
        runs[f"{scope}-spec"] = _run(
            tmp_path / f"{scope}-spec", bench, "speceyes", wall=walls[scope], **kw
        )
    return runs, walls


def test_a_full_block_fills_its_rows(deepeyes_block):
    runs, walls = deepeyes_block
    table = build_table1(list(runs.values()))
    base, base_row = _cells(table, "DeepEyes", "deepeyes")
    spec, spec_row = _cells(table, "SpecEyes (min)", "deepeyes")
    columns = {
        "vstar_attr": ("vstar", "direct_attributes"),
        "vstar_pos": ("vstar", "relative_position"),
        "hr_4k": ("hr4k", None),
        "hr_8k": ("hr8k", None),
        "pope_adv": ("pope_adversarial", None),
        "pope_pop": ("pope_popular", None),
        "pope_rand": ("pope_random", None),
    }
    for i, (col, (scope, cat)) in enumerate(columns.items()):
        assert base[col].ours_accuracy == pytest.approx(_accuracy(runs[f"{scope}-agent"], cat))
        assert spec[col].ours_accuracy == pytest.approx(_accuracy(runs[f"{scope}-spec"], cat))
        assert base[col].ours_speedup == pytest.approx(1.0)
        assert spec[col].ours_speedup == pytest.approx(180.0 / walls[scope])
        assert spec[col].baseline == str(runs[f"{scope}-agent"])
        published = paper.ROWS[6]
        assert published.label == "SpecEyes (min)" and published.backbone == "deepeyes"
        assert spec[col].paper_accuracy == published.accuracy[i]
        assert spec[col].diff_accuracy == pytest.approx(
            spec[col].ours_accuracy - published.accuracy[i]
        )
        assert spec[col].diff_speedup == pytest.approx(
            spec[col].ours_speedup - published.speedup[i]
        )
    assert spec["vstar_attr"].pooled_speedup and not spec["hr_4k"].pooled_speedup
    assert spec_row.ours_avg_accuracy == pytest.approx(
        np.mean([c.ours_accuracy for c in spec.values()])
    )
    assert not table.notes
    md = format_markdown(table)
    lines = md.splitlines()
    i = next(
        k for k, line in enumerate(lines) if line.startswith("| SpecEyes (min) | paper | 90.43")
    )
    assert lines[i + 1].startswith("|  | ours | ") and lines[i + 2].startswith("|  | diff | ")
    assert f"{spec['hr_8k'].ours_speedup:.2f}x |" in lines[i + 1]
    assert "x* |" in lines[i + 1]  # V*'s pooled speedup is marked
    # Rows without runs keep only the paper's line.
    j = next(k for k, line in enumerate(lines) if line.startswith("| Thyme | paper |"))
    assert lines[j + 1].startswith("| SpecReason | paper |")


def test_vstar_split_runs_fill_their_own_column_with_their_own_speedup(tmp_path):
    """A V* run of one category (eval --split) fills that column; its speedup is measured
    against the agent-only run of the same split, as the released scripts time each split."""
    runs, walls = [], {}
    for i, cat in enumerate(VSTAR_CATS):
        kw = {"data": "vstar_bench", "loader": {"categories": [cat]}, "categories": (cat,),
              "seed": i}
        runs.append(_run(tmp_path / f"{cat}-agent", "vstar", "agent", wall=180.0, **kw))
        walls[cat] = 40.0 + 50 * i
        runs.append(_run(tmp_path / f"{cat}-spec", "vstar", "speceyes", wall=walls[cat], **kw))
    table = build_table1(runs)
    spec, _ = _cells(table, "SpecEyes (min)", "deepeyes")
    for col, cat in (("vstar_attr", "direct_attributes"), ("vstar_pos", "relative_position")):
        assert spec[col].ours_speedup == pytest.approx(180.0 / walls[cat])
        assert not spec[col].pooled_speedup
        assert spec[col].baseline == str(tmp_path / f"{cat}-agent")
        assert spec[col].ours_accuracy == pytest.approx(_accuracy(tmp_path / f"{cat}-spec"))
    assert not table.notes
    # The speedup's denominator is said, and a run whose agent-only run used another schedule
    # is noted.
    for run, schedule in zip(runs, ("serial", "batched", "serial", "serial"), strict=True):
        rd = RunDir(run)
        results = rd.read_results()
        results["config"]["schedule"] = schedule
        rd.write_results(results)
    table = build_table1(runs)
    assert "Agent-loop schedule of these runs: batched, serial" in format_markdown(table)
    notes = table.notes
    assert any("differ in schedule" in n for n in notes), notes


def test_vstar_split_flag_loads_one_category(tmp_path):
    from speceyes.bench.benchmarks import load_from_args
    from speceyes.cli import build_parser

    data = tiny_vstar(tmp_path / "vstar", 2)
    argv = ["eval", "--bench", "vstar", "--data", str(data), "--small", "s", "--large", "l"]
    args = build_parser().parse_args([*argv, "--split", "relative_position"])
    _, loader_kw, queries = load_from_args(args)
    assert loader_kw["categories"] == ["relative_position"]
    assert {q.category for q in queries} == {"relative_position"}
    with pytest.raises(ValueError, match="V\\* has no split 'attr'"):
        load_from_args(build_parser().parse_args([*argv, "--split", "attr"]))


def test_runs_are_scored_by_their_own_protocol(tmp_path):
    runs = []
    for protocol in ("fair", "published"):
        p = _run(
            tmp_path / protocol,
            "vstar",
            "agent",
            wall=100.0,
            categories=VSTAR_CATS,
            protocol=protocol,
            agent="deepeyes" if protocol == "fair" else "thyme",
        )
        rd = RunDir(p)
        recs = rd.records()
        for r in recs[:10]:  # errors: wrong under fair rules, dropped under published ones
            r.update(error="agent timed out", correct=False)
        rd.rewrite(recs)
        runs.append(p)
    table = build_table1(runs)
    fair, _ = _cells(table, "DeepEyes", "deepeyes")
    published, _ = _cells(table, "Thyme", "thyme")
    for col, cat in (("vstar_attr", "direct_attributes"), ("vstar_pos", "relative_position")):
        for path, cells, drop in ((runs[0], fair, False), (runs[1], published, True)):
            recs = [r for r in RunDir(path).records() if r["category"] == cat]
            if drop:
                recs = [r for r in recs if not r["error"]]
            want = 100.0 * np.mean([r["correct"] for r in recs])
            assert cells[col].ours_accuracy == pytest.approx(want)
    assert fair["vstar_attr"].scoring == "fair" and published["vstar_attr"].scoring == "published"
    forced = build_table1(runs, scoring="fair")
    cells, _ = _cells(forced, "Thyme", "thyme")
    assert cells["vstar_attr"].ours_accuracy == pytest.approx(
        _accuracy(runs[1], "direct_attributes")
    )


def test_placement_notes_and_refusals(tmp_path):
    agent = _run(tmp_path / "pope-agent", "pope", "agent", wall=90.0, categories=POPE_SPLITS)
    lone = _run(
        tmp_path / "pope-mean", "pope", "speceyes", agent="thyme", agg="mean", wall=30.0,
        loader={"split": "popular"}, categories=("popular",),
    )  # fmt: skip
    both = _run(tmp_path / "both", "vstar", "both", wall=50.0, categories=VSTAR_CATS)
    hr = _run(tmp_path / "hr", "hrbench", "agent", wall=50.0, data="hr/bench.tsv")
    draft = _run(tmp_path / "draft", "pope", "small", wall=10.0, categories=POPE_SPLITS)
    table = build_table1([agent, lone, both, hr, draft])
    notes = "\n".join(table.notes)
    assert f"{lone}: no agent-only thyme run on pope/popular" in notes
    assert f"{both}: left out: mode 'both'" in notes
    assert "cannot tell HR-Bench 4K from 8K" in notes and str(hr) in notes
    cells, _ = _cells(table, "SpecEyes (mean)", "thyme")
    assert cells["pope_pop"].ours_accuracy is not None and cells["pope_pop"].ours_speedup is None
    assert cells["pope_adv"].run is None
    # The draft-only row is measured against DeepEyes' agent-only run over the same splits.
    draft_cells, draft_row = _cells(table, "Qwen3-VL-2B (draft only)", None)
    assert draft_cells["pope_rand"].ours_speedup == pytest.approx(90.0 / 10.0)
    assert draft_cells["pope_rand"].pooled_speedup and draft_row.ours_avg_accuracy is None
    # Two runs for one cell: refused, naming both.
    again = _run(
        tmp_path / "pope-adv", "pope", "agent", wall=30.0, loader={"split": "adversarial"},
        categories=("adversarial",),
    )  # fmt: skip
    with pytest.raises(Table1Error, match=f"two runs give DeepEyes .* POPE Adv.: {agent} and"):
        build_table1([agent, again])


def test_the_published_numbers_are_consistent():
    assert len(paper.COLUMNS) == 7
    assert len({r.key for r in paper.ROWS}) == len(paper.ROWS)
    for row in paper.ROWS:
        assert len(row.accuracy) == len(row.speedup) == len(paper.COLUMNS)
        # The paper's Avg. is the mean of the seven cells, to its printed precision.
        assert np.mean(row.accuracy) == pytest.approx(row.avg_accuracy, abs=0.006), row.label
        assert np.mean(row.speedup) == pytest.approx(row.avg_speedup, abs=0.006), row.label
        if row.method == "agent":
            assert set(row.speedup) == {1.0}
    assert paper.paper_row("thyme", "speceyes", "min").accuracy[0] == 87.83
    assert paper.paper_row("thyme", "specreason", "min") is None


def test_table1_command_on_real_tiny_runs(tiny_dirs, tmp_path, capsys):
    from speceyes.cli import main

    data = tiny_vstar(tmp_path / "vstar", 2)
    common = ["--bench", "vstar", "--data", str(data), "--small", str(tiny_dirs["qwen3_vl"])]
    common += ["--large", str(tiny_dirs["qwen2_5_vl"]), "--agent-max-tokens", "12"]
    common += ["--batch-size", "2", "--no-progress"]
    agent, spec = tmp_path / "agent", tmp_path / "spec"
    assert main(["eval", *common, "--mode", "agent", "--output", str(agent)]) == 0
    assert main(["eval", *common, "--mode", "speceyes", "--tau", "0.5", "--output", str(spec)]) == 0
    capsys.readouterr()

    args = build_parser().parse_args(["table1", str(agent), str(spec), "--json"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {(r["backbone"], r["label"]): r for r in out["rows"]}
    spec_cells = {c["column"]: c for c in rows[("deepeyes", "SpecEyes (min)")]["cells"]}
    res_a, res_s = (RunDir(p).read_results() for p in (agent, spec))
    for col, cat in (("vstar_attr", "direct_attributes"), ("vstar_pos", "relative_position")):
        want = 100.0 * res_s["metrics"]["per_category"][cat]["accuracy"]
        assert spec_cells[col]["ours_accuracy"] == pytest.approx(want)
        speedup = res_a["time_per_query"] / res_s["time_per_query"]
        assert spec_cells[col]["ours_speedup"] == pytest.approx(speedup)
        assert spec_cells[col]["paper_accuracy"] is not None
    args = build_parser().parse_args(["table1", str(agent), str(spec)])
    assert args.func(args) == 0
    md = capsys.readouterr().out
    assert "| **Based on DeepEyes** |" in md and "| DeepEyes | paper | 90.43 | 1.00x |" in md


def _dry_run(tmp_path: Path, **env: str) -> list[list[str]]:
    import os
    import shlex
    import subprocess

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "reproduce_table1.sh"
    proc = subprocess.run(
        ["bash", str(script)],
        env={**os.environ, "DRY_RUN": "1", "OUT": str(tmp_path / "out"), **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return [shlex.split(line[2:]) for line in proc.stdout.splitlines() if line.startswith("+ ")]


def test_the_reproduction_script_runs_valid_commands(tmp_path):
    from speceyes.cli import build_parser

    commands = _dry_run(tmp_path)
    evals = [c for c in commands if c[:2] == ["speceyes", "eval"]]
    places = set()
    for argv in evals:
        args = build_parser().parse_args(argv[1:])  # every flag is one eval takes
        assert args.protocol == "published"
        places.add((args.agent, args.bench, args.data, args.split, args.mode, args.tau))
    assert len(evals) == len(places) == 2 * 7 * 2 + 7  # backbones x splits x modes, + draft
    assert ("deepeyes", "vstar", "/data/vstar_bench", "relative_position", "speceyes", 0.98) in (
        places
    )  # V* one category per run, each timed on its own
    assert ("thyme", "hrbench", "/data/HR-Bench/hr_bench_8k.tsv", None, "speceyes", 0.98) in places
    assert ("deepeyes", "pope", "/data/POPE", "random", "speceyes", 0.97) in places
    table = commands[-1]
    assert table[:2] == ["speceyes", "table1"]
    assert build_parser().parse_args(table[1:]).runs

    sharded = _dry_run(tmp_path, SHARDS="2", DRAFT="0")
    merges = [c for c in sharded if c[:2] == ["speceyes", "merge"]]
    assert len(merges) == 2 * 7 * 2
    for argv in sharded:
        if argv[:2] == ["speceyes", "eval"]:
            assert build_parser().parse_args(argv[1:]).shard.count == 2
        elif argv[:2] == ["speceyes", "merge"]:
            assert len(build_parser().parse_args(argv[1:]).runs) == 2
