"""Load benchmark on a real engine: agent-only vs SpecEyes (each judge variant) behind vLLM.

Starts two vLLM OpenAI servers on 127.0.0.1 (free ports), one per bundled mini-world model
(``speceyes/miniworld/models/{small,large}``), with the settings of ``tests/vllm_support.py``
(CPU build: eager, 1 GiB KV cache, prefix caching, 64 logprobs, float32). Each mode gets its own
``speceyes serve`` app (pipelined schedule, the manifest's search agent, tau and batch size; the
clients see the checkpoints' own 224x224 view, as transformers does), by default in a process of
its own, as a server is deployed (``--apps process``; ``thread``: every app in this process,
beside the clients). Closed-loop clients at concurrency C send the same mini-world test
questions to every mode:

- ``agent-only``: every query through the large model's search loop;
- ``speceyes/<judge>``: the funnel with that judge variant (``large`` is the published one);
- with ``--points FILE`` (``speceyes calibrate --operating-points``): ``speceyes/auto``, the
  load-aware choice among the file's points, and every static variant the file calibrated runs
  at its own calibrated tau and the file's gate, as auto's points do. Before each C's timed
  rounds auto serves ``--settle`` untimed requests at that C: a server that stays at a load
  pays its trials of each point there once, and the timed part measures it settled (with its
  later re-runs); ``--settle 0`` gives the cold figure.

Modes are interleaved in time: for each C, ``--rounds`` rounds, and in each round every mode
serves one batch of requests in turn, in an order drawn afresh each round (``--order``), so load
from other processes on the machine, and whatever one cell leaves behind for the next, falls on
all modes alike. ``--twin J`` adds a second app of the static variant J, which does J's work:
its ratio to J is the benchmark's own noise for two modes that do the same work. A round
scores ``--requests`` requests after its first C, all sent under the full load
(:func:`closed_loop`); where 4C <= ``--short-rounds`` (by default C = 1 and 4) the rounds are
that many requests long, and more of them, the same requests per mode in all. Per mode and C
it prints throughput (C over the scored requests' mean latency, Little's law for a closed loop;
the answers counted in a window beside it), client-side p50/p95 latency, accuracy, the share
the small model answered, and throughput and p50 against agent-only at the same C; and per
query the CPU each process used and the time a request spent outside its server's own clock
(the client's latency less the server's ``total``: the HTTP round trip and the wait for an
interpreter to read the request and the response, which a funnel timing its queries cannot
see). Writes OUT/results.json, OUT/table.md, OUT/samples.jsonl (every answer of
the timed rounds, written as each round ends) and, with ``--points``, OUT/auto-decisions.log
(each of auto's choices, why, and the times it compared). The vLLM servers are always stopped
(their process groups), also on Ctrl-C, SIGTERM or SIGHUP.

    python benchmarks/bench_load_vllm.py [--concurrency 1,4,16] [--with-64] [--rounds 3]
        [--requests 0] [--short-rounds 32] [--settle -1] [--scenes 8] [--judges large,prefix,none]
        [--points FILE] [--twin none] [--order shuffle] [--placement split] [--executor uni]
        [--apps process] [--equal-hardware] [--busy 0] [--out runs/bench-load-vllm]

Placement (``--placement``). ``split`` (default) binds each server's engine threads to cores of
its own (the small model the first half of this process's cores, the large model the rest);
``shared`` keeps vLLM's own binding, which on one NUMA node puts both engines on the same cores.
vLLM's CPU worker busy-polls its input queue for a second after each step
(``SpinCondition.busy_loop_s`` in ``vllm/distributed/device_communicators/shm_broadcast.py``),
so under ``shared`` the engine that served last takes the core from the other for that second:
here a large-model request of 23 ms alone took 370 ms when sent 50 ms after a small-model one,
and a small-model request 420 ms right after a large-model one (``split``: 41 and 32 ms). On a
GPU that poll runs on a host core and slows no kernel, so ``split``, a device per model, is
the analogue of a GPU deployment; ``shared`` measures the CPU build's artefact.

Executor (``--executor``). Even on cores of its own, the engine that served last spins on its
core for that second, and the app and the other server's front processes, which are bound to
no core, lose it: an agent-only loop of 0.41 s took 0.81 s when it followed a small-model
request, and 0.42 s after 1.5 s of quiet. ``uni`` (default) runs each engine's worker inside
its engine-core process, with no shared-memory queue to poll; there the same loop took 0.41 s
after a small-model request. ``mp`` is vLLM's CPU default. With
``--equal-hardware`` a third server runs the large model on every core, and the mode
``agent-only/all`` sends agent-only's queries to it: agent-only on the hardware both of
SpecEyes' servers hold.

Apps (``--apps``). ``process`` (default) runs each mode's app in a process of its own, as a
server is deployed; ``thread`` is the earlier layout, every app and the clients in this
interpreter. With ``process`` a request spent 1-9 ms outside its server's clock (the CPU
table's last column, run 49), so the time a query spends in the funnel, which ``--judge auto``
compares, is the time its client waits.

With ``--busy N``, N CPU-bound processes (bound to no core) run through the timed rounds: the
load of another job on the machine, which the interleaved rounds should spread over every mode
alike, so that the ratios match a quiet run's.

The vLLM environment is ``.venv-vllm`` (``bash tests/vllm_env/setup.sh``) or ``--vllm-python``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing; tests/ holds the helpers
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np  # noqa: E402

from speceyes.backends.base import checkpoint_geometry  # noqa: E402
from speceyes.bench import scoring  # noqa: E402
from speceyes.bench.datasets import load_jsonl  # noqa: E402
from speceyes.factory import MANIFEST, Settings, build_funnel  # noqa: E402
from speceyes.images import load_image, to_data_uri  # noqa: E402
from speceyes.miniworld.demo import MODELS_DIR  # noqa: E402
from speceyes.miniworld.splits import level_defaults, make_split  # noqa: E402
from speceyes.operating_points import AUTO, PointChooser  # noqa: E402
from speceyes.types import Query  # noqa: E402
from tests.vllm_support import (  # noqa: E402
    EXECUTORS,
    NON_SPINNING_EXECUTOR,
    PLACEMENTS,
    SPLIT_PLACEMENT,
)

AGENT_ONLY = "agent-only"
AGENT_ONLY_ALL = "agent-only/all"  # --equal-hardware: agent-only on a server that has every core
# --twin J: a second app of the static variant J, labelled J + TWIN; it runs the same work as J
TWIN = "#twin"
ORDERS = ("shuffle", "rotate")  # --order: each round's order of modes
SMALL_ROUTE = "small"  # the route of an answer the small model gave (gate accepted)
APP_LAYOUTS = ("process", "thread")  # --apps: each mode's app in a process of its own, or here
APP_START_S = 180.0  # an app process's start-up: imports, the funnel's tokenizers
CLIENT_TIMEOUT_S = 900.0
# per mode and round, whatever C: a round must outlast this machine's jitter. At 32 a round at
# C = 1 or 4 lasted 2.5-5 s, and one mode's rounds spread by 0.93-1.03 of another's with both
# running the same point and the same model calls (runs 31-34, and two probes at one client);
# at 64 (10-15 s) auto's rounds against the best static mode's still spread by 0.93-1.01 at
# one client (run 44), where the modes are 4% apart
MIN_REQUESTS = 128
# rounds at low C (``--short-rounds``): this machine slows down by 15-35% for a minute or two at a
# time (run 58, C=1 round 1; run 59, C=1 round 3: the two blocks of 128 that met it, 45-60 s
# each, read 15-35% slower than their modes' other rounds), so in rounds of 128 such a spell
# falls on one or two of five modes. Where 4C <= 32 a mode's turn of 32 takes 11-16 s at C=1, and
# a spell then spans every mode's turn of a round or two. Each mode still serves --rounds x
# MIN_REQUESTS scored requests at that C, as before
SHORT_ROUND_REQUESTS = 32
# auto's untimed requests at a new load, in trials of max(4C, 64) requests each: a trial (a
# turnover of the queue, then PointChooser.TRIAL_QUERIES counted, half of them from the agent)
# takes up to that many at C = 16 and 64 (run 27 timed part of agent-only's first trial with
# half of it), and a new load has up to the first of each of four points and the contest's
# further passes of the three that can be close to the quickest (PointChooser._contest_trial)
SETTLE_TRIALS = 4 + 3 * (PointChooser.CONTEST_TRIALS - 1)
SETTLE_TRIAL_REQUESTS = 64
# auto's interval against the best other mode (vs_best_interval): resamples and coverage
INTERVAL_RESAMPLES = 4000
INTERVAL_LEVEL = 0.95


def round_plan(c: int, rounds: int, requests: int, short: int) -> tuple[int, int]:
    """Requests per round and rounds at ``c`` clients: ``requests`` (``--requests``) or
    max(4C, MIN_REQUESTS) per round, ``rounds`` of them; with ``short`` (``--short-rounds``) and no
    ``requests``, where 4C <= ``short``, rounds of ``short`` instead, as many as keep each mode's
    scored requests at ``rounds`` x MIN_REQUESTS (rounded up to whole rounds)."""
    if requests:
        return requests, rounds
    if short and 4 * c <= short:
        return short, -(-rounds * MIN_REQUESTS // short)
    return max(4 * c, MIN_REQUESTS), rounds


def round_order(modes: int, r: int, c: int, order: str, seed: int = 0) -> list[int]:
    """The modes' order in round ``r`` at ``c`` clients (indices into the run's modes).
    ``rotate`` shifts one fixed order by a place each round, so every mode follows the same
    mode in every round but one in ``modes`` (what came before it, and so the state it meets:
    the servers' prefix caches, a slow spell that began in the cell before, always belong to
    that one mode). ``shuffle`` draws each round's order afresh, seeded by (seed, c, r), so a
    mode's predecessor and place vary and such carry-over falls on every mode alike."""
    if order == "rotate":
        return [(j + r) % modes for j in range(modes)]
    return [int(x) for x in np.random.default_rng([seed, c, r]).permutation(modes)]


