"""A cascade's threshold vectors priced by a simulated deployment (``calibrate --cascade
--price-bench``).

The fixed-sequence test certifies many threshold vectors at once (every one of them holds the
bound with probability >= 1 - delta), so which one to deploy is free to choose. By default the
calibration keeps the one whose replayed seconds on its own log are least; on the mini world
that log's costs are a CPU's, where the small model costs nearly what the large one does, and
the cheapest vector there turns the small model off. On GPUs the small model is several times
cheaper and the large model's image prefill dominates, so the same certified set has another
cheapest member. Here a vector is priced by what it does to a deployment: its stage mix (the
share the judge sends tool-free and each stage's acceptance among the queries reaching it, read
off the calibration log at that vector) is run through the simulated cascade
(:mod:`speceyes.simulate.cascade`) on a benchmark's image sizes, and its price is seconds per
query at the given concurrency.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from speceyes.bench import cascade_replay as cr
from speceyes.simulate import cascade as sc
from speceyes.simulate.costs import CostModel, bench_costs
from speceyes.simulate.runs import draw, simulate_one
from speceyes.types import DIRECT_PROMPTS, JUDGES

DEFAULT_PRICE_QUERIES = 2000  # per simulated run: a mix's throughput to within about 1%
DEFAULT_PRICE_CONCURRENCY = 16


@dataclass(frozen=True)
class StageMix:
    """What one threshold vector does, as the simulator's parameters."""

    beta: float  # share of queries the judge sent tool-free (1.0 when the log has no judge)
    accept: dict[str, float]  # per stage that is on: accepted / reached (an off stage: absent)

    @property
    def alpha(self) -> float:
        return self.accept.get(cr.SMALL0, 0.0)

    def spec(self, direct_prompt: str = DIRECT_PROMPTS[0]) -> sc.CascadeSpec:
        """The simulated cascade: the stages after small@0 that are on (a stage at NO_TAU is
        skipped by the funnel, so it costs nothing there either)."""
        later = {s: p for s, p in self.accept.items() if s != cr.SMALL0}
        depths = [cr.stage_sort_key(s)[1] for s in later if s.startswith("small@")]
        return sc.CascadeSpec(
            depth=max(depths, default=0),
            middle_tier=cr.LARGE_DIRECT in later,
            accept=later,
            direct_prompt=direct_prompt,
        )

    def key(self) -> tuple:
        return (round(self.beta, 3), *sorted((s, round(p, 3)) for s, p in self.accept.items()))


def stage_mix(log: cr.CascadeLog, taus: np.ndarray, idx: np.ndarray) -> StageMix:
    """The mix of one vector: ``taus`` (S,) and the stage accepting each query ``idx`` (n,)."""
    return mix_from_file(cr.stage_mix(log, taus, idx))


def mix_from_file(block: Any) -> StageMix:
    """The ``mix`` a cascade calibration file records (``cascade.mix``)."""
    try:
        accept = {str(k): float(v) for k, v in block["accept"].items()}
        mix = StageMix(float(block["beta"]), accept)
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise ValueError(f"not a stage mix ({{beta, accept: {{stage: share}}}}): {block!r}") from e
    for stage in accept:
        cr.stage_sort_key(stage)  # raises on an unknown stage
    if not all(0.0 <= p <= 1.0 for p in (mix.beta, *accept.values())):
        raise ValueError(f"a stage mix's shares must be in [0, 1]: {block!r}")
    return mix


