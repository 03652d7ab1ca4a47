"""``speceyes eval --ray ADDRESS``: the N shards of an eval as Ray actors, merged into one run.

Each shard (:mod:`speceyes.bench.shards`) runs in an actor of its own, which builds its own
funnel (models in process, on ``--gpus-per-shard`` GPUs when given, or the servers behind
``--small``/``--large`` URLs) and runs ``speceyes eval --shard i/N --resume`` into
``OUTPUT/shards/i-of-N``. When every shard has finished, :func:`speceyes.bench.merge.merge_runs`
joins them into ``OUTPUT``, which then reads as one run (report, regate, calibrate, view).

Failures: an actor that dies (its process killed, its node lost) is restarted by Ray up to
``--max-restarts`` times and its call retried; the restarted actor resumes its shard from its
run folder, so no query is lost or logged twice (a query in flight is run again). A driver
that dies can be rerun with ``--resume``: every shard continues where it stopped.

Every node must see the benchmark data and ``OUTPUT`` at the same paths (a shared filesystem);
relative paths are made absolute here, on the driver.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from speceyes.bench.shards import Shard, shard_of
from speceyes.rundir import RunDir, RunDirError
from speceyes.scale.session import connect, require_ray

__all__ = ["ShardWorker", "add_ray_eval_args", "run_ray_eval", "shard_folder"]

SHARDS_DIR = "shards"  # OUTPUT/shards/i-of-N: the shards' own run folders
DEFAULT_MAX_RESTARTS = 3
# Test hook: "i:K" makes shard i's actor exit abruptly once its run folder holds K records
# (only the incarnation that sees the count reach K, so the restarted actor finishes).
EXIT_AFTER_ENV = "SPECEYES_RAY_TEST_EXIT_AFTER"
_PATH_ARGS = ("data", "output", "small", "large", "calibration", "image_dir")


def add_ray_eval_args(parser: argparse.ArgumentParser) -> None:
    """``--ray`` and the flags that size its actors (read only with ``--ray``)."""
    g = parser.add_argument_group("ray (with --ray; needs the extra speceyes[ray])")
    g.add_argument(
        "--ray",
        default=None,
        metavar="ADDRESS",
        help="run the shards as actors on the Ray cluster at ADDRESS (auto: this machine's; "
        "local: start Ray here), then merge them into --output",
    )
    g.add_argument(
        "--shards",
        type=int,
        default=None,
        help="how many shards (actors) (default: the cluster's GPUs / --gpus-per-shard, "
        "else its CPUs / --cpus-per-shard)",
    )
    g.add_argument(
        "--gpus-per-shard",
        type=float,
        default=0.0,
        help="GPUs each actor holds; in-process hf models then default to --device-map auto "
        "(default: 0, e.g. with --small/--large server URLs)",
    )
    g.add_argument(
        "--cpus-per-shard", type=float, default=1.0, help="CPUs each actor holds (default: 1)"
    )
    g.add_argument(
        "--max-restarts",
        type=int,
        default=DEFAULT_MAX_RESTARTS,
        help=f"restarts of a dead actor, which resumes its shard (default: {DEFAULT_MAX_RESTARTS})",
    )


def shard_folder(output: Path, shard: Shard) -> Path:
    """The run folder of ``shard`` under the merged run's folder ``output``."""
    return output / SHARDS_DIR / f"{shard.index}-of-{shard.count}"


class ShardWorker:
    """One shard's eval in a Ray actor (made remote by :func:`run_ray_eval`)."""

    def run(self, args: argparse.Namespace) -> dict[str, Any]:
        """``speceyes eval`` over ``args`` (one shard, resuming); the shard's results."""
        from speceyes.cli.eval import run as run_eval_command

        out = RunDir(args.output)
        _arm_exit_hook(out, args.shard)
        run_eval_command(args)
        return out.read_results()