def round_start(r: int, n: int, questions: int) -> int:
    """The question that round ``r`` of ``n`` requests starts at: every mode asks the same
    questions in a round (cyclically from there)."""
    return (r * n) % questions


def settle_requests(c: int) -> int:
    """auto's default untimed requests at ``c`` clients (``--settle -1``)."""
    return SETTLE_TRIALS * max(4 * c, SETTLE_TRIAL_REQUESTS)


@dataclass
class Mode:
    label: str
    mode: str  # the funnel's mode
    judge: str | None = None  # the judge variant (speceyes mode only)
    large: str = "large"  # the large model's server: "large", or "large-all" (every core)
    auto_hold: float | None = None  # speceyes/auto: its hold margin (None: the funnel's default)
    early_agent: int | None = None  # the funnel's early_agent (None: its default)
    twin: bool = False  # --twin: a second app of a static variant (a same-work control)


@dataclass
class Sample:
    latency_s: float
    correct: bool
    route: str
    point: str | None = None  # speceyes/auto: the operating point that answered
    band: int | None = None  # speceyes/auto: the load band its point was chosen in
    timed: bool = True  # answered inside its round's counting window (see closed_loop)
    scored: bool = True  # one of its round's n requests after the first C (see closed_loop)
    index: int = -1  # its place in its round's order of requests
    slot: int = -1  # its mode's place in its round's order of modes (round_order)
    # the app's own clocks for it, in seconds: each phase's share of its batch, its wait for a
    # front batch ("queue") and the total (the response's ``speceyes.timings``)
    timings: dict[str, float] = field(default_factory=dict)
    batch: int = 0  # the size of the front batch it ran in (0: not reported)

    @property
    def server_s(self) -> float | None:
        """The server's own time for it (its response's total; None: not reported)."""
        return self.timings.get("total")


@dataclass
class LoopRun:
    """One closed loop's answers (:func:`closed_loop`) and its clocks."""

    samples: list[Sample]
    errors: int
    window_s: float  # the steady window: from its opening answer to its n-th after it
    wall_s: float  # from the first request to the last answer (the CPU counts cover this)


def phase_means(samples: list[Sample]) -> dict[str, float]:
    """Mean milliseconds per phase of the app's clocks over ``samples`` (a phase a query did
    not run counts 0; what the total holds beyond them is the app's own work; the funnel's
    phases are the query's share of its batch's phase), ``batch``: the mean front batch, and
    ``outside``: the client's latency less the app's total (HTTP both ways, intake and reply)."""
    phases = sorted({k for s in samples for k in s.timings})
    out = {k: round(1000 * float(np.mean([s.timings.get(k, 0.0) for s in samples])), 2)
           for k in phases}
    batched = [s.batch for s in samples if s.batch > 0]
    if batched:  # the phases' clocks are shares of the batch's: this turns them into times
        out["batch"] = round(float(np.mean(batched)), 2)
    with_total = [s for s in samples if "total" in s.timings]
    if with_total:
        out["outside"] = round(
            1000 * float(np.mean([s.latency_s - s.timings["total"] for s in with_total])), 2)
    return out


