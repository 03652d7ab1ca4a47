"""Synthetic cascade logs with a known truth: per-stage arrays (``draw_cascade_log``) for the
coverage tests of the cascade calibration, and run folders (``write_synthetic_cascade_run``)
whose samples.jsonl logs every stage, for the replay and the CLI."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from speceyes.bench.cascade_replay import CascadeLog, stage_eligible
from speceyes.rundir import RunDir
from tests.tools.synthetic_run import write_synthetic_run

STAGES = ("small@0", "small@1", "small@2", "large_direct")
STAGE_SECONDS = (0.3, 0.8, 1.3, 2.0)  # each stage's own seconds; the agent 6 s, the judge 0.1 s
AGENT_SECONDS, JUDGE_SECONDS = 6.0, 0.1


@dataclass(frozen=True)
class Scenario:
    """How answers and confidences arise. ``flat_error`` set: every stage is wrong with that
    probability whatever its confidence (confidences uniform); else a latent ease per query
    drives every stage (later stages abler), so stages' errors are correlated."""

    flat_error: float | None = None
    ability: tuple[float, ...] = (0.6, 1.0, 1.3, 1.8)
    ease_weight: float = 1.5
    conf_noise: float = 0.8
    p_tool: float = 0.25  # judged "tools needed": small@0 does not decide on them


def draw_cascade_log(
    rng: np.random.Generator, n: int, scenario: Scenario, stages: tuple[str, ...] = STAGES
) -> CascadeLog:
    s_count = len(stages)
    judge_tool = (rng.random(n) < scenario.p_tool).astype(float)
    if scenario.flat_error is not None:
        conf = rng.random((n, s_count))
        wrong = rng.random((n, s_count)) < scenario.flat_error
    else:
        ease = rng.normal(0.0, 1.0, n) - 0.8 * judge_tool  # tool queries are harder
        ability = np.asarray(scenario.ability[:s_count])
        skill = ability[None, :] + scenario.ease_weight * ease[:, None]
        skill = skill + rng.normal(0.0, 0.7, (n, s_count))  # per-stage luck
        wrong = rng.random((n, s_count)) >= 1.0 / (1.0 + np.exp(-skill))
        noisy = skill + rng.normal(0.0, scenario.conf_noise, (n, s_count))
        conf = 1.0 / (1.0 + np.exp(-noisy))
    eligible = np.column_stack([stage_eligible(s, judge_tool) for s in stages])
    seconds = np.tile(np.asarray(STAGE_SECONDS[:s_count]), (n, 1))
    return CascadeLog(
        stages=stages,
        conf=conf,
        wrong=wrong,
        eligible=eligible,
        seconds=seconds,
        judge_seconds=np.full(n, JUDGE_SECONDS),
        agent_seconds=np.full(n, AGENT_SECONDS),
        agent_correct=rng.random(n) < 0.85,
        categories=np.array(["a" if i % 2 else "b" for i in range(n)], dtype=object),
    )


def write_synthetic_cascade_run(
    run_dir: str | Path,
    n: int = 400,
    *,
    seed: int = 0,
    depth: int = 2,
    middle_tier: bool = True,
    small0_in_stages: bool = False,
    **run_options,
) -> Path:
    """A ``both`` run (``write_synthetic_run``) whose samples also log the stages small@1..depth
    and large_direct; small@0 is the legacy fields, and also a stage entry when
    ``small0_in_stages``. Each later stage is more often right on queries the small model got
    right (correlated stages), with a confidence that rises with its correctness."""
    path = write_synthetic_run(run_dir, n, seed=seed, mode="both", **run_options)
    rd = RunDir(path)
    samples = rd.records()
    rng = np.random.default_rng([seed, 7])
    names = [f"small@{d}" for d in range(1, depth + 1)] + (["large_direct"] if middle_tier else [])
    for s in samples:
        base = 1.0 if s["small_correct"] else -1.0
        stages = []
        if small0_in_stages:
            stages.append(
                {
                    "stage": "small@0",
                    "answer": s["small_answer"],
                    "confidence": s["confidence"],
                    "accepted": s["route"] == "small",
                    "seconds": s["timings"]["small"],
                    "tool_calls": 0,
                    "correct": s["small_correct"],
                }
            )
        for j, name in enumerate(names):
            skill = 0.5 + 0.4 * j + base + rng.normal(0.0, 1.0)
            correct = bool(rng.random() < 1.0 / (1.0 + np.exp(-2.0 * skill)))
            conf = float(1.0 / (1.0 + np.exp(-(2.5 * skill + rng.normal(0.0, 1.0)))))
            stages.append(
                {
                    "stage": name,
                    "answer": s["answer"] if correct else "Z",
                    "confidence": conf,
                    "accepted": False,
                    "seconds": float(STAGE_SECONDS[min(j + 1, 3)] * rng.uniform(0.8, 1.2)),
                    "tool_calls": j + 1 if name.startswith("small@") else 0,
                    "correct": correct,
                }
            )
        s["stages"] = stages
    rd.rewrite(samples)
    return path