class DeploymentPrice:
    """Prices threshold vectors by their mix in the simulated cascade (one judge variant, one
    concurrency, closed loop): :meth:`bind` gives the :data:`cascade_replay.CostFn` of a log,
    seconds per query (1 / simulated throughput). Mixes are cached, and every mix runs on the
    same seed, so vectors are compared on common draws."""

    def __init__(
        self,
        costs: CostModel,
        judge: str,
        concurrency: int = DEFAULT_PRICE_CONCURRENCY,
        queries: int = DEFAULT_PRICE_QUERIES,
        direct_prompt: str = DIRECT_PROMPTS[0],
        seed: int = 0,
        bench: str | None = None,
    ) -> None:
        costs.validate()
        if judge not in JUDGES:
            raise ValueError(f"unknown judge {judge!r}; choose from {', '.join(JUDGES)}")
        if concurrency < 1 or queries < 1:
            raise ValueError("concurrency and queries must be >= 1")
        self.costs, self.judge, self.bench = costs, judge, bench
        self.concurrency, self.queries, self.seed = concurrency, queries, seed
        self.direct_prompt = direct_prompt
        self._seen: dict[tuple, float] = {}

    @classmethod
    def from_options(
        cls,
        bench: str,
        judge: str,
        concurrency: int = DEFAULT_PRICE_CONCURRENCY,
        shared_gpu: bool = False,
        costs_file: str | None = None,
        direct_prompt: str = DIRECT_PROMPTS[0],
    ) -> DeploymentPrice:
        costs = bench_costs(bench)
        if costs_file:  # the file's fields over the benchmark's token counts
            costs = CostModel.from_file(costs_file, base=costs)
        costs.shared_gpu = shared_gpu or costs.shared_gpu
        return cls(costs, judge, concurrency, direct_prompt=direct_prompt, bench=bench)

    @property
    def info(self) -> dict[str, Any]:
        return {
            "by": "simulated deployment",
            "bench": self.bench,
            "judge": self.judge,
            "concurrency": self.concurrency,
            "gpus": "one for both models" if self.costs.shared_gpu else "one per model",
            "queries": self.queries,
            "direct_prompt": self.direct_prompt,
        }

    def bind(self, log: cr.CascadeLog) -> cr.CostFn:
        def cost(stage_idx: np.ndarray, taus: np.ndarray) -> np.ndarray:
            taus = np.atleast_2d(taus)
            return np.array([self.price(stage_mix(log, taus[t], stage_idx[:, t]))
                             for t in range(taus.shape[0])])

        return cost

    def price(self, mix: StageMix) -> float:
        """Seconds per query of ``mix`` (1 / simulated throughput)."""
        key = mix.key()
        if key not in self._seen:
            self._seen[key] = 1.0 / self.throughput(mix)
        return self._seen[key]

    def throughput(self, mix: StageMix) -> float:
        # without a judge small@0 decides every query: its acceptance among the queries a judge
        # would have sent to tools is not in a judged log, so it is taken as 0 (conservative)
        d = draw(self.costs, self.queries, mix.beta, mix.alpha, self.seed, 0.0)
        r = sc.simulate_cascade_one(
            self.costs, d, self.concurrency, mix.spec(self.direct_prompt), self.judge, self.seed
        )
        return self.queries / r.makespan

    def agent_only_throughput(self) -> float:
        d = draw(self.costs, self.queries, 1.0, 0.0, self.seed, 0.0)
        return self.queries / simulate_one("agent-only", self.costs, d, self.concurrency).makespan

    def report(self, mix_block: Any) -> dict[str, float]:
        """The kept vector's simulated throughput beside agent-only's (same draws)."""
        # simulated again, not read from the price cache: the cache keys mixes by rounded rates,
        # and the recorded figure is the exact mix's, which simulate --mix-from reproduces
        thr, base = self.throughput(mix_from_file(mix_block)), self.agent_only_throughput()
        return {"queries_per_s": thr, "agent_only_queries_per_s": base, "x_agent_only": thr / base}

    @staticmethod
    def describe(info: Any) -> str:
        return (
            f"kept for a simulated deployment ({info['bench']} images, judge {info['judge']}, "
            f"C={info['concurrency']}, {info['gpus']}): {info['x_agent_only']:.2f}x agent-only "
            f"({info['queries_per_s']:.3f} against {info['agent_only_queries_per_s']:.3f} "
            "queries/s)"
        )
