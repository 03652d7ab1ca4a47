"""``--judge auto`` in the simulator: each operating point's per-query costs from the cost model,
for :func:`speceyes.operating_points.choose` (the rule the funnel uses too)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from speceyes.operating_points import AGENT_POINT, OperatingPoint, PointCosts, choose
from speceyes.simulate.costs import LARGE, SMALL, CostModel, judge_costs


def point_costs(costs: CostModel, point: OperatingPoint, in_flight: int) -> PointCosts:
    """Seconds per query of ``point`` on ``costs``'s engines with ``in_flight`` queries.

    Under load a decode step serves a whole batch, so decoded tokens cost ``t(b) / b`` of a step
    at batch ``b`` (the agent loops in flight, up to the engine's limit), while a prefill and each
    sequence's KV reads are paid in full; tool calls run on the CPU and cost no GPU time."""
    c = costs if point.judge_max_pixels is None else replace(
        costs, judge_max_pixels=point.judge_max_pixels
    )
    if point.judge == AGENT_POINT:  # no front: every query's loop, the large model alone
        return _agent_only_costs(c, in_flight)
    j = judge_costs(c)[point.judge]
    small_pre = c.prefill_s(SMALL, c.small_text_tokens, c.small_view_tokens)
    cs = c.small_s()
    # Phases I-II on the critical path. The simulated funnel asks the small model for every
    # query's answer beside the judge (the answer is dropped when the judge says "tool"). On
    # two GPUs the two run side by side and a query the judge sends to tools waits for the
    # judge only; on one GPU their prefills share the same steps, so every query waits for both.
    if point.judge in ("large", "prefix", "small"):
        front = j["s"] + cs if c.shared_gpu else max(j["s"], cs)
    else:  # small-prefix: the answer, then its judge turn; none: the answer alone
        front = cs + j["s"]
    judge_pre = j["s"]  # one token of decode on top of its prefill: negligible under load
    large_front = judge_pre if j["model"] == "large" else 0.0
    small_front = small_pre + (judge_pre if j["model"] == "small" else 0.0)
    latency, demand = _agent_costs(c, in_flight, 1.0 - point.skipped, front)
    return PointCosts(
        front_latency=front, large_front=large_front, small_front=small_front,
        agent_latency=latency, agent_demand=demand, agent_saved=j.get("saves_agent_s", 0.0),
    )


def _agent_costs(
    c: CostModel, in_flight: int, to_agent: float, front: float
) -> tuple[float, float]:
    """(one agent loop alone, its large-model seconds under load). The loops in flight share
    the decode steps: by Little's law, the in-flight queries times the share of a query's time
    spent in its agent loop."""
    pre, dec, kv, tool = c._agent_parts()
    agent_time = to_agent * (pre + dec + kv + tool)
    share = agent_time / (front + agent_time) if agent_time > 0 else 0.0
    b = min(max(1.0, in_flight * share), float(c.large_max_batch))
    table = c.step_table(LARGE)
    lo = int(b)
    step = table[lo] + (b - lo) * (table[min(lo + 1, len(table) - 1)] - table[lo])
    return pre + dec + kv + tool, pre + dec * step / (b * table[1]) + kv


def _agent_only_costs(c: CostModel, in_flight: int) -> PointCosts:
    latency, demand = _agent_costs(c, in_flight, 1.0, 0.0)
    return PointCosts(front_latency=0.0, large_front=0.0, small_front=0.0,
                      agent_latency=latency, agent_demand=demand)


def choose_point(
    costs: CostModel, points: Sequence[OperatingPoint], in_flight: int
) -> OperatingPoint:
    """The operating point ``--judge auto`` runs with ``in_flight`` queries on these engines."""
    return choose(
        points, lambda p, n: point_costs(costs, p, n), in_flight, costs.shared_gpu
    )
