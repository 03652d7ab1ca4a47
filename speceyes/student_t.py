"""Student's t distribution for whole degrees of freedom: its CDF and quantiles.

Written out because the standard library has none and the package does without scipy (see
``bench/ltt.py``); whole degrees of freedom have a closed-form CDF (Abramowitz and Stegun,
Handbook of Mathematical Functions, 26.7.3 and 26.7.4), and the quantile is its inverse by
bisection."""

from __future__ import annotations

import math


def cdf(t: float, dof: int) -> float:
    """P(T <= t) for Student's t with ``dof`` (>= 1) degrees of freedom."""
    if dof < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {dof}")
    theta = math.atan(abs(t) / math.sqrt(dof))
    c2 = math.cos(theta) ** 2
    # A(t | dof) = P(|T| <= |t|): a finite series in cos(theta)^2, odd and even dof apart
    term, total = 1.0, 1.0
    if dof % 2:
        for k in range(1, (dof - 1) // 2):
            term *= c2 * (2 * k) / (2 * k + 1)
            total += term
        inside = (2 / math.pi) * (
            theta + (math.sin(theta) * math.cos(theta) * total if dof > 1 else 0.0))
    else:
        for k in range(1, dof // 2):
            term *= c2 * (2 * k - 1) / (2 * k)
            total += term
        inside = math.sin(theta) * total
    return 0.5 + math.copysign(inside / 2, t)


def quantile(p: float, dof: int) -> float:
    """The t with P(T <= t) = ``p`` (0 < p < 1), to 1e-10."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    lo, hi = -1.0, 1.0
    while cdf(lo, dof) > p:
        lo *= 2.0
    while cdf(hi, dof) < p:
        hi *= 2.0
    while hi - lo > 1e-10:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid, dof) < p else (lo, mid)
    return (lo + hi) / 2
