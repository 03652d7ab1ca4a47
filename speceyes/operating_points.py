"""Operating points of phase I and the load-aware choice among them (``--judge auto``).

An operating point is one judge variant (:data:`speceyes.types.JUDGES`) with its own calibrated
threshold and the rates measured at it: beta (the share it calls tool-free) and alpha (the
share of those the gate accepts; without a judge also ``alpha_tool``, the share accepted among
the queries a judge would have sent to tools). Each point carries its own tau, so the error
guarantee printed for it holds whichever point answers a query.

Which point costs least depends on load. At low load a query's latency decides: the published
judge runs beside the small answer and sends tool queries to the agent at once. At high load
the engines' work per query decides: the judge's full-image prefill is large-model time that
batching does not amortise, and skipping it can serve more queries. :func:`expected_throughput`
puts both in one number: with N queries in flight, throughput is at most ``N / R0`` (R0: one
query's time alone) and at most ``1 / D`` (D: the busiest device's seconds of work per query),
the asymptotic bounds of operational analysis (Denning and Buzen, ACM Computing Surveys 10(3),
1978); mean value analysis of the engines as queueing devices gives the curve between them.
:func:`choose` takes the point with the highest estimate; the simulator and the funnel share it.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from speceyes.types import JUDGES

AUTO = "auto"  # the judge setting that picks among operating points by load
# The point that skips phases I-III: every query goes straight to the agent loop. Where the
# front costs more than the loops it saves (a light load on engines that share a CPU, say),
# agent-only is the fastest choice, and auto should be able to make it.
AGENT_POINT = "agent"
POINT_KINDS: tuple[str, ...] = (*JUDGES, AGENT_POINT)


@dataclass(frozen=True)
class OperatingPoint:
    judge: str  # a JUDGES variant
    tau: float | None = None  # its own threshold; None: the funnel's
    beta: float = 1.0  # share judged tool-free ("none": every query)
    alpha: float = 0.0  # gate acceptance among the judged tool-free, at tau
    alpha_tool: float = 0.0  # "none": acceptance among the queries a judge sends to tools
    judge_max_pixels: int | None = None  # a judge view budget ("large" and "small")

    def __post_init__(self) -> None:
        if self.judge not in POINT_KINDS:
            raise ValueError(
                f"unknown judge {self.judge!r}; choose from {', '.join(POINT_KINDS)}"
            )
        for name in ("beta", "alpha", "alpha_tool"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        if self.tau is not None and not 0.0 <= self.tau <= 1.0:
            raise ValueError(f"tau must be in [0, 1], got {self.tau}")

    @property
    def skipped(self) -> float:
        """Expected share of queries answered without the agent loop."""
        if self.judge == AGENT_POINT:
            return 0.0
        if self.judge == "none":
            return self.beta * self.alpha + (1.0 - self.beta) * self.alpha_tool
        return self.beta * self.alpha

    @property
    def name(self) -> str:
        return self.judge if self.judge_max_pixels is None else (
            f"{self.judge}@{self.judge_max_pixels}px"
        )


@dataclass(frozen=True)
class PointCosts:
    """Seconds per query of one operating point, split by where they are spent."""

    front_latency: float  # phases I-III alone, on the query's critical path (its batch's time)
    large_front: float  # large-model seconds of phase I per query, under load
    small_front: float  # small-model seconds of phases I-II per query, under load
    agent_latency: float  # one agent loop alone (batch 1)
    agent_demand: float  # large-model seconds of one agent loop, under load
    agent_saved: float = 0.0  # agent seconds a prefix-shared judge saves (its cached prefill)
    skipped: float | None = None  # share answered without the agent, as measured; None: the point's


def _estimate(
    point: OperatingPoint, costs: PointCosts, in_flight: int, shared_device: bool
) -> tuple[float, float, float]:
    """(expected throughput, seconds of device work per query, R0) of one point."""
    if in_flight < 1:
        raise ValueError("in_flight must be >= 1")
    to_agent = 1.0 - (point.skipped if costs.skipped is None else costs.skipped)
    r0 = costs.front_latency + to_agent * (costs.agent_latency - costs.agent_saved)
    d_large = costs.large_front + to_agent * (costs.agent_demand - costs.agent_saved)
    demands = [d_large + costs.small_front] if shared_device else [d_large, costs.small_front]
    # What R0 spends beyond the devices' amortised work (batch-1 decode steps that a full
    # batch would share, tool calls on the CPU) is a delay that does not queue.
    delay = max(0.0, r0 - sum(demands))
    return _mva(demands, delay, in_flight), d_large + costs.small_front, r0


def _mva(demands: Sequence[float], delay: float, customers: int) -> float:
    """Throughput of a closed network of queueing devices plus a delay, by exact mean value
    analysis (Reiser and Lavenberg, "Mean-Value Analysis of Closed Multichain Queuing
    Networks", JACM 27(2), 1980). It lies under both asymptotic bounds, N / R0 and 1 / D_max,
    and bends between them as queues form: written out because it is ten lines and no
    maintained package offers it without a modelling framework."""
    queue = [0.0] * len(demands)
    x = 0.0
    for n in range(1, customers + 1):
        resid = [d * (1.0 + q) for d, q in zip(demands, queue, strict=True)]
        total = delay + sum(resid)
        x = n / total if total > 0 else math.inf
        queue = [x * r for r in resid]
    return x


def expected_throughput(
    point: OperatingPoint, costs: PointCosts, in_flight: int, shared_device: bool
) -> float:
    """Queries per second the point is expected to serve with ``in_flight`` queries in the
    system: mean value analysis of the engines as queueing devices (under the latency bound
    ``N / R0`` and the bottleneck bound ``1 / D``)."""
    return _estimate(point, costs, in_flight, shared_device)[0]


# Estimates this close count as equal: the next criteria decide.
TIE = 1e-3


def choose(
    points: Sequence[OperatingPoint],
    costs_of: Callable[[OperatingPoint, int], PointCosts],
    in_flight: int,
    shared_device: bool,
) -> OperatingPoint:
    """The point with the highest expected throughput at this load. Between points whose
    estimates tie (the same device limits both), the one with less work over all devices wins, since
    real queues feel every device's load, then the one with the shorter R0, then the earlier
    point in ``points``."""
    if not points:
        raise ValueError("no operating points to choose from")
    scored = [(_estimate(p, costs_of(p, in_flight), in_flight, shared_device), i, p)
              for i, p in enumerate(points)]
    best_x = max(b[0] for b, _, _ in scored)
    tied = [(b[1], b[2], i, p) for b, i, p in scored if b[0] >= best_x * (1 - TIE)]
    return min(tied, key=lambda t: t[:3])[3]


# --- files -----------------------------------------------------------------------------------


def read_points(path: str | Path) -> list[OperatingPoint]:
    """Operating points from JSON: a list of point objects, or ``{"points": [...]}`` (as
    :func:`write_points` writes it)."""
    return read_points_file(path).points


@dataclass(frozen=True)
class PointsFile:
    """A points file as ``calibrate --operating-points`` writes it: the points, and where the
    file records them, the setup the points' taus hold for (``{"models", "agent"}``), the gate
    they were calibrated with (``{"top_k", "agg", "scale"}``), the judge mode and threshold,
    and the family's guarantee. A hand-written list of points records none of these."""

    points: list[OperatingPoint]
    setup: dict[str, Any] | None = None
    gate: dict[str, Any] | None = None
    judge_mode: str | None = None
    judge_threshold: float | None = None
    guarantee: dict[str, Any] | None = None


def read_points_file(path: str | Path) -> PointsFile:
    """:func:`read_points` with what the file records besides the points (one read, one
    parse)."""
    p = Path(path)
    try:
        data: Any = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON ({e})") from e
    points = _points_of(p, data.get("points") if isinstance(data, dict) else data)
    if not isinstance(data, dict):
        return PointsFile(points)
    for key in ("setup", "gate", "guarantee"):
        if data.get(key) is not None and not isinstance(data[key], dict):
            raise ValueError(f"{path}: {key} must be an object")
    return PointsFile(
        points,
        setup=data.get("setup"),
        gate=data.get("gate"),
        judge_mode=data.get("judge_mode"),
        judge_threshold=data.get("judge_threshold"),
        guarantee=data.get("guarantee"),
    )


def _points_of(p: Path, items: Any) -> list[OperatingPoint]:
    """The points of a file's list, each checked (``p`` names the file in errors)."""
    if not isinstance(items, list) or not items:
        raise ValueError(f"{p}: expected a non-empty list of operating points")
    known = set(OperatingPoint.__dataclass_fields__)
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or "judge" not in item:
            raise ValueError(f"{p}: point {i} must be an object with a 'judge'")
        extra = sorted(set(item) - known - {"note", "max_error", "confidence", "n"})
        if extra:
            raise ValueError(f"{p}: point {i} has unknown keys: {', '.join(extra)}")
        try:
            out.append(OperatingPoint(**{k: v for k, v in item.items() if k in known}))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{p}: point {i}: {e}") from e
    return out


def write_points(path: str | Path, points: Sequence[OperatingPoint], **extra: Any) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"points": [asdict(x) for x in points], **extra}, indent=2) + "\n")
    return p


