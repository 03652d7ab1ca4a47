"""The cascade as a simulated schedule: small@0, then the small model after d light tool calls
(small@1..small@d), then the large model answering directly (large_direct), then the agent loop,
each stage gated (docs/cascade.md). Same engines, cost model and per-query draws as the other
schedules (:mod:`speceyes.simulate.runs`), so ``compare`` sets it beside agent-only and the
two-stage funnel (``speceyes``) at equal hardware.

Stage costs (the cost model's fields, plus the two constants below):

- small@0: the two-stage funnel's speculative answer, overlapped with the judge as ours does;
- small@d: one more turn of the small model's tool loop: it decodes a tool call
  (``SMALL_TOOL_CALL_TOKENS``), the tool runs on the CPU (``tool_s``), then it prefills the crop
  (the small model's view of a DeepEyes crop of the original image, plus ``tool_text_tokens``)
  and decodes the short answer (``small_decode_tokens``) whose logits the gate reads. With prefix
  caching the earlier turns stay cached; without, every turn prefills its whole history;
- large_direct: the large model answers on the full image and decodes ``small_decode_tokens``.
  Its prompt (``CascadeSpec.direct_prompt``): ``speculative``, the speculative-answer prompt
  (image plus ``small_text_tokens``), shares nothing with the agent, so its image prefill is
  added; ``agent-prefix``, the agent's own first-turn prompt followed by a short direct
  question (``DIRECT_QUESTION_TOKENS``), so with prefix caching (a) after the prefix judge only
  the tail and the question are prefilled, and (b) the agent's first turn after a rejected
  direct answer hits the cache (only ``prefix_tail_tokens`` prefilled): the image prefill is
  moved, not added.

Acceptance per stage is a parameter: the share of the queries reaching a stage that its gate
accepts (``--stage-accept small@1=0.4,large_direct=0.3``); small@0's is the funnel's ``alpha``
(and ``alpha_tool`` without a judge), drawn exactly as for the two-stage funnel. Which queries a
stage decides on follows the cascade: a query the judge sends to tools skips small@0 and visits
small@1 onwards. The later stages' acceptances are drawn from their own seeded stream, so the
two-stage funnel's draws are unchanged.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np

from speceyes.simulate.costs import (
    CROP_SIDE_FRACTION,
    LARGE,
    SMALL,
    SMALL_FACTOR,
    SMALL_MAX_PIXELS,
    SMALL_MIN_PIXELS,
    CostModel,
    ideal_gain,
    image_tokens,
)
from speceyes.simulate.report import format_table
from speceyes.simulate.runs import (
    DEFAULT_ALPHA_TOOL,
    Draws,
    Row,
    RunResult,
    _Run,
    draw,
    simulate_one,
)
from speceyes.types import DIRECT_PROMPTS

CASCADE = "cascade"
SMALL_TOOL_CALL_TOKENS = 40  # a zoom call (a JSON bounding box) decoded by the small model
DIRECT_QUESTION_TOKENS = 40  # "answer directly from the image" after the agent's prompt
# Assumed until measured: acceptance among the queries reaching each stage.
DEFAULT_STAGE_ACCEPT = {"small@1": 0.4, "large_direct": 0.3}
LARGE_DIRECT = "large_direct"


@dataclass(frozen=True)
class CascadeSpec:
    """The stages after small@0 and the acceptance of each among the queries reaching it."""

    depth: int = 1  # small@1..small@depth
    middle_tier: bool = True  # large_direct
    accept: Mapping[str, float] | None = None  # None: DEFAULT_STAGE_ACCEPT; a stage missing: 0
    direct_prompt: str = "speculative"  # large_direct's prompt (DIRECT_PROMPTS, module doc)

    @property
    def stages(self) -> list[str]:
        names = [f"small@{d}" for d in range(1, self.depth + 1)]
        return names + ([LARGE_DIRECT] if self.middle_tier else [])

    def acceptance(self) -> list[float]:
        given = DEFAULT_STAGE_ACCEPT if self.accept is None else self.accept
        return [float(given.get(s, 0.0)) for s in self.stages]

    def validate(self) -> None:
        if self.depth < 0:
            raise ValueError("speculate depth must be >= 0")
        given = self.accept or {}
        unknown = sorted(set(given) - set(self.stages))
        if unknown:
            raise ValueError(
                f"acceptance given for stages the cascade does not run: {', '.join(unknown)} "
                f"(stages: {', '.join(self.stages) or 'none'}; small@0's is --alpha)"
            )
        if self.direct_prompt not in DIRECT_PROMPTS:
            raise ValueError(
                f"unknown direct prompt {self.direct_prompt!r}; one of {', '.join(DIRECT_PROMPTS)}"
            )
        if any(not 0.0 <= p <= 1.0 for p in given.values()):
            raise ValueError("stage acceptances must be in [0, 1]")


def parse_stage_accept(text: str) -> dict[str, float]:
    """'small@0=0.6,small@1=0.4,large_direct=0.3' -> {stage: share}."""
    out = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"--stage-accept expects stage=share, got {part!r}")
        out[name.strip()] = float(value)
    return out


def small_crop_tokens(costs: CostModel) -> int:
    """The small model's view of a DeepEyes crop of the original image."""
    if costs.image_wh:
        w, h = costs.image_wh
        cw, ch = max(1, round(w * CROP_SIDE_FRACTION)), max(1, round(h * CROP_SIDE_FRACTION))
        return image_tokens(cw, ch, SMALL_FACTOR, SMALL_MIN_PIXELS, SMALL_MAX_PIXELS)
    return max(1, round(costs.crop_tokens * costs.small_view_tokens / costs.image_tokens))


