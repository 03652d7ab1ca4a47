"""The four phases of SpecEyes over a stream of queries, one step each.

I   ``_judge``: tool-need judgment on the large model: P(tool) per query; "yes" goes straight
    to IV.
II  ``_speculate``: speculative answers from the small model, keeping the top-K logits of every
    token.
III ``_gate``: the cognitive gate: accept iff sigmoid(scale * separability) > tau.
IV  ``_agent``: the agent loop on the large model for everything not accepted.

Each step reads and extends one :class:`Batch` (a batch's results and the phases' verdicts),
counts its own statistics, and makes its one call into the models (the protocol's
``tool_probability``, ``answers`` and ``confidence``, ``agents.base.drive_loops``). The
baselines are modes of the same funnel, each a row of :data:`PLANS`: ``agent`` (IV for all),
``small`` (II for all, III recording the confidence only) and ``both`` (every phase for every
query, routed as ``speceyes`` would, so any gate setting can be replayed offline from the logs).
A query's route is decided once, by :func:`route_of`, when its result is final.

The cascade (docs/cascade.md; off by default, which is the paper's funnel) adds stages between
III and IV, each gated by the same score against its own threshold (``stage_taus``, else
``tau``): ``_deepen``, the small model's own short tool loop (``speculate_depth`` calls, stages
``small@1``..), answered and gated after every call; then ``_middle``, the large model's direct
answer on the full image (``middle_tier``, stage ``large_direct``). The first stage whose gate
passes answers the query; the rest go on to IV, whose agent starts from scratch.

Three schedules compose the same steps and give the same results for the same inputs under
greedy decoding:

- ``batched``: each batch of queries goes through I-III, then its agent loops run together.
- ``pipelined``: phases I-III of later batches run while earlier agent loops are still going;
  agent loops join and leave one shared batch as they start and finish (continuous batching,
  at most ``max_agent_loops`` in flight), so an engine always has a full batch of agent turns.
  Results come out in completion order.
- ``serial``: ``batched``, but a batch's agent loops run one at a time, as the released SpecEyes
  code runs them (the ``published`` protocol's default, so speedups share its denominator).

``early_agent`` (pipelined only) starts a batch's agent loops at its opening, beside phases
I-III, while at most that many queries are in the system (default 1: a query alone in an idle
funnel) and fewer than half of the queries settled so far were answered early
(``EARLY_AGENT_MAX_SHARE``; under ``auto``, its point's share as the chooser counts it), and
drops the loops of the queries phases I-III answer. A query that needs the agent then does not
wait for the judge and the gate first, so at one client its latency is the agent's
(docs/throughput.md); results are the same, only the large model's spare time is spent.

``overlap`` runs phase II on the whole batch at the same time as phase I (the small model's
answers for queries the judge sends to tools are then discarded), which hides the small model's
latency behind the judge when the two models live on different devices or servers.

``judge`` picks who answers phase I (:data:`JUDGES`; docs/throughput.md measures them):

- ``large`` (default): the published judge, the large model on its judge prompt and image;
  ``judge_max_pixels`` shows it a smaller view of the image (a judge view budget).
- ``prefix``: the large model, with the judge question asked as one more user turn after the
  agent's own first-turn prompt (system prompt, image, question), byte-identical to what the
  agent then sends, so a server with prefix caching (vLLM ``--enable-prefix-caching``, on by
  default in its V1 engine; SGLang's radix cache, on unless ``--disable-radix-cache``) serves
  the agent's first turn from the judge's cached prefill. Only for agents whose
  ``shares_first_prompt`` is true.
- ``small``: the small model on the judge prompt (``judge_max_pixels`` applies too).
- ``small-prefix``: the small model, the judge question asked after its own answer prompt, once
  the answer is done (phase II runs before phase I), so a prefix-caching server prefills the
  image once for both.
- ``none``: no judge; the small model answers every query and the gate alone decides.
- ``auto``: per batch, one of the configured operating points (a variant with its own tau),
  the one whose queries spent least time in the funnel at the load then (by Little's law, the
  one serving the most; :class:`speceyes.operating_points.PointChooser`); every step of the
  batch reads that point's configuration (``Batch.cfg``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Any, Literal

import numpy as np

from speceyes import cascade, gate, prompts, protocols
from speceyes.agents.base import EMPTY, END, Agent, LoopAgent, drive_loops
from speceyes.backends.base import Backend, BackendError, per_item
from speceyes.images import MIN_PIXELS, load_image, resize_for_model
from speceyes.judging import JudgeMode
from speceyes.operating_points import (
    AGENT_POINT,
    AUTO,
    OperatingPoint,
    PointChooser,
    check_hold_margin,
    load_level,
)
from speceyes.rates import beta_alpha
from speceyes.types import (  # the funnel's vocabulary, re-exported for older imports
    AGENT_ONLY_MODES,
    DIRECT_PROMPTS,
    JUDGES,
    LARGE_DIRECT_STAGE,
    MODES,
    NO_CATEGORY,
    SCHEDULES,
    SMALL_STAGE_PREFIX,
    Mode,
    Query,
    Result,
    Route,
    Schedule,
    SpecAnswer,
    small_stage,
    stage_route,
)

# The judge question as one more user turn after a shared prefix: the published judge's
# instructions and question (prompts.JUDGE_SYSTEM, prompts.JUDGE_SUFFIX) as one text.
PREFIX_JUDGE_TEXT = prompts.JUDGE_SYSTEM + prompts.JUDGE_SUFFIX.lstrip("\n")

# early_agent starts the agent only while fewer than this share of the settled queries were
# answered early: then the median query is an agent query, which starting early shortens; with
# more answered early, the dropped loops' work (the search agent's first round, crops cut in the
# app) cost the early answers more than the agent queries gained (docs/throughput.md, run 39)
EARLY_AGENT_MAX_SHARE = 0.5


def early_share_allows(share: float | None) -> bool:
    """early_agent's share rule: ``share``, the share of queries answered early (None before
    any settled), is under ``EARLY_AGENT_MAX_SHARE``."""
    return share is None or share < EARLY_AGENT_MAX_SHARE


@dataclass
class FunnelConfig:
    mode: Mode = "speceyes"
    tau: float | None = None  # None: the agent's default_tau
    top_k: int = gate.DEFAULT_TOP_K
    agg: gate.Aggregation = "min"
    scale: float = gate.DEFAULT_SCALE
    judge_mode: JudgeMode = "logit"
    judge_threshold: float = 0.5  # tool iff P(tool) >= threshold; 0.5 equals greedy yes-vs-no
    judge: str = "large"  # who answers phase I: see JUDGES and the module docstring
    judge_max_pixels: int | None = None  # large/small judge: the image shown at most this big
    # None: the protocol's (factory.Settings.resolved); left out: the fair protocol's
    batch_size: int | None = protocols.FAIR.loop_settings().batch_size
    max_new_tokens: int = 20
    schedule: Schedule | None = "batched"  # None: the protocol's (EvalProtocol.schedule)
    overlap: bool = False
    max_agent_loops: int = 32
    # pipelined: start the agent loops at a batch's opening while at most this many queries are
    # in the system (0: never); see the module docstring
    early_agent: int = 1
    protocol: str = "fair"  # or "published": the authors' prompts and rules (protocols.py)
    # ---- the cascade (docs/cascade.md); these defaults are the paper's two-stage funnel
    speculate_depth: int = 0  # the small model's own tool calls, gated after each (small@d)
    middle_tier: bool = False  # the large model's direct answer, gated (large_direct)
    direct_prompt: str = DIRECT_PROMPTS[0]  # large_direct's prompt (types.DIRECT_PROMPTS)
    small_agent: str | None = None  # the small model's loop; None: cascade.default_small_agent
    stage_taus: dict[str, float] | None = None  # a threshold per stage; a stage not named: tau
    # per query category, a threshold per stage (adaptive gating, calibrate --per-category);
    # a category or stage not named: stage_taus
    category_taus: dict[str, dict[str, float]] | None = None
    # ---- --judge auto: the operating points it picks among (operating_points.OperatingPoint
    # fields: judge, tau, beta, alpha, alpha_tool, judge_max_pixels), one per batch by load
    points: list[dict[str, Any]] | None = None
    # how much less time another point needs to displace the one held (PointChooser)
    auto_hold: float = PointChooser.HOLD_MARGIN

    def operating_points(self) -> list[OperatingPoint]:
        """``--judge auto``'s points (ValueError when there are none or one is malformed)."""
        if not self.points:
            raise ValueError("--judge auto needs operating points (--points FILE)")
        try:
            return [OperatingPoint(**p) for p in self.points]
        except TypeError as e:
            raise ValueError(f"an operating point has an unknown field: {e}") from e

    def at_point(self, point: OperatingPoint) -> FunnelConfig:
        """This configuration with ``point``'s judge, view and threshold (a batch's, under
        ``--judge auto``)."""
        if point.judge == AGENT_POINT:  # phases I-III skipped: the agent loop for every query
            return replace(self, mode="agent", judge=JUDGES[0], judge_max_pixels=None,
                           points=None, speculate_depth=0, middle_tier=False,
                           direct_prompt=DIRECT_PROMPTS[0])
        tau = self.tau if point.tau is None else point.tau
        return replace(self, judge=point.judge, judge_max_pixels=point.judge_max_pixels,
                       tau=tau, points=None)

    @property
    def cascade(self) -> bool:
        """Whether any stage beyond the paper's speculative answer runs."""
        return self.speculate_depth > 0 or self.middle_tier

    def stages(self) -> tuple[str, ...]:
        """The gated stages, in cascade order."""
        deep = tuple(small_stage(d) for d in range(self.speculate_depth + 1))
        return deep + ((LARGE_DIRECT_STAGE,) if self.middle_tier else ())

    def stage_tau(self, stage: str, category: str | None = None) -> float:
        """The threshold ``stage``'s gate accepts above for a query of ``category``: the
        category's own where a calibration set one, else the stage's, else tau."""
        own = (self.category_taus or {}).get(NO_CATEGORY if category is None else category)
        if own and stage in own:
            return own[stage]
        return (self.stage_taus or {}).get(stage, self.tau)

    def stage_may_accept(self, stage: str) -> bool:
        """Whether ``stage`` can accept a query of some category (a threshold below 1.0): a
        stage that cannot does not run outside ``both``."""
        own = [t[stage] for t in (self.category_taus or {}).values() if stage in t]
        return min([self.stage_tau(stage), *own]) < 1.0

    def validate(self) -> None:
        protocols.check_protocol(self.protocol)
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose from {', '.join(MODES)}")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; choose from {SCHEDULES}")
        if self.agg not in gate.AGGREGATIONS:
            raise ValueError(f"unknown aggregation {self.agg!r}")
        if self.tau is not None and not 0.0 <= self.tau <= 1.0:  # None: the agent's
            raise ValueError(f"tau must be in [0, 1], got {self.tau}")
        if self.top_k < 2:
            raise ValueError("top_k must be at least 2")
        if (self.batch_size is not None and self.batch_size < 1) or self.max_agent_loops < 1:
            raise ValueError("batch_size and max_agent_loops must be at least 1")
        if self.early_agent < 0:
            raise ValueError(f"early_agent must be at least 0, got {self.early_agent}")
        if self.judge == AUTO:
            if self.judge_max_pixels is not None:
                raise ValueError("--judge auto: a judge view budget belongs to each point")
            self.operating_points()  # raises on a missing or bad point
        elif self.judge not in JUDGES:
            raise ValueError(
                f"unknown judge {self.judge!r}; choose from {', '.join((*JUDGES, AUTO))}"
            )
        elif self.points:
            raise ValueError("operating points are for --judge auto")
        check_hold_margin(self.auto_hold)
        if self.judge_max_pixels is not None:
            if self.judge not in ("large", "small"):
                raise ValueError(
                    f"a judge view budget applies to the large and small judges, not "
                    f"{self.judge!r} (a prefix-shared judge must see the prompt's own image)"
                )
            if self.judge_max_pixels < MIN_PIXELS:
                raise ValueError(f"judge_max_pixels must be >= {MIN_PIXELS}")
        self._validate_cascade()

    def _validate_cascade(self) -> None:
        if self.speculate_depth < 0:
            raise ValueError("speculate_depth must be at least 0")
        if self.small_agent is not None and self.small_agent not in cascade.SMALL_AGENTS:
            raise ValueError(
                f"unknown small agent {self.small_agent!r}; choose from "
                f"{', '.join(cascade.SMALL_AGENTS)}"
            )
        if self.direct_prompt not in DIRECT_PROMPTS:
            raise ValueError(
                f"unknown direct prompt {self.direct_prompt!r}; choose from "
                f"{', '.join(DIRECT_PROMPTS)}"
            )
        if self.direct_prompt != DIRECT_PROMPTS[0] and not self.middle_tier:
            raise ValueError(
                f"--direct-prompt {self.direct_prompt} is the middle tier's prompt: add "
                "--middle-tier"
            )
        if self.cascade and PLANS[self.mode].gate != "accept":
            raise ValueError(
                f"the cascade (speculate_depth, middle_tier) gates answers: modes "
                f"{', '.join(m for m, p in PLANS.items() if p.gate == 'accept')}, not {self.mode!r}"
            )
        named = [("stage_taus", self.stage_taus or {})] + [
            (f"category_taus[{c}]", t) for c, t in (self.category_taus or {}).items()
        ]
        for where, taus in named:
            for stage, tau in taus.items():
                if not stage.startswith(SMALL_STAGE_PREFIX) and stage != LARGE_DIRECT_STAGE:
                    raise ValueError(f"{where}: unknown stage {stage!r}")
                if not 0.0 <= tau <= 1.0:
                    raise ValueError(f"{where}: {stage} must be in [0, 1], got {tau}")

    def to_dict(self) -> dict:
        """Its fields; the cascade's only where they differ from the defaults, so a two-stage
        funnel's run configuration reads (and resumes) as before the cascade existed."""
        out = asdict(self)
        defaults = {**CASCADE_DEFAULTS, "points": None, "auto_hold": PointChooser.HOLD_MARGIN,
                    "early_agent": FunnelConfig.early_agent}
        for name, default in defaults.items():
            if out[name] == default:
                del out[name]
        return out