# --- in the funnel: costs measured as it runs --------------------------------------------------


class _Mean:
    """A running mean over the last observations (an exponential moving average: costs drift
    with load, and the funnel should follow them)."""

    WEIGHT = 0.2  # the newest observation's share

    def __init__(self) -> None:
        self.value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.WEIGHT * (x - self.value)


class PointChooser:
    """``--judge auto`` in the funnel: the operating point for the next batch, from the costs
    the funnel measured so far. Each point runs one batch first, so its costs are measured, not
    assumed; then :func:`choose` decides with the queries in flight. The share each point
    answers without the agent is measured too (starting from its calibrated rate): a threshold
    calibrated on other queries may accept more or less of these. A point not run for
    ``EXPLORE_EVERY`` batches runs one batch again, so an estimate made under another load, or
    on a few queries, is renewed. Each re-run that the rule then does not follow doubles that
    point's wait (up to ``EXPLORE_MAX``), and the rule choosing it resets the wait: a point that
    keeps losing costs a number of batches that grows with the log of the run's length, not with
    its length, while a change of load that favours it is still found. Thread-safe (the
    pipelined schedule observes agent loops from another thread)."""

    EXPLORE_EVERY = 24  # batches after which a point not run since runs one batch again
    EXPLORE_MAX = 16 * EXPLORE_EVERY  # the longest wait a losing point's re-runs back off to

    def __init__(self, points: Sequence[OperatingPoint], shared_device: bool) -> None:
        if not points:
            raise ValueError("--judge auto needs at least one operating point")
        self.points = list(points)
        self.shared_device = shared_device
        self._judge = {p.name: _Mean() for p in self.points}  # seconds per query, phase I
        self._small = {p.name: _Mean() for p in self.points}  # seconds per query, phase II
        self._skip = {p.name: _Mean() for p in self.points}  # share answered without the agent
        # the batch's share of the large engine while its phase I ran: n / (n + agent loops)
        self._front_share = {p.name: _Mean() for p in self.points}
        # one query's time in phases I-III: its batch's wall time there, at that share
        self._front_wall = {p.name: _Mean() for p in self.points}
        for p in self.points:
            self._skip[p.name].add(p.skipped)  # the calibrated rate, until measured
        self._agent = _Mean()  # one agent loop's share of the engine time of its batched turns
        self._wall = _Mean()  # one agent loop's wall time: that share times the loops sharing
        self._batches = 0  # batches chosen so far
        self._last = {p.name: -1 for p in self.points}  # the batch each point last ran
        self._wait = {p.name: self.EXPLORE_EVERY for p in self.points}  # batches before a re-run
        self._lock = threading.Lock()

    def choose(self, in_flight: int) -> OperatingPoint:
        with self._lock:
            self._batches += 1
            stale = [p for p in self.points if self._judge[p.name].value is None] or [
                p for p in self.points if self._batches - self._last[p.name] > self._wait[p.name]
            ]
            if stale:
                picked = min(stale, key=lambda p: self._last[p.name])
                if self._last[picked.name] >= 0:  # a re-run: the next one waits twice as long
                    self._wait[picked.name] = min(2 * self._wait[picked.name], self.EXPLORE_MAX)
            else:
                picked = choose(self.points, self._costs, max(1, in_flight), self.shared_device)
                self._wait[picked.name] = self.EXPLORE_EVERY  # the rule wants it: renew it often
            self._last[picked.name] = self._batches
            return picked

    def observe_front(
        self,
        point: OperatingPoint,
        judge_s: float,
        small_s: float,
        skipped: float | None = None,
        engine_share: float = 1.0,
        front_wall_s: float | None = None,
    ) -> None:
        """Phase I and II seconds per query of one batch that ran at ``point``, the share of
        its queries answered without the agent, the batch's share of the large engine while
        it ran (``n / (n + agent loops running beside it)``), and its wall time from opening to
        the end of phase III (``front_wall_s``). The seconds are wall time: the engine served
        the agent loops in the same steps, so the batch's own work is that share of them, the
        same accounting as an agent loop's (``observe_agent``).

        The per-query seconds are work; the batch's wall time is what each of its queries
        waits. They differ by the batch size: an engine whose calls cost mostly fixed overhead
        answers a batch of 16 in about the time of one, and per-query seconds measured on that
        batch would make the front look 16 times quicker to a lone query than it is."""
        with self._lock:
            self._judge[point.name].add(judge_s)
            self._small[point.name].add(small_s)
            self._front_share[point.name].add(engine_share)
            if front_wall_s is not None:
                self._front_wall[point.name].add(front_wall_s * engine_share)
            if skipped is not None:
                self._skip[point.name].add(skipped)

    def observe_agent(self, seconds: float, loops_running: int) -> None:
        """One agent loop's ``seconds``: its share of the wall time of the batched turns it
        took part in (``agents.base.drive_loops``), that is its engine time, with
        ``loops_running`` loops sharing the engine; its wall time is about that many shares."""
        with self._lock:
            self._agent.add(seconds)
            self._wall.add(seconds * max(1, loops_running))

    def _costs(self, point: OperatingPoint, in_flight: int) -> PointCosts:
        judge = self._judge[point.name].value or 0.0
        small = self._small[point.name].value or 0.0
        on_large = point.judge in ("large", "prefix")
        agent = self._agent.value or 0.0
        front_share = self._front_share[point.name].value or 1.0
        # the small engine is shared with the agent loops only where both models share one
        small_share = front_share if self.shared_device else 1.0
        wall = self._front_wall[point.name].value
        return PointCosts(
            front_latency=judge + small if wall is None else wall,
            large_front=judge * front_share if on_large else 0.0,
            small_front=(small + (0.0 if on_large else judge)) * small_share,
            agent_latency=self._wall.value or agent,
            agent_demand=agent,  # already a share: the loop's engine time
            skipped=self._skip[point.name].value,
        )
