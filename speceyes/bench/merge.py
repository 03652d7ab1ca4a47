"""``speceyes merge``: the run folders of a sharded eval joined into one run folder.

Each shard folder is a finished ``speceyes eval --shard i/N`` run (:mod:`speceyes.bench.shards`).
The merged folder has the three files of any run (:mod:`speceyes.rundir`), so ``report``,
``regate``, ``calibrate`` and ``view`` read it as one run:

* ``run.json``: the shards' common configuration without its ``shard`` key (so it equals the
  unsharded run's), every shard's time segments (each tagged with its shard) and
  ``merged_from`` (each shard's folder, shard, query count and wall time);
* ``samples.jsonl``: every shard's records, in the benchmark's order when its data can be
  read (else shard by shard);
* ``results.json``: recomputed from the merged records by the code ``eval`` uses
  (:func:`speceyes.bench.runner.run_results`), plus the shard times below.

Wall time. ``wall_time`` is the sum of the shards' wall times: the device time the run took,
the same quantity an unsharded run's ``wall_time`` measures, so ``time_per_query``, ``qps`` and
``report``'s speedup (agent-only seconds per query / this run's) compare a merged run with an
unsharded one, or two merged runs, on one definition. ``wall_time_elapsed`` is the longest
shard's wall time: what the clock showed when the shards ran side by side, each on its own
device; it is recorded, never used for a speedup. The sum is the device time only when each
shard had its device(s) to itself.

Refusals (:class:`MergeError`, naming what differs): shards whose run.json differs beyond the
``shard`` key and the time segments; a folder without results.json (an unfinished shard); shards
of different N, a shard given twice or missing; a record whose id hashes to another shard; a
query id in two shards; and, when the benchmark's data can be read, queries missing from every
shard or not in the benchmark. A folder without run.json is read from the config and segments in its results.json.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from speceyes.bench import benchmarks
from speceyes.bench.runner import run_results, write_results
from speceyes.bench.shards import Shard, parse_shard
from speceyes.rundir import RunDir, ScanReport, json_default

__all__ = ["MergeError", "MergeResult", "ShardRun", "merge_runs", "read_shard"]

SHARD_KEY = "shard"  # in a run's config: "i/N"
TIME_KEYS = ("segments",)  # run.json entries that are time, not settings
MAX_LISTED = 10  # ids named in a message before "and K more"


class MergeError(ValueError):
    """Shard folders that cannot be merged into one run; the message says why."""


@dataclass
class ShardRun:
    """One shard's run folder, read."""

    path: Path
    state: dict[str, Any]  # run.json
    results: dict[str, Any]
    records: list[dict[str, Any]]
    shard: Shard | None

    @property
    def label(self) -> str:
        return str(self.shard) if self.shard is not None else str(self.path)

    @property
    def wall_time(self) -> float:
        return float(sum(s["seconds"] for s in self.state.get("segments") or []))


@dataclass
class MergeResult:
    output: Path
    n: int
    shards: list[str]
    wall_time: float  # sum over shards
    wall_time_elapsed: float  # longest shard
    notes: list[str] = field(default_factory=list)


def read_shard(path: str | Path) -> ShardRun:
    """A finished run folder: run.json, results.json and every record of samples.jsonl."""
    run_dir = RunDir(path)
    if not run_dir.path.is_dir():
        raise MergeError(f"{run_dir.path}: not a run folder")
    if not run_dir.results_file.is_file():
        raise MergeError(
            f"{run_dir.path}: no results.json, so the run did not finish; resume it with "
            "`speceyes eval ... --resume` first"
        )
    results = run_dir.read_results()
    state = run_dir.read_state() or _state_from_results(results)
    if not isinstance(state.get("config"), dict) or not state["config"]:
        raise MergeError(f"{run_dir.path}: no run configuration: not a speceyes eval run")
    scan = ScanReport()
    records = list(run_dir.iter_records(report=scan))
    if scan.torn is not None:
        raise MergeError(f"{run_dir.samples_file}:{scan.torn[0]}: the last line is cut off")
    if results.get("n") is not None and results["n"] != len(records):
        raise MergeError(
            f"{run_dir.path}: samples.jsonl holds {len(records)} records but results.json "
            f"counts {results['n']}"
        )
    label = state["config"].get(SHARD_KEY)
    try:
        shard = None if label is None else parse_shard(label)
    except ValueError as exc:
        raise MergeError(f"{run_dir.path}: run.json: {exc}") from exc
    return ShardRun(run_dir.path, state, results, records, shard)