CASCADE_DEFAULTS: dict[str, Any] = {
    "speculate_depth": 0,
    "middle_tier": False,
    "direct_prompt": DIRECT_PROMPTS[0],
    "small_agent": None,
    "stage_taus": None,
    "category_taus": None,
}


@dataclass
class FunnelStats:
    """Running counts: beta = judged tool-free / judged, alpha = accepted / judged tool-free."""

    queries: int = 0
    judged: int = 0
    tool_free: int = 0
    accepted: int = 0
    blank: int = 0  # judged tool-free answers that were empty or whitespace (never accepted)
    points: dict[str, int] = field(default_factory=dict)  # --judge auto: queries per point
    errors: int = 0
    # The cascade, per stage: the queries it answered, and those whose final answer it gave
    # (the first stage whose gate passed); empty without a cascade.
    stage_runs: dict[str, int] = field(default_factory=dict)
    stage_accepted: dict[str, int] = field(default_factory=dict)
    early_agent: int = 0  # agent loops started beside phases I-III (FunnelConfig.early_agent)
    agent_dropped: int = 0  # of those, the loops dropped: phases I-III answered the query

    @property
    def beta(self) -> float | None:
        return beta_alpha(self.judged, self.tool_free, self.accepted)[0]

    @property
    def alpha(self) -> float | None:
        return beta_alpha(self.judged, self.tool_free, self.accepted)[1]