def run_ray_eval(args: argparse.Namespace) -> int:
    """The ``eval --ray`` command: every shard as an actor, then the merge into --output."""
    from speceyes.bench.benchmarks import load_from_args
    from speceyes.bench.merge import merge_runs

    if args.shard is not None:
        raise ValueError("--ray runs every shard itself; drop --shard (use --shards N)")
    if args.shards is not None and args.shards < 1:
        raise ValueError(f"--shards must be at least 1, got {args.shards}")
    args = _absolute(args)
    bench, _, queries = load_from_args(args)
    ids = [q.id for q in itertools.islice(queries, args.limit)]
    if not ids:
        raise ValueError(f"no queries found in {args.data}")
    out = Path(args.output or f"runs/{bench}-{args.mode}").absolute()
    if RunDir(out).holds_run():
        raise RunDirError(f"{out} already holds a run (merged); choose another --output")

    ray = require_ray()
    started = connect(args.ray)
    actors: list[Any] = []
    try:
        n = args.shards or _default_shards(ray.cluster_resources(), args)
        shards = [Shard(i, n) for i in range(n)]
        _check_shards(out, shards, ids, resume=args.resume)
        worker = ray.remote(ShardWorker)
        options: dict[str, Any] = {
            "num_cpus": args.cpus_per_shard,
            "max_restarts": args.max_restarts,
            "max_task_retries": args.max_restarts,  # the call is rerun on the restarted actor
        }
        if args.gpus_per_shard:
            options["num_gpus"] = args.gpus_per_shard
        if os.environ.get(EXIT_AFTER_ENV):  # the test hook reaches the actors' processes
            options["runtime_env"] = {"env_vars": {EXIT_AFTER_ENV: os.environ[EXIT_AFTER_ENV]}}
        t0 = time.perf_counter()
        calls = {}
        for shard in shards:
            actor = worker.options(**options).remote()
            actors.append(actor)
            calls[actor.run.remote(_shard_args(args, out, shard))] = shard
        pending = list(calls)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            res = ray.get(done[0])
            print(f"shard {calls[done[0]]}: n={res['n']} wall={res['wall_time']:.1f}s", flush=True)
        elapsed = time.perf_counter() - t0
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        if started:
            ray.shutdown()

    merged = merge_runs([shard_folder(out, s) for s in shards], out)
    res = RunDir(out).read_results()
    print(f"run folder: {out} (merged from {n} shards in {SHARDS_DIR}/)")
    print(
        f"n={res['n']} accuracy={res['accuracy']:.4f} errors={res['n_errors']} "
        f"device time={merged.wall_time:.1f}s (sum of shards) elapsed={elapsed:.1f}s"
    )
    for note in merged.notes:
        print(f"note: {note}")
    print(json.dumps(res["metrics"], indent=2))
    return 0


def _default_shards(resources: dict[str, float], args: argparse.Namespace) -> int:
    if args.gpus_per_shard:
        return max(1, int(resources.get("GPU", 0) // args.gpus_per_shard))
    return max(1, int(resources.get("CPU", 1) // max(args.cpus_per_shard, 1e-9)))


def _check_shards(out: Path, shards: list[Shard], ids: list[str], *, resume: bool) -> None:
    """Refuse, before any actor starts, a shard with no query (the split is by hash) and shard
    folders from an earlier run when not resuming."""
    counts = Counter(shard_of(i, len(shards)) for i in ids)
    empty = [str(s) for s in shards if not counts[s.index]]
    if empty:
        raise ValueError(
            f"shard(s) {', '.join(empty)} would hold none of the {len(ids)} queries; "
            "use fewer --shards"
        )
    used = [shard_folder(out, s) for s in shards if RunDir(shard_folder(out, s)).holds_run()]
    if used and not resume:
        raise RunDirError(
            f"{used[0].parent} already holds shard runs; pass --resume to continue them or "
            "choose another --output"
        )


def _absolute(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with local paths made absolute (actors may start in another directory)."""
    fixed = argparse.Namespace(**vars(args))
    for name in _PATH_ARGS:
        value = getattr(fixed, name, None)
        if isinstance(value, str) and value and Path(value).exists():
            setattr(fixed, name, str(Path(value).absolute()))
    if fixed.gpus_per_shard and fixed.engine == "hf" and fixed.device_map is None:
        fixed.device_map = "auto"  # the actor sees only its own GPUs
    return fixed


def _shard_args(args: argparse.Namespace, out: Path, shard: Shard) -> argparse.Namespace:
    """The ``eval`` arguments one actor runs: its shard, its folder, always resuming (a
    restarted actor continues its own folder; the driver refused stale folders already)."""
    return argparse.Namespace(
        **{
            **vars(args),
            "shard": shard,
            "output": str(shard_folder(out, shard)),
            "resume": True,
            "no_progress": True,
            "ray": None,
        }
    )


def _arm_exit_hook(out: RunDir, shard: Shard) -> None:
    spec = os.environ.get(EXIT_AFTER_ENV, "")
    index, _, count = spec.partition(":")
    if not spec or int(index) != shard.index:
        return
    limit = int(count)

    def logged() -> int:
        path = out.samples_file
        return path.read_bytes().count(b"\n") if path.is_file() else 0

    if logged() >= limit:
        return  # a restarted incarnation: finish the shard

    def watch() -> None:
        while logged() < limit:
            time.sleep(0.01)
        os._exit(1)  # as a killed process: no cleanup, no flush

    threading.Thread(target=watch, daemon=True, name="speceyes-exit-hook").start()
