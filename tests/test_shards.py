"""Shards of an eval (--shard i/N) and `speceyes merge`: a real tiny eval run over two shards and
merged equals the same eval run whole; merge refuses folders that are not one run's shards."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from speceyes.bench.merge import MergeError, merge_runs
from speceyes.bench.shards import (
    Shard,
    add_shard_arg,
    apply_shard,
    parse_shard,
    select_shard,
    shard_of,
)
from speceyes.cli import build_parser
from speceyes.rundir import RunDir
from speceyes.types import Query
from tests.conftest import make_scene

N_PER_CAT = 3


def _queries(n: int) -> list[Query]:
    return [Query(id=f"cat/{i:04d}", image=None, question="q") for i in range(n)]


# ---------------------------------------------------------------------------- the split


def test_shard_of_is_the_same_in_every_process():
    ids = [f"direct_attributes/sa_{i}" for i in range(50)] + ["adversarial/7", "é/ü", ""]
    code = (
        "import json, sys; from speceyes.bench.shards import shard_of; "
        "print(json.dumps([shard_of(i, 7) for i in json.loads(sys.argv[1])]))"
    )
    outs = []
    for seed in ("1", "2"):  # str hash() differs between these; shard_of must not
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run(
            [sys.executable, "-c", code, json.dumps(ids)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        outs.append(json.loads(proc.stdout))
    assert outs[0] == outs[1] == [shard_of(i, 7) for i in ids]
    assert len(set(outs[0])) > 3  # not everything in one shard
    # Pinned: run folders sharded by one version must merge under the next.
    assert [shard_of(f"q{i}", 4) for i in range(8)] == PINNED_Q0_TO_Q7


PINNED_Q0_TO_Q7 = [3, 2, 3, 3, 3, 1, 1, 3]  # sha256(id)[:8] big-endian % 4


def test_shards_partition_the_queries_in_order():
    qs = _queries(400)
    parts = [list(select_shard(qs, i, 4)) for i in range(4)]
    ids = [q.id for part in parts for q in part]
    assert sorted(ids) == [q.id for q in qs] and len(set(ids)) == len(qs)
    for i, part in enumerate(parts):
        assert [q.id for q in part] == [q.id for q in qs if shard_of(q.id, 4) == i]
        assert 70 <= len(part) <= 130  # a hash, so roughly even
    assert [q.id for q in select_shard(qs, 0, 1)] == [q.id for q in qs]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("4/4", r"\[0, N\)"),
        ("-1/4", "expected i/N"),
        ("1/0", "at least 1"),
        ("a/b", "expected i/N"),
        ("3", "expected i/N"),
        ("", "expected i/N"),
    ],
)
def test_parse_shard_says_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        parse_shard(text)


def test_parse_shard_and_the_flag(capsys):
    assert parse_shard(" 1 / 3 ") == Shard(1, 3) and str(Shard(1, 3)) == "1/3"
    parser = argparse.ArgumentParser(prog="eval")
    parser.add_argument("--limit", type=int, default=None)
    add_shard_arg(parser)
    assert parser.parse_args([]).shard is None
    assert parser.parse_args(["--shard", "2/5"]).shard == Shard(2, 5)
    with pytest.raises(SystemExit):
        parser.parse_args(["--shard", "5/5"])
    assert "the index i must be in [0, N)" in capsys.readouterr().err


def test_apply_shard_cuts_the_limit_first():
    parser = argparse.ArgumentParser()
    parser.add_argument("--limit", type=int, default=None)
    add_shard_arg(parser)
    qs = _queries(40)
    assert list(apply_shard(parser.parse_args([]), qs)) == qs
    limited = []
    for i in range(3):
        args = parser.parse_args(["--limit", "10", "--shard", f"{i}/3"])
        limited += [q.id for q in apply_shard(args, qs)]
    assert sorted(limited) == [q.id for q in qs[:10]]


# ---------------------------------------------------------------------------- real shards


def tiny_vstar(root: Path, n_per_cat: int) -> Path:
    """A V*-layout folder of ``n_per_cat`` drawn scenes per category."""
    colors = {"red": (220, 30, 30), "blue": (30, 30, 220)}
    for cat in ("direct_attributes", "relative_position"):
        (root / cat).mkdir(parents=True)
        for i in range(n_per_cat):
            name = list(colors)[i % 2]
            make_scene(box=(30 + 20 * i, 40, 120 + 20 * i, 130), color=colors[name]).save(
                root / cat / f"img{i}.jpg"
            )
            meta = {"question": "What color is the square?", "options": [name, "green"]}
            (root / cat / f"img{i}.json").write_text(json.dumps(meta))
    return root


@pytest.fixture(scope="module")
def vstar(tmp_path_factory):
    return tiny_vstar(tmp_path_factory.mktemp("vstar-shards") / "vstar", N_PER_CAT)


def _eval_args(tiny_dirs, vstar, out, *extra):
    from speceyes.cli import build_parser

    argv = ["eval", "--bench", "vstar", "--data", str(vstar), "--output", str(out)]
    argv += ["--small", str(tiny_dirs["qwen3_vl"]), "--large", str(tiny_dirs["qwen2_5_vl"])]
    # Batch size 1: a shard changes which queries share a batch, and left padding of a
    # different batch can move greedy outputs; one query per batch keeps runs comparable.
    argv += ["--mode", "both", "--tau", "0.5", "--batch-size", "1", "--agent-max-tokens", "12"]
    argv += ["--no-progress"]
    return build_parser().parse_args([*argv, *extra])


def _eval(args, funnel) -> None:
    """What `speceyes eval` does, with the two shard calls (apply_shard, EvalSpec.shard)."""
    from dataclasses import replace

    from speceyes.bench.benchmarks import load_from_args
    from speceyes.bench.runner import EvalSpec, run_eval
    from speceyes.factory import Settings

    bench, loader_kw, queries = load_from_args(args)
    queries = apply_shard(args, queries)
    spec = EvalSpec(
        bench=bench,
        data=args.data,
        output=Path(args.output),
        limit=args.limit,
        models={"small": args.small, "large": args.large},
        loader_kw=loader_kw,
        shard=args.shard,
        settings=replace(Settings.from_args(args), bench=bench).resolved(),
    )
    run_eval(spec, funnel, queries, progress=False, plots=False)


@pytest.fixture(scope="module")
def runs(tiny_dirs, vstar, tmp_path_factory):
    from speceyes.factory import Settings, build_funnel

    root = tmp_path_factory.mktemp("shard-runs")
    funnel = build_funnel(Settings.from_args(_eval_args(tiny_dirs, vstar, root / "x")))
    out = {"whole": root / "whole", "s0": root / "s0", "s1": root / "s1"}
    _eval(_eval_args(tiny_dirs, vstar, out["whole"]), funnel)
    _eval(_eval_args(tiny_dirs, vstar, out["s0"], "--shard", "0/2"), funnel)
    _eval(_eval_args(tiny_dirs, vstar, out["s1"], "--shard", "1/2"), funnel)
    return out


def _untimed(record: dict) -> dict:
    """A record without what depends on the clock."""
    out = {k: v for k, v in record.items() if k != "timings"}
    out["trace"] = [
        {k: v for k, v in step.items() if k not in ("seconds", "elapsed")}
        for step in record.get("trace") or []
    ]
    return out


def test_merged_shards_equal_the_whole_run(runs, tmp_path):
    s0, s1 = RunDir(runs["s0"]), RunDir(runs["s1"])
    assert s0.read_state()["config"]["shard"] == "0/2"
    assert "shard" not in RunDir(runs["whole"]).read_state()["config"]
    n0, n1 = len(s0.records()), len(s1.records())
    assert n0 + n1 == 2 * N_PER_CAT and n0 and n1, "each shard should hold some queries"

    merged = tmp_path / "merged"
    args = build_parser().parse_args(
        ["merge", str(runs["s1"]), str(runs["s0"]), "--output", str(merged)]
    )
    assert args.func(args) == 0

    whole = RunDir(runs["whole"])
    got, want = RunDir(merged).records(), whole.records()
    assert [_untimed(r) for r in got] == [_untimed(r) for r in want]  # same rows, same order
    res, ref = RunDir(merged).read_results(), whole.read_results()
    for key in ("metrics", "accuracy", "n", "n_errors", "beta", "alpha_accept", "routes"):
        assert res[key] == ref[key], key
    assert res["config"] == ref["config"]
    state = RunDir(merged).read_state()
    assert state["config"] == RunDir(runs["whole"]).read_state()["config"]
    walls = [RunDir(p).read_results()["wall_time"] for p in (runs["s0"], runs["s1"])]
    assert res["wall_time"] == pytest.approx(sum(walls))
    assert res["wall_time_elapsed"] == pytest.approx(max(walls))
    assert res["time_per_query"] == pytest.approx(sum(walls) / (2 * N_PER_CAT))
    assert [s["shard"] for s in state["segments"]] == ["0/2", "1/2"]

    # The offline tools read it as one run.
    from speceyes.bench.regate import regate
    from speceyes.bench.report import report
    from speceyes.bench.runlog import load_run
    from speceyes.view import build_view

    run = load_run(merged)
    assert run.ids == [r["id"] for r in want]
    assert regate(run, [0.5])[0].accuracy == regate(load_run(runs["whole"]), [0.5])[0].accuracy
    md, _ = report([merged, runs["whole"]])
    assert "merged (both)" in md
    view = build_view([merged], tmp_path / "view")
    assert view.cards == 2 * N_PER_CAT


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_state(path: Path, **config) -> None:
    rd = RunDir(path)
    state = rd.read_state()
    state["config"].update(config)
    rd.write_state(state)


def test_merge_refuses_other_settings(runs, tmp_path):
    other = _copy(runs["s1"], tmp_path / "s1")
    _edit_state(other, tau=0.9, top_k=20)
    with pytest.raises(MergeError, match=r"differs in config\.tau, config\.top_k"):
        merge_runs([runs["s0"], other], tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_merge_refuses_missing_repeated_and_mixed_shards(runs, tmp_path):
    with pytest.raises(MergeError, match=r"missing shard\(s\) 1/2 of 2"):
        merge_runs([runs["s0"]], tmp_path / "m")
    with pytest.raises(MergeError, match="shard 0/2 is given twice"):
        merge_runs([runs["s0"], runs["s0"], runs["s1"]], tmp_path / "m")
    three = _copy(runs["s1"], tmp_path / "s1")
    _edit_state(three, shard="1/3")
    with pytest.raises(MergeError, match="split the queries different ways"):
        merge_runs([runs["s0"], three], tmp_path / "m")
    with pytest.raises(MergeError, match="not a shard"):
        merge_runs([runs["s0"], runs["whole"]], tmp_path / "m")


def test_merge_refuses_duplicate_and_missing_ids(runs, tmp_path):
    # Two unsharded folders of one setting: every id twice.
    copy = _copy(runs["whole"], tmp_path / "again")
    with pytest.raises(MergeError, match=r"query id\(s\) logged more than once: direct_attr"):
        merge_runs([runs["whole"], copy], tmp_path / "m")
    # A shard that lost a query: the benchmark's ids say which.
    short = _copy(runs["s1"], tmp_path / "s1")
    rd = RunDir(short)
    records = rd.records()
    lost = records.pop()
    rd.rewrite(records)
    results = rd.read_results()
    results["n"] = len(records)
    rd.write_results(results)
    with pytest.raises(MergeError, match=f"queries are in no shard: {lost['id']}"):
        merge_runs([runs["s0"], short], tmp_path / "m")
    # A record in the wrong shard's folder.
    stray = _copy(runs["s1"], tmp_path / "stray")
    RunDir(stray).rewrite(RunDir(stray).records() + RunDir(runs["s0"]).records()[:1])
    results = RunDir(stray).read_results()
    results["n"] += 1
    RunDir(stray).write_results(results)
    with pytest.raises(MergeError, match="belong to other shards than 1/2"):
        merge_runs([runs["s0"], stray], tmp_path / "m")


def test_merge_refuses_unfinished_shards_and_used_outputs(runs, tmp_path):
    unfinished = _copy(runs["s1"], tmp_path / "s1")
    (unfinished / "results.json").unlink()
    with pytest.raises(MergeError, match="did not finish"):
        merge_runs([runs["s0"], unfinished], tmp_path / "m")
    with pytest.raises(MergeError, match="already holds a run"):
        merge_runs([runs["s0"], runs["s1"]], runs["whole"])


def test_merge_without_the_data_keeps_shard_order_and_says_so(runs, tmp_path, vstar):
    res = merge_runs([runs["s0"], runs["s1"]], tmp_path / "m", data=tmp_path / "moved", plots=False)
    assert any("could not be read" in n for n in res.notes)
    ids = [r["id"] for r in RunDir(tmp_path / "m").records()]
    s0 = [r["id"] for r in RunDir(runs["s0"]).records()]
    assert ids[: len(s0)] == s0 and len(ids) == 2 * N_PER_CAT


def test_merge_reads_folders_without_run_json(tmp_path):
    """Run folders that hold only samples.jsonl and results.json (no run.json) merge too."""
    from tests.tools.synthetic_run import write_synthetic_run

    whole = RunDir(write_synthetic_run(tmp_path / "whole", 40, mode="both"))
    parts = []
    for i, wall in enumerate((30.0, 50.0)):
        rd = RunDir(tmp_path / f"part{i}")
        rd.path.mkdir()
        rd.rewrite([r for r in whole.records() if shard_of(r["id"], 2) == i])
        results = whole.read_results()
        results["config"] |= {"bench": "vstar", "data": str(tmp_path / "gone"), "shard": f"{i}/2"}
        results |= {"n": len(rd.records()), "wall_time": wall}
        rd.write_results(results)
        parts.append(rd.path)
    res = merge_runs(parts, tmp_path / "m", plots=False)
    assert res.wall_time == 80.0 and res.wall_time_elapsed == 50.0
    assert any("could not be read" in n for n in res.notes)  # the data is gone
    merged = RunDir(tmp_path / "m")
    assert sorted(r["id"] for r in merged.records()) == [r["id"] for r in whole.records()]
    assert merged.read_results()["beta"] == pytest.approx(whole.read_results()["beta"])
    assert "shard" not in merged.read_state()["config"]
