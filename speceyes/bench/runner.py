"""``speceyes eval``: run a benchmark through the funnel, one logged line per query.

A run directory (:mod:`speceyes.rundir`) holds ``run.json`` (the configuration, written first:
the funnel's settings flat as readers look them up, and the whole resolved ``Settings`` under
``settings``, which ``Settings.from_dict`` reads back),
``samples.jsonl`` (one line per query, appended and flushed as soon as the query finishes) and
``results.json`` (metrics, written at the end). ``resume`` skips every id already logged, so a
killed run loses at most the batch in flight and never logs a query twice.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from speceyes import __version__, gate
from speceyes.bench import benchmarks, scoring
from speceyes.bench.calibration_file import SETTINGS_KEY
from speceyes.bench.shards import Shard
from speceyes.funnel import Funnel
from speceyes.rates import beta_alpha_of
from speceyes.rundir import RunDir, RunDirError
from speceyes.types import CASCADE_PHASES, PHASES, Query, Result

if TYPE_CHECKING:
    from speceyes.factory import Settings


@dataclass
class EvalSpec:
    bench: str
    data: str
    output: Path
    limit: int | None = None
    resume: bool = False
    retry_errors: bool = False  # on resume, redo logged queries that ended in an error
    llm_judge: str | None = None  # OpenAI-compatible URL judging free-form answers (off: None)
    llm_judge_model: str | None = None
    models: dict[str, str | None] = field(default_factory=dict)
    loader_kw: dict[str, Any] = field(default_factory=dict)
    shard: Shard | None = None  # run only this shard of the queries (recorded in run.json)
    settings: Settings | None = None  # the resolved settings the funnel was built from


def _topk_list(topk: np.ndarray | None) -> list[list[float]] | None:
    if topk is None:
        return None
    # float32 precision is what the models produce; 6 significant digits keep the gate exact to 1e-5.
    return [[float(f"{v:.6g}") for v in row] for row in np.asarray(topk, dtype=np.float32)]


def sample_record(
    q: Query, r: Result, mode: str, score: Callable[[Query, str | None], bool] = scoring.is_correct
) -> dict[str, Any]:
    """The logged line for one query (the format `regate`, `calibrate` and `report` read)."""
    small_correct = None if r.small_answer is None else score(q, r.small_answer)
    agent_correct = None if r.agent_answer is None else score(q, r.agent_answer)
    used_agent = r.route not in ("small", "small_only", "small_deep", "large_direct")
    error = r.error if (r.route == "error" or (used_agent and r.error)) else None
    record = {
        "id": q.id,
        "category": q.category,
        "meta": q.meta,
        "question": q.question,
        "options": q.options,
        "answer": q.answer,
        "mode": mode,
        "route": r.route,
        "p_tool": r.p_tool,
        "judge_tool": r.judge_tool,
        "small_answer": r.small_answer,
        "small_correct": small_correct,
        "confidence": r.confidence,
        "small_topk": _topk_list(r.small_topk),
        "agent_answer": r.agent_answer,
        "agent_correct": agent_correct,
        "prediction": r.answer,
        "correct": error is None and score(q, r.answer),
        "tool_calls": r.tool_calls,
        "invalid_tool_calls": r.invalid_tool_calls,
        "timings": {k: round(v, 6) for k, v in r.timings.items()},
        "error": error,
        "agent_error": r.error if r.error and error is None else None,
        "trace": r.trace,
    }
    if r.stages:  # the cascade's stages, each scored as the small and agent answers are
        record["stages"] = [
            {**s, "correct": None if s["answer"] is None else score(q, s["answer"])}
            for s in r.stages
        ]
    return record


def stage_summary(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per cascade stage (in the order the records list them): the queries it answered, their
    accuracy, its gate's passes and the accuracy among them, the queries whose final answer it
    gave (the first stage that passed), and its seconds in all; empty without a cascade."""
    out: dict[str, dict[str, Any]] = {}
    for rec in records:
        stages = rec.get("stages") or []
        first = next((s["stage"] for s in stages if s["accepted"]), None)
        for s in stages:
            row = out.setdefault(
                s["stage"], {"n": 0, "correct": 0, "passed": 0, "passed_correct": 0,
                             "answered": 0, "seconds": 0.0, "tool_calls": 0},
            )  # fmt: skip
            row["n"] += 1
            row["correct"] += bool(s.get("correct"))
            row["passed"] += bool(s["accepted"])
            row["passed_correct"] += bool(s["accepted"] and s.get("correct"))
            row["answered"] += rec["route"] != "error" and s["stage"] == first
            row["seconds"] += float(s["seconds"])
            row["tool_calls"] += int(s.get("tool_calls") or 0)
    for row in out.values():
        n, passed = row["n"], row["passed"]
        row["accuracy"] = row.pop("correct") / n
        row["acceptance"] = passed / n
        pc = row.pop("passed_correct")
        row["accuracy_passed"] = pc / passed if passed else None
        row["seconds_per_query"] = row["seconds"] / n
    return out