def skipped_share(beta: float, alpha: float, spec: CascadeSpec, judge: str, alpha_tool: float):
    """Expected share of queries no agent loop runs for: 1 - P(every stage rejects)."""
    first = beta * alpha + ((1 - beta) * alpha_tool if judge == "none" else 0.0)
    left = (1.0 - first) * float(np.prod([1.0 - p for p in spec.acceptance()]))
    return 1.0 - left


class _CascadeRun(_Run):
    """Ours (``speceyes``) with the stages after small@0 between the gate and the agent."""

    def __init__(
        self,
        costs: CostModel,
        d: Draws,
        concurrency: int,
        judge: str,
        spec: CascadeSpec,
        stage_u: np.ndarray,
    ) -> None:
        super().__init__("speceyes", costs, d, concurrency, None, judge)
        self.sequential = False  # its small stages continue every query's small answer
        self.stage_names = spec.stages
        self.stage_accept = [(stage_u[:, j] < p).tolist() for j, p in enumerate(spec.acceptance())]
        self.pos = [-1] * self.n  # index into stage_names of the stage running
        self.small_ctx = [0] * self.n
        self.direct_ran = [False] * self.n
        self.crop = small_crop_tokens(costs)
        c = costs
        self.direct_shares_prefix = spec.direct_prompt == "agent-prefix" and c.prefix_caching
        if spec.direct_prompt == "speculative":
            tokens = c.image_tokens + c.small_text_tokens
            self.req_direct = (tokens, c.prefill_s(LARGE, c.small_text_tokens, c.image_tokens))
        elif judge == "prefix" and c.prefix_caching:  # the judge cached the agent's prompt
            tokens = c.prefix_tail_tokens + DIRECT_QUESTION_TOKENS
            self.req_direct = (tokens, c.prefill_s(LARGE, tokens))
        else:
            tokens = c.agent_prefill_tokens + DIRECT_QUESTION_TOKENS
            pre = c.prefill_s(LARGE, c.agent_text_tokens + DIRECT_QUESTION_TOKENS, c.image_tokens)
            self.req_direct = (tokens, pre)

    # phases I and II as ours, then the next stage instead of the agent
    def _spec_judged(self, q: int, t: float) -> None:
        if self.tool[q] and (not self.stage_names or self.stage_names[0] == LARGE_DIRECT):
            self._advance(q, t)  # no small stage continues the small answer: do not wait for it
            return
        self.state[q] |= 1
        if self.state[q] == 3:
            self._gate(q, t)

    def _gate(self, q: int, t: float) -> None:
        if (self.judge == "none" or not self.tool[q]) and self.accept[q]:
            self._complete(q, t)
        else:
            self._advance(q, t)

    def _advance(self, q: int, t: float) -> None:
        self.pos[q] += 1
        k = self.pos[q]
        if k >= len(self.stage_names):
            self._agent_start(q, t)
        elif self.stage_names[k] == LARGE_DIRECT:
            self._direct(q, t)
        else:
            self._small_tool_call(q, t)

    def _stage_done(self, q: int, t: float) -> None:
        if self.stage_accept[self.pos[q]][q]:
            self._complete(q, t)
        else:
            self._advance(q, t)

    # small@d: a tool call, the tool, the crop's prefill and the answer
    def _small_tool_call(self, q: int, t: float) -> None:
        c = self.costs
        if self.small_ctx[q] == 0:
            self.small_ctx[q] = c.small_prefill_tokens + c.small_decode_tokens
        self.small_ctx[q] += SMALL_TOOL_CALL_TOKENS
        self.small.submit(
            t, SMALL, 0, 0.0, SMALL_TOOL_CALL_TOKENS, self.small_ctx[q], self._small_tool, q
        )

    def _small_tool(self, q: int, t: float) -> None:
        self.sim.at(t + self.costs.tool_s, self._small_answer, q)

    def _small_answer(self, q: int, t: float) -> None:
        c = self.costs
        before = self.small_ctx[q]
        new = self.crop + c.tool_text_tokens
        if c.prefix_caching:
            tokens, pre = new, c.prefill_s(SMALL, c.tool_text_tokens, self.crop)
        else:  # the whole history again: its images are the view and every crop so far
            depth = self.pos[q] + 1
            img = c.small_view_tokens + depth * self.crop
            tokens = before + new
            pre = c.prefill_s(SMALL, tokens - img, img)
        self.small_ctx[q] = ctx = before + new + c.small_decode_tokens
        self.small.submit(t, SMALL, tokens, pre, c.small_decode_tokens, ctx, self._stage_done, q)

    # large_direct: the agent's prompt, a direct question, a short answer
    def _direct(self, q: int, t: float) -> None:
        c = self.costs
        self.direct_ran[q] = True
        tokens, pre = self.req_direct
        ctx = c.image_tokens + max(tokens - c.image_tokens, 0) + c.small_decode_tokens
        self.large.submit(t, LARGE, tokens, pre, c.small_decode_tokens, ctx, self._stage_done, q)

    def _agent_start(self, q: int, t: float) -> None:
        c = self.costs
        hit = self.first_hit or (self.direct_ran[q] and self.direct_shares_prefix)
        tokens = c.prefix_tail_tokens if hit else c.agent_prefill_tokens
        pre = c.prefill_s(LARGE, c.prefix_tail_tokens) if hit else self.first_s
        self.turn[q] = 0
        n = self.tt[q][0]
        self.ctx[q] = ctx = c.agent_prefill_tokens + n
        self.large.submit(t, LARGE, tokens, pre, n, ctx, self._agent_turn_done, q)


