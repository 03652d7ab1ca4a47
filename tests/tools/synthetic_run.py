"""Seeded, internally consistent run folders (samples.jsonl, results.json) without a model,
for tests and benchmarks of the offline tools (regate, calibrate, report, view)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from speceyes import gate
from speceyes.rundir import RunDir


def write_synthetic_run(
    run_dir: str | Path,
    n: int = 500,
    *,
    seed: int = 0,
    mode: str = "both",
    k_logged: int = 32,
    tokens: tuple[int, int] = (1, 9),
    tau: float = 0.98,
    top_k: int | None = None,
    agg: str = "min",
    scale: float = gate.DEFAULT_SCALE,
    categories: tuple[str, ...] = ("direct_attributes", "relative_position"),
    p_tool: float = 0.2,
    agent_accuracy: float = 0.85,
    wall_time: float | None = None,
) -> Path:
    """Write a seeded, internally consistent run directory.

    Small-answer correctness rises with the answer's separability, so the gate is informative.
    Routes, predictions and results.json follow the funnel's rules for ``mode`` (speceyes, both,
    agent, small) at the given tau / top_k / agg.
    """
    rng = np.random.default_rng(seed)
    k_run = min(top_k or k_logged, k_logged)
    lengths = rng.integers(tokens[0], tokens[1], size=n)
    margin = rng.gamma(2.0, 2.5, size=n)  # per-answer ease: larger -> more separable, more correct
    topk = [
        _synthetic_topk(rng, int(t), k_logged, float(m))
        for t, m in zip(lengths, margin, strict=True)
    ]
    conf = gate.batch_confidence(topk, top_k=k_run, agg=agg, scale=scale)  # type: ignore[arg-type]
    small_ok = rng.random(n) < 1.0 / (1.0 + np.exp(-(margin - 3.0)))
    agent_ok = rng.random(n) < agent_accuracy
    judge = rng.random(n) < p_tool
    times = {
        "judge": rng.uniform(0.03, 0.08, n),
        "small": rng.uniform(0.15, 0.4, n),
        "agent": rng.uniform(1.0, 6.0, n),
    }
    samples = [
        _synthetic_sample(
            i,
            mode,
            rng,
            categories,
            topk[i],
            conf[i],
            bool(small_ok[i]),
            bool(agent_ok[i]),
            bool(judge[i]),
            tau,
            {k: float(v[i]) for k, v in times.items()},
        )  # fmt: skip
        for i in range(n)
    ]
    path = Path(run_dir)
    path.mkdir(parents=True, exist_ok=True)
    RunDir(path).rewrite(samples)
    config = {"bench": "synthetic", "mode": mode, "tau": tau, "top_k": k_run, "agg": agg}
    config["scale"] = scale
    results = _synthetic_results(samples, config, wall_time)
    RunDir(path).write_results(results)
    return path


def _synthetic_topk(rng: np.random.Generator, tokens: int, k: int, margin: float) -> np.ndarray:
    z = -np.sort(-rng.normal(0.0, 1.0, size=(tokens, k)), axis=1)
    z[:, 0] += margin * rng.uniform(0.6, 1.6, size=tokens)  # the chosen token stands out
    return (z + rng.normal(5.0, 2.0, size=(tokens, 1))).astype(np.float32).astype(np.float64)


def _synthetic_sample(
    i: int,
    mode: str,
    rng: np.random.Generator,
    categories: tuple[str, ...],
    topk: np.ndarray,
    conf: float,
    small_ok: bool,
    agent_ok: bool,
    judge_tool: bool,
    tau: float,
    t: dict[str, float],
) -> dict[str, Any]:
    gold = "ABCD"[int(rng.integers(4))]
    other = "ABCD".replace(gold, "")[int(rng.integers(3))]
    small = {"small_answer": gold if small_ok else other, "small_correct": small_ok}
    small |= {"confidence": None if math.isnan(conf) else float(conf), "small_topk": topk.tolist()}
    agent = {"agent_answer": gold if agent_ok else other, "agent_correct": agent_ok}
    run_small, run_agent, run_judge = mode != "agent", mode != "small", mode in ("both", "speceyes")
    accepted = run_judge and not judge_tool and gate.accept(conf, tau)
    if mode == "speceyes":  # the funnel runs only what its routing needs
        run_small, run_agent = not judge_tool, not accepted
    route = {"agent": "agent_only", "small": "small_only"}.get(mode)
    if route is None:
        route = "agent_after_judge" if judge_tool else ("small" if accepted else "agent_after_gate")
    use_small = mode == "small" or (run_judge and accepted)
    pred_ok = small_ok if use_small else agent_ok
    sample: dict[str, Any] = {
        "id": f"q{i:06d}",
        "category": categories[i % len(categories)] if categories else None,
        "meta": {"index": i},
        "answer": gold,
        "mode": mode,
        "route": route,
        "p_tool": (0.9 if judge_tool else 0.1) if run_judge else None,
        "judge_tool": judge_tool if run_judge else None,
    }
    nulls = dict.fromkeys(("small_answer", "small_correct", "confidence", "small_topk"))
    sample |= small if run_small else nulls
    sample |= agent if run_agent else dict.fromkeys(("agent_answer", "agent_correct"))
    sample |= {"prediction": gold if pred_ok else other, "correct": pred_ok}
    sample["tool_calls"] = int(rng.integers(0, 4)) if run_agent else 0
    ran = {"judge": run_judge, "small": run_small, "agent": run_agent}
    sample |= {"timings": {k: v for k, v in t.items() if ran[k]}, "error": None}
    return sample


def _synthetic_results(
    samples: list[dict[str, Any]], config: dict[str, Any], wall_time: float | None
) -> dict[str, Any]:
    n = len(samples)
    correct = np.array([s["correct"] for s in samples], dtype=float)
    cats = sorted({s["category"] for s in samples if s["category"] is not None})
    per_cat = {
        c: float(np.mean([s["correct"] for s in samples if s["category"] == c])) for c in cats
    }
    wall = wall_time if wall_time is not None else sum(sum(s["timings"].values()) for s in samples)
    judged = [s for s in samples if s["judge_tool"] is not None]
    tool_free = [s for s in judged if not s["judge_tool"]]
    beta = len(tool_free) / len(judged) if judged else None
    accepted = sum(s["route"] == "small" for s in tool_free)
    return {
        "config": config,
        "metrics": {"overall": float(correct.mean()) if n else 0.0, "per_category": per_cat},
        "wall_time": wall,
        "n": n,
        "qps": n / wall if wall else None,
        "beta": beta,
        "alpha_accept": accepted / len(tool_free) if tool_free else None,
        "time_share": {},
        "versions": {"speceyes": "synthetic"},
    }