def versions(models: dict[str, str | None]) -> dict[str, Any]:
    out: dict[str, Any] = {"speceyes": __version__, "python": platform.python_version()}
    for mod in ("torch", "transformers", "numpy"):
        try:
            out[mod] = __import__(mod).__version__
        except ImportError:
            pass
    for role, path in models.items():
        if path:
            cfg = Path(path) / "config.json"
            out[f"{role}_model"] = {
                "path": str(path),
                "config_mtime": cfg.stat().st_mtime if cfg.is_file() else None,
            }
    return out


def summarize(records: list[dict[str, Any]], bench: str) -> dict[str, Any]:
    """Metrics, beta, alpha and time share per phase from logged records."""
    metrics = benchmarks.get(bench).metrics(records)
    beta, alpha = beta_alpha_of(records)
    # The cascade's steps count where they ran (a two-stage funnel's keys are as before).
    ran = [p for p in CASCADE_PHASES if any(p in r["timings"] for r in records)]
    phase_time = {p: float(sum(r["timings"].get(p, 0.0) for r in records)) for p in (*PHASES, *ran)}
    total = sum(phase_time.values())
    return {
        "metrics": metrics,
        "accuracy": float(np.mean([scoring.record_correct(r) for r in records]))
        if records
        else None,
        "n": len(records),
        "n_errors": sum(1 for r in records if r.get("error")),
        # judged tool-free answers that were empty or whitespace: never accepted (gate.is_blank)
        "n_blank_answers": sum(
            1
            for r in records
            if r.get("judge_tool") is False
            and r.get("small_answer") is not None
            and gate.is_blank(r["small_answer"])
        ),
        "beta": beta,
        "alpha_accept": alpha,
        "routes": {
            k: sum(1 for r in records if r["route"] == k)
            for k in sorted({r["route"] for r in records})
        },
        "time_by_phase": phase_time,
        "time_share": {p: (t / total if total else 0.0) for p, t in phase_time.items()},
        "tool_calls_per_query": float(np.mean([r["tool_calls"] for r in records]))
        if records
        else 0.0,
        **({"stages": stages} if (stages := stage_summary(records)) else {}),
        **({"operating_points": pts} if (pts := point_summary(records)) else {}),
    }


def point_summary(records: list[dict]) -> dict[str, dict[str, float | int]]:
    """``--judge auto``: per operating point, the queries it answered and their accuracy."""
    by: dict[str, list[bool]] = {}
    for r in records:
        point = next((t["point"] for t in r.get("trace") or () if t.get("type") ==
                      "operating_point"), None)
        if point is not None:
            by.setdefault(point, []).append(bool(scoring.record_correct(r)))
    return {k: {"n": len(v), "accuracy": float(np.mean(v))} for k, v in sorted(by.items())}


def _progress(total: int | None, done: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=done, disable=not enabled, unit="q", dynamic_ncols=True)


def _limited(queries: Iterable[Query], limit: int | None) -> Iterator[Query]:
    for i, q in enumerate(queries):
        if limit is not None and i >= limit:
            return
        yield q