@dataclass
class Cell:
    """One mode at one concurrency: every request of its rounds, and their clocks."""

    mode: str
    concurrency: int
    rounds: list[list[Sample]] = field(default_factory=list)  # each round's answers, in order
    wall_s: float = 0.0  # the rounds' counting windows
    busy_wall_s: float = 0.0  # the rounds' whole time, over which the CPU was counted
    errors: int = 0
    round_qps: list[float] = field(default_factory=list)  # each round's queries/s, in order
    round_counted_qps: list[float] = field(default_factory=list)  # and its window's count
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds by process group

    @property
    def samples(self) -> list[Sample]:
        """Every round's answers, in order."""
        return [s for got in self.rounds for s in got]

    def add_round(
        self,
        got: list[Sample],
        errors: int,
        window_s: float,
        cpu_s: dict[str, float] | None = None,
        wall_s: float | None = None,
    ) -> None:
        self.rounds.append(got)
        self.errors += errors
        self.wall_s += window_s
        self.busy_wall_s += window_s if wall_s is None else wall_s
        timed = sum(s.timed for s in got)
        self.round_counted_qps.append(timed / window_s if window_s > 0 else 0.0)
        self.round_qps.append(self._little([s for s in got if s.scored]) or 0.0)
        for group, seconds in (cpu_s or {}).items():
            self.cpu_s[group] = self.cpu_s.get(group, 0.0) + seconds

    def _little(self, scored: list[Sample]) -> float | None:
        """Throughput by Little's law (J. D. C. Little, 1961) for ``concurrency`` clients that
        send again the moment they are answered: C over the mean latency (see closed_loop)."""
        return self.concurrency / float(np.mean([s.latency_s for s in scored])) if scored else None

    def summary(self) -> dict[str, Any]:
        samples = self.samples
        timed = [s for s in samples if s.timed]  # the counting windows' answers
        scored = [s for s in samples if s.scored]  # the same requests for every mode
        lat = np.array([s.latency_s for s in scored]) if scored else np.zeros(0)
        n, n_all = len(scored), len(samples)
        outside = [s.latency_s - s.server_s for s in scored if s.server_s is not None]
        return {
            "mode": self.mode,
            "concurrency": self.concurrency,
            "requests": n,
            "rounds": len(self.rounds),
            "errors": self.errors,
            "qps": self._little(scored),
            "round_qps": [round(x, 4) for x in self.round_qps],
            # the answers counted within the windows, per second of them (see closed_loop)
            "counted_qps": len(timed) / self.wall_s if self.wall_s > 0 else None,
            "round_counted_qps": [round(x, 4) for x in self.round_counted_qps],
            "wall_s": round(self.wall_s, 3),
            "p50_s": float(np.percentile(lat, 50)) if n else None,
            "p95_s": float(np.percentile(lat, 95)) if n else None,
            "accuracy": sum(s.correct for s in scored) / n if n else None,
            "small_share": sum(s.route == SMALL_ROUTE for s in scored) / n if n else None,
            # where the CPU went: ms per query by process (each server's tree, the apps, the
            # clients), over every answer of the rounds, and the cores busy over the rounds
            "cpu_ms_per_query": {g: round(1000 * v / n_all, 1) for g, v in self.cpu_s.items()}
            if n_all else {},
            "cores_busy": round(sum(self.cpu_s.values()) / self.busy_wall_s, 2)
            if self.cpu_s and self.busy_wall_s > 0 else None,
            # the mean time a request spent outside its server's clock (see the docstring)
            "outside_server_ms": round(1000 * float(np.mean(outside)), 1) if outside else None,
            # per route, the mean latency at the client and at the server, to set beside the
            # funnel's own times (auto's decisions log)
            "mean_s_by_route": {
                route: {"n": len(got), "client": round(float(np.mean([s.latency_s for s in got])), 4),
                        "server": round(float(np.mean([s.server_s or 0.0 for s in got])), 4)}
                for route in sorted({s.route for s in scored})
                if (got := [s for s in scored if s.route == route])
            },
            # per route, where the app's time went: the mean of each phase's clock (0 where a
            # query skipped the phase), "outside" the client's latency less the app's total
            "mean_ms_by_route_phase": {
                route: phase_means(got) for route in sorted({s.route for s in scored})
                if (got := [s for s in scored if s.route == route])
            },
            "points": dict(Counter(s.point for s in scored if s.point is not None)),
            # auto: its points per load band (operating_points.load_level), to see where the
            # trials of a band new to it went
            "points_by_band": {
                str(b): dict(Counter(s.point for s in scored if s.band == b))
                for b in sorted({s.band for s in scored if s.band is not None})
            },
        }


def modes_of(
    judges: list[str],
    auto: bool = False,
    equal_hardware: bool = False,
    auto_holds: tuple[float, ...] = (),
    waiting: tuple[str, ...] = (),
    twins: tuple[str, ...] = (),
) -> list[Mode]:
    """The modes a run compares: agent-only, each static judge, and with ``auto`` the default
    auto beside one auto per hold margin of ``auto_holds`` (``speceyes/auto@hold=M``); each
    judge of ``waiting`` also with the agent started only after the gate
    (``speceyes/J@early=0``); each judge of ``twins`` also as a second app of its own
    (``speceyes/J#twin``), a control that does the same work as ``speceyes/J``."""
    static = [Mode(f"speceyes/{j}", "speceyes", j) for j in judges]
    static += [Mode(f"speceyes/{j}@early=0", "speceyes", j, early_agent=0) for j in waiting]
    static += [Mode(f"speceyes/{j}{TWIN}", "speceyes", j, twin=True) for j in twins]
    extra = [Mode(f"speceyes/{AUTO}", "speceyes", AUTO)] if auto else []
    extra += [
        Mode(f"speceyes/{AUTO}@hold={h:g}", "speceyes", AUTO, auto_hold=h)
        for h in (auto_holds if auto else ())
    ]
    wide = [Mode(AGENT_ONLY_ALL, "agent", large="large-all")] if equal_hardware else []
    return [Mode(AGENT_ONLY, "agent"), *wide, *static, *extra]


def core_sets(placement: str, cores: list[int] | None = None) -> dict[str, str | None]:
    """The cores each server's engine is bound to (``VLLM_CPU_OMP_THREADS_BIND``; None: vLLM's
    own binding): ``split`` gives the small model the first half of ``cores`` (default: the
    cores this process may run on) and the large model the rest; ``large-all`` has them all."""
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}; choose from {', '.join(PLACEMENTS)}")
    cores = sorted(os.sched_getaffinity(0)) if cores is None else sorted(cores)
    every = ",".join(map(str, cores))
    if placement == "shared":
        return {"small": None, "large": None, "large-all": every}
    if len(cores) < 2:
        raise ValueError(f"--placement split needs at least 2 cores, this process has {cores}")
    half = len(cores) // 2
    return {"small": ",".join(map(str, cores[:half])), "large": ",".join(map(str, cores[half:])),
            "large-all": every}