# ---- which phases each mode runs -----------------------------------------------------------
STEPS: tuple[str, ...] = ("judge", "speculate", "gate", "agent")  # phases I-IV, in order


@dataclass(frozen=True)
class Plan:
    """The phases one mode runs, and for which queries."""

    judge: bool  # I on every query
    speculate: Literal["tool_free", "all"] | None  # II for the judged tool-free or for all
    gate: Literal["accept", "record"] | None  # III accepts, or records the confidence only
    agent: Literal["rest", "all"] | None  # IV for the queries not accepted, or for all

    @property
    def steps(self) -> tuple[str, ...]:
        """The steps it runs, in the paper's order (``small-prefix`` runs II before I, and
        ``overlap`` runs them side by side)."""
        on = (self.judge, self.speculate, self.gate, self.agent)
        return tuple(step for step, runs in zip(STEPS, on, strict=True) if runs)


PLANS: dict[Mode, Plan] = {
    "speceyes": Plan(judge=True, speculate="tool_free", gate="accept", agent="rest"),
    "both": Plan(judge=True, speculate="all", gate="accept", agent="all"),
    "small": Plan(judge=False, speculate="all", gate="record", agent=None),
    "agent": Plan(judge=False, speculate=None, gate=None, agent="all"),
    "specreason": Plan(judge=False, speculate=None, gate=None, agent="all"),
}


def route_of(mode: str, result: Result, *, failed: bool, accepted: bool) -> Route:
    """Where a query's final answer comes from; the one place a route is decided.

    ``failed``: the query broke before phase IV (its image, a prompt, a model call), so it
    ends as an error; ``accepted``: the gate accepted its speculative answer."""
    if failed:
        return "error"
    if mode == "small":
        return "small_only"
    if mode in AGENT_ONLY_MODES:
        return "specreason" if mode == "specreason" else "agent_only"
    if accepted:
        return "small"
    # The cascade: the first stage whose gate passed (its small@0 is ``accepted``).
    stage = next((s["stage"] for s in result.stages if s["accepted"]), None)
    if stage is not None:
        return stage_route(stage)
    return "agent_after_judge" if result.judge_tool else "agent_after_gate"


def _answer_of(result: Result) -> str:
    """The final answer its route names."""
    if result.route in ("small", "small_only"):
        return result.small_answer or ""
    if result.route == "error":
        return ""
    if result.route in ("small_deep", "large_direct"):
        return result.stage_answer() or ""
    return result.agent_answer or ""


