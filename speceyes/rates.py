"""The funnel's two rates and the analytic latency they give (arXiv 2603.23483).

beta is the share of judged queries the judge calls tool-free; alpha is the share of those the
gate accepts. With per-query costs c_J (judge), c_S (small model and gate) and L_agent (agent),
the expected latency is ``E[L] = c_J + beta*c_S + (1 - beta*alpha)*L_agent`` and the speedup
over agent-only is ``L_agent / E[L]``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the run viewer uses the rates without loading numpy
    import numpy as np


def beta_alpha(judged: int, tool_free: int, accepted: int) -> tuple[float | None, float | None]:
    """(beta, alpha) from counts; a rate over nothing is None."""
    return (
        tool_free / judged if judged else None,
        accepted / tool_free if tool_free else None,
    )


def beta_alpha_of(records: Iterable[dict[str, Any]]) -> tuple[float | None, float | None]:
    """(beta, alpha) of logged sample records: judged where ``judge_tool`` is set, accepted
    where a tool-free query took the ``small`` route."""
    judged = tool_free = accepted = 0
    for r in records:
        if r.get("judge_tool") is None:
            continue
        judged += 1
        if not r["judge_tool"]:
            tool_free += 1
            accepted += r.get("route") == "small"
    return beta_alpha(judged, tool_free, accepted)


def analytic_latency(
    c_judge: float, c_small: float, l_agent: float, beta: float, alpha: float | np.ndarray
) -> float | np.ndarray:
    """E[L] = c_J + beta*c_S + (1 - beta*alpha)*L_agent; arrays broadcast.

    A NaN alpha (nobody judged tool-free) counts as 0 accepted.
    """
    import numpy as np

    alpha = np.nan_to_num(np.asarray(alpha, dtype=np.float64), nan=0.0)
    out = c_judge + beta * c_small + (1.0 - beta * alpha) * l_agent
    return float(out) if np.ndim(out) == 0 else out


def analytic_speedup(
    c_judge: float, c_small: float, l_agent: float, beta: float, alpha: float
) -> float:
    """The expected speedup over agent-only: L_agent / E[L]."""
    return l_agent / float(analytic_latency(c_judge, c_small, l_agent, beta, alpha))