def question_set(out: Path, scenes: int, seed: int) -> list[Query]:
    """Level-1 mini-world test questions (the bundled models' world), ``scenes`` x 8, in a
    seeded shuffle: a scene's questions share its target's size (all answered at once, or all
    needing the agent), so in file order a short round would draw one kind only."""
    canvas, clutter = level_defaults(1)
    make_split(out, "test", scenes, seed=seed, canvas=canvas, clutter=clutter, level=1)
    queries = list(load_jsonl(out / "questions.jsonl"))
    random.Random(seed).shuffle(queries)
    return queries


def request_body(q: Query, image_uri: str) -> dict[str, Any]:
    content = [
        {"type": "image_url", "image_url": {"url": image_uri}},
        {"type": "text", "text": q.question},
    ]
    body: dict[str, Any] = {"model": "speceyes", "messages": [{"role": "user", "content": content}]}
    if q.options:
        body["options"] = list(q.options)
    return body


def request_bodies(queries: list[Query]) -> list[dict[str, Any]]:
    """Each query's request body, its image encoded once per image file."""
    uris = {q.image: to_data_uri(load_image(q.image)) for q in queries}
    return [request_body(q, uris[q.image]) for q in queries]


def model_family(folder: Path) -> str:
    return json.loads((folder / "config.json").read_text())["model_type"]


def settings_for(
    mode: Mode, small_url: str, large_url: str, points: Path | None = None
) -> Settings:
    """The demo's settings (manifest) with the models behind the servers, seen as the
    checkpoints see images, on the pipelined schedule. With ``points``, a SpecEyes mode takes
    the file's gate, and a static judge its point's calibrated tau (auto: all the points)."""
    from tests.vllm_support import MAX_LOGPROBS

    s = Settings.from_manifest(MODELS_DIR / MANIFEST)
    if points is not None and mode.mode == "speceyes":
        # checked while the settings name the bundled folders the servers serve
        s = s.with_points_file(points)
        if mode.judge != AUTO:
            own = [p for p in s.funnel.operating_points() if p.name == mode.judge]
            tau = own[0].tau if own and own[0].tau is not None else s.funnel.tau
            s = s.with_funnel(points=None, tau=tau)
    s.small, s.large = small_url, large_url
    s.small_family = model_family(MODELS_DIR / "small")
    s.large_family = model_family(MODELS_DIR / "large")
    s.backend.max_logprobs = MAX_LOGPROBS
    # each server's client sends images at its checkpoint's own view, as transformers shows them
    for role, family in (("small", s.small_family), ("large", s.large_family)):
        g = checkpoint_geometry(family, MODELS_DIR / role)
        setattr(s.backend, f"{role}_min_pixels", g.min_pixels)
        setattr(s.backend, f"{role}_max_pixels", g.max_pixels)
    changes: dict[str, Any] = {"mode": mode.mode, "schedule": "pipelined"}
    if mode.auto_hold is not None:
        changes["auto_hold"] = mode.auto_hold
    if mode.early_agent is not None:
        changes["early_agent"] = mode.early_agent
    if mode.judge is not None:
        changes["judge"] = mode.judge
    return s.with_funnel(**changes)


async def closed_loop(
    url: str,
    bodies: list[dict],
    queries: list[Query],
    start: int,
    n: int,
    concurrency: int,
    warm: int | None = None,
) -> LoopRun:
    """Closed-loop clients at ``concurrency``, each sending its next request (queries
    ``start``, ``start+1``, ... cyclically) when its last one is answered. The requests after
    the first ``warm`` (default ``concurrency``: those go out to idle engines) up to ``n`` of
    them are the round's scored ones: the same questions for every mode, all sent under the
    full load. Clients keep sending until ``n`` answers have come after the ``warm``-th (the
    counting window); then no request goes out, and those in flight are answered (drained, so
    the next mode starts on idle engines).

    The throughput the benchmark reports is Little's law on the scored requests: C over their
    mean latency, which holds for a closed loop whose clients send again at once (each client
    always has one request in the system). The scored requests are the same questions for
    every mode, so the modes' ratios do not depend on which questions a window happened to
    count; the answers counted in the window, per second, are reported beside it. (A mean
    latency over the answers that came within a window would favour the quick ones: a long
    request that starts late in it ends after it.) Timed from the first request to the last
    answer, as before, a round also timed its drain: the last agent loops, after the other
    clients had stopped.
    """
    import aiohttp

    warm = concurrency if warm is None else warm
    issued = answered = counted = errors = 0
    samples: list[Sample] = []
    timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
    t_start = time.perf_counter()
    t_open = t_start if warm == 0 else None
    t_close: float | None = None

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal issued, answered, counted, errors, t_open, t_close
        while t_close is None:
            i = issued
            issued += 1
            k = (start + i) % len(queries)
            t0 = time.perf_counter()
            async with session.post(url + "/v1/chat/completions", json=bodies[k]) as r:
                data = await r.json()
            t1 = time.perf_counter()
            answered += 1
            timed = t_open is not None and t_close is None
            scored = warm <= i < warm + n
            if timed:  # an error counts too: it ends a request, and the window must close
                counted += 1
                if counted == n:
                    t_close = t1
            elif answered == warm:
                t_open = t1
            if r.status != 200:
                errors += 1
                print(f"  request error {r.status}: {str(data)[:300]}", flush=True)
                continue
            answer = data["choices"][0]["message"]["content"]
            info = data.get("speceyes", {})
            correct = scoring.is_correct(queries[k], answer)
            samples.append(
                Sample(t1 - t0, correct, info.get("route", ""), info.get("operating_point"),
                       info.get("load_band"), timed=timed, scored=scored, index=i, timings=_timings(info),
                       batch=int(info.get("batch_size") or 0))
            )  # fmt: skip

    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    t_end = time.perf_counter()
    assert t_open is not None and t_close is not None  # n answers came after the opening one
    return LoopRun(samples, errors, t_close - t_open, t_end - t_start)


