"""The scripts under benchmarks/ import against the current package (a renamed function must not
leave a benchmark broken until someone runs it), and the load benchmark builds each mode's
settings from a points file as it documents."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from speceyes.funnel import FunnelConfig

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)  # the scripts run main() only under __main__
    return module


@pytest.mark.parametrize("path", sorted(BENCHMARKS.glob("*.py")), ids=lambda p: p.name)
def test_benchmark_script_imports(path):
    module = _load(path)
    assert callable(getattr(module, "main", None)), f"{path.name} has no main()"


def _points_file(folder: Path) -> Path:
    """A points file for the bundled models: the published judge at tau 0.5, `none` at 0.93."""
    from speceyes.miniworld.demo import MODELS_DIR

    points = folder / "points.json"
    points.write_text(json.dumps({
        "points": [{"judge": "large", "tau": 0.5, "beta": 0.5, "alpha": 1.0},
                   {"judge": "none", "tau": 0.93, "beta": 0.5, "alpha": 0.96}],
        "setup": {"models": {"small": str(MODELS_DIR / "small"), "large": str(MODELS_DIR / "large")},
                  "agent": "search"},
        "gate": {"top_k": 32, "agg": "min", "scale": 0.6},
    }))  # fmt: skip
    return points


def test_load_benchmark_modes_from_a_points_file(tmp_path):
    bench = _load(BENCHMARKS / "bench_load_vllm.py")
    points = _points_file(tmp_path)
    modes = {m.label: m for m in bench.modes_of(["large", "prefix"], auto=True)}
    assert list(modes) == ["agent-only", "speceyes/large", "speceyes/prefix", "speceyes/auto"]
    urls = ("http://127.0.0.1:1", "http://127.0.0.1:2")
    large = bench.settings_for(modes["speceyes/large"], *urls, points).funnel
    assert (large.judge, large.tau, large.top_k, large.points) == ("large", 0.5, 32, None)
    prefix = bench.settings_for(modes["speceyes/prefix"], *urls, points).funnel
    assert prefix.judge == "prefix" and prefix.tau == 0.9  # no point of its own: the manifest's
    auto = bench.settings_for(modes["speceyes/auto"], *urls, points)
    assert auto.funnel.judge == "auto" and len(auto.funnel.operating_points()) == 2
    assert (auto.small, auto.large) == urls
    assert large.early_agent == FunnelConfig.early_agent  # the funnel's own default
    waiting = bench.modes_of(["large"], waiting=("large",))[-1]
    assert waiting.label == "speceyes/large@early=0"
    assert bench.settings_for(waiting, *urls, points).funnel.early_agent == 0
    # each client sends images at its checkpoint's own view (224x224 for the bundled models)
    assert auto.backend.large_max_pixels == auto.backend.small_max_pixels == 224 * 224
    rows = [
        {"mode": "agent-only", "concurrency": 4, "qps": 1.0},
        {"mode": "speceyes/none", "concurrency": 4, "qps": 2.0},
        {"mode": "speceyes/auto", "concurrency": 4, "qps": 1.9},
    ]
    assert bench.auto_lines(rows)[-1].startswith("C=4: auto 1.90 queries/s = 0.950 x the best")


def test_load_benchmark_reports_autos_points_per_load_band(tmp_path):
    """Where auto's trials went: its answers counted per load band its point was chosen in,
    and the questions in a seeded mix of both scenes (one scene's questions share a route)."""
    bench = _load(BENCHMARKS / "bench_load_vllm.py")
    cell = bench.Cell("speceyes/auto", 16)
    cell.wall_s = 4.0
    cell.rounds = [[bench.Sample(1.0, True, "small", "none", 2) for _ in range(6)] + [
        bench.Sample(1.0, True, "agent", "large", 2),
        bench.Sample(1.0, True, "agent", "agent", 1),
    ]]
    row = cell.summary()
    assert row["points_by_band"] == {"1": {"agent": 1}, "2": {"none": 6, "large": 1}}
    other = {"mode": "agent-only", "concurrency": 16, "qps": 1.0}
    line = bench.auto_lines([other, row])[-1]
    assert line.endswith("points by load band: band 1: agent 100%; band 2: large 14%, none 86%")
    queries = bench.question_set(tmp_path / "mw", 2, 0)
    assert len(queries) == 16 and len({q.image for q in queries[:8]}) == 2  # a round mixes both


def test_load_benchmark_pairs_rounds_for_its_ratios():
    """Each round's modes met the same machine, so ratios pair round with round; the table and
    auto's line show their range, which says how large a gap between two modes is noise."""
    bench = _load(BENCHMARKS / "bench_load_vllm.py")
    agent, auto = bench.Cell("agent-only", 4), bench.Cell("speceyes/auto", 4)
    # each round's queries/s: C over its mean latency (Little's law), here also its count
    for got, wall in ((4, 2.0), (4, 4.0)):
        agent.add_round([bench.Sample(wall, True, "agent")] * got, 0, wall)
    for got, latency in ((6, 4 / 3), (3, 8 / 3)):
        auto.add_round([bench.Sample(latency, True, "agent")] * got, 1, 2.0)
    a, s = agent.summary(), auto.summary()
    assert a["round_qps"] == [2.0, 1.0] and s["round_qps"] == [3.0, 1.5]
    assert a["round_counted_qps"] == [2.0, 1.0] and s["round_counted_qps"] == [3.0, 1.5]
    assert (s["requests"], s["errors"], s["wall_s"]) == (9, 2, 4.0)
    assert bench.round_ratios(s, a) == [1.5, 1.5]
    assert bench.round_ratios({"round_qps": [1.0, 2.0]}, {"round_qps": [2.0, 0.0]}) == [0.5]
    assert bench.spread_text([1.2, 0.9, 1.05]) == " (0.90-1.20)"
    assert bench.spread_text([1.2]) == ""
    assert "| 2.25 | 1.69 (1.50-1.50) |" in bench.table([a, s])
    assert "by round 1.50, 1.50" in bench.auto_lines([a, s])[-1]
    # an auto at another hold margin is compared with the same best non-auto mode, not with auto
    modes = bench.modes_of(["large"], auto=True, auto_holds=(0.0,))
    assert [(m.label, m.auto_hold) for m in modes[2:]] == [
        ("speceyes/auto", None), ("speceyes/auto@hold=0", 0.0)]  # fmt: skip
    other = {**s, "mode": "speceyes/auto@hold=0", "qps": 3.0}
    lines = bench.auto_lines([a, s, other])
    assert lines[1].startswith("C=4: auto 2.25 queries/s = 1.688 x the best other mode (agent-only")
    assert lines[2].startswith("C=4: auto@hold=0 3.00 queries/s = 2.250 x the best other mode (a")


def test_load_benchmark_shortens_rounds_at_low_concurrency():
    """Where 4C fits a short round, a C's rounds are shorter and more, each mode serving the
    same scored requests in all; --requests, or a C too large for a short round, keeps them."""
    bench = _load(BENCHMARKS / "bench_load_vllm.py")
    plan, full = bench.round_plan, bench.MIN_REQUESTS
    assert plan(1, 4, 0, 32) == (32, 4 * full // 32)
    assert plan(8, 4, 0, 32) == (32, 4 * full // 32)
    assert plan(16, 4, 0, 32) == (max(64, full), 4)
    assert plan(64, 4, 0, 32) == (256, 4)
    assert plan(1, 4, 0, 0) == (full, 4)  # off
    assert plan(1, 4, 50, 32) == (50, 4)  # --requests given
    assert plan(1, 3, 0, 40) == (40, 10)  # whole rounds, rounded up (9.6)
    cell = bench.Cell("agent-only", 1)
    for _ in range(3):
        cell.add_round([bench.Sample(0.5, True, "agent")], 0, 0.5)
    assert cell.summary()["rounds"] == 3


def test_load_benchmark_varies_what_each_mode_follows():
    """rotate: auto (last) follows the same mode in every round but one in five; shuffle: each
    round a permutation of the modes, the same for the same seed, C and round, and over a C's
    rounds a mode follows several others."""
    bench = _load(BENCHMARKS / "bench_load_vllm.py")

    def predecessors(order, mode, rounds=16):
        got = []
        for r in range(rounds):
            seq = bench.round_order(5, r, 4, order, seed=23)
            assert sorted(seq) == list(range(5))
            if seq.index(mode) > 0:
                got.append(seq[seq.index(mode) - 1])
        return Counter(got)

    assert predecessors("rotate", 4) == Counter({3: 13})
    shuffled = predecessors("shuffle", 4)
    assert len(shuffled) >= 3 and max(shuffled.values()) < 13
    assert bench.round_order(5, 2, 4, "shuffle", 23) == bench.round_order(5, 2, 4, "shuffle", 23)
    assert len({tuple(bench.round_order(5, r, 4, "shuffle", 23)) for r in range(16)}) > 8


def test_load_benchmark_twin_does_its_originals_work_and_is_not_compared_with_auto(tmp_path):
    """--twin none: a second app of the none variant, built from the same settings; auto's line
    compares it with the best of agent-only and the static variants (not the twin), and a line
    of its own gives the twin against its original."""
    bench = _load(BENCHMARKS / "bench_load_vllm.py")
    points = _points_file(tmp_path)
    modes = {m.label: m for m in bench.modes_of(["large", "none"], auto=True, twins=("none",))}
    assert list(modes) == ["agent-only", "speceyes/large", "speceyes/none", "speceyes/none#twin",
                           "speceyes/auto"]  # fmt: skip
    urls = ("http://127.0.0.1:1", "http://127.0.0.1:2")
    twin = bench.settings_for(modes["speceyes/none#twin"], *urls, points)
    assert twin == bench.settings_for(modes["speceyes/none"], *urls, points)
    assert twin.funnel.tau == 0.93
    spec = json.loads(bench.app_spec(modes["speceyes/none#twin"], *urls, points, None, tmp_path))
    assert bench.Mode(**spec["mode"]) == modes["speceyes/none#twin"]  # an app process rebuilds it
    rows = [
        {"mode": "agent-only", "concurrency": 4, "qps": 1.0},
        {"mode": "speceyes/none", "concurrency": 4, "qps": 2.0, "round_qps": [2.0, 2.0]},
        {"mode": "speceyes/none#twin", "concurrency": 4, "qps": 2.2, "round_qps": [2.4, 2.0],
         "vs_best_interval": [0.95, 1.2]},
        {"mode": "speceyes/auto", "concurrency": 4, "qps": 1.9},
    ]  # fmt: skip
    twin_line = bench.twin_lines(rows)[1]
    assert twin_line.startswith("C=4: none#twin 2.20 queries/s = 1.100 x speceyes/none (the same")
    assert "95% interval 0.950-1.200, by round 1.20, 1.00" in twin_line
    assert bench.auto_lines(rows)[1].startswith("C=4: auto 1.90 queries/s = 0.950 x the best "
                                                "other mode (speceyes/none, 2.00)")  # fmt: skip


def _one_client_run(folder, times, per_round=4, rounds=2, questions=4):
    """A load run's files at one client: each static mode's time per question, every round."""
    folder.mkdir()
    rows = [{"mode": "agent-only", "concurrency": 1, "requests": per_round * rounds,
             "rounds": rounds}]
    (folder / "results.json").write_text(json.dumps(
        {"questions": questions, "args": {"settle": "40"}, "rows": rows}))
    with (folder / "samples.jsonl").open("w") as f:
        for mode, per_question in times.items():
            for r in range(rounds):
                start = (r * per_round) % questions
                for i in range(per_round):
                    seconds, early = per_question[(start + i) % questions]
                    f.write(json.dumps({"mode": mode, "concurrency": 1, "round": r, "index": i,
                                        "scored": True, "latency_s": seconds,
                                        "route": "small" if early else "agent"}) + "\n")


def test_auto_replayed_at_one_client_finds_the_quicker_point(tmp_path):
    """The chooser itself, replayed on static cells' times per question: it runs the quicker
    point for most queries and is scored by the cells' times, so equal points score 1 exactly;
    the questions are those the load benchmark sent in each round."""
    replay = _load(BENCHMARKS / "replay_auto_one_client.py")
    from speceyes.operating_points import OperatingPoint

    points = [OperatingPoint("large", 0.9, 0.5, 1.0), OperatingPoint("none", 0.9, 0.5, 1.0)]
    slow = {q: (0.5 + 0.1 * q, q % 2 == 0) for q in range(4)}
    quick = {q: (0.3 + 0.1 * q, q % 2 == 0) for q in range(4)}
    _one_client_run(tmp_path / "run", {"speceyes/large": slow, "speceyes/none": quick},
                    per_round=3)
    plan = replay.plan_of(json.loads((tmp_path / "run" / "results.json").read_text()))
    assert (plan.questions, plan.per_round, plan.rounds, plan.settle) == (4, 3, 2, 40)
    times = replay.cell_times(tmp_path / "run" / "samples.jsonl", plan)
    # rounds of 3 on 4 questions: round 0 asks 0, 1, 2 and round 1 asks 3, 0, 1
    assert times[("speceyes/none", 0)] == [(0.3, True), (0.3, True)]
    assert len(times[("speceyes/none", 2)]) == len(times[("speceyes/none", 3)]) == 1
    ratio, used = replay.replay(points, times, plan, random.Random(0))
    assert used["none"] > 0.8 * sum(used.values()) and 0.97 <= ratio <= 1.0
    # drift moves what auto sees, not what it is scored by: equal cells score 1 whatever it ran
    _one_client_run(tmp_path / "same", {"speceyes/large": quick, "speceyes/none": quick})
    same = replay.plan_of(json.loads((tmp_path / "same" / "results.json").read_text()))
    times = replay.cell_times(tmp_path / "same" / "samples.jsonl", same)
    assert replay.replay(points, times, same, random.Random(1), drift=0.2)[0] == pytest.approx(1.0)


def test_load_benchmark_bounds_auto_against_the_best_other_mode():
    """auto's interval against the best other mode: requests pair by their place in a round
    (not by the order they came back in), and the best mode is chosen again in each resample,
    so a mode equal to two others reads below 1 as a point ratio but not by its interval."""
    bench = _load(BENCHMARKS / "bench_load_vllm.py")
    rng = np.random.default_rng(3)

    def cell(label, rounds):
        got = bench.Cell(label, 16)
        for lat in rounds:
            got.add_round([bench.Sample(float(x), True, "agent", index=i)
                           for i, x in enumerate(lat)], 0, 1.0)  # fmt: skip
        return got

    # the same latencies per question, answered in another order: exactly the other mode
    questions = [rng.lognormal(0.0, 0.5, 64) for _ in range(4)]
    same, shuffled = cell("agent-only", questions), cell("speceyes/auto", questions)
    for got in shuffled.rounds:
        got.reverse()
    assert bench.vs_best_interval(shuffled, [same], resamples=200) == (1.0, 1.0)
    # three modes alike in distribution, their rounds' load drifting alike: auto's point ratio
    # against the best of the other two falls below 1, and its interval holds 1
    load = [1.0, 1.6, 0.8, 1.3]

    def alike(label):
        return cell(label, [f * q * rng.lognormal(0.0, 0.25, 64) for f, q in zip(load, questions, strict=True)])

    auto, others = alike("speceyes/auto"), [alike("agent-only"), alike("speceyes/large")]
    point = min(float(np.mean([s.latency_s for s in o.samples])) for o in others) / float(
        np.mean([s.latency_s for s in auto.samples]))
    lo, hi = bench.vs_best_interval(auto, others)
    assert point < 1.0 and lo < point < hi and lo < 1.0 < hi
    # an auto a fifth slower on every question is told apart
    slow = cell("speceyes/auto", [1.25 * q for q in questions])
    assert bench.vs_best_interval(slow, [same])[1] < 0.85
    # a round that every mode answered is needed
    assert bench.vs_best_interval(cell("speceyes/auto", []), [same]) is None
    row = {**auto.summary(), "vs_best_interval": [0.91, 1.02]}
    assert ", 95% interval 0.910-1.020 (bootstrap" in bench.auto_lines([others[0].summary(), row])[-1]


def test_uni_executor_keeps_the_worker_in_the_engine_process():
    """``uni`` asks for the in-process worker and sets the variable without which vLLM's CPU
    platform turns ``uni`` back into ``mp`` (whose worker busy-polls a shared-memory queue)."""
    from tests.vllm_support import executor_options

    args, env = executor_options("uni")
    assert args == ["--distributed-executor-backend", "uni"]
    assert env == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert executor_options("mp") == ([], {})
    with pytest.raises(ValueError, match="unknown executor"):
        executor_options("ray")


def test_a_bound_server_keeps_its_other_thread_pools_within_its_cores():
    """A server bound to N cores runs every OpenMP pool at N threads: pools as wide as the
    machine spin at their barriers when another process holds one of their cores."""
    from tests.vllm_support import bound_threads_env, core_count

    assert [core_count(c) for c in ("1", "2-3", "0,1", "0,2-3", " 4 ")] == [1, 2, 2, 3, 1]
    assert bound_threads_env("2-3") == {"VLLM_CPU_OMP_THREADS_BIND": "2-3", "OMP_NUM_THREADS": "2"}
    for bad in ("", "a", "3-1", "1-", "0;1"):
        with pytest.raises(ValueError, match="not a CPU list"):
            core_count(bad)


def test_load_benchmark_counts_the_cpu_each_process_uses_per_query():
    """Each cell records CPU seconds by process group (a server's whole process tree), and
    the table shows them per query beside the cores busy."""
    import subprocess

    bench = _load(BENCHMARKS / "bench_load_vllm.py")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in bench.process_tree(os.getpid())
    finally:
        child.kill()
        child.wait()
    before = bench.cpu_seconds([os.getpid()])
    t0 = time.process_time()
    while time.process_time() - t0 < 0.3:  # 0.3 s of this process's CPU
        pass
    assert bench.cpu_seconds([os.getpid()]) - before >= 0.2
    cell = bench.Cell("speceyes/none", 16)
    got = [bench.Sample(0.1, True, "small")] * 10
    cell.add_round(got, 0, 2.0, {"small": 0.5, "large": 1.0, "app": 0.5})
    cell.add_round(got, 0, 2.0, {"small": 0.5, "large": 1.0, "app": 0.5})
    row = cell.summary()
    assert row["cpu_ms_per_query"] == {"small": 50.0, "large": 100.0, "app": 50.0}
    assert row["cores_busy"] == 1.0
    text = "\n".join(bench.cpu_lines([row]))
    assert "| 16 | speceyes/none | 50.0 | 100.0 | 50.0 | 200.0 | 1.00 | - |" in text
    # the time outside the server's clock: the client's latency less the server's total
    cell.rounds = [[bench.Sample(0.25, True, "small", timings={"total": 0.2}),
                    bench.Sample(0.5, True, "small", timings={"total": 0.4}),
                    bench.Sample(0.3, True, "")]]
    assert cell.summary()["outside_server_ms"] == 75.0
    # each route's phases: a phase a query skipped counts 0; outside = latency less the total
    cell.rounds = [[bench.Sample(0.25, True, "small", timings={"small": 0.1, "total": 0.2}),
                    bench.Sample(0.5, True, "small", timings={"queue": 0.02, "small": 0.3,
                                                              "total": 0.4}, batch=3),
                    bench.Sample(2.0, True, "agent", timings={"agent": 1.5, "total": 1.9})]]
    phases = cell.summary()["mean_ms_by_route_phase"]
    assert phases["small"] == {"queue": 10.0, "small": 200.0, "total": 300.0, "outside": 75.0,
                               "batch": 3.0}  # the one that reported its batch
    assert phases["agent"] == {"agent": 1500.0, "total": 1900.0, "outside": 100.0}


def test_load_benchmark_app_process_fails_with_its_log_when_its_servers_are_down(tmp_path):
    """``--apps process``: an app whose funnel cannot start (no model server at its URL) exits,
    and the benchmark says so and where its output is, instead of waiting out the start-up."""
    bench = _load(BENCHMARKS / "bench_load_vllm.py")
    url_file = tmp_path / "app.url"
    dead = "http://127.0.0.1:9"
    spec = bench.app_spec(bench.modes_of([])[0], dead, dead, None, None, url_file)
    app = bench.AppProcess(spec, url_file, tmp_path / "app.log")
    try:
        with pytest.raises(RuntimeError, match=r"exited with 1; its output: .*app\.log"):
            app.wait_ready(120)
    finally:
        app.stop()
    assert "start-up check of http://127.0.0.1:9 failed" in (tmp_path / "app.log").read_text()
    assert not url_file.exists()


def test_load_benchmark_places_each_engine_on_cores_of_its_own():
    """``split`` gives the two engines disjoint cores (an idle vLLM CPU worker busy-polls its
    core for a second, so engines on one core slow each other); ``shared`` is vLLM's own."""
    bench = _load(BENCHMARKS / "bench_load_vllm.py")
    assert bench.core_sets("split", [0, 1]) == {"small": "0", "large": "1", "large-all": "0,1"}
    four = bench.core_sets("split", [3, 0, 2, 1])
    assert (four["small"], four["large"], four["large-all"]) == ("0,1", "2,3", "0,1,2,3")
    assert bench.core_sets("shared", [0, 1])["small"] is None
    with pytest.raises(ValueError, match="at least 2 cores"):
        bench.core_sets("split", [0])
    with pytest.raises(ValueError, match="unknown placement"):
        bench.core_sets("apart", [0, 1])
    labels = [m.label for m in bench.modes_of(["none"], equal_hardware=True)]
    assert labels == ["agent-only", "agent-only/all", "speceyes/none"]
    assert bench.modes_of(["none"], equal_hardware=True)[1].large == "large-all"
    rows = [
        {"mode": "agent-only", "concurrency": 16, "qps": 2.0},
        {"mode": "agent-only/all", "concurrency": 16, "qps": 2.5},
        {"mode": "speceyes/none", "concurrency": 16, "qps": 5.0},
    ]
    line = bench.equal_hardware_lines(rows)[-1]
    assert line == ("C=16: against agent-only/all (2.50 queries/s): agent-only 0.80x, "
                    "speceyes/none 2.00x")


def test_load_benchmark_busy_processes_burn_a_core_until_killed():
    """``--busy N``: each process is CPU-bound (it spends its time on the CPU, not waiting)."""
    bench = _load(BENCHMARKS / "bench_load_vllm.py")
    assert bench.start_busy(0) == []
    (hog,) = bench.start_busy(1)
    try:
        time.sleep(1.0)
        assert hog.poll() is None and bench.cpu_seconds([hog.pid]) > 0.1
    finally:
        hog.kill()
        hog.wait()
    assert hog.returncode is not None


def test_cascade_miniworld_logs_every_stage_with_its_direct_prompt(tmp_path, monkeypatch):
    """One val scene through the bundled models: the pooled run folder logs every stage of every
    query and records the middle tier's prompt, which its thresholds belong to, in the form the
    cascade's calibration and replay read."""
    from speceyes.bench import cascade_replay as cr
    from speceyes.bench.runlog import load_run

    bench = _load(BENCHMARKS / "cascade_miniworld.py")
    out = tmp_path / "cmw"
    monkeypatch.setattr(sys, "argv", ["cascade_miniworld.py", "--split", "val", "--scenes", "1",
                                      "--pooled", "--direct-prompt", "agent-prefix",
                                      "--out", str(out)])
    bench.main()
    run_dir = out / bench.POOLED
    run = load_run(run_dir)
    assert run.config["direct_prompt"] == "agent-prefix" and run.n == 8
    log = cr.cascade_log(run)
    assert log.stages == ("small@0", "small@1", "large_direct")
    assert not np.isnan(log.conf[:, 2]).any()  # the middle tier answered every query


def test_load_benchmark_times_a_round_in_steady_state_and_drains_it():
    """A round scores the n requests after its first C (all sent under the full load, whatever
    order they come back in) and counts answers from the C-th to the n-th after it while every
    client keeps sending; then no request goes out and those in flight are answered, so
    nothing is left on the server. Its throughput is C over the scored requests' mean latency.
    A stand-in server drives the control flow: odd questions take 20 times longer, as the
    agent loop does."""
    import asyncio

    from aiohttp import web

    from speceyes.types import Query
    from tests.tools.server_thread import ServerThread

    bench = _load(BENCHMARKS / "bench_load_vllm.py")
    state = {"in_flight": 0, "requests": []}

    async def chat(request: web.Request) -> web.Response:
        k = int((await request.json())["messages"][0]["content"][1]["text"])
        state["requests"].append(k)
        state["in_flight"] += 1
        await asyncio.sleep(0.2 if k % 2 else 0.01)
        state["in_flight"] -= 1
        info = {"route": "agent" if k % 2 else "small", "timings": {"total": 0.005}}
        return web.json_response({"choices": [{"message": {"content": "yes" if k < 8 else "no"}}],
                                  "speceyes": info})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    queries = [Query(id=str(k), image="-", question=str(k), answer="yes") for k in range(16)]
    bodies = [bench.request_body(q, "data:,") for q in queries]
    with ServerThread(app) as srv:
        run = asyncio.run(bench.closed_loop(srv.url, bodies, queries, 2, 8, 4))
    assert state["in_flight"] == 0 and run.errors == 0  # drained
    assert len(state["requests"]) == len(run.samples) >= 8 + 4  # C before the window, n in it
    assert state["requests"][:8] == list(range(2, 10))  # from `start`, in order
    timed = [s for s in run.samples if s.timed]
    scored = [s for s in run.samples if s.scored]
    assert len(timed) == 8 and len(scored) == 8
    assert 0 < run.window_s < run.wall_s
    cell = bench.Cell("speceyes/none", 4)
    cell.add_round(run.samples, run.errors, run.window_s, {"app": 1.0}, run.wall_s)
    row = cell.summary()
    assert sorted(s.index for s in scored) == list(range(4, 12))
    mean = sum(s.latency_s for s in scored) / 8
    assert row["requests"] == 8 and row["qps"] == pytest.approx(4 / mean)  # C / mean latency
    assert row["counted_qps"] == pytest.approx(8 / run.window_s)
    assert row["mean_s_by_route"]["agent"]["client"] > row["mean_s_by_route"]["small"]["client"]
    assert row["accuracy"] == 2 / 8  # scored: questions 6..13, of which 6 and 7 are right
    assert row["small_share"] == 0.5  # of the scored: even questions
    assert row["cores_busy"] == pytest.approx(1.0 / run.wall_s, abs=0.01)
    assert row["outside_server_ms"] > 0
    assert row["mean_ms_by_route_phase"]["small"]["total"] == 5.0  # the app's clock, read back


def test_sim_vs_real_traces_a_cells_error_to_its_route():
    """sim_vs_real gives each static mode's mean latency per route, measured beside simulated:
    the agent's routes pooled by their counts, and in the simulator the small model's answers
    (those the gate accepts) quicker than the agent's."""
    from speceyes.simulate import CostModel

    svr = _load(BENCHMARKS / "sim_vs_real.py")
    by_route = {"small": {"n": 30, "client": 0.1},
                "agent_after_gate": {"n": 10, "client": 1.0},
                "agent_after_judge": {"n": 30, "client": 2.0}}  # fmt: skip
    assert svr.measured_routes({"mean_s_by_route": by_route}) == (0.1, 1.75)
    assert svr.measured_routes({}) == (None, None)
    rows = [{"mode": "agent-only", "concurrency": 4, "qps": 2.0, "small_share": 0.0,
             "mean_s_by_route": {"agent_only": {"n": 8, "client": 2.0}}},
            {"mode": "speceyes/none", "concurrency": 4, "qps": 4.0, "small_share": 0.5,
             "mean_s_by_route": {"small": {"n": 4, "client": 0.2},
                                 "agent_after_gate": {"n": 4, "client": 1.8}}}]  # fmt: skip
    lines = svr.compare(rows, CostModel(), {}, batches=2, seed=0, tolerance=0.15)
    none = next(x for x in lines if x["mode"] == "speceyes/none")
    early, agent = none["routes"]["simulated"]
    assert none["routes"]["measured"] == (0.2, 1.8)
    assert 0 < early < agent
    assert next(x for x in lines if x["mode"] == "agent-only")["routes"]["simulated"][0] is None
    # the simulator's own record of each query's route: without a judge the gate decides for
    # every query, with one only for those judged tool-free
    from speceyes.simulate import draw, simulate_one

    d = draw(CostModel(), 32, 0.5, 0.6, 1, 0.3)
    got = simulate_one("speceyes", CostModel(), d, 4, judge="none").early
    assert got is not None and (got == np.where(d.tool, d.accept_tool, d.accept)).all()
    got = simulate_one("speceyes", CostModel(), d, 4, judge="large").early
    assert (got == (~d.tool & d.accept)).all() and 0 < got.sum() < 32
    table = svr.route_lines(lines)
    assert table[-1].startswith("| 4 | speceyes/none | 200 / ") and f"({early / 0.2 - 1:+.0%})" in table[-1]
    # the small model's answers by phase: only rows that recorded the app's clocks
    assert svr.phase_lines(rows) == []
    rows[1]["mean_ms_by_route_phase"] = {"small": {"intake": 14.5, "queue": 10.4, "small": 40.4,
                                                   "gate": 0.3, "total": 66.2, "outside": 1.3}}
    assert svr.phase_lines(rows)[-1] == "| 4 | speceyes/none | 1.3 | 14.5 | 10.4 | - | 40.4 | 0.3 | 200.0 |"