def run_eval(
    spec: EvalSpec,
    funnel: Funnel,
    queries: Iterable[Query],
    *,
    total: int | None = None,
    progress: bool = True,
    plots: bool = True,
) -> dict[str, Any]:
    """Run (or resume) an evaluation; returns the results dict also written to results.json."""
    out = spec.output
    out.mkdir(parents=True, exist_ok=True)
    run_dir = RunDir(out)
    config = {
        "bench": spec.bench,
        "data": str(spec.data),
        "limit": spec.limit,
        **funnel.config.to_dict(),
        "models": spec.models,
        "agent": getattr(funnel.agent, "name", None),
        "loader": spec.loader_kw,
        # Each model's decoding policy and the greedy settings it decodes with.
        "decoding": {
            role: getattr(backend, "decoding", None)
            for role, backend in (("small", funnel.small), ("large", funnel.large))
        },
    }
    if spec.shard is not None:  # only when sharded: older run folders still resume
        config["shard"] = str(spec.shard)
    if spec.settings is not None:
        config[SETTINGS_KEY] = spec.settings.to_dict()
    state: dict[str, Any] = {"config": config, "segments": []}
    if run_dir.holds_run():
        if not spec.resume:
            raise RunDirError(
                f"{out} already holds a run; pass --resume to continue it or choose another --output"
            )
        logged_state = run_dir.read_state()
        if logged_state is not None:
            state = logged_state
            # A run logged before "decoding" or the settings were recorded resumes under today's.
            for key in ("decoding", SETTINGS_KEY):
                if key in config:
                    state["config"].setdefault(key, json.loads(json.dumps(config[key])))
            # The settings are recorded, not compared: a run resumes, as it always did, on
            # another device or memory share; the other keys are what its results depend on.
            logged, today = (
                {k: v for k, v in c.items() if k != SETTINGS_KEY}
                for c in (state["config"], json.loads(json.dumps(config)))
            )
            if logged != today:
                diff = sorted(k for k in today if logged.get(k) != today[k])
                raise RunDirError(
                    f"cannot resume {out}: the configuration differs in {', '.join(diff)}"
                )
    run_dir.repair()
    done_records = run_dir.records()
    if spec.retry_errors:
        kept = [r for r in done_records if not (r.get("error") or r.get("agent_error"))]
        if len(kept) < len(done_records):
            run_dir.rewrite(kept)
        done_records = kept
    done_ids = {r["id"] for r in done_records}

    todo = (q for q in _limited(queries, spec.limit) if q.id not in done_ids)
    n_total = (
        min(total, spec.limit) if (total is not None and spec.limit) else (total or spec.limit)
    )
    records = list(done_records)
    bar = _progress(n_total, len(done_records), progress)
    qmap: dict[str, Query] = {}

    def remember(stream: Iterator[Query]) -> Iterator[Query]:
        for q in stream:
            qmap[q.id] = q
            yield q

    judge = None
    if spec.llm_judge:
        from speceyes.bench.llm_judge import LLMJudge

        judge = LLMJudge(spec.llm_judge, spec.llm_judge_model)
        config["llm_judge"] = {"url": spec.llm_judge, "model": judge.model}
    from speceyes.bench.llm_judge import make_scorer

    score = make_scorer(judge)

    t0 = time.perf_counter()
    cpu0 = time.process_time()  # CPU seconds of every thread of the process (torch's too)
    # The segment is kept current in run.json as the run goes, so a killed run's time still counts.
    segment = {"started": time.time(), "seconds": 0.0, "cpu_seconds": 0.0, "queries": 0}
    state["segments"].append(segment)
    run_dir.write_state(state)  # a run killed before its first update still shows the segment
    last_save = t0
    try:
        with run_dir.writer() as log:
            for r in funnel.iter_results(remember(todo)):
                q = qmap.pop(r.id)
                rec = sample_record(q, r, funnel.config.mode, score)
                log.append(rec)
                records.append(rec)
                bar.update(1)
                s = funnel.stats
                bar.set_postfix(
                    acc=f"{np.mean([x['correct'] for x in records]):.3f}",
                    beta="-" if s.beta is None else f"{s.beta:.2f}",
                    alpha="-" if s.alpha is None else f"{s.alpha:.2f}",
                    refresh=False,
                )
                now = time.perf_counter()
                segment.update(
                    seconds=now - t0,
                    cpu_seconds=time.process_time() - cpu0,
                    queries=len(records) - len(done_records),
                )
                if now - last_save > 1.0:
                    run_dir.write_state(state)
                    last_save = now
    finally:
        bar.close()
        segment.update(
            seconds=time.perf_counter() - t0,
            cpu_seconds=time.process_time() - cpu0,
            queries=len(records) - len(done_records),
        )
        run_dir.write_state(state)

    results = run_results(config, records, spec.bench, state["segments"], versions(spec.models))
    write_results(run_dir, results, plots=plots)
    return results


def run_results(
    config: dict[str, Any],
    records: list[dict[str, Any]],
    bench: str,
    segments: list[dict[str, Any]],
    versions_info: dict[str, Any],
) -> dict[str, Any]:
    """results.json of a run: the summary of its records, and its wall time as the sum of its
    time segments (a resumed run's segments add up; so do a merged run's shards)."""
    wall = float(sum(s["seconds"] for s in segments))
    cpu_parts = [s.get("cpu_seconds") for s in segments]  # absent in older run folders
    cpu = float(sum(cpu_parts)) if None not in cpu_parts else None
    return {
        "config": config,
        **summarize(records, bench),
        "wall_time": wall,
        "time_per_query": wall / len(records) if records else None,
        "qps": len(records) / wall if wall > 0 else None,
        "cpu_time": cpu,
        "cpu_time_per_query": cpu / len(records) if (records and cpu is not None) else None,
        "segments": segments,
        "versions": versions_info,
    }


def write_results(run_dir: RunDir, results: dict[str, Any], *, plots: bool = True) -> None:
    """Write results.json, then the run's plots (named in it; a failed plot is noted there)."""
    run_dir.write_results(results)
    if plots:
        from speceyes.bench.plots import write_run_plots

        try:
            results["plots"] = [str(p) for p in write_run_plots(run_dir.path)]
        except Exception as e:  # a plot must never cost the run's results
            results["plots_error"] = f"{type(e).__name__}: {e}"
        run_dir.write_results(results)
