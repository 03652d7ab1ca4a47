"""The funnel's own numbers over one ``generate_until`` call, for lmms-eval's results.

beta and alpha are :mod:`speceyes.rates`'; the time of a route is the model time (judge, small
model, gate, agent: ``Result.timings``) per query that took it; the speedup is the analytic one,
``L_agent / (c_J + beta*c_S + (1 - beta*alpha)*L_agent)``, from this call's own costs: c_J the
judge seconds per query, c_S the small model and gate seconds per query they answered, L_agent
the agent seconds per query the agent ran. In ``speceyes`` mode only the escalated queries run
the agent, so L_agent is theirs (often the harder ones); ``mode=both`` runs it on every query.

:func:`lmms_metrics` flattens them to the numbers lmms-eval's ``log_metrics`` takes (it drops
anything else and reports each key as ``avg_<key>``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from speceyes.rates import analytic_speedup, beta_alpha_of
from speceyes.types import PHASES, Result

PREFIX = "speceyes_"  # the keys' prefix in lmms-eval's throughput table


def model_seconds(r: Result) -> float:
    return float(sum(r.timings.get(p, 0.0) for p in PHASES))


def funnel_metrics(results: Sequence[Result], wall_seconds: float | None = None) -> dict[str, Any]:
    """beta, alpha, routes, time per route and phase, and the analytic speedup; the wall time
    per query when ``wall_seconds`` (the time these results took) is given."""
    n = len(results)
    records = [{"judge_tool": r.judge_tool, "route": r.route} for r in results]
    beta, alpha = beta_alpha_of(records)
    phase = {p: float(sum(r.timings.get(p, 0.0) for r in results)) for p in PHASES}
    judged = sum(1 for r in results if r.judge_tool is not None)
    answered = sum(1 for r in results if "small" in r.timings)
    agent_runs = sum(1 for r in results if "agent" in r.timings)
    c_judge = phase["judge"] / judged if judged else None
    c_small = (phase["small"] + phase["gate"]) / answered if answered else None
    l_agent = phase["agent"] / agent_runs if agent_runs else None
    speedup = None
    if c_judge is not None and l_agent:
        speedup = analytic_speedup(c_judge, c_small or 0.0, l_agent, beta or 0.0, alpha or 0.0)
    routes = Counter(r.route for r in results)
    by_route: dict[str, list[float]] = {}
    for r in results:
        by_route.setdefault(r.route, []).append(model_seconds(r))
    return {
        "queries": n,
        "beta": beta,
        "alpha": alpha,
        "routes": dict(sorted(routes.items())),
        "route_share": {k: v / n for k, v in sorted(routes.items())} if n else {},
        "seconds_per_query_by_route": {k: sum(v) / len(v) for k, v in sorted(by_route.items())},
        "seconds_by_phase": phase,
        "c_judge": c_judge,
        "c_small": c_small,
        "l_agent": l_agent,
        "speedup": speedup,
        "wall_seconds": wall_seconds,
        "seconds_per_query": wall_seconds / n if (n and wall_seconds is not None) else None,
        "tool_calls_per_query": sum(r.tool_calls for r in results) / n if n else None,
        "errors": routes.get("error", 0),
    }


def lmms_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The numbers of :func:`funnel_metrics` as flat ``speceyes_*`` keys (unknowns left out)."""
    flat: dict[str, float] = {}
    for key in (
        "queries",
        "beta",
        "alpha",
        "speedup",
        "seconds_per_query",
        "tool_calls_per_query",
        "errors",
    ):
        if metrics.get(key) is not None:
            flat[PREFIX + key] = float(metrics[key])
    for route, share in metrics["route_share"].items():
        flat[f"{PREFIX}share_{route}"] = float(share)
    for route, seconds in metrics["seconds_per_query_by_route"].items():
        flat[f"{PREFIX}seconds_{route}"] = float(seconds)
    return flat