def stage_uniforms(n: int, n_stages: int, seed: int) -> np.ndarray:
    """The later stages' acceptance uniforms, from a stream of their own."""
    return np.random.default_rng([seed, 1]).random((n, n_stages))


def simulate_cascade_one(
    costs: CostModel,
    d: Draws,
    concurrency: int,
    spec: CascadeSpec,
    judge: str = "large",
    seed: int = 0,
) -> RunResult:
    spec.validate()
    u = stage_uniforms(len(d.turns), len(spec.stages), seed)
    r = _CascadeRun(costs, d, concurrency, judge, spec, u).run()
    r.schedule = CASCADE
    return r


def compare(
    costs: CostModel,
    spec: CascadeSpec,
    concurrencies: Sequence[int],
    n_queries: int,
    beta: float,
    alpha: float,
    seed: int = 0,
    judges: Sequence[str] = ("large",),
    alpha_tool: float = DEFAULT_ALPHA_TOOL,
) -> list[Row]:
    """Agent-only (one GPU; also two when the models get a GPU each), the two-stage funnel and
    the cascade per judge, at every C, on the same draws."""
    costs.validate()
    spec.validate()
    d = draw(costs, n_queries, beta, alpha, seed, alpha_tool)
    pair = 1 if costs.shared_gpu else 2
    rows = []
    for c in concurrencies:
        runs = [(simulate_one("agent-only", costs, d, int(c)), 1, 0.0)]
        for j in judges:
            funnel = simulate_one("speceyes", costs, d, int(c), judge=j)
            runs.append(
                (funnel, pair, skipped_share(beta, alpha, CascadeSpec(0, False), j, alpha_tool))
            )
            runs.append(
                (
                    simulate_cascade_one(costs, d, int(c), spec, j, seed),
                    pair,
                    skipped_share(beta, alpha, spec, j, alpha_tool),
                )
            )
        base = n_queries / runs[0][0].makespan
        base2 = math.nan
        if not costs.shared_gpu:
            two = simulate_one("agent-only-2gpu", costs, d, int(c))
            base2 = n_queries / two.makespan
            runs.insert(1, (two, 2, 0.0))
        for r, gpus, skipped in runs:
            lat = r.latencies
            thr = n_queries / r.makespan
            rows.append(
                Row(
                    schedule=r.schedule,
                    concurrency=int(c),
                    throughput=thr,
                    p50_s=float(np.percentile(lat, 50)),
                    p95_s=float(np.percentile(lat, 95)),
                    mean_s=float(lat.mean()),
                    large_batch=r.engines["large"]["mean_batch"],
                    small_batch=r.engines["small"]["mean_batch"],
                    large_util=r.engines["large"]["utilisation"],
                    small_util=r.engines["small"]["utilisation"],
                    vs_agent_only=thr / base,
                    of_ideal=thr / (base * ideal_gain(skipped)),
                    judge=r.judge,
                    gpus=gpus,
                    per_gpu_vs_agent_only=thr / gpus / base,
                    vs_agent_only_2gpu=thr / base2,
                )
            )
    return rows


