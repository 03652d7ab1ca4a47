"""``speceyes demo``: the mini-world benchmark on (stand-in) bundled models, end to end.

The stand-ins are random tiny Qwen2.5-VL folders built by the trainer's own ``build_base`` in the
bundled models' layout; they load through HFBackend like the trained ones. Nothing is downloaded.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from speceyes.agents.search import SearchAgent
from speceyes.cli import main
from speceyes.factory import Settings
from speceyes.miniworld import demo as mwdemo
from speceyes.miniworld.summary import label_log_axis, zoom_on_target
from speceyes.rates import analytic_speedup

SPLITS = ("small-targets", "large-targets")
MODES = ("agent", "small", "speceyes")
# Level 1 (the demo's default world) has no relative-position question.
CATEGORIES = ("attribute", "pope_random", "pope_popular", "pope_adversarial")
MANIFEST = {
    "tau": 0.5,
    "batch_size": 3,  # 8 questions a split: batches of 3, 3 and 2, so the modes take turns
    "agent": {"depth": 1},  # kind, grid and answer_prompt from the defaults
    "test": {"scenes": 2},
    "training": {"steps": 123, "note": "stand-in"},
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mw-models")
    mwdemo.build_standin_models(root, seed=0)
    (root / "manifest.json").write_text(json.dumps(MANIFEST))
    return root


@pytest.fixture(scope="module")
def demo_run(models, tmp_path_factory):
    """The demo as `make demo` runs it: its batches on worker processes (two on a machine of two
    cores or more)."""
    out = tmp_path_factory.mktemp("mw-demo") / "out"
    rc = main(["demo", "--models", str(models), "--out", str(out), "--no-progress"])
    assert rc == 0
    return out


@pytest.fixture(scope="module")
def demo_run_in_process(models, tmp_path_factory):
    """The demo with ``--workers 1``: every batch in the calling process."""
    out = tmp_path_factory.mktemp("mw-demo-1") / "out"
    args = ["demo", "--models", str(models), "--out", str(out), "--no-progress", "--workers", "1"]
    assert main(args) == 0
    return out


def _results(out: Path, split: str, mode: str) -> dict:
    return json.loads((out / "runs" / split / mode / "results.json").read_text())


def test_run_folders_are_eval_runs(demo_run):
    from speceyes.bench.runlog import load_run

    data = demo_run / "data"
    for split, size in zip(SPLITS, ("small", "large"), strict=True):
        rows = [json.loads(x) for x in (data / f"questions-{size}.jsonl").read_text().splitlines()]
        assert rows and all(r["target_size"] == size for r in rows)
        for mode in MODES:
            d = demo_run / "runs" / split / mode
            res = _results(demo_run, split, mode)
            samples = [json.loads(x) for x in (d / "samples.jsonl").read_text().splitlines()]
            assert res["n"] == len(samples) == len(rows)
            assert {s["id"] for s in samples} == {r["id"] for r in rows}
            assert res["config"]["mode"] == mode and res["config"]["bench"] == "jsonl"
            assert res["config"]["tau"] == 0.5  # from the manifest
            assert res["wall_time"] > 0 and set(res["time_by_phase"]) >= {"judge", "small", "agent"}
            assert "plots_error" not in res and isinstance(res["plots"], list)
            if mode != "agent":  # agent-only logs no confidences: nothing to plot
                assert (d / "plots").is_dir() and res["plots"]
            load_run(d)  # what report / regate read
    assert main(["report", *(str(demo_run / "runs" / "small-targets" / m) for m in MODES)]) == 0


def test_run_folders_record_each_modes_settings(demo_run, models):
    from speceyes.factory import Settings

    for mode in MODES:
        state = json.loads((demo_run / "runs" / "small-targets" / mode / "run.json").read_text())
        settings = Settings.from_dict(state["config"]["settings"])
        manifest = Settings.from_manifest(models / "manifest.json")
        assert settings == manifest.with_funnel(mode=mode).resolved()


def test_table_rows_and_columns(demo_run):
    md = (demo_run / "summary.md").read_text()
    main_table = md.split("\n\n")[0]  # the targets table follows after a blank line
    lines = [x for x in main_table.splitlines() if x.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head[0] == "questions"
    for lab in ("agent-only", "small-only", "SpecEyes"):
        assert [f"{lab} acc", f"{lab} s/query", f"{lab} speedup"] == head[
            head.index(f"{lab} acc") : head.index(f"{lab} acc") + 3
        ]
    assert head[-4:] == ["beta", "alpha", "analytic speedup", "share of analytic"]
    labels = [x.split("|")[1].strip().split(" (n=")[0] for x in lines[2:]]
    assert labels == ["small targets", "large targets", "all", *CATEGORIES]
    assert all(len(x.strip("|").split("|")) == len(head) for x in lines)
    assert "time per query cannot be attributed to a category" in md

    s = json.loads((demo_run / "summary.json").read_text())
    assert list(s["rows"]) == ["small-targets", "large-targets", "all"]
    assert list(s["categories"]) == list(CATEGORIES)
    # manifest: given keys, defaults for the rest, training metadata carried along
    assert s["settings"]["funnel"]["tau"] == 0.5 and s["split"]["canvas"] == [1024, 1024]
    agent = s["settings"]["agent"]
    assert (agent["kind"], agent["options"]) == ("search", {"depth": 1, "answer_prompt": "small"})
    assert agent["max_new_tokens"] == SearchAgent.Settings.max_new_tokens
    assert s["settings"]["funnel"]["batch_size"] == s["batch_size"] == MANIFEST["batch_size"]
    assert s["settings"]["extra"]["training"] == MANIFEST["training"]
    assert s["split"]["n_scenes"] == 2 and s["split"]["level"] == 1
    assert s["threads"]["torch"] >= 1 and "omp_wait_policy" in s["threads"]
    assert s["threads"]["workers"] == mwdemo.default_workers()


def test_checks_targets_plot_and_viewer(demo_run):
    from speceyes.miniworld.targets import gate_auroc, judge_routing
    from speceyes.rundir import RunDir

    s = json.loads((demo_run / "summary.json").read_text())
    small = [
        r
        for split in ("small-targets", "large-targets")
        for r in RunDir(demo_run / "runs" / split / "small").records()
    ]
    assert s["gate_auroc"] == {"run": "small", **gate_auroc(small)}
    spec = [
        r
        for split in ("small-targets", "large-targets")
        for r in RunDir(demo_run / "runs" / split / "speceyes").records()
    ]
    assert s["judge_routing"] == judge_routing(spec)
    assert s["judge_routing"]["small"]["n"] + s["judge_routing"]["large"]["n"] == len(spec)
    curve = s["accuracy_vs_tau"]
    assert len(curve["tau"]) == len(curve["accuracy"]) == len(curve["small_share"])
    names = [t["target"] for t in s["targets"]]
    assert any("AUROC" in n for n in names) and any("judge" in n for n in names)
    md = (demo_run / "summary.md").read_text()
    assert "| target | measured | verdict |" in md and "Judge routing:" in md
    from PIL import Image

    with Image.open(demo_run / "demo.png") as im:
        assert im.width > 600 and im.height > 300
    assert (demo_run / "view" / "index.html").is_file()


def test_speedups_follow_from_measured_times(demo_run):
    s = json.loads((demo_run / "summary.json").read_text())
    tot = {m: [0.0, 0] for m in MODES}
    analytic_time = {"agent": 0.0, "speceyes": 0.0}  # summed over the splits
    for split in SPLITS:
        agent = _results(demo_run, split, "agent")
        L = agent["wall_time"] / agent["n"]
        for mode in MODES:
            res = _results(demo_run, split, mode)
            tpq = res["wall_time"] / res["n"]
            cell = s["rows"][split][mode]
            assert cell["time_per_query"] == pytest.approx(tpq, rel=1e-9)
            assert cell["speedup"] == pytest.approx(L / tpq, rel=1e-9)
            assert cell["accuracy"] == pytest.approx(res["accuracy"])
            tot[mode][0] += res["wall_time"]
            tot[mode][1] += res["n"]
        spec = _results(demo_run, split, "speceyes")
        assert spec["n_errors"] == 0  # so every query was judged: beta*c_S = (small+gate) / n
        n, tp = spec["n"], spec["time_by_phase"]
        beta, alpha = spec["beta"], spec["alpha_accept"] or 0.0
        c_J, beta_c_S = tp["judge"] / n, (tp["small"] + tp["gate"]) / n
        analytic = L / (c_J + beta_c_S + (1 - beta * alpha) * L)
        analytic_time["agent"] += n * L
        analytic_time["speceyes"] += n * (c_J + beta_c_S + (1 - beta * alpha) * L)
        cell = s["rows"][split]["speceyes"]
        assert cell["beta"] == pytest.approx(beta) and (cell["alpha"] or 0.0) == pytest.approx(
            alpha
        )
        assert cell["L_agent"] == pytest.approx(L, rel=1e-9)
        assert cell["analytic_speedup"] == pytest.approx(analytic, rel=1e-9)
        assert cell["share_of_analytic"] == pytest.approx(cell["speedup"] / analytic, rel=1e-9)
    # "all": total time / total queries per mode, speedup against the pooled agent-only time
    L_all = tot["agent"][0] / tot["agent"][1]
    for mode in MODES:
        cell = s["rows"]["all"][mode]
        assert cell["n"] == tot[mode][1]
        assert cell["time_per_query"] == pytest.approx(tot[mode][0] / tot[mode][1], rel=1e-9)
        assert cell["speedup"] == pytest.approx(L_all / cell["time_per_query"], rel=1e-9)
        # the same questions: total agent-only time / total time of the mode
        assert cell["speedup"] == pytest.approx(tot["agent"][0] / tot[mode][0], rel=1e-9)
    # the pooled analytic speedup by the same definition: total agent-only time / the sum of
    # each split's analytic SpecEyes time (not one formula over pooled costs)
    cell = s["rows"]["all"]["speceyes"]
    pooled = analytic_time["agent"] / analytic_time["speceyes"]
    assert math.isfinite(pooled) and cell["analytic_speedup"] == pytest.approx(pooled, rel=1e-9)
    assert cell["share_of_analytic"] == pytest.approx(cell["speedup"] / pooled, rel=1e-9)


def test_cpu_time_per_query_and_its_speedup(demo_run):
    s = json.loads((demo_run / "summary.json").read_text())
    tot = {m: [0.0, 0] for m in MODES}
    for split in SPLITS:
        agent = _results(demo_run, split, "agent")
        L_cpu = agent["cpu_time"] / agent["n"]
        for mode in MODES:
            res = _results(demo_run, split, mode)
            state = json.loads((demo_run / "runs" / split / mode / "run.json").read_text())
            # the run's CPU time is its batches' segments' CPU time, as its wall time is theirs
            assert res["cpu_time"] == pytest.approx(
                sum(seg["cpu_seconds"] for seg in state["segments"]), rel=1e-9
            )
            assert res["cpu_time"] > 0 and res["cpu_time_per_query"] == pytest.approx(
                res["cpu_time"] / res["n"], rel=1e-9
            )
            cell = s["rows"][split][mode]
            assert cell["cpu_time_per_query"] == pytest.approx(res["cpu_time_per_query"], rel=1e-9)
            assert cell["cpu_speedup"] == pytest.approx(L_cpu / res["cpu_time_per_query"], rel=1e-9)
            tot[mode][0] += res["cpu_time"]
            tot[mode][1] += res["n"]
    for mode in MODES:
        cell = s["rows"]["all"][mode]
        assert cell["cpu_time_per_query"] == pytest.approx(tot[mode][0] / tot[mode][1], rel=1e-9)
    md = (demo_run / "summary.md").read_text()
    cpu_table = next(b for b in md.split("\n\n") if "CPU s/query" in b.splitlines()[0])
    head = [c.strip() for c in cpu_table.splitlines()[0].strip("|").split("|")]
    assert head == [
        "questions",
        "agent-only wall s/query",
        "agent-only CPU s/query",
        "small-only wall s/query",
        "small-only CPU s/query",
        "small-only speedup wall / CPU",
        "SpecEyes wall s/query",
        "SpecEyes CPU s/query",
        "SpecEyes speedup wall / CPU",
    ]
    all_row = next(x for x in cpu_table.splitlines() if x.startswith("| all"))
    sp = s["rows"]["all"]["speceyes"]
    assert all_row.split("|")[-2].strip() == f"{sp['speedup']:.2f}x / {sp['cpu_speedup']:.2f}x"


def _segments(out: Path) -> list[tuple[float, str, str, int]]:
    """(start time, split, mode, queries) of every time segment of the demo's runs, in time
    order."""
    segs = []
    for split in SPLITS:
        for mode in MODES:
            state = json.loads((out / "runs" / split / mode / "run.json").read_text())
            segs += [(seg["started"], split, mode, seg["queries"]) for seg in state["segments"]]
    return sorted(segs)


def _rotating_order(out: Path) -> list[tuple[str, str, int]]:
    """(split, mode, questions) of every batch of the six runs (both splits' modes) in one
    rotating order: 1 2 3 4 5 6, then 2 3 4 5 6 1, then 3 4 5 6 1 2, ..."""
    bs = MANIFEST["batch_size"]
    n = _results(out, SPLITS[0], "agent")["n"]
    assert all(_results(out, split, "agent")["n"] == n for split in SPLITS)
    sizes = [min(bs, n - i) for i in range(0, n, bs)]
    assert len(sizes) >= 3  # enough batches for the splits to change places
    runs = [(split, m) for split in SPLITS for m in MODES]
    return [(*run, size) for b, size in enumerate(sizes) for run in runs[b % 6 :] + runs[: b % 6]]


def test_modes_of_both_splits_take_turns_batch_by_batch(demo_run_in_process):
    """In one process each run is one segment per batch, in the rotating order exactly, so a
    load that changes during the demo falls on every mode of every split alike."""
    segments = [(s, m, q) for _, s, m, q in _segments(demo_run_in_process)]
    assert segments == _rotating_order(demo_run_in_process)


def test_workers_take_the_batches_in_turn_one_per_run_at_a_time(demo_run):
    """On worker processes the batches start in the same rotating order (two started together
    may swap), a run's batches one after another (one writer per folder), and the workers'
    batches overlap in time: each runs on a core of its own."""
    workers = mwdemo.default_workers()
    if workers < 2:
        pytest.skip("one CPU: the demo runs its batches in its own process")
    expected = _rotating_order(demo_run)
    turn = {}  # (split, mode, batch index) -> its place in the rotating order
    for split, mode, _ in expected:
        b = sum(1 for k in turn if k[:2] == (split, mode))
        turn[split, mode, b] = len(turn)
    timed = []  # (started, seconds, split, mode, batch index, questions)
    for split in SPLITS:
        for mode in MODES:
            state = json.loads((demo_run / "runs" / split / mode / "run.json").read_text())
            segs = state["segments"]
            for a, b in zip(segs, segs[1:], strict=False):  # never two batches of a run at once
                assert b["started"] >= a["started"] + a["seconds"] - 0.01, (split, mode)
            timed += [
                (seg["started"], seg["seconds"], split, mode, i, seg["queries"])
                for i, seg in enumerate(segs)
            ]
    timed.sort()
    assert sorted((s, m, q) for *_, s, m, _, q in timed) == sorted(expected)
    for rank, (_, _, split, mode, b, _) in enumerate(timed):  # within a place of its turn
        assert abs(turn[split, mode, b] - rank) < workers, (split, mode, b)
    overlaps = sum(
        1 for (t0, d0, *_), (t1, *_) in zip(timed, timed[1:], strict=False) if t1 < t0 + d0
    )
    assert overlaps > 0


def test_next_batches_keep_the_order_and_one_batch_per_run():
    """The dispatcher takes batches from the front of the schedule, skips (and keeps for later)
    those of a run with a batch in flight, and drops those with nothing left to run."""
    from types import SimpleNamespace

    from speceyes.miniworld.workers import _next_batches

    a, b, c = (SimpleNamespace(name=x, pending=lambda i: True) for x in "abc")
    c.pending = lambda i: i != 0  # c's batch 0 is logged already
    waiting = [(a, 0), (c, 0), (a, 1), (b, 0), (c, 1), (b, 1)]
    picked = _next_batches(waiting, [], 2)
    assert [(r.name, i) for r, i in picked] == [("a", 0), ("b", 0)]
    assert [(r.name, i) for r, i in waiting] == [("a", 1), ("c", 1), ("b", 1)]
    assert [(r.name, i) for r, i in _next_batches(waiting, [a, b], 2)] == [("c", 1)]
    assert [(r.name, i) for r, i in waiting] == [("a", 1), ("b", 1)]
    assert _next_batches(waiting, [a, b], 1) == [] and len(waiting) == 2


def test_schedule_spreads_a_shorter_run_and_keeps_each_runs_order():
    """Runs of as many batches take turns batch by batch in a rotating order; a run of fewer
    batches has its batches spread evenly between the others' (not all at the start)."""
    from types import SimpleNamespace

    from speceyes.miniworld.interleave import rotation, schedule

    same = [SimpleNamespace(name=c, n_batches=4) for c in "ABC"]
    order = [(r.name, b) for r, b in schedule(same)]
    assert order == [(r.name, b) for b in range(4) for r in rotation(same, b)]
    assert order[:6] == [("A", 0), ("B", 0), ("C", 0), ("B", 1), ("C", 1), ("A", 1)]

    runs = [SimpleNamespace(name="long", n_batches=4), SimpleNamespace(name="short", n_batches=2)]
    order = [(r.name, b) for r, b in schedule(runs)]
    assert sorted(order) == sorted((r.name, b) for r in runs for b in range(r.n_batches))
    for r in runs:  # each run's own batches in order
        assert [b for name, b in order if name == r.name] == list(range(r.n_batches))
    # the short run's batch b sits where the long run is (b + 1/2) / 2 of the way through
    done_before = [sum(1 for x in order[:i] if x[0] == "long") for i, x in enumerate(order)]
    assert [d for d, x in zip(done_before, order, strict=True) if x[0] == "short"] == [1, 3]
    assert schedule([]) == []


def test_schedule_keeps_the_pooled_speedup_under_a_load_step():
    """A load that triples at some point of the demo (simulated clock): with the splits one
    after the other the step falls on one split's modes more than the other's and skews the
    pooled ratio, total agent-only time / total SpecEyes time; the schedule spreads it over
    every run alike, wherever it falls."""
    from types import SimpleNamespace

    from speceyes.miniworld.interleave import schedule

    # seconds per batch when quiet: SpecEyes is slower than agent-only on small targets
    # (judge overhead, every question to the agent) and much faster on large ones
    cost = {("small", "agent"): 1.0, ("small", "speceyes"): 1.1}
    cost |= {("large", "agent"): 1.0, ("large", "speceyes"): 0.1}
    runs = [SimpleNamespace(key=k, n_batches=8) for k in cost]
    quiet_total = sum(c * 8 for c in cost.values())
    quiet = 16 / (8 * 1.1 + 8 * 0.1)

    def pooled_speedup(order: list[tuple[SimpleNamespace, int]], step_at: float) -> float:
        clock, spent = 0.0, dict.fromkeys(cost, 0.0)
        for run, _ in order:
            took = cost[run.key] * (1.0 if clock < step_at * quiet_total else 3.0)
            clock += took
            spent[run.key] += took
        agent = sum(t for k, t in spent.items() if k[1] == "agent")
        return agent / sum(t for k, t in spent.items() if k[1] == "speceyes")

    one_after_other = [*schedule(runs[:2]), *schedule(runs[2:])]  # a split's modes in turns
    for step_at in (0.1, 0.25, 0.4, 0.5, 0.6, 0.75, 0.9):
        assert pooled_speedup(one_after_other, step_at) > 1.1 * quiet
        assert pooled_speedup(schedule(runs), step_at) == pytest.approx(quiet, rel=0.1)


def _without_timings(records: list[dict]) -> list[dict]:
    """The records less what was timed: the phase timings and the agent loop's seconds (its
    trace's ``end`` step)."""
    return [
        {
            **{k: v for k, v in r.items() if k != "timings"},
            "trace": [{k: v for k, v in t.items() if k != "seconds"} for t in r.get("trace") or []],
        }
        for r in records
    ]


@pytest.fixture
def worker_threads():
    """This process on the threads a demo worker runs on, so that its sums add up alike."""
    import torch

    before = torch.get_num_threads()
    workers = mwdemo.default_workers()
    torch.set_num_threads(mwdemo.threads_per_worker(workers) if workers > 1 else before)
    yield
    torch.set_num_threads(before)


def test_interleaved_runs_match_uninterrupted_runs(demo_run, models, tmp_path, worker_threads):
    """Taking turns, on worker processes, changes nothing but the timings: every mode run on
    its own on each split, in one run_eval call over the whole split in this process, logs the
    same records, in the same order."""
    from speceyes.bench.datasets import load_jsonl
    from speceyes.bench.runner import EvalSpec, run_eval
    from speceyes.factory import build_funnel, make_agent, make_backend
    from speceyes.rundir import RunDir

    s = Settings.from_manifest(models / mwdemo.MANIFEST)
    backends = {r: make_backend(getattr(s, r), settings=s.backend) for r in ("small", "large")}
    agent = make_agent(s.resolved().agent, backends["large"])
    for split, size in zip(SPLITS, ("small", "large"), strict=True):
        subset = demo_run / "data" / f"questions-{size}.jsonl"
        for mode in MODES:
            funnel = build_funnel(
                s.with_funnel(mode=mode), (backends["small"], backends["large"]), agent
            )
            spec = EvalSpec(bench="jsonl", data=str(subset), output=tmp_path / split / mode)
            run_eval(spec, funnel, load_jsonl(subset), progress=False, plots=False)
            alone = RunDir(tmp_path / split / mode).records()
            interleaved = RunDir(demo_run / "runs" / split / mode).records()
            assert len(alone) == 8, (split, mode)
            assert _without_timings(interleaved) == _without_timings(alone), (split, mode)


def test_rerun_reuses_split_and_resumes(models, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["demo", "--models", str(models), "--out", str(out), "--no-progress", "--modes", "small"]
    assert main(args) == 0
    assert "(generated;" in capsys.readouterr().out
    q = out / "data" / "questions.jsonl"
    before = q.stat().st_mtime_ns
    small = out / "runs" / "small-targets" / "small"
    n_lines = len((small / "samples.jsonl").read_text().splitlines())

    assert main(args) == 0
    assert "(reused;" in capsys.readouterr().out
    assert q.stat().st_mtime_ns == before
    assert len((small / "samples.jsonl").read_text().splitlines()) == n_lines  # nothing redone
    # one segment per batch, then one (empty) for the resumed run's check of the folder
    n_batches = -(-n_lines // MANIFEST["batch_size"])
    assert len(json.loads((small / "run.json").read_text())["segments"]) == n_batches + 1
    assert not list(small.parent.glob("*.stale-*"))
    s = json.loads((out / "summary.json").read_text())
    assert s["modes"] == ["small"] and s["rows"]["small-targets"]["small"]["speedup"] is None

    # killed after its first batch (and mid-way through logging the second): only the
    # unlogged questions run, the logged ones are kept as they are
    lines = (small / "samples.jsonl").read_text().splitlines(keepends=True)
    kept = MANIFEST["batch_size"] + 1
    (small / "samples.jsonl").write_text("".join(lines[:kept]) + lines[kept][:20])
    (small / "results.json").unlink()
    n_segments = len(json.loads((small / "run.json").read_text())["segments"])
    assert main(args) == 0
    after = (small / "samples.jsonl").read_text().splitlines(keepends=True)
    assert after[:kept] == lines[:kept] and len(after) == n_lines
    segments = json.loads((small / "run.json").read_text())["segments"][n_segments:]
    assert sum(seg["queries"] for seg in segments) == n_lines - kept
    res = json.loads((small / "results.json").read_text())  # written again, figures too
    assert res["n"] == n_lines and res["plots"]

    # another tau: the old run is moved aside (kept), a fresh one is made
    assert main([*args, "--tau", "0.7"]) == 0
    stale = list(small.parent.glob("small.stale-*"))
    assert len(stale) == 1 and (stale[0] / "samples.jsonl").is_file()
    cfg = json.loads((small / "run.json").read_text())
    assert cfg["config"]["tau"] == 0.7 and len(cfg["segments"]) == n_batches


def test_missing_models_exit_2(tmp_path, monkeypatch, capsys):
    empty = tmp_path / "bundled"
    empty.mkdir()
    monkeypatch.setattr(mwdemo, "MODELS_DIR", empty)  # the default folder, without weights
    assert main(["demo", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "no trained mini-world models" in err and str(empty) in err
    assert "speceyes miniworld train" in err and "docs/miniworld-training.md" in err
    assert not (tmp_path / "out").exists()  # nothing written
    assert main(["demo", "--models", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2


def test_settings_defaults_and_errors(tmp_path):
    s = Settings.from_manifest(tmp_path / "missing.json")
    t = mwdemo.TestSplit.from_settings(s)
    assert (t.canvas, s.funnel.tau, s.funnel.agg) == ((1024, 1024), 0.9, "min")
    assert (s.agent.kind, s.agent.options) == ("search", {"depth": 3, "answer_prompt": "small"})
    assert (t.level, t.seed, t.scenes, t.small_fraction) == (1, 0, 40, 0.5)
    p = tmp_path / "m.json"
    p.write_text(json.dumps({"agent": {"kind": "teleport"}}))
    with pytest.raises(ValueError, match="agent.kind"):
        Settings.from_manifest(p)
    for bad, match in (({"canvas": [1]}, "canvas"), ({"level": 3}, "level"), ({"test": 1}, "test")):
        p.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=match):
            mwdemo.TestSplit.from_settings(Settings.from_manifest(p))
    p.write_text(json.dumps({"canvas": [640, 480], "level": 2, "test": {"scenes": 3}}))
    t = mwdemo.TestSplit.from_settings(Settings.from_manifest(p))
    assert (t.canvas, t.level, t.scenes, t.seed) == ((640, 480), 2, 3, 0)
    speedup = analytic_speedup  # speceyes.rates' formula, (c_J, c_S, L_agent, beta, alpha)
    assert speedup(0.0, 0.0, 1.0, 0.0, 0.0) == 1.0
    assert speedup(0.1, 0.2, 1.0, 0.8, 0.5) == pytest.approx(1 / (0.1 + 0.16 + 0.6))


def test_wait_policy_defaults_to_passive_before_torch_loads():
    """The demo's OpenMP threads sleep at barriers unless told otherwise; once torch (OpenMP) is
    loaded the setting is left alone and what is in effect is reported."""
    import os
    import subprocess
    import sys

    code = (
        "import sys; from speceyes.miniworld import demo; "
        "print(demo.set_wait_policy(), 'torch' in sys.modules)"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    root = str(Path(mwdemo.__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)

    def policy(**extra: str) -> str:
        cmd = [sys.executable, "-c", code]
        out = subprocess.run(cmd, env={**env, **extra}, capture_output=True, text=True, check=True)
        return out.stdout.split()[0]

    assert policy() == mwdemo.OMP_WAIT_POLICY == "PASSIVE"
    assert policy(OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"  # the user's choice is kept
    preloaded = code.replace("import sys;", "import sys, torch;")
    out = subprocess.run([sys.executable, "-c", preloaded], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["None", "True"]  # too late to set: OpenMP's default


def test_bundled_models_load_and_answer_from_their_own_logits():
    """The shipped checkpoints: bf16 HF folders within the size budget, a valid manifest, and
    both load through HFBackend and answer a mini-world question with real top-K logits."""
    from speceyes import prompts
    from speceyes.backends.hf import HFBackend
    from speceyes.judging import tool_probability
    from speceyes.miniworld.scenes import generate_scene, load_pool, scene_rng

    found = mwdemo.find_models(mwdemo.MODELS_DIR)
    total = sum(f.stat().st_size for f in mwdemo.MODELS_DIR.rglob("*") if f.is_file())
    assert total < 50e6
    settings = Settings.from_manifest(mwdemo.MODELS_DIR / mwdemo.MANIFEST)
    assert 0 < settings.funnel.tau < 1 and settings.agent.kind == "search"
    canvas = mwdemo.TestSplit.from_settings(settings).canvas
    scene = generate_scene(
        scene_rng("test", 99, 0), load_pool("test"), canvas=canvas, regime="large"
    )
    q = next(q for q in scene.questions if q.category == "attribute")
    for role in ("small", "large"):
        cfg = json.loads((found[role] / "config.json").read_text())
        assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"
        be = HFBackend(found[role], dtype="float32")
        (ans,) = be.answer([prompts.small_messages(scene.image, q.question, q.options)])
        # A trained model answers with one of the words it was trained on, never format noise.
        assert ans.text.strip() in {*q.options, "yes", "no"} or ans.text.strip() in (
            "circle",
            "rectangle",
            "triangle",
            "red",
            "green",
            "blue",
            "yellow",
            "black",
            "gray",
            "teal",
            "brown",
            "left",
            "right",
        )
        assert ans.topk is not None and len(ans.topk) >= 1
    judge = tool_probability(
        HFBackend(found["large"], dtype="float32"),
        [prompts.judge_messages(scene.image, q.question, q.options)],
    )
    assert 0.0 <= judge[0] <= 1.0


def test_zoom_on_target_counts_last_zooms_holding_the_target(demo_run):
    def rec(box, *crops):
        trace = [{"type": "zoom", "crop_box": list(c)} for c in crops]
        return {"meta": {"target_bbox": box}, "trace": [*trace, {"type": "assistant"}]}

    recs = [
        rec([10, 10, 20, 20], (0, 0, 100, 100), (0, 0, 30, 30)),  # last zoom holds it
        rec([10, 10, 20, 20], (0, 0, 100, 100), (15, 0, 60, 60)),  # last zoom cuts it
        rec([10, 10, 20, 20]),  # no zoom: not counted
        rec(None, (0, 0, 5, 5)),  # no known target: not counted
    ]
    assert zoom_on_target(recs) == {"n": 2, "hits": 1, "share": 0.5}
    # The demo's own agent runs are measured the same way and reported in the table's notes.
    s = json.loads((demo_run / "summary.json").read_text())
    from speceyes.rundir import RunDir

    recs = RunDir(demo_run / "runs" / "small-targets" / "agent").records()
    assert s["rows"]["small-targets"]["agent"]["zoom_on_target"] == zoom_on_target(recs)
    assert "last crop holds the whole target" in (demo_run / "summary.md").read_text()


def test_demo_plot_labels_its_log_axis_in_plain_decimals_at_1_2_and_5() -> None:
    """The plot's time axis spans about 0.03-0.6 s: labelled at every minor tick in scientific
    notation its labels overlapped; only 1, 2 and 5 per decade are labelled, as plain numbers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    try:
        ax.set_xscale("log")
        ax.set_xlim(0.03, 0.6)
        label_log_axis(ax.xaxis)
        fig.canvas.draw()
        shown = [t.get_text() for t in ax.get_xticklabels() + ax.get_xticklabels(minor=True)
                 if t.get_text() and 0.03 <= t.get_position()[0] <= 0.6]
        assert shown == ["0.05", "0.1", "0.2", "0.5"]
        ax.set_xlim(0.3, 40.0)
        fig.canvas.draw()
        shown = [t.get_text() for t in ax.get_xticklabels() + ax.get_xticklabels(minor=True)
                 if t.get_text() and 0.3 <= t.get_position()[0] <= 40.0]
        assert shown == ["0.5", "1", "2", "5", "10", "20"]
    finally:
        plt.close(fig)