def _state_from_results(results: dict[str, Any]) -> dict[str, Any]:
    """run.json as results.json gives it, for a run folder written without run.json."""
    segments = results.get("segments") or [{"seconds": float(results.get("wall_time") or 0.0)}]
    return {"config": results.get("config") or {}, "segments": segments}


def merge_runs(
    paths: Sequence[str | Path],
    output: str | Path,
    *,
    data: str | Path | None = None,
    plots: bool = True,
) -> MergeResult:
    """Merge the shard run folders ``paths`` into a new run folder ``output``.

    ``data`` is the benchmark's location when it moved since the shards ran (default: the one
    in their config); it gives the query order and the check for missing queries.
    """
    out = RunDir(output)
    if not paths:
        raise MergeError("give the run folders of the shards to merge")
    if out.holds_run():
        raise MergeError(f"{out.path} already holds a run; choose another --output")
    shards = [read_shard(p) for p in paths]
    config = _common_config(shards)
    shards = _ordered_shards(shards)
    _check_records(shards)
    notes: list[str] = []
    by_id = {r["id"]: r for s in shards for r in s.records}
    order = _dataset_ids(config, data, notes)
    if order is not None:
        _check_against_dataset(by_id, order)
        records = [by_id[i] for i in order]
    else:
        records = [r for s in shards for r in s.records]

    segments = [
        {**seg, SHARD_KEY: s.label} for s in shards for seg in s.state.get("segments") or []
    ]
    walls = {s.label: s.wall_time for s in shards}
    state = {
        "config": config,
        "segments": segments,
        "merged_from": [
            {"path": str(s.path), SHARD_KEY: s.label, "n": len(s.records), "wall_time": w}
            for s, w in zip(shards, walls.values(), strict=True)
        ],
    }
    results = run_results(config, records, str(config["bench"]), segments, _versions(shards, notes))
    results["wall_time_elapsed"] = max(walls.values(), default=0.0)
    results["shard_wall_times"] = walls
    out.path.mkdir(parents=True, exist_ok=True)
    out.write_state(state)
    out.rewrite(records)
    write_results(out, results, plots=plots)
    return MergeResult(
        out.path,
        len(records),
        [s.label for s in shards],
        results["wall_time"],
        results["wall_time_elapsed"],
        notes,
    )


# ---------------------------------------------------------------------------- the checks


def _settings(state: dict[str, Any]) -> dict[str, Any]:
    """run.json as the value shards must share: without its time and the shard itself."""
    plain = json.loads(json.dumps(state, default=json_default))
    out = {k: v for k, v in plain.items() if k not in TIME_KEYS}
    out["config"] = {k: v for k, v in plain["config"].items() if k != SHARD_KEY}
    return out


