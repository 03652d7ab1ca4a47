"""The four phases of SpecEyes over a stream of queries.

I   tool-need judgment on the large model: P(tool) per query; "yes" goes straight to IV.
II  speculative answers from the small model, keeping the top-K logits of every token.
III the cognitive gate: accept iff sigmoid(alpha * separability) > tau.
IV  the agent loop on the large model for everything not accepted.

The baselines are modes of the same funnel: ``agent`` (IV for all), ``small`` (II for all) and
``both`` (every phase for every query, routed as ``speceyes`` would, so any gate setting can be
replayed offline from the logs).

Two schedules give the same results for the same inputs under greedy decoding:

- ``batched``: each batch of queries goes through I-III, then its agent loops run together.
- ``pipelined``: phases I-III of later batches run while earlier agent loops are still going;
  agent loops join and leave one shared batch as they start and finish (continuous batching,
  at most ``max_agent_loops`` in flight), so an engine always has a full batch of agent turns.
  Results come out in completion order.

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
  the agent's first turn from the judge's cached prefill.
- ``small``: the small model on the judge prompt (``judge_max_pixels`` applies too).
- ``small-prefix``: the small model, the judge question asked after its own answer prompt, once
  the answer is done, so a prefix-caching server prefills the image once for both.
- ``none``: no judge; the small model answers every query and the gate alone decides.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Any, Literal

import numpy as np

from speceyes import gate, prompts, protocols
from speceyes.agents.base import EMPTY, END, Agent, AgentOutcome, LoopAgent, drive_loops
from speceyes.backends.base import Backend, BackendError, per_item
from speceyes.images import MIN_PIXELS, load_image, resize_for_model
from speceyes.judging import JudgeMode
from speceyes.rates import beta_alpha
from speceyes.types import Query, Result

Mode = Literal["speceyes", "agent", "small", "both", "specreason"]
MODES: tuple[str, ...] = ("speceyes", "agent", "small", "both", "specreason")
AGENT_ONLY_MODES = ("agent", "specreason")  # every query runs the (given) agent
SCHEDULES: tuple[str, ...] = ("batched", "pipelined")
JUDGES: tuple[str, ...] = ("large", "prefix", "small", "small-prefix", "none")
# The judge question as one more user turn after a shared prefix: the published judge's
# instructions and question (prompts.JUDGE_SYSTEM, prompts.JUDGE_SUFFIX) as one text.
PREFIX_JUDGE_TEXT = prompts.JUDGE_SYSTEM + prompts.JUDGE_SUFFIX.lstrip("\n")


@dataclass
class FunnelConfig:
    mode: Mode = "speceyes"
    tau: float | None = None  # None: the agent's default_tau
    top_k: int = gate.DEFAULT_TOP_K
    agg: gate.Aggregation = "min"
    alpha: float = gate.DEFAULT_ALPHA
    judge_mode: JudgeMode = "logit"
    judge_threshold: float = 0.5  # tool iff P(tool) >= threshold; 0.5 equals greedy yes-vs-no
    judge: str = "large"  # who answers phase I: see JUDGES and the module docstring
    judge_max_pixels: int | None = None  # large/small judge: the image shown at most this big
    # None: the protocol's (factory.Settings.resolved); left out: the fair protocol's
    batch_size: int | None = protocols.FAIR.loop_settings().batch_size
    max_new_tokens: int = 20
    schedule: Literal["batched", "pipelined"] = "batched"
    overlap: bool = False
    max_agent_loops: int = 32
    protocol: str = "fair"  # or "published": the authors' prompts and rules (protocols.py)

    def validate(self) -> None:
        protocols.check_protocol(self.protocol)
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose from {', '.join(MODES)}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; choose from {SCHEDULES}")
        if self.agg not in gate.AGGREGATIONS:
            raise ValueError(f"unknown aggregation {self.agg!r}")
        if self.tau is not None and not 0.0 <= self.tau <= 1.0:  # None: the agent's
            raise ValueError(f"tau must be in [0, 1], got {self.tau}")
        if self.top_k < 2:
            raise ValueError("top_k must be at least 2")
        if (self.batch_size is not None and self.batch_size < 1) or self.max_agent_loops < 1:
            raise ValueError("batch_size and max_agent_loops must be at least 1")
        if self.judge not in JUDGES:
            raise ValueError(f"unknown judge {self.judge!r}; choose from {', '.join(JUDGES)}")
        if self.judge_max_pixels is not None:
            if self.judge not in ("large", "small"):
                raise ValueError(
                    f"a judge view budget applies to the large and small judges, not "
                    f"{self.judge!r} (a prefix-shared judge must see the prompt's own image)"
                )
            if self.judge_max_pixels < MIN_PIXELS:
                raise ValueError(f"judge_max_pixels must be >= {MIN_PIXELS}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class FunnelStats:
    """Running counts: beta = judged tool-free / judged, alpha = accepted / judged tool-free."""

    queries: int = 0
    judged: int = 0
    tool_free: int = 0
    accepted: int = 0
    errors: int = 0

    @property
    def beta(self) -> float | None:
        return beta_alpha(self.judged, self.tool_free, self.accepted)[0]

    @property
    def alpha(self) -> float | None:
        return beta_alpha(self.judged, self.tool_free, self.accepted)[1]


@dataclass
class _Front:
    """What phases I-III leave for phase IV."""

    results: dict[int, Result]
    live: dict[int, Query]
    rest: list[int]  # queries whose final answer comes from the agent
    agent: list[int]  # queries the agent must run (all live ones in "both" mode)


class Funnel:
    def __init__(
        self,
        small: Backend | None,
        large: Backend | None,
        agent: Agent | None,
        config: FunnelConfig | None = None,
    ) -> None:
        self.config = config or FunnelConfig()
        if self.config.tau is None:  # the agent's own threshold (the base one without an agent)
            default = getattr(agent, "default_tau", LoopAgent.default_tau)
            self.config = replace(self.config, tau=default)
        self.config.validate()
        mode = self.config.mode
        if mode in ("speceyes", "both", *AGENT_ONLY_MODES) and (large is None or agent is None):
            raise ValueError(f"mode {mode!r} needs the large model and its agent")
        if mode in ("speceyes", "both", "small") and small is None:
            raise ValueError(f"mode {mode!r} needs the small model")
        self.small, self.large, self.agent = small, large, agent
        self._protocol = protocols.get_protocol(self.config.protocol)
        self._family = self._protocol.family_of(getattr(agent, "name", None))
        if self.config.judge == "prefix" and getattr(agent, "name", None) == "thyme":
            raise ValueError(
                "--judge prefix: the Thyme agent's first prompt names a per-run sandbox file, "
                "so no judge can share it; use large, small, small-prefix or none"
            )
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
        front = self._front(queries)
        loops = iter([(i, front.live[i]) for i in front.agent])
        take = lambda block: next(loops, END)  # noqa: E731
        for i, outcome, seconds in drive_loops(self.agent, take, max_active=None):
            self._finish_agent(front, i, outcome, seconds)
        return [front.results[i] for i in range(len(queries))]

    # ---- phases I-III ---------------------------------------------------------------------
    def _front(self, queries: Sequence[Query]) -> _Front:
        cfg = self.config
        results: dict[int, Result] = {}
        live: dict[int, Query] = {}
        for i, q in enumerate(queries):
            try:
                live[i] = replace(q, image=load_image(q.image, copy=False))
            except (OSError, ValueError) as e:
                results[i] = Result(id=q.id, answer="", route="error", error=str(e))
            else:
                results[i] = Result(id=q.id, answer="", route="error")
        with self._stats_lock:
            self.stats.queries += len(queries)
            self.stats.errors += len(queries) - len(live)
        idx = list(live)
        if cfg.mode in AGENT_ONLY_MODES:
            return _Front(results, live, rest=idx, agent=idx)
        if cfg.mode == "small":
            self._phase_small(live, idx, results)
            for i in (i for i in idx if i in live):
                results[i].route, results[i].answer = "small_only", results[i].small_answer or ""
            return _Front(results, live, rest=[], agent=[])

        # Phase II runs on every query in "both" mode, and with overlap it runs beside phase I.
        small_all = cfg.mode == "both" or cfg.overlap
        if cfg.judge == "none":
            to_small = self._no_judge(live, results)
            self._phase_small(live, to_small, results)
        elif cfg.judge == "small-prefix":
            # The answer first: its prompt is then cached for the judge question that follows.
            self._phase_small(live, idx, results)
            to_small = self._phase_judge(live, results)
        elif small_all and cfg.overlap and idx:
            with ThreadPoolExecutor(2) as pool:
                judged = pool.submit(self._phase_judge, live, results)
                self._phase_small(live, idx, results)
                to_small = judged.result()
        else:
            to_small = self._phase_judge(live, results)
            self._phase_small(live, idx if small_all else to_small, results)
        if cfg.mode == "speceyes" and (cfg.overlap or cfg.judge == "small-prefix"):
            free = set(to_small)
            for i in idx:  # discard answers the judge did not ask for: same results as sequential
                if i not in free:
                    r = results[i]
                    r.small_answer, r.small_topk, r.confidence = None, None, None
                    r.timings.pop("small", None)
                    r.timings.pop("gate", None)
                    r.trace = [s for s in r.trace if s["type"] != "small"]
        accepted = [i for i in to_small if gate.accept(results[i].confidence, cfg.tau)]
        with self._stats_lock:
            self.stats.tool_free += len(to_small)
            self.stats.accepted += len(accepted)
        for i in accepted:
            results[i].route, results[i].answer = "small", results[i].small_answer or ""
        taken = set(accepted)
        rest = [i for i in idx if i not in taken and i in live]  # failed queries dropped out
        return _Front(results, live, rest=rest, agent=idx if cfg.mode == "both" else rest)

    def _phase_judge(self, live: dict[int, Query], results: dict[int, Result]) -> list[int]:
        """Phase I over all live queries; returns the indices judged tool-free."""
        cfg = self.config
        idx = list(live)
        if not idx:
            return []
        backend, build = self._judge_setup()
        idx, msgs = self._messages(build, live, idx, results)
        if not idx:
            return []
        t0 = time.perf_counter()
        try:
            p_tools = per_item(
                lambda m: self._protocol.tool_probability(backend, m, cfg.judge_mode, self._family),
                msgs,
            )
        except BackendError as e:
            p_tools = [e] * len(idx)
        per = (time.perf_counter() - t0) / len(idx)
        to_small = []
        for i, p in zip(idx, p_tools, strict=True):
            if isinstance(p, BackendError):
                # A failed judgment is treated as "tools needed": correctness first.
                results[i].trace.append({"type": "judge_error", "error": str(p)})
                p = 1.0
            elif isinstance(p, Exception):
                self._fail(live, results, i, p)
                continue
            r = results[i]
            r.p_tool = float(p)
            r.judge_tool = bool(p >= cfg.judge_threshold)
            r.timings["judge"] = per
            if not r.judge_tool:
                to_small.append(i)
        with self._stats_lock:
            self.stats.judged += len(idx)
        return to_small

    def _judge_setup(self) -> tuple[Backend, Callable[..., list[dict]]]:
        """Phase I's model and prompt builder ``(image, question, options) -> messages`` for
        the configured judge variant."""
        cfg = self.config
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

    def _no_judge(self, live: dict[int, Query], results: dict[int, Result]) -> list[int]:
        """``judge="none"``: every live query goes to the small model and the gate."""
        idx = list(live)
        for i in idx:
            results[i].judge_tool = False
        with self._stats_lock:
            self.stats.judged += len(idx)
        return idx

    def _phase_small(
        self, live: dict[int, Query], idx: Sequence[int], results: dict[int, Result]
    ) -> None:
        """Phases II and III: speculative answers and their confidence."""
        cfg = self.config
        if not idx:
            return
        build = partial(self._protocol.small_messages, self._family)
        idx, msgs = self._messages(build, live, idx, results)
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
                ),
                msgs,
            )
        except BackendError as e:
            got = [e] * len(idx)
        per = (time.perf_counter() - t0) / len(idx)
        answered = []
        for i, a in zip(idx, got, strict=True):
            if isinstance(a, BackendError):  # no speculative answer: the gate cannot accept
                results[i].timings["small"] = per
                results[i].trace.append({"type": "small_error", "error": str(a)})
            elif isinstance(a, Exception):
                self._fail(live, results, i, a)
            else:
                answered.append((i, a))
        if not answered:
            return
        idx, answers = [i for i, _ in answered], [a for _, a in answered]
        t1 = time.perf_counter()
        conf = self._protocol.confidence(
            self.small, answers, top_k=cfg.top_k, agg=cfg.agg, alpha=cfg.alpha
        )
        per_gate = (time.perf_counter() - t1) / len(idx)
        for i, a, c in zip(idx, answers, conf, strict=True):
            r = results[i]
            r.small_answer = a.text
            r.small_topk = a.topk
            r.confidence = None if np.isnan(c) else float(c)
            r.timings["small"] = per
            r.timings["gate"] = per_gate
            r.trace.append({"type": "small", "text": a.text, "tokens": len(a.topk)})

    # ---- one query's failure stays its own -------------------------------------------------
    def _messages(
        self,
        build: Callable[..., list[dict]],
        live: dict[int, Query],
        idx: Sequence[int],
        results: dict[int, Result],
    ) -> tuple[list[int], list[list[dict]]]:
        """Prompts of the live queries in ``idx``; a query whose prompt cannot be built fails."""
        kept, msgs = [], []
        for i in idx:
            q = live.get(i)  # gone: failed in a phase running beside this one
            if q is None:
                continue
            try:
                msgs.append(build(q.image, q.question, q.options))
            except Exception as e:
                self._fail(live, results, i, e)
                continue
            kept.append(i)
        return kept, msgs

    def _fail(
        self, live: dict[int, Query], results: dict[int, Result], i: int, e: BaseException
    ) -> None:
        """Query ``i`` ends as an error result; its batch-mates go on without it."""
        if live.pop(i, None) is None:
            return
        r = results[i]
        r.route, r.answer, r.error = "error", "", f"{type(e).__name__}: {e}"
        with self._stats_lock:
            self.stats.errors += 1

    # ---- phase IV -------------------------------------------------------------------------
    def _finish_agent(self, front: _Front, i: int, out: AgentOutcome, seconds: float) -> None:
        r = front.results[i]
        r.agent_answer = out.answer
        r.tool_calls = out.tool_calls
        r.invalid_tool_calls = out.invalid_tool_calls
        r.timings["agent"] = seconds
        r.trace.extend(out.trace)
        if out.error:
            r.error = out.error
        if i in front.rest:
            r.answer = out.answer
            if self.config.mode in AGENT_ONLY_MODES:
                r.route = "specreason" if self.config.mode == "specreason" else "agent_only"
            else:
                r.route = "agent_after_judge" if r.judge_tool else "agent_after_gate"

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
                    f = self._front(chunk)
                    needs = set(f.agent)
                    for i in range(len(chunk)):
                        if i not in needs:
                            out_q.put(f.results[i])
                    for i in f.agent:
                        agent_q.put((f, i))
            except BaseException as e:  # surfaced to the consumer below
                out_q.put(e)
            finally:
                agent_q.put(done)

        def take(block: bool) -> Any:
            if stop.is_set():
                return END
            try:
                item = agent_q.get(block=block)
            except queue.Empty:
                return EMPTY
            if item is done:
                return END
            f, i = item
            return (f, i), f.live[i]

        def back() -> None:
            try:
                for (f, i), outcome, seconds in drive_loops(self.agent, take, cfg.max_agent_loops):
                    self._finish_agent(f, i, outcome, seconds)
                    out_q.put(f.results[i])
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


def _judge_turn() -> dict:
    return {"role": "user", "content": [prompts.text_part(PREFIX_JUDGE_TEXT)]}


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