def _timings(info: dict[str, Any]) -> dict[str, float]:
    """The numeric entries of a response's ``speceyes.timings`` (an error's may be missing)."""
    got = info.get("timings") or {}
    return {k: float(v) for k, v in got.items() if isinstance(v, int | float)}


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat_fields(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (whose parentheses may hold
    spaces): state, ppid, ...; None when the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (Linux ``/proc``; just ``pid`` elsewhere)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit() and (fields := _stat_fields(entry)) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the processes ``pids`` have used so far (all their threads)."""
    total = 0.0
    for p in pids:
        if (fields := _stat_fields(p)) is not None:  # utime + stime, in clock ticks
            total += (int(fields[11]) + int(fields[12])) / _TICK
    return total


def app_spec(
    mode: Mode, small_url: str, large_url: str, points: Path | None, log: Path | None, url_file: Path
) -> str:
    """What an app process (``--serve-app``) needs to build its mode's funnel, as JSON."""
    return json.dumps({
        "mode": asdict(mode), "small": small_url, "large": large_url,
        "points": None if points is None else str(points),
        "log": None if log is None else str(log), "url_file": str(url_file),
    })  # fmt: skip


def log_decisions(path: Path) -> None:
    """auto's every decision and the times it compared, appended to ``path`` (the benchmark's
    process and each app process write to it, each record flushed at once)."""
    handler = logging.FileHandler(path, mode="a")
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    chooser_log = logging.getLogger("speceyes.operating_points")
    chooser_log.addHandler(handler)
    chooser_log.setLevel(logging.DEBUG)


def serve_app(spec: str) -> int:
    """``--serve-app SPEC`` (:func:`app_spec`): one mode's app in this process until its stdin
    closes; the benchmark holds the other end, so the app also ends when the benchmark does."""
    from speceyes.serve import create_app
    from tests.tools.server_thread import ServerThread

    d = json.loads(spec)
    if d["log"] is not None:
        log_decisions(Path(d["log"]))
    points = None if d["points"] is None else Path(d["points"])
    funnel = build_funnel(settings_for(Mode(**d["mode"]), d["small"], d["large"], points))
    srv = ServerThread(create_app(funnel, max_queue=1024, request_timeout=None)).start()
    url_file = Path(d["url_file"])
    url_file.with_suffix(".tmp").write_text(srv.url)
    url_file.with_suffix(".tmp").replace(url_file)  # whole, or not yet there
    sys.stdin.read()
    srv.stop()
    return 0


class AppProcess:
    """One mode's app in a process of its own (:func:`serve_app`), in a session of its own (a
    Ctrl-C reaches the benchmark, which stops it); its output goes to ``log``."""

    def __init__(self, spec: str, url_file: Path, log: Path) -> None:
        self.url_file, self.log, self.url = url_file, log, ""
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--serve-app", spec],
                stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    def wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while not self.url_file.is_file():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                why = (f"exited with {self.proc.returncode}" if self.proc.returncode is not None
                       else f"did not serve within {timeout:.0f} s")
                raise RuntimeError(f"an app process {why}; its output: {self.log}")
            time.sleep(0.2)
        self.url = self.url_file.read_text().strip()
        return self.url

    def close(self) -> None:
        """Ask it to stop (it stops its app and exits); :meth:`stop` waits for that."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()

    def stop(self, timeout: float = 30.0) -> None:
        self.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_servers(
    log_dir: Path,
    timeout: float,
    placement: str = "split",
    names: tuple[str, ...] = (),
    executor: str = NON_SPINNING_EXECUTOR,
) -> list[Any]:
    """The small and large model servers (and those ``names`` adds, such as ``large-all``),
    bound to their cores (:func:`core_sets`), with ``executor`` (one of ``EXECUTORS``), launched together (start-up is mostly waiting) from this thread (the one
    that outlives them), then waited for."""
    from tests.vllm_support import launch_server, wait_ready

    cpus = core_sets(placement)
    servers = [
        launch_server(MODELS_DIR / n.split("-")[0], log_dir / f"vllm-{n}.log", cpus=cpus[n],
                      executor=executor)
        for n in ("small", "large", *names)
    ]  # fmt: skip
    try:
        for s in servers:
            wait_ready(s, timeout)
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers


# A core's worth of work that never waits: the load another job puts on the machine.
_SPIN = "while True:\n    pass\n"


def start_busy(n: int) -> list[subprocess.Popen[bytes]]:
    """``n`` CPU-bound processes, bound to no core (the caller kills them)."""
    return [subprocess.Popen([sys.executable, "-c", _SPIN]) for _ in range(n)]


def _signals_as_interrupt() -> None:
    """SIGTERM and SIGHUP raise KeyboardInterrupt, so the servers' clean-up runs."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def round_ratios(row: dict[str, Any], base: dict[str, Any]) -> list[float]:
    """``row``'s throughput over ``base``'s, round by round. A round's modes ran back to back on
    the same questions, so each ratio pairs two batches that met the same machine; their spread
    says how far one run's ratio can be trusted (a gap between two modes smaller than it is
    not a finding)."""
    a, b = row.get("round_qps") or [], base.get("round_qps") or []
    return [x / y for x, y in zip(a, b, strict=False) if y > 0]


def spread_text(ratios: list[float]) -> str:
    """`` (rounds lo-hi)``: the range of the per-round ratios, or nothing for fewer than 2."""
    return f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""


def vs_best_interval(
    auto: Cell, others: list[Cell], resamples: int = INTERVAL_RESAMPLES,
    level: float = INTERVAL_LEVEL, seed: int = 0,
) -> tuple[float, float] | None:
    """A percentile interval for ``auto``'s throughput over the best of ``others``, by a
    two-stage bootstrap (resampling the units at each level of a nested design, Davison and
    Hinkley 1997, section 3.8): the rounds with replacement, each whole with every mode (a
    round's modes met the same machine), then within each chosen round its scored requests
    with replacement, paired across modes by their place in the round (the same question for
    every mode). Throughput is C over the mean latency, so a ratio is a ratio of mean latencies.
    The best other mode is chosen again in every resample: the interval carries the upward bias
    of the largest of several noisy throughputs, which the point ratio does not (a copy of the
    best mode reads below 1 by that much). Resampling both stages errs wide (the requests'
    spread is counted again inside the rounds'), so a miss whose interval still holds 0.97 is
    not shown to be one. None without a request every mode answered."""
    cells = [auto, *others]
    per_round = []  # each round: the modes' latencies (rows) over its paired requests
    for r in range(min(len(c.rounds) for c in cells)):
        by_index = [{s.index: s.latency_s for s in c.rounds[r] if s.scored} for c in cells]
        keys = sorted(set.intersection(*(set(d) for d in by_index)))
        if keys:
            per_round.append(np.array([[d[k] for k in keys] for d in by_index]))
    if not per_round:
        return None
    rng = np.random.default_rng(seed)
    ratios = np.empty(resamples)
    for b in range(resamples):
        total, count = np.zeros(len(cells)), 0
        for r in rng.integers(len(per_round), size=len(per_round)):
            lat = per_round[r]
            total += lat[:, rng.integers(lat.shape[1], size=lat.shape[1])].sum(axis=1)
            count += lat.shape[1]
        mean = total / count
        ratios[b] = mean[1:].min() / mean[0]
    tail = (1 - level) / 2
    lo, hi = np.quantile(ratios, [tail, 1 - tail])
    return float(lo), float(hi)


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one row per C and mode, ratios against agent-only at the same C."""

    def f(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    base = {r["concurrency"]: r for r in rows if r["mode"] == AGENT_ONLY}
    out = [
        "| C | mode | requests | queries/s | x agent-only (rounds) | counted q/s (x agent-only) "
        "| p50 s | p95 s | p50 / agent-only "
        "| accuracy | small model answers | points (auto) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b = base.get(r["concurrency"], {})
        out.append(
            f"| {r['concurrency']} | {r['mode']} | {r['requests']}"
            + (f" ({r['errors']} errors)" if r["errors"] else "")
            + f" | {f(r['qps'], '.2f')} | {f(ratio(r['qps'], b.get('qps')), '.2f')}"
            + (spread_text(round_ratios(r, b)) if r is not b else "")
            + f" | {f(r.get('counted_qps'), '.2f')}"
            f" ({f(ratio(r.get('counted_qps'), b.get('counted_qps')), '.2f')})"
            + f" | {f(r['p50_s'], '.2f')} | {f(r['p95_s'], '.2f')}"
            f" | {f(ratio(r['p50_s'], b.get('p50_s')), '.2f')}"
            f" | {f(r['accuracy'], '.1%')} | {f(r['small_share'], '.0%')}"
            f" | {_points_text(r.get('points') or {})} |"
        )
    return "\n".join(
        out + twin_lines(rows) + auto_lines(rows) + equal_hardware_lines(rows) + cpu_lines(rows)
    )


def cpu_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Per C and mode: the CPU milliseconds per query by process and the cores busy."""
    if not any(r.get("cpu_ms_per_query") for r in rows):
        return []
    groups = list(dict.fromkeys(g for r in rows for g in r.get("cpu_ms_per_query") or {}))
    out = ["", "CPU per query (ms) by process, cores busy over the timed rounds, and the mean time "
           "a request spent outside its server's clock (ms):", "",
           "| C | mode | " + " | ".join(groups) + " | total | cores busy | outside server |",
           "|---|---|" + "---|" * (len(groups) + 3)]
    for r in rows:
        ms = r.get("cpu_ms_per_query") or {}
        if not ms:
            continue
        outside = r.get("outside_server_ms")
        out.append(f"| {r['concurrency']} | {r['mode']} | "
                   + " | ".join(f"{ms.get(g, 0.0):.1f}" for g in groups)
                   + f" | {sum(ms.values()):.1f} | {r.get('cores_busy') or 0:.2f}"
                   + f" | {'-' if outside is None else f'{outside:.1f}'} |")
    return out


def equal_hardware_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Per C, with ``--equal-hardware``: every other mode against agent-only on every core."""
    out = []
    for c in sorted({r["concurrency"] for r in rows}):
        at = {r["mode"]: r for r in rows if r["concurrency"] == c and r["qps"]}
        wide = at.get(AGENT_ONLY_ALL)
        if wide is None:
            continue
        others = ", ".join(
            f"{m} {r['qps'] / wide['qps']:.2f}x" for m, r in at.items() if m != AGENT_ONLY_ALL
        )
        out.append(f"C={c}: against {AGENT_ONLY_ALL} ({wide['qps']:.2f} queries/s): {others}")
    return [""] + out if out else []


def _points_text(points: dict[str, int]) -> str:
    total = sum(points.values())
    return ", ".join(f"{k} {v / total:.0%}" for k, v in sorted(points.items())) or "-"


def is_auto(label: str) -> bool:
    return label == f"speceyes/{AUTO}" or label.startswith(f"speceyes/{AUTO}@")


def is_twin(label: str) -> bool:
    return label.endswith(TWIN)


def is_compared(label: str) -> bool:
    """A mode auto is measured against: agent-only and every static variant, not a twin (a
    second copy of a variant would make the best of them a maximum over more noisy copies)."""
    return not is_auto(label) and not is_twin(label)


def auto_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Per C and auto mode: its throughput against the best of agent-only and every static
    variant."""
    out = []
    for c in sorted({r["concurrency"] for r in rows}):
        at = {r["mode"]: r for r in rows if r["concurrency"] == c and r["qps"]}
        others = [r for m, r in at.items() if is_compared(m)]
        for label, auto in at.items():
            if is_auto(label) and others:
                out.append(_auto_line(c, auto, others))
    return [""] + out if out else []


def twin_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Per C and twin (``--twin``): its throughput against its original's."""
    out = []
    for c in sorted({r["concurrency"] for r in rows}):
        at = {r["mode"]: r for r in rows if r["concurrency"] == c and r["qps"]}
        for label, twin in at.items():
            if is_twin(label) and label.removesuffix(TWIN) in at:
                out.append(_twin_line(c, twin, at[label.removesuffix(TWIN)]))
    return [""] + out if out else []


def _twin_line(c: int, twin: dict[str, Any], original: dict[str, Any]) -> str:
    """A twin against its original: the same work in two apps, so what separates them is the
    benchmark's own noise, the yardstick for auto's gap to the best other mode."""
    per_round = round_ratios(twin, original)
    interval = twin.get("vs_best_interval")
    return (
        f"C={c}: {twin['mode'].removeprefix('speceyes/')} {twin['qps']:.2f} queries/s = "
        f"{twin['qps'] / original['qps']:.3f} x {original['mode']} (the same work in another app)"
        + (f", {INTERVAL_LEVEL:.0%} interval {interval[0]:.3f}-{interval[1]:.3f}" if interval else "")
        + (f", by round {', '.join(f'{x:.2f}' for x in per_round)}" if len(per_round) > 1 else "")
    )


def _auto_line(c: int, auto: dict[str, Any], others: list[dict[str, Any]]) -> str:
    best = max(others, key=lambda r: r["qps"])
    bands = "; ".join(
        f"band {band}: {_points_text(pts)}"
        for band, pts in (auto.get("points_by_band") or {}).items()
    )
    per_round = round_ratios(auto, best)
    counted = [r.get("counted_qps") for r in (auto, *others)]
    by_count = ""
    if all(counted):
        top = max(others, key=lambda r: r["counted_qps"])
        by_count = (f"; counted in the windows {auto['counted_qps'] / top['counted_qps']:.3f} x "
                    f"the best other mode ({top['mode']})")
    interval = auto.get("vs_best_interval")
    return (
        f"C={c}: {auto['mode'].removeprefix('speceyes/')} {auto['qps']:.2f} queries/s = {auto['qps'] / best['qps']:.3f} x the "
        f"best other mode ({best['mode']}, {best['qps']:.2f})"
        + (f", {INTERVAL_LEVEL:.0%} interval {interval[0]:.3f}-{interval[1]:.3f} (bootstrap over "
           "rounds and requests, the best mode chosen in each)" if interval else "")
        + (f", by round {', '.join(f'{x:.2f}' for x in per_round)}" if len(per_round) > 1 else "")
        + by_count
        + (f"; points by load band: {bands}" if bands else "")
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,4,16", help="comma-separated C values")
    ap.add_argument("--with-64", action="store_true", help="also C=64")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per C")
    ap.add_argument(
        "--requests",
        type=int,
        default=0,
        help=f"timed answers per mode per round (default: max(4C, {MIN_REQUESTS}); at C=1 a round "
        "of 8 lasts a few seconds, and two rounds of one mode then differ by 20%%); a round also "
        "sends C untimed requests before its window and drains those in flight after it",
    )
    ap.add_argument(
        "--short-rounds",
        type=int,
        default=SHORT_ROUND_REQUESTS,
        metavar="N",
        help="where 4C <= N and --requests is not given, rounds of N requests, --rounds x "
        f"{MIN_REQUESTS} / N of them: each mode serves as many requests as in --rounds rounds "
        f"of {MIN_REQUESTS}, in shorter turns, so that a slow spell of the machine lasting a "
        f"minute falls on every mode (default {SHORT_ROUND_REQUESTS}: C = 1 and 4; 0: off)",
    )
    ap.add_argument(
        "--settle",
        type=int,
        default=-1,
        help="untimed requests that speceyes/auto serves at each C before that C's rounds, so "
        "that its one-time trials at a load new to it fall outside the timed part (its later "
        "re-runs stay inside); the static modes keep no state to settle (default: "
        f"{SETTLE_TRIALS} x max(4C, {SETTLE_TRIAL_REQUESTS}), what its first trial of each of "
        "four points and a full contest of three take; 0: none, the cold figure)",
    )
    ap.add_argument(
        "--scenes", type=int, default=8,
        help="mini-world test scenes, 8 questions each (default 8: 64 questions; with 2 the "
        "share answered early rests on 16 questions)",
    )  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--judges", default="large,prefix,none", help="SpecEyes judge variants")
    ap.add_argument(
        "--auto-holds", default="", metavar="M,M",
        help="with --points: also speceyes/auto at each of these hold margins (--auto-hold), "
        "beside the default one; 0 is the rule without a hold (default: none)",
    )  # fmt: skip
    ap.add_argument(
        "--waiting", default="", metavar="J,J",
        help="also these judge variants with --early-agent 0 (speceyes/J@early=0): the agent "
        "loop starts only after the judge and the gate, even with one query in flight "
        "(default: none)",
    )  # fmt: skip
    ap.add_argument(
        "--twin", default="", metavar="J,J",
        help="also a second app of each of these static variants (speceyes/J#twin), a control "
        "that does the same work as speceyes/J: its ratio to J is the benchmark's own noise, "
        "set beside auto's gap to the best other mode (auto is not compared with a twin; "
        "default: none)",
    )  # fmt: skip
    ap.add_argument(
        "--order", choices=ORDERS, default=ORDERS[0],
        help="each round's order of modes: shuffle (default) draws it afresh each round "
        "(seeded), so no mode always follows the same one; rotate shifts one fixed order by a "
        "place each round, as runs before 63 did",
    )  # fmt: skip
    ap.add_argument(
        "--points",
        type=Path,
        default=None,
        help="operating points (calibrate --operating-points): adds speceyes/auto, and the "
        "static variants run at their points' taus",
    )
    ap.add_argument(
        "--placement", choices=PLACEMENTS, default=SPLIT_PLACEMENT,
        help="split: each server's engine on cores of its own (a device per model); shared: "
        "vLLM's own binding, both engines on the same cores (see the module docstring)",
    )  # fmt: skip
    ap.add_argument(
        "--executor", choices=EXECUTORS, default=NON_SPINNING_EXECUTOR,
        help="uni: each engine's worker in its engine process; mp: vLLM's CPU default, a worker "
        "process that busy-polls for a second after each step (see the module docstring)",
    )  # fmt: skip
    ap.add_argument(
        "--equal-hardware", action="store_true",
        help=f"also {AGENT_ONLY_ALL}: agent-only on a third server that has every core",
    )  # fmt: skip
    ap.add_argument(
        "--busy", type=int, default=0, metavar="N",
        help="N CPU-bound processes (bound to no core, normal priority) run through the timed "
        "rounds: the same ratios on a machine busy with something else (default 0)",
    )  # fmt: skip
    ap.add_argument(
        "--apps", choices=APP_LAYOUTS, default=APP_LAYOUTS[0],
        help="process: each mode's app in a process of its own, as a server is deployed; "
        "thread: every app in this process, beside the clients (see the module docstring)",
    )  # fmt: skip
    ap.add_argument("--serve-app", default=None, help=argparse.SUPPRESS)  # an app process's own
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-load-vllm")
    ap.add_argument("--start-timeout", type=float, default=600.0, help="seconds per server")
    ap.add_argument(
        "--vllm-python", type=Path, default=None,
        help="the vLLM environment's python (default: .venv-vllm/bin/python)",
    )  # fmt: skip
    args = ap.parse_args()
    if args.serve_app is not None:
        return serve_app(args.serve_app)
    if args.busy < 0:
        ap.error("--busy takes a count >= 0")
    if args.short_rounds < 0:
        ap.error("--short-rounds takes a count >= 0 (0: off)")
    cs = [int(x) for x in args.concurrency.split(",") if x.strip()]
    if args.with_64 and 64 not in cs:
        cs.append(64)
    from speceyes.funnel import JUDGES

    judges = [j.strip() for j in args.judges.split(",") if j.strip()]
    waiting = tuple(j.strip() for j in args.waiting.split(",") if j.strip())
    twins = tuple(j.strip() for j in args.twin.split(",") if j.strip())
    if any(j not in JUDGES for j in (*judges, *waiting)):
        ap.error(f"--judges and --waiting take {', '.join(JUDGES)}")
    if any(j not in judges for j in twins):
        ap.error(f"--twin takes variants of --judges ({', '.join(judges)}), got {args.twin!r}")
    try:
        holds = tuple(float(x) for x in args.auto_holds.split(",") if x.strip())
    except ValueError:
        ap.error(f"--auto-holds takes numbers, got {args.auto_holds!r}")
    modes = modes_of(judges, auto=args.points is not None, equal_hardware=args.equal_hardware,
                     auto_holds=holds, waiting=waiting, twins=twins)  # fmt: skip
    try:
        cpus = core_sets(args.placement)
    except ValueError as e:
        ap.error(str(e))

    from speceyes.serve import create_app
    from tests import vllm_support
    from tests.tools.server_thread import ServerThread

    if args.vllm_python is not None:  # server_command reads it when a server starts
        vllm_support.VLLM_PYTHON = args.vllm_python
    if not vllm_support.VLLM_PYTHON.is_file():
        print(f"no vLLM environment at {vllm_support.VLLM_PYTHON}: {vllm_support.SETUP_HINT}")
        return 2
    _signals_as_interrupt()
    args.out.mkdir(parents=True, exist_ok=True)
    samples_file = args.out / "samples.jsonl"
    samples_file.write_text("")
    decisions = args.out / "auto-decisions.log" if args.points is not None else None
    if decisions is not None:  # auto's every decision, and the rounds between them
        decisions.write_text("")
        log_decisions(decisions)
    t_all = time.perf_counter()
    servers: list[Any] = []
    apps: list[ServerThread | AppProcess] = []
    hogs: list[subprocess.Popen[bytes]] = []
    cells: dict[tuple[str, int], Cell] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            queries = question_set(Path(tmp) / "mw", args.scenes, args.seed)
            bodies = request_bodies(queries)
            print(
                f"{len(queries)} questions on {args.scenes} scenes; modes: "
                f"{', '.join(m.label for m in modes)}; C = {cs}; rounds {args.rounds}",
                flush=True,
            )
            t0 = time.perf_counter()
            extra = ("large-all",) if args.equal_hardware else ()
            servers = start_servers(
                args.out, args.start_timeout, args.placement, extra, args.executor
            )
            start_s = time.perf_counter() - t0
            where = ", ".join(f"{n} on cores {cpus[n] or 'of vLLM'}" for n in ("small", "large", *extra))
            print(f"vLLM servers up in {start_s:.0f} s ({where})", flush=True)
            server_url = dict(zip(("small", "large", *extra), (s.url for s in servers), strict=True))
            urls = {}
            for k, m in enumerate(modes):
                large_url = server_url[m.large]
                if args.apps == "process":  # started together, waited for below
                    url_file = Path(tmp) / f"app-{k}.url"
                    spec = app_spec(m, server_url["small"], large_url, args.points,
                                    decisions if m.judge == AUTO else None, url_file)
                    apps.append(AppProcess(spec, url_file, args.out / f"app-{k}.log"))
                    continue
                funnel = build_funnel(settings_for(m, server_url["small"], large_url, args.points))
                srv = ServerThread(create_app(funnel, max_queue=1024, request_timeout=None))
                apps.append(srv.start())
                urls[m.label] = srv.url
            for m, a in zip(modes, apps, strict=True):
                if isinstance(a, AppProcess):
                    urls[m.label] = a.wait_ready(APP_START_S)
            # Untimed warm-up: each mode answers every question once (first calls, caches).
            for m in modes:
                asyncio.run(closed_loop(urls[m.label], bodies, queries, 0, len(queries), 4, 0))
            print(f"warm-up done at {time.perf_counter() - t_all:.0f} s", flush=True)
            hogs = start_busy(args.busy)
            # CPU by process group: each server's process tree (read now: its workers exist),
            # the apps' processes, and this one (the clients; with --apps thread, the apps too)
            groups = {n: process_tree(s.proc.pid) for n, s in zip(("small", "large", *extra),
                                                                   servers, strict=True)}
            if args.apps == "process":
                groups["app"] = [p for a in apps if isinstance(a, AppProcess)
                                 for p in process_tree(a.proc.pid)]
                groups["clients"] = [os.getpid()]
            else:
                groups["app"] = [os.getpid()]
            for c in cs:
                n, rounds = round_plan(c, args.rounds, args.requests, args.short_rounds)
                settle = settle_requests(c) if args.settle < 0 else args.settle
                for m in modes:
                    if settle and m.judge == AUTO:  # untimed: the trials of a load new to it
                        asyncio.run(closed_loop(urls[m.label], bodies, queries, 0, settle, c, 0))
                        print(f"C={c} {m.label}: settled on {settle} requests", flush=True)
                for r in range(rounds):
                    for slot, j in enumerate(round_order(len(modes), r, c, args.order, args.seed)):
                        m = modes[j]
                        cell = cells.setdefault((m.label, c), Cell(m.label, c))
                        start = round_start(r, n, len(queries))
                        before = {g: cpu_seconds(p) for g, p in groups.items()}
                        run = asyncio.run(
                            closed_loop(urls[m.label], bodies, queries, start, n, c)
                        )
                        for x in run.samples:
                            x.slot = slot
                        used = {g: cpu_seconds(p) - before[g] for g, p in groups.items()}
                        cell.add_round(run.samples, run.errors, run.window_s, used, run.wall_s)
                        with samples_file.open("a") as f:  # kept whatever happens later
                            f.writelines(json.dumps({"mode": m.label, "concurrency": c,
                                                     "round": r, **asdict(x)}) + "\n"
                                         for x in run.samples)  # fmt: skip
                        scored = [x.latency_s for x in run.samples if x.scored]
                        line = (f"C={c} round {r} {m.label}: {len(scored)} scored, mean "
                                f"{np.mean(scored):.2f} s; {n} counted in {run.window_s:.1f} s "
                                f"(round {len(run.samples)} in {run.wall_s:.1f} s)")
                        logging.getLogger("speceyes.operating_points").info(line)
                        print(line, flush=True)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
        for a in apps:  # every app process asked at once: each may take seconds to stop
            if isinstance(a, AppProcess):
                a.close()
        for a in apps:
            a.stop()
        for s in servers:
            s.stop()
    total_s = time.perf_counter() - t_all
    rows = [cells[(m.label, c)].summary() for c in cs for m in modes if (m.label, c) in cells]
    for row in rows:  # auto against the best other mode: its interval beside the point ratio
        c = row["concurrency"]
        if is_auto(row["mode"]):
            others = [x for (label, at), x in cells.items() if at == c and is_compared(label)]
        elif is_twin(row["mode"]):  # a twin against its original, by the same bootstrap
            original = cells.get((row["mode"].removesuffix(TWIN), c))
            others = [original] if original else []
        else:
            continue
        got = vs_best_interval(cells[(row["mode"], c)], others) if others else None
        row["vs_best_interval"] = [round(x, 4) for x in got] if got else None
    md = table(rows)
    print(md)
    meta = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "args": {k: str(v) for k, v in vars(args).items()},
        "questions": len(queries),
        "server_start_s": round(start_s, 1),
        "total_s": round(total_s, 1),
        "cpus": os.cpu_count(),
        "placement": args.placement,
        "executor": args.executor,
        "apps": args.apps,
        "busy": args.busy,
        "server_cores": {n: cpus[n] for n in ("small", "large", *extra)},
        "load_avg": os.getloadavg(),
        "machine": platform.platform(),
        "modes": [asdict(m) for m in modes],
    }
    (args.out / "results.json").write_text(json.dumps({**meta, "rows": rows}, indent=2))
    (args.out / "table.md").write_text(md + "\n")
    print(
        f"total {total_s:.0f} s (servers {start_s:.0f} s); wrote {args.out}/results.json, table.md"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