def write_outputs(
    rows: Sequence[Row],
    out_dir: str | Path,
    costs: CostModel,
    spec: CascadeSpec,
    beta: float,
    alpha: float,
    n_queries: int,
    seed: int,
    note: str = "",
) -> list[Path]:
    """cascade.md (settings, stage costs, table) and cascade.csv."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    accept = ", ".join(f"{s}={p:g}" for s, p in zip(spec.stages, spec.acceptance(), strict=True))
    md = [
        "# speceyes simulate --cascade",
        "",
        f"{n_queries} queries per run, closed loop, beta={beta}, small@0 alpha={alpha}, "
        f"later stages' acceptance among the queries reaching them: {accept or 'none'}; "
        f"seed={seed}" + (f"; {note}" if note else "") + ".",
        f"large_direct prompt: {spec.direct_prompt}. Small model crop: "
        f"{small_crop_tokens(costs)} visual tokens; tool call "
        f"{SMALL_TOOL_CALL_TOKENS} decoded tokens; direct question {DIRECT_QUESTION_TOKENS} "
        "tokens after the agent's prompt.",
        "",
        format_table(rows),
        "",
        "## Cost model",
        "",
        "```json",
        json.dumps(asdict(replace(costs)), indent=2),
        "```",
        "",
    ]
    paths = [out / "cascade.md", out / "cascade.csv"]
    paths[0].write_text("\n".join(md))
    with paths[1].open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=[f.name for f in fields(Row)])
        w.writeheader()
        for r in rows:
            w.writerow(
                {
                    k: (None if isinstance(v, float) and math.isnan(v) else v)
                    for k, v in asdict(r).items()
                }
            )
    return paths