def _differing_keys(a: Any, b: Any, prefix: str = "") -> list[str]:
    """Dotted paths where two JSON values differ (a whole list counts as one value)."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted(set(a) | set(b))
        out: list[str] = []
        for k in keys:
            out += _differing_keys(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [prefix.rstrip(".")]


def _common_config(shards: list[ShardRun]) -> dict[str, Any]:
    first = _settings(shards[0].state)
    for s in shards[1:]:
        diff = _differing_keys(first, _settings(s.state))
        if diff:
            raise MergeError(
                f"{s.path} and {shards[0].path} are runs of different settings: run.json "
                f"differs in {', '.join(diff)}"
            )
    if not first["config"].get("bench"):
        raise MergeError(f"{shards[0].path}: run.json names no benchmark (config 'bench')")
    return first["config"]


def _ordered_shards(shards: list[ShardRun]) -> list[ShardRun]:
    """The shards by index, after checking they are all N of one split."""
    labelled = [s for s in shards if s.shard is not None]
    if not labelled:
        return shards  # plain runs over disjoint queries: the id checks below still apply
    if len(labelled) < len(shards):
        plain = ", ".join(str(s.path) for s in shards if s.shard is None)
        raise MergeError(f"{plain}: not a shard (no 'shard' in run.json), unlike the others")
    counts = sorted({s.shard.count for s in labelled})  # type: ignore[union-attr]
    if len(counts) > 1:
        listed = ", ".join(f"{s.path} ({s.label})" for s in shards)
        raise MergeError(f"the shards split the queries different ways: {listed}")
    n = counts[0]
    seen: dict[int, ShardRun] = {}
    for s in shards:
        i = s.shard.index  # type: ignore[union-attr]
        if i in seen:
            raise MergeError(f"shard {s.label} is given twice: {seen[i].path} and {s.path}")
        seen[i] = s
    missing = [f"{i}/{n}" for i in range(n) if i not in seen]
    if missing:
        raise MergeError(f"missing shard(s) {', '.join(missing)} of {n}: merge needs all {n}")
    return [seen[i] for i in range(n)]


def _listed(ids: Iterable[str]) -> str:
    ids = list(ids)
    head = ", ".join(ids[:MAX_LISTED])
    return head + (f" and {len(ids) - MAX_LISTED} more" if len(ids) > MAX_LISTED else "")


def _check_records(shards: list[ShardRun]) -> None:
    where: dict[str, list[str]] = {}
    for s in shards:
        strays = [str(r["id"]) for r in s.records if s.shard and not s.shard.holds(str(r["id"]))]
        if strays:
            raise MergeError(
                f"{s.path}: {len(strays)} record(s) belong to other shards than {s.label}: "
                f"{_listed(strays)}"
            )
        for r in s.records:
            where.setdefault(r["id"], []).append(s.label)
    dups = {i: where_ for i, where_ in where.items() if len(where_) > 1}
    if dups:
        shown = [f"{i} ({', '.join(w)})" for i, w in dups.items()]
        raise MergeError(f"{len(dups)} query id(s) logged more than once: {_listed(shown)}")


def _dataset_ids(
    config: dict[str, Any], data: str | Path | None, notes: list[str]
) -> list[str] | None:
    """The ids the run covers, in the benchmark's order (the first ``limit``); None, with a
    note, when the data cannot be read."""
    root = data if data is not None else config.get("data")
    try:
        bench = benchmarks.get(str(config["bench"]))
        queries = bench.load_logged(str(root), config.get("loader") or {})
        return list(_first(queries, config.get("limit")))
    except (OSError, ValueError) as exc:
        notes.append(
            f"the benchmark data at {root} could not be read ({exc}): no check for missing "
            "queries, records kept in shard order (pass --data to point at the data)"
        )
        return None


def _first(queries: Iterator[Any], limit: int | None) -> Iterator[str]:
    for i, q in enumerate(queries):
        if limit is not None and i >= limit:
            return
        yield q.id


def _check_against_dataset(by_id: dict[str, Any], order: list[str]) -> None:
    expected = set(order)
    missing = [i for i in order if i not in by_id]
    extra = [str(i) for i in by_id if i not in expected]
    if missing:
        raise MergeError(
            f"{len(missing)} of the benchmark's {len(order)} queries are in no shard: "
            f"{_listed(missing)}"
        )
    if extra:
        raise MergeError(f"{len(extra)} logged id(s) are not in the benchmark: {_listed(extra)}")


def _versions(shards: list[ShardRun], notes: list[str]) -> dict[str, Any]:
    """The first shard's versions; where another shard's differ, all are kept and noted."""
    first = shards[0].results.get("versions") or {}
    differ = [s.label for s in shards if (s.results.get("versions") or {}) != first]
    if not differ:
        return first
    notes.append(f"library or model versions differ between shards: {', '.join(differ)}")
    return {**first, "per_shard": {s.label: s.results.get("versions") for s in shards}}