@dataclass(eq=False)
class Batch:
    """One batch on its way through the phases: each step reads it and adds its verdicts.

    A query that fails leaves ``live``; its result stays, with the error."""

    results: list[Result]  # one per query, in input order; each route is set once, when final
    live: dict[int, Query]  # the queries still in play (index -> query with its image loaded)
    tool_free: list[int] = field(default_factory=list)  # I: judged tool-free
    answers: dict[int, SpecAnswer] = field(default_factory=dict)  # II: speculative answers
    accepted: set[int] = field(default_factory=set)  # III: answered by the small model
    # The cascade: accepted at a stage past small@0 (index -> its first such stage).
    cascade_accepted: dict[int, str] = field(default_factory=dict)
    to_agent: list[int] = field(default_factory=list)  # IV: the queries the agent runs
    # the configuration its steps read: the funnel's, or its operating point's (--judge auto)
    cfg: FunnelConfig = field(default_factory=FunnelConfig)
    point: OperatingPoint | None = None
    opened: float = 0.0  # perf_counter() when it opened: each query's time in the funnel starts
    in_flight: int = 0  # the queries in the system when it opened (its own included)
    # early_agent: the queries whose loops started at the opening; once phases I-III have
    # decided (``decided``), the loops of those not in ``wanted`` are dropped, and a loop that
    # ended before the decision waits in ``parked`` (outcome, seconds)
    raced: frozenset[int] = frozenset()
    decided: bool = False
    wanted: frozenset[int] = frozenset()
    parked: dict[int, tuple[Any, float]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def tau(self, stage: str, i: int) -> float:
        """Query ``i``'s threshold at ``stage`` (its category's, where one is calibrated)."""
        query = self.live.get(i)
        return self.cfg.stage_tau(stage, None if query is None else query.category)

    def still_open(self, everyone: bool) -> list[int]:
        """The live queries a cascade stage runs on: all (``both``) or those not yet accepted."""
        if everyone:
            return list(self.live)
        return [i for i in self.live if i not in self.accepted and i not in self.cascade_accepted]


class Funnel:
    def __init__(
        self,
        small: Backend | None,
        large: Backend | None,
        agent: Agent | None,
        config: FunnelConfig | None = None,
        speculation: cascade.Speculation | None = None,
    ) -> None:
        """``speculation``: the small model's loop for ``speculate_depth`` (default: built by
        ``cascade.make_speculation`` for ``small_agent``, with the agent's settings)."""
        self.config = config or FunnelConfig()
        if self.config.tau is None:  # the agent's own threshold (the base one without an agent)
            default = getattr(agent, "default_tau", LoopAgent.default_tau)
            self.config = replace(self.config, tau=default)
        if self.config.schedule is None:
            schedule = protocols.get_protocol(self.config.protocol).schedule
            self.config = replace(self.config, schedule=schedule)
        self.config.validate()
        mode = self.config.mode
        self.plan = PLANS[mode]
        if self.plan.agent and (large is None or agent is None):
            raise ValueError(f"mode {mode!r} needs the large model and its agent")
        if self.plan.speculate and small is None:
            raise ValueError(f"mode {mode!r} needs the small model")
        self.small, self.large, self.agent = small, large, agent
        name = agent.name if agent is not None else None
        self._protocol = protocols.get_protocol(self.config.protocol)
        self._family = self._protocol.family_of(name)
        self._chooser: PointChooser | None = None
        judges = {self.config.judge}
        if self.config.judge == AUTO:
            points = self.config.operating_points()
            judges = {p.judge for p in points}
            self._chooser = PointChooser(points, self.config.auto_hold)
        self._in_agent = 0  # queries handed to phase IV and not yet done (--judge auto's load)
        # the queries settled and those of them answered without the agent: early_agent's
        # share answered early (under --judge auto, the chooser's share of each point instead)
        self._settled = [0, 0]
        # A server's queries that have not reached the funnel yet (serve sets it): they are in
        # the system too, and a point whose front is slow keeps more of them waiting, so
        # without them the load band would depend on the point.
        self.waiting: Callable[[], int] | None = None
        if "prefix" in judges and agent is not None and not agent.shares_first_prompt:
            raise ValueError(
                "--judge prefix: this agent's first prompt cannot be shared with the judge "
                "(the Thyme agent's names a per-run sandbox file); use large, small, "
                "small-prefix or none"
            )
        shared_direct = self.config.middle_tier and self.config.direct_prompt == "agent-prefix"
        if shared_direct and agent is not None and not agent.shares_first_prompt:
            raise ValueError(
                "--direct-prompt agent-prefix: this agent's first prompt cannot be shared with "
                "the direct answer (the Thyme agent's names a per-run sandbox file); use "
                "--direct-prompt speculative"
            )
        self.speculation = speculation
        cfg = self.config
        if cfg.speculate_depth and speculation is None:
            if small is None:
                raise ValueError("speculate_depth needs the small model")
            kind = cfg.small_agent or cascade.default_small_agent(name)
            self.speculation = cascade.make_speculation(kind, small, cfg.speculate_depth, agent)
        self.stats = FunnelStats()
        self._stats_lock = threading.Lock()

    # ---- public ---------------------------------------------------------------------------
    def run(
        self, queries: Iterable[Query], on_result: Callable[[Result], None] | None = None
    ) -> list[Result]:
        results = []
        for r in self.iter_results(queries):
            if on_result is not None:
                on_result(r)
            results.append(r)
        return results

    def iter_results(self, queries: Iterable[Query]) -> Iterator[Result]:
        """Results as soon as they are final (input order when batched, else completion order)."""
        yield from self.iter_batches(_chunks(queries, self.config.batch_size))

    def iter_batches(self, batches: Iterable[Sequence[Query]]) -> Iterator[Result]:
        """Like ``iter_results`` over batches formed by the caller (a server's micro-batches);
        the next batch is drawn only when the schedule is ready for it."""
        if self.config.schedule == "pipelined":
            yield from self._iter_pipelined(batches)
            return
        for chunk in batches:
            yield from self.run_batch(chunk)

    def run_batch(self, queries: Sequence[Query]) -> list[Result]:
        """All four phases for one batch; results in input order."""
        batch = self._front(queries)
        if self.plan.agent:
            self._agent(batch)
        return batch.results

    # ---- phases I-III, composed -----------------------------------------------------------
    def _front(self, queries: Sequence[Query]) -> Batch:
        """Phases I-III of one batch as the mode's plan says; every result that needs no agent
        loop is final when this returns, and ``to_agent`` names the others."""
        batch = self._open(queries)
        self._decide(batch)
        return batch

    def _decide(self, batch: Batch) -> None:
        """Phases I-III of an opened batch (see ``_front``)."""
        # the batch's own plan: under --judge auto, the agent-only point skips I-III
        plan = PLANS[batch.cfg.mode]
        if plan.judge:
            self._judge_and_speculate(batch)
        elif plan.speculate:
            self._speculate(batch, list(batch.live))
        if plan.gate:
            self._gate(batch)
        if batch.cfg.cascade:
            self._cascade(batch)
        if plan.agent == "all":
            batch.to_agent = list(batch.live)
        elif plan.agent == "rest":
            batch.to_agent = batch.still_open(everyone=False)
        if batch.point is not None:
            self._observe_point(batch)
        if not batch.raced:  # a raced batch's loops were counted when they started
            with self._stats_lock:
                self._in_agent += len(batch.to_agent)
        needs_agent = set(batch.to_agent)
        for i in range(len(batch.results)):
            if i not in needs_agent:
                self._settle(batch, i)

    def _judge_and_speculate(self, batch: Batch) -> None:
        """Phases I and II in the order the judge variant asks for."""
        cfg = batch.cfg
        everyone = list(batch.live)
        if cfg.judge == "small-prefix":
            # The answer first: its prompt is then cached for the judge question that follows.
            self._speculate(batch, everyone)
            self._judge(batch)
        elif cfg.overlap and cfg.judge != "none" and everyone:
            with ThreadPoolExecutor(2) as pool:
                judged = pool.submit(self._judge, batch)
                self._speculate(batch, everyone)
                judged.result()
        else:
            self._judge(batch)
            wanted = batch.tool_free if self.plan.speculate == "tool_free" else everyone
            self._speculate(batch, wanted)

    def _open(self, queries: Sequence[Query]) -> Batch:
        """A batch's state with every image loaded; a query whose image cannot be read fails
        here, alone."""
        batch = Batch(results=[Result(id=q.id, answer="") for q in queries], live={},
                      cfg=self.config, opened=time.perf_counter())
        outside = self.waiting() if self.waiting is not None else 0
        with self._stats_lock:
            batch.in_flight = len(queries) + self._in_agent + outside
        if self._chooser is not None:  # --judge auto: this batch's point, by the load now
            batch.point = self._chooser.choose(batch.in_flight)
            batch.cfg = self.config.at_point(batch.point)
        unreadable = 0
        for i, q in enumerate(queries):
            try:
                # the protocol opens it (the published one never EXIF-rotates, and re-encodes
                # as JPEG where the released script does)
                batch.live[i] = replace(q, image=self._protocol.open_image(q, self._family))
            except (OSError, ValueError) as e:
                batch.results[i].error = str(e)
                unreadable += 1
        self._count(queries=len(queries), errors=unreadable)
        return batch

    # ---- phase I --------------------------------------------------------------------------
    def _judge(self, batch: Batch) -> None:
        """Phase I over every live query: P(tool) and the verdict; ``tool_free`` lists the
        queries judged tool-free (a failed judgment counts as "tools needed")."""
        cfg = batch.cfg
        idx = list(batch.live)
        if cfg.judge == "none":  # no model call: every query goes on to the gate
            for i in idx:
                batch.results[i].judge_tool = False
            batch.tool_free = idx
            self._count(judged=len(idx))
            return
        if not idx:
            return
        backend, build = self._judge_setup(cfg)
        idx, msgs = self._messages(build, batch, idx)
        if not idx:
            return
        t0 = time.perf_counter()
        try:
            p_tools = per_item(
                lambda m: self._protocol.tool_probability(backend, m, cfg.judge_mode, self._family),
                msgs,
            )
        except BackendError as e:
            p_tools = [e] * len(idx)
        per = (time.perf_counter() - t0) / len(idx)
        tool_free = []
        for i, p in zip(idx, p_tools, strict=True):
            if isinstance(p, BackendError):
                # A failed judgment is treated as "tools needed": correctness first.
                batch.results[i].trace.append({"type": "judge_error", "error": str(p)})
                p = 1.0
            elif isinstance(p, Exception):
                self._fail(batch, i, p)
                continue
            r = batch.results[i]
            r.p_tool = float(p)
            r.judge_tool = bool(p >= cfg.judge_threshold)
            r.timings["judge"] = per
            if not r.judge_tool:
                tool_free.append(i)
        batch.tool_free = tool_free
        self._count(judged=len(idx))

    def _judge_setup(self, cfg: FunnelConfig) -> tuple[Backend, Callable[..., list[dict]]]:
        """Phase I's model and prompt builder ``(image, question, options) -> messages`` for
        the batch's judge variant."""
        if cfg.judge == "prefix":
            return self.large, self._prefix_judge_messages
        if cfg.judge == "small-prefix":
            answer = partial(self._protocol.small_messages, self._family)
            return self.small, lambda image, q, opts: [*answer(image, q, opts), _judge_turn()]
        backend = self.small if cfg.judge == "small" else self.large
        build = partial(self._protocol.judge_messages, self._family)
        if cfg.judge_max_pixels is None:
            return backend, build
        budget = cfg.judge_max_pixels
        return backend, lambda image, q, opts: build(_judge_view(image, backend, budget), q, opts)

    def _prefix_judge_messages(self, image: Any, question: str, options: Any) -> list[dict]:
        """The agent's own first-turn messages, then the judge question as a user turn."""
        query = Query(id="judge", image=image, question=question, options=options)
        return [*self.agent.first_messages(query), _judge_turn()]

    def _agent_prefix_direct_messages(self, image: Any, question: str, options: Any) -> list[dict]:
        """The agent's own first-turn messages, then the direct question as a user turn (the
        middle tier with ``--direct-prompt agent-prefix``)."""
        query = Query(id="direct", image=image, question=question, options=options)
        return [*self.agent.first_messages(query), prompts.direct_turn()]

    # ---- phase II -------------------------------------------------------------------------
    def _speculate(self, batch: Batch, idx: Sequence[int]) -> None:
        """Phase II: the small model's answers for ``idx``, each with the top-K values of
        every generated token."""
        cfg = batch.cfg
        if not idx:
            return
        build = partial(self._protocol.small_messages, self._family)
        idx, msgs = self._messages(build, batch, idx)
        if not idx:
            return
        t0 = time.perf_counter()
        try:
            got = per_item(
                lambda m: self._protocol.answers(
                    self.small,
                    m,
                    max_new_tokens=cfg.max_new_tokens,
                    top_k=cfg.top_k,
                    agg=cfg.agg,
                    family=self._family,
                ),
                msgs,
            )
        except BackendError as e:
            got = [e] * len(idx)
        per = (time.perf_counter() - t0) / len(idx)
        for i, a in zip(idx, got, strict=True):
            r = batch.results[i]
            if isinstance(a, BackendError):  # no speculative answer: the gate cannot accept
                r.timings["small"] = per
                r.trace.append({"type": "small_error", "error": str(a)})
            elif isinstance(a, Exception):
                self._fail(batch, i, a)
            else:
                r.small_answer = a.text
                r.small_topk = a.topk
                r.timings["small"] = per
                r.trace.append({"type": "small", "text": a.text, "tokens": len(a.topk)})
                batch.answers[i] = a

    # ---- phase III ------------------------------------------------------------------------
    def _gate(self, batch: Batch) -> None:
        """Phase III: the confidence of every speculative answer, then (unless the plan only
        records it) acceptance of the judged tool-free answers with confidence > tau."""
        cfg = batch.cfg
        if batch.answers:
            idx = list(batch.answers)
            t0 = time.perf_counter()
            conf = self._protocol.confidence(
                self.small,
                list(batch.answers.values()),
                top_k=cfg.top_k,
                agg=cfg.agg,
                scale=cfg.scale,
            )
            per = (time.perf_counter() - t0) / len(idx)
            for i, c in zip(idx, conf, strict=True):
                r = batch.results[i]
                r.confidence = None if np.isnan(c) else float(c)
                r.timings["gate"] = per
        if self.plan.gate == "record":
            return
        if self.plan.speculate == "tool_free":
            # Answers the judge did not ask for (overlap, small-prefix) are discarded, so the
            # results equal those of the judge-first order.
            free = set(batch.tool_free)
            for i, r in enumerate(batch.results):
                if i not in free:
                    r.small_answer, r.small_topk, r.confidence = None, None, None
                    r.timings.pop("small", None)
                    r.timings.pop("gate", None)
                    r.trace = [s for s in r.trace if s["type"] != "small"]
        results = batch.results
        stage = small_stage(0)
        accepted = [
            i for i in batch.tool_free if gate.accept(results[i].confidence, batch.tau(stage, i))
        ]
        batch.accepted = set(accepted)
        blank = sum(
            1
            for i in batch.tool_free
            if i in batch.answers and gate.is_blank(results[i].small_answer)
        )
        self._count(tool_free=len(batch.tool_free), accepted=len(accepted), blank=blank)

    # ---- the cascade, between III and IV (docs/cascade.md) ---------------------------------
    def _cascade(self, batch: Batch) -> None:
        """The stages past the paper's gate: the small model's speculation depth by depth,
        then the middle tier; in ``both`` every stage runs for every query."""
        cfg = batch.cfg
        everyone = self.plan.agent == "all"
        self._small_stage(batch)
        # A stage at tau 1.0 accepts nothing (a calibration switches a costly stage off so),
        # so outside ``both`` it does not run: the loop stops at the last depth that can pass.
        depth = max(
            (d for d in range(1, cfg.speculate_depth + 1)
             if everyone or cfg.stage_may_accept(small_stage(d))),
            default=0,
        )
        if depth:
            self._deepen(batch, batch.still_open(everyone), depth)
        if cfg.middle_tier and (everyone or cfg.stage_may_accept(LARGE_DIRECT_STAGE)):
            self._middle(batch, batch.still_open(everyone))

    def _small_stage(self, batch: Batch) -> None:
        """Stage small@0's record: phases II and III as they ran (accepted: by phase III)."""
        stage = small_stage(0)
        for i, r in enumerate(batch.results):
            if i not in batch.live or "small" not in r.timings:  # not asked, or discarded
                continue
            tau = batch.tau(stage, i)
            seconds = r.timings["small"] + r.timings.get("gate", 0.0)
            if i in batch.answers:
                record = cascade.stage_record(
                    stage, r.small_answer, r.confidence, i in batch.accepted, tau, seconds
                )
            else:
                error = next(s["error"] for s in r.trace if s["type"] == "small_error")
                record = cascade.stage_record(stage, None, None, False, tau, seconds, error=error)
            r.stages.append(record)

    def _deepen(self, batch: Batch, idx: Sequence[int], max_depth: int) -> None:
        """Stages small@1..small@n: the small model's own loop, one tool call at a time; after
        each call it answers on what it last saw, gated at that stage's tau. A loop stops at
        its first accepted answer (``both``: at the end of its loop)."""
        spec = self.speculation
        everyone = self.plan.agent == "all"
        loops: dict[int, Any] = {}
        for i in idx:
            try:
                loops[i] = spec.start(batch.live[i])
            except Exception as e:  # this query's input broke the loop: only this one
                self._fail(batch, i, e)
        active = [i for i in loops if spec.can_go(loops[i])]
        for depth in range(1, max_depth + 1):
            if not active:
                return
            stage = small_stage(depth)
            t0 = time.perf_counter()
            try:
                errors = per_item(
                    lambda ls: (spec.step(ls), [None] * len(ls))[1], [loops[i] for i in active]
                )
            except BackendError as e:
                errors = [e] * len(active)
            step = (time.perf_counter() - t0) / len(active)
            moved: list[int] = []
            for i, e in zip(active, errors, strict=True):
                if isinstance(e, BackendError):  # no answer at this depth: the loop ends here
                    record = cascade.stage_record(
                        stage, None, None, False, batch.tau(stage, i), step, error=str(e)
                    )
                    batch.results[i].stages.append(record)
                    _add_time(batch.results[i], "small_deep", step)
                elif e is not None:
                    self._fail(batch, i, e)
                elif spec.tool_calls(loops[i]) >= depth:  # else it stopped: nothing new seen
                    moved.append(i)
            views = {i: spec.seen(loops[i]) for i in moved}
            moved, msgs = self._messages(
                partial(self._protocol.small_messages, self._family),
                batch,
                moved,
                image=lambda i, q, views=views: views[i],
            )
            calls = {i: spec.tool_calls(loops[i]) for i in moved}
            passed = self._stage(batch, stage, self.small, moved, msgs, "small_deep", step, calls)
            active = [
                i
                for i in moved
                if i in batch.live and spec.can_go(loops[i]) and (everyone or i not in passed)
            ]

    def _middle(self, batch: Batch, idx: Sequence[int]) -> None:
        """Stage large_direct: the large model's answer on the full image without tools,
        gated at its own tau; its prompt is the speculative answer's, or the agent's own first
        turn and the direct question (``direct_prompt``)."""
        if batch.cfg.direct_prompt == "agent-prefix":
            build = self._agent_prefix_direct_messages
        else:
            build = partial(self._protocol.small_messages, self._family)
        idx, msgs = self._messages(build, batch, idx)
        self._stage(batch, LARGE_DIRECT_STAGE, self.large, idx, msgs, LARGE_DIRECT_STAGE)

    def _stage(
        self,
        batch: Batch,
        stage: str,
        backend: Backend,
        idx: Sequence[int],
        msgs: Sequence[list[dict]],
        timing: str,
        before: float = 0.0,
        tool_calls: dict[int, int] | None = None,
    ) -> set[int]:
        """One gated stage for ``idx``: ``backend``'s answers to ``msgs`` with their top-K
        logits, the gate's confidence, each query's stage record; returns the queries whose
        gate passed. ``before``: seconds each query already spent on this stage (its loop's
        step)."""
        cfg = batch.cfg
        if not idx:
            return set()
        t0 = time.perf_counter()
        try:
            got = per_item(
                lambda m: self._protocol.answers(
                    backend, m, max_new_tokens=cfg.max_new_tokens, top_k=cfg.top_k, agg=cfg.agg
                ),
                list(msgs),
            )
        except BackendError as e:
            got = [e] * len(idx)
        answered = [(i, a) for i, a in zip(idx, got, strict=True) if not isinstance(a, Exception)]
        confidence: dict[int, float | None] = {}
        if answered:
            scores = self._protocol.confidence(
                backend, [a for _, a in answered], top_k=cfg.top_k, agg=cfg.agg, scale=cfg.scale
            )
            for (i, _), c in zip(answered, scores, strict=True):
                confidence[i] = None if np.isnan(c) else float(c)
        seconds = before + (time.perf_counter() - t0) / len(idx)
        passed = set()
        calls = tool_calls or {}
        for i, a in zip(idx, got, strict=True):
            r = batch.results[i]
            tau = batch.tau(stage, i)
            if isinstance(a, BackendError):
                record = cascade.stage_record(
                    stage, None, None, False, tau, seconds, calls.get(i, 0), error=str(a)
                )
            elif isinstance(a, Exception):
                self._fail(batch, i, a)
                continue
            else:
                ok = gate.accept(confidence[i], tau)
                record = cascade.stage_record(
                    stage, a.text, confidence[i], ok, tau, seconds, calls.get(i, 0)
                )
                if ok:
                    passed.add(i)
                    if i not in batch.accepted:
                        batch.cascade_accepted.setdefault(i, stage)
            r.stages.append(record)
            _add_time(r, timing, seconds)
        return passed

    # ---- phase IV -------------------------------------------------------------------------
    def _agent(self, batch: Batch) -> None:
        """Phase IV for one batch: its agent loops run together (batched) or one by one
        (serial)."""
        pending = iter(batch.to_agent)

        def take(block: bool) -> Any:
            i = next(pending, None)
            return END if i is None else ((batch, i), batch.live[i])

        max_active = 1 if self.config.schedule == "serial" else None
        for _ in self._agent_loops(take, max_active=max_active):
            pass

    def _agent_loops(self, take: Callable[[bool], Any], max_active: int | None) -> Iterator[Result]:
        """Agent loops for the ``(batch, index)`` keys ``take`` hands out, in continuous batches
        (``agents.base.drive_loops``); yields each query's final result as its loop ends (an
        early loop's, once phases I-III have sent its query to the agent)."""
        for (batch, i), out, seconds in drive_loops(
            self.agent, take, max_active, dropped=_unwanted
        ):
            if i in batch.raced:
                with batch.lock:
                    if not batch.decided:  # phases I-III still deciding: _end_race settles it
                        batch.parked[i] = (out, seconds)
                        continue
                if i not in batch.wanted:  # answered before its loop ended: already counted
                    continue
            yield self._finish_agent(batch, i, out, seconds)

    def _finish_agent(self, batch: Batch, i: int, out: Any, seconds: float) -> Result:
        """Query ``i``'s agent outcome into its result, made final."""
        with self._stats_lock:
            self._in_agent -= 1
        r = batch.results[i]
        r.agent_answer = out.answer
        r.tool_calls = out.tool_calls
        r.invalid_tool_calls = out.invalid_tool_calls
        r.timings["agent"] = seconds
        r.trace.extend(out.trace)
        if out.error:
            r.error = out.error
        return self._settle(batch, i)

    # ---- the agent started early (early_agent) --------------------------------------------
    def _race(self, batch: Batch) -> bool:
        """Whether ``batch``'s agent loops start now, beside phases I-III: on the pipelined
        schedule, for a mode that sends only the rest to the agent, while the system holds at
        most ``early_agent`` queries (the large model is otherwise idle, so the loops cost the
        others nothing) and less than ``EARLY_AGENT_MAX_SHARE`` of its queries are answered
        early: of those settled, or under ``--judge auto`` its point's share as the chooser
        counts it (from the calibrated rate on, so a point near the bound does not switch the
        early start on and off with each query: its times would then mix the two)."""
        cfg = batch.cfg
        if (
            cfg.schedule != "pipelined"
            or PLANS[cfg.mode].agent != "rest"
            or not batch.live
            or batch.in_flight > cfg.early_agent
        ):
            return False
        if self._chooser is not None and batch.point is not None:
            share: float | None = self._chooser.skipped(batch.point)
        else:
            with self._stats_lock:
                settled, early = self._settled
            share = early / settled if settled else None
        if not early_share_allows(share):
            return False
        batch.raced = frozenset(batch.live)
        for i in batch.raced:
            batch.results[i].trace.append({"type": "early_agent", "in_flight": batch.in_flight})
        with self._stats_lock:
            self._in_agent += len(batch.raced)
            self.stats.early_agent += len(batch.raced)
        return True

    def _end_race(self, batch: Batch) -> list[Result]:
        """After phases I-III of a raced batch: the loops of the queries they answered (or
        failed) are dropped, and each loop that had already ended is settled if wanted."""
        with batch.lock:
            batch.wanted = frozenset(batch.to_agent)
            batch.decided = True
            parked, batch.parked = batch.parked, {}
        dropped = len(batch.raced - batch.wanted)
        with self._stats_lock:
            self._in_agent -= dropped
            self.stats.agent_dropped += dropped
        return [
            self._finish_agent(batch, i, out, seconds)
            for i, (out, seconds) in parked.items()
            if i in batch.wanted
        ]

    def _observe_point(self, batch: Batch) -> None:
        """--judge auto: each result records the point that answered it (the chooser hears
        each query's time in the funnel when it settles)."""
        for r in batch.results:
            r.trace.append({"type": "operating_point", "point": batch.point.name,
                            "judge": batch.point.judge, "tau": batch.cfg.tau,
                            "in_flight": batch.in_flight,
                            "load_band": load_level(max(1, batch.in_flight))})
        with self._stats_lock:
            name = batch.point.name
            self.stats.points[name] = self.stats.points.get(name, 0) + len(batch.results)

    # ---- a query's end --------------------------------------------------------------------
    def _settle(self, batch: Batch, i: int) -> Result:
        """Query ``i``'s result made final: its route, and the answer that route names."""
        r = batch.results[i]
        failed, accepted = i not in batch.live, i in batch.accepted
        r.route = route_of(batch.cfg.mode, r, failed=failed, accepted=accepted)
        r.answer = _answer_of(r)
        if not failed:
            with self._stats_lock:
                self._settled[0] += 1
                self._settled[1] += i not in batch.to_agent
        if self._chooser is not None and batch.point is not None and not failed:
            # its time in the system: a server's queue as well (a slow front makes the next
            # batch's queries wait there, and by Little's law that time costs throughput too)
            seconds = time.perf_counter() - batch.opened + batch.live[i].queued_s
            early = i not in batch.to_agent  # answered without the agent loop
            self._chooser.observe(batch.point, batch.in_flight, seconds, early=early)
        if r.stages:
            self._count_stages(r)
        return r

    def _count_stages(self, r: Result) -> None:
        """Add a final result's stages to the per-stage counts."""
        answered_by = next((s["stage"] for s in r.stages if s["accepted"]), None)
        if r.route == "error":
            answered_by = None
        with self._stats_lock:
            for s in r.stages:
                runs = self.stats.stage_runs
                runs[s["stage"]] = runs.get(s["stage"], 0) + 1
            if answered_by is not None:
                acc = self.stats.stage_accepted
                acc[answered_by] = acc.get(answered_by, 0) + 1

    def _messages(
        self,
        build: Callable[..., list[dict]],
        batch: Batch,
        idx: Sequence[int],
        image: Callable[[int, Query], Any] | None = None,
    ) -> tuple[list[int], list[list[dict]]]:
        """Prompts of the live queries in ``idx`` (on ``image(i, query)``, default the query's
        image); a query whose prompt cannot be built fails."""
        kept, msgs = [], []
        for i in idx:
            q = batch.live.get(i)  # gone: failed in a phase running beside this one
            if q is None:
                continue
            try:
                view = q.image if image is None else image(i, q)
                msgs.append(build(view, q.question, q.options))
            except Exception as e:
                self._fail(batch, i, e)
                continue
            kept.append(i)
        return kept, msgs

    def _fail(self, batch: Batch, i: int, e: BaseException) -> None:
        """Query ``i`` leaves the batch with the error; its batch-mates go on without it."""
        if batch.live.pop(i, None) is None:
            return
        batch.results[i].error = f"{type(e).__name__}: {e}"
        self._count(errors=1)

    def _count(self, **deltas: int) -> None:
        """Add to the running counts (steps of different batches may run at the same time)."""
        with self._stats_lock:
            for name, n in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + n)

    # ---- pipelined schedule ---------------------------------------------------------------
    def _iter_pipelined(self, batches: Iterable[Sequence[Query]]) -> Iterator[Result]:
        cfg = self.config
        done = object()
        out_q: queue.Queue = queue.Queue()
        # Bounded hand-off: the front end may run ahead of the agents, but not without limit.
        agent_q: queue.Queue = queue.Queue(maxsize=2 * cfg.max_agent_loops + cfg.batch_size)
        stop = threading.Event()

        def front() -> None:
            try:
                for chunk in batches:
                    if stop.is_set():
                        return
                    batch = self._open(chunk)
                    raced = self._race(batch)
                    for i in batch.raced:
                        agent_q.put((batch, i))
                    self._decide(batch)
                    needs_agent = set(batch.to_agent)
                    for i, r in enumerate(batch.results):
                        if i not in needs_agent:
                            out_q.put(r)
                    if raced:
                        for r in self._end_race(batch):
                            out_q.put(r)
                        continue
                    for i in batch.to_agent:
                        agent_q.put((batch, i))
            except BaseException as e:  # surfaced to the consumer below
                out_q.put(e)
            finally:
                agent_q.put(done)

        def take(block: bool) -> Any:
            while not stop.is_set():
                try:
                    item = agent_q.get(block=block)
                except queue.Empty:
                    return EMPTY
                if item is done:
                    return END
                batch, i = item
                query = batch.live.get(i)  # an early loop's query may have failed or been answered
                if query is not None and not _unwanted(item):
                    return item, query
            return END

        def back() -> None:
            try:
                for r in self._agent_loops(take, cfg.max_agent_loops):
                    out_q.put(r)
            except BaseException as e:
                out_q.put(e)
            finally:
                out_q.put(done)

        threads = [threading.Thread(target=t, daemon=True) for t in (front, back)]
        for t in threads:
            t.start()
        try:
            while True:
                item = out_q.get()
                if item is done:
                    break
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            # Unblock a front end waiting on a full hand-off queue, wake the back end, and let
            # both finish the model call they are in.
            while threads[0].is_alive():
                try:
                    agent_q.get_nowait()
                except queue.Empty:
                    threads[0].join(0.05)
            agent_q.put(done)
            threads[1].join(timeout=600)


def _unwanted(key: tuple[Batch, int]) -> bool:
    """Whether an agent loop's answer is no longer wanted: phases I-III answered its query
    while the loop ran (early_agent)."""
    batch, i = key
    if i not in batch.raced:
        return False
    with batch.lock:
        return batch.decided and i not in batch.wanted


def _add_time(result: Result, key: str, seconds: float) -> None:
    result.timings[key] = result.timings.get(key, 0.0) + seconds


def _judge_turn() -> dict:
    return prompts.user_turn(PREFIX_JUDGE_TEXT)


def _judge_view(image: Any, backend: Backend, max_pixels: int) -> Any:
    """The image at most ``max_pixels`` big, resized as ``backend``'s model would (its factor),
    so the backend's own resize leaves it as it is."""
    lo = min(backend.min_pixels, max_pixels)
    view, _ = resize_for_model(load_image(image, copy=False), backend.factor, lo, max_pixels)
    return view


def _chunks(queries: Iterable[Query], size: int) -> Iterator[list[Query]]:
    batch: list[Query] = []
    for q in queries:
        batch.append(q)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
