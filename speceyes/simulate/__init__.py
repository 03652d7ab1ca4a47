"""Discrete-event model of serving the SpecEyes funnel: compare schedules at scale, no GPU.

Physics. An engine is a continuous-batching server (vLLM-like) that runs one batch step at a
time. A request (one model call: a prefill of P tokens, then N decoded tokens) joins the running
batch at a step boundary if its model has room - fewer than ``max_batch`` sequences and KV-cache
space for its whole context (``kv_tokens``) - and the step's prefill token budget allows; its
prefill is paid in the step it joins, which also yields its first token, so it finishes N steps
later. A step with ``b`` sequences holding ``T`` context tokens takes
``t(b) = t1 * (1 + gamma*(b-1)) + T * kv_read`` (or a measured curve for the first part) plus
the prefill seconds of the requests joining in it: decode is memory-bound (the weights are read
once per step, each sequence's KV cache once), so batching it is nearly free at small ``b``;
prefill is compute-bound, so it is linear in tokens whatever the batch, and image tokens also
pay the vision encoder.

Between two events (a request joins or leaves) the batch is constant, so the simulator jumps from
event to event instead of stepping token by token: about two heap events per request.

Schedules (same engines, same cost model, same per-query random draws - common random numbers):

- ``agent-only``: every query runs the agent loop on the large engine (one GPU); many loops in
  flight, each loop's next turn is submitted when the previous one returns (plus the tool's CPU
  time).
- ``agent-only-2gpu``: the same on two GPUs, data parallel (two replicas, the clients split
  between them): what a second GPU buys without SpecEyes.
- ``published``: the authors' code. Queries are taken in batches (``published_batch``, default B =
  the concurrency C): phase I as one batched call, then phase II over the judged tool-free ones,
  the gate, then phase IV's agent loops ONE QUERY AT A TIME, then the next batch.
- ``speceyes`` (ours): phases I and II overlapped (the small model answers while the judge
  judges), instant gate, accepted answers return at once, the rest join the large engine's
  continuous batch as agent loops; everything concurrent, bounded by the C clients.

Ours and the published schedule use two GPUs (one per model) unless ``shared_gpu`` puts both
models on one: then their steps share the GPU (a step's time is the sum of both models' parts)
and its memory (each model gets a smaller KV cache).

Judge variants of ours (``judge=``, see :data:`JUDGES`): ``large`` (the published judge: the large
model on the full image, or on ``judge_max_pixels``), ``prefix`` (the judge question asked after
the agent's own first-turn prompt, so an engine with prefix caching reuses that prefill for the
agent's first turn), ``small`` (the judge prompt on the small model), ``small-prefix`` (the judge
question after the small model's own answer prompt: one image prefill on the small model for both)
and ``none`` (no judge: the small model answers every query, the gate alone decides; among the
queries the published judge would send to tools it accepts a share ``alpha_tool``).

Image token counts per benchmark come from Qwen's smart_resize of the benchmark's image size
(:func:`bench_costs`, :data:`BENCH_IMAGES`); the engine constants from public vLLM/A100 numbers
(docs/throughput.md gives the sources and the arithmetic).

Workload: a closed loop of C clients; each sends its next query when its previous one returns,
until ``n_queries`` have been sent. Throughput = n_queries / makespan.

The ideal is ``throughput(agent-only, C) / (1 - beta*alpha)``; the analytic batch-1 latency is
``E[L] = c_J + beta*c_S + (1 - beta*alpha)*L_agent`` (DESIGN.md section 1).
"""

from __future__ import annotations

import csv
import heapq
import json
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from speceyes.funnel import JUDGES  # the same variants the funnel runs
from speceyes.images import smart_resize
from speceyes.rates import analytic_latency

SCHEDULES: tuple[str, ...] = ("agent-only", "agent-only-2gpu", "published", "speceyes")
IDEAL = "ideal"
DEFAULT_CONCURRENCIES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEFAULT_BETA = 0.8
DEFAULT_ALPHA = 0.71
# Gate acceptance among the queries the published judge sends to tools, for ``judge="none"``:
# measured on the mini world with the bundled models (docs/throughput.md); a guess elsewhere.
DEFAULT_ALPHA_TOOL = 0.5
MD_FILE, CSV_FILE, PNG_FILE = "simulate.md", "simulate.csv", "simulate.png"

LARGE, SMALL = 0, 1  # model classes on an engine

# --- image tokens per benchmark ----------------------------------------------------------------

# Qwen2.5-VL (the DeepEyes agent and the judge): 28 px per visual token (14 px patches, 2x2
# merge), DeepEyes' pixel limits. Qwen3-VL (the small model): 32 px per token, its processor's
# limits (16384 tokens).
LARGE_FACTOR, LARGE_MIN_PIXELS, LARGE_MAX_PIXELS = 28, 4 * 28 * 28, 16384 * 28 * 28
SMALL_FACTOR, SMALL_MIN_PIXELS, SMALL_MAX_PIXELS = 32, 4 * 32 * 32, 16384 * 32 * 32
# A DeepEyes zoom box is this share of the image's width and height (an assumption: about 600
# tokens of crop on a V* image); the crop is cut from the ORIGINAL image and smart_resized.
CROP_SIDE_FRACTION = 0.36


@dataclass(frozen=True)
class BenchImages:
    size: tuple[int, int]  # (width, height) used for the token counts
    note: str  # where the size comes from


BENCH_IMAGES: dict[str, BenchImages] = {
    "vstar": BenchImages(
        (2246, 1582),
        "V* Bench: 191 images, average 2246x1582 (Wu & Xie, arXiv 2312.14135); range "
        "1690x1500 to 5759x1440",
    ),
    "hrbench4k": BenchImages(
        (4096, 2160),
        "HR-Bench 4K: 4K crops of 8K images (Wang et al., arXiv 2408.15556); 4096x2160 taken "
        "as typical (a 4096x3000 image gives 15.6k tokens)",
    ),
    "hrbench8k": BenchImages(
        (7680, 4320),
        "HR-Bench 8K: 8K images from DIV8K and the web (arXiv 2408.15556); downscaled to the "
        "16384-token cap",
    ),
    "pope": BenchImages(
        (640, 480), "POPE: COCO val2014 images, longest side 640 px (arXiv 2305.10355)"
    ),
    "miniworld": BenchImages((1024, 1024), "the mini world's 1024x1024 canvas"),
}


def image_tokens(
    width: int, height: int, factor: int = LARGE_FACTOR, min_pixels: int = LARGE_MIN_PIXELS,
    max_pixels: int = LARGE_MAX_PIXELS,
) -> int:
    """Visual tokens of an image after Qwen's smart_resize: one per ``factor`` x ``factor``."""
    h, w = smart_resize(height, width, factor, min_pixels, max_pixels)
    return (h // factor) * (w // factor)


def bench_costs(bench: str, base: CostModel | None = None, **overrides: Any) -> CostModel:
    """``base`` (default :class:`CostModel`) with the token counts of a benchmark's images:
    the large model's and the small model's view of its image and of a DeepEyes crop."""
    if bench not in BENCH_IMAGES:
        raise ValueError(f"unknown benchmark {bench!r}; choose from {', '.join(BENCH_IMAGES)}")
    w, h = BENCH_IMAGES[bench].size
    cw, ch = max(1, round(w * CROP_SIDE_FRACTION)), max(1, round(h * CROP_SIDE_FRACTION))
    costs = replace(
        base or CostModel(),
        image_tokens=image_tokens(w, h),
        small_image_tokens=image_tokens(w, h, SMALL_FACTOR, SMALL_MIN_PIXELS, SMALL_MAX_PIXELS),
        crop_tokens=image_tokens(cw, ch),
        image_wh=[w, h],
    )
    costs = replace(costs, **overrides)
    costs.validate()
    return costs


@dataclass
class CostModel:
    """Costs of the paper's setting: Qwen2.5-VL-7B agent/judge and Qwen3-VL-2B small model, bf16,
    vLLM on A100-80GB GPUs. Every field can be overridden from JSON (:meth:`from_json`); the
    sources and the arithmetic of the defaults are in docs/throughput.md:

    - decode: a step reads the weights once (7.6B LLM parameters, 15.2 GB) at 77% of the A100's
      2.04 TB/s (what vLLM reaches at batch 1 on an A100 for an 8B model): 9.7 ms; ``gamma``
      0.02 per extra sequence (vLLM's 6.6x throughput at 8 concurrent requests, less its KV
      reads); plus each sequence's KV cache read every step (57 KB per token for Qwen2.5-7B);
    - prefill: FLOPs at 55% of the A100's 312 TFLOPS bf16 (2 x 7.6 G per token, plus 6.9 G per
      image token for the vision encoder); at most 8192 prefill tokens join a step;
    - KV cache: 90% of 80 GB less weights and activations, in tokens (861k for the 7B alone);
    - the 2B small model: 5 ms per decode step, about a third of the 7B's prefill per token;
    - images: V* by default, 4480 visual tokens for the large model, 3430 for the small one
      (:func:`bench_costs` for the others); prompt text 120 (judge), 80 (small), 350 (DeepEyes);
    - judge = one prefill + 1 token (the logit judge); small answer = prefill + 5 tokens;
    - agent = K tool calls (P(K=0..5) below, mean 1.83) + the answer turn, so ~2.8 turns; each turn
      decodes U[100, 300] tokens; a tool turn prefills the crop and 60 tokens of tool text
      (prefix caching keeps the history; without it the whole history is prefilled again); each
      tool call spends 10 ms on the CPU.
    """

    large_decode_s: float = 0.0097
    large_gamma: float = 0.02
    large_prefill_s_per_token: float = 9.4e-5
    large_vit_s_per_token: float = 4.0e-5  # extra per image token: the vision encoder
    large_kv_read_s_per_token: float = 3.65e-8  # per context token per decode step
    large_max_batch: int = 256  # vLLM's default max_num_seqs
    large_batch_curve: list[list[float]] | None = None  # [[b, t(b)/t(1)], ...] overrides gamma
    small_decode_s: float = 0.005
    small_gamma: float = 0.02
    small_prefill_s_per_token: float = 2.85e-5
    small_vit_s_per_token: float = 5.6e-5
    small_kv_read_s_per_token: float = 7.3e-8
    small_max_batch: int = 256
    small_batch_curve: list[list[float]] | None = None
    prefill_budget_tokens: int = 8192
    shared_gpu: bool = False  # both models on one GPU: their steps run one after the other
    prefix_caching: bool = True  # vLLM's automatic prefix caching / SGLang's radix cache

    # KV-cache capacity in tokens; None derives it from the memory below
    large_kv_tokens: int | None = None
    small_kv_tokens: int | None = None
    gpu_mem_gb: float = 80.0
    gpu_mem_util: float = 0.9  # vLLM's default --gpu-memory-utilization
    large_weights_gb: float = 16.6  # Qwen2.5-VL-7B, 8.3B parameters in bf16
    small_weights_gb: float = 4.3  # Qwen3-VL-2B
    large_reserve_gb: float = 6.0  # activations, vision encoder, CUDA graphs (assumed)
    small_reserve_gb: float = 4.0
    large_kv_bytes_per_token: int = 57344  # 28 layers x 4 KV heads x 128 x (K, V) x 2 bytes
    small_kv_bytes_per_token: int = 114688  # 28 layers x 8 KV heads x 128 x 2 x 2 bytes
    shared_small_kv_gb: float = 8.0  # the small model's KV cache when both share one GPU

    image_tokens: int = 4480  # the large model's view of the image (V*: 2246x1582)
    small_image_tokens: int | None = 3430  # the small model's view; None: same as image_tokens
    image_wh: list[int] | None = field(default_factory=lambda: [2246, 1582])
    judge_image_tokens: int | None = None  # None: the full image; less models a smaller view
    judge_max_pixels: int | None = None  # a judge view budget in pixels (needs image_wh)
    judge_text_tokens: int = 120
    small_text_tokens: int = 80
    agent_text_tokens: int = 350
    prefix_judge_tokens: int = 90  # the judge question turn after a shared prefix
    prefix_tail_tokens: int = 16  # recomputed after a cache hit (only full blocks are cached)
    judge_decode_tokens: int = 1
    small_decode_tokens: int = 5
    tool_call_probs: list[float] = field(
        default_factory=lambda: [0.10, 0.35, 0.30, 0.15, 0.07, 0.03]
    )
    turn_tokens_min: int = 100
    turn_tokens_max: int = 300
    crop_tokens: int = 580  # a DeepEyes zoom crop (V*: 36% of each side, smart_resized)
    tool_text_tokens: int = 60
    tool_s: float = 0.01

    def validate(self) -> None:
        p = np.asarray(self.tool_call_probs, dtype=np.float64)
        if p.ndim != 1 or p.size == 0 or (p < 0).any() or abs(p.sum() - 1.0) > 1e-6:
            raise ValueError(f"tool_call_probs must be probabilities summing to 1, got {p}")
        if min(self.large_decode_s, self.small_decode_s) <= 0:
            raise ValueError("decode step times must be positive")
        costs = (
            self.large_prefill_s_per_token, self.small_prefill_s_per_token, self.tool_s,
            self.large_vit_s_per_token, self.small_vit_s_per_token,
            self.large_kv_read_s_per_token, self.small_kv_read_s_per_token,
        )
        if min(costs) < 0:
            raise ValueError("prefill, KV-read and tool costs must be non-negative")
        if min(self.large_max_batch, self.small_max_batch, self.prefill_budget_tokens) < 1:
            raise ValueError("max batch and prefill budget must be >= 1")
        if min(self.judge_decode_tokens, self.small_decode_tokens, self.turn_tokens_min) < 1:
            raise ValueError("every model call decodes at least one token")
        if self.turn_tokens_max < self.turn_tokens_min:
            raise ValueError("turn_tokens_max < turn_tokens_min")
        if self.judge_max_pixels is not None and self.judge_max_pixels < LARGE_MIN_PIXELS:
            raise ValueError(f"judge_max_pixels must be >= {LARGE_MIN_PIXELS}")
        for cls in (LARGE, SMALL):
            if self.kv_tokens(cls) < 1:
                raise ValueError(
                    "no KV-cache memory left: weights and reserves exceed the GPU memory"
                )
        for curve in (self.large_batch_curve, self.small_batch_curve):
            if curve is not None:
                _curve_table(curve, 2)  # raises on a malformed curve

    # --- per-model constants -------------------------------------------------------------------
    def step_table(self, cls: int) -> list[float]:
        """Decode-step seconds for 0..max_batch sequences of one model class (weights and
        per-sequence work; the KV-cache reads come on top, per context token)."""
        if cls == LARGE:
            t1, gamma, curve, mb = (
                self.large_decode_s, self.large_gamma, self.large_batch_curve, self.large_max_batch
            )
        else:
            t1, gamma, curve, mb = (
                self.small_decode_s, self.small_gamma, self.small_batch_curve, self.small_max_batch
            )
        if curve is not None:
            factors = _curve_table(curve, mb)
        else:
            factors = [0.0] + [1.0 + gamma * (b - 1) for b in range(1, mb + 1)]
        return [t1 * f for f in factors]

    def kv_read(self, cls: int) -> float:
        return self.large_kv_read_s_per_token if cls == LARGE else self.small_kv_read_s_per_token

    def kv_tokens(self, cls: int) -> int:
        """KV-cache capacity of one model's engine, in tokens (on its own GPU, or sharing one)."""
        given = self.large_kv_tokens if cls == LARGE else self.small_kv_tokens
        if given is not None:
            return int(given)
        usable = self.gpu_mem_gb * self.gpu_mem_util
        if self.shared_gpu:
            if cls == SMALL:
                kv_gb = self.shared_small_kv_gb
            else:
                kv_gb = (
                    usable - self.large_weights_gb - self.small_weights_gb
                    - self.large_reserve_gb - self.small_reserve_gb - self.shared_small_kv_gb
                )
        elif cls == LARGE:
            kv_gb = usable - self.large_weights_gb - self.large_reserve_gb
        else:
            kv_gb = usable - self.small_weights_gb - self.small_reserve_gb
        per = self.large_kv_bytes_per_token if cls == LARGE else self.small_kv_bytes_per_token
        return int(kv_gb * 1e9 // per)

    def prefill_s(self, cls: int, text: int, image: int = 0) -> float:
        """Seconds to prefill ``text`` text tokens and ``image`` image tokens."""
        if cls == LARGE:
            pp, vit = self.large_prefill_s_per_token, self.large_vit_s_per_token
        else:
            pp, vit = self.small_prefill_s_per_token, self.small_vit_s_per_token
        return (text + image) * pp + image * vit

    # --- token counts ----------------------------------------------------------------------------
    @property
    def small_view_tokens(self) -> int:
        return self.image_tokens if self.small_image_tokens is None else self.small_image_tokens

    def judge_view_tokens(self, cls: int = LARGE) -> int:
        """Image tokens the judge sees on model ``cls`` (the view budget applied)."""
        if cls == LARGE and self.judge_image_tokens is not None:
            return self.judge_image_tokens
        full = self.image_tokens if cls == LARGE else self.small_view_tokens
        if self.judge_max_pixels is None:
            return full
        factor, lo = (
            (LARGE_FACTOR, LARGE_MIN_PIXELS) if cls == LARGE else (SMALL_FACTOR, SMALL_MIN_PIXELS)
        )
        if self.image_wh:
            w, h = self.image_wh
            return min(full, image_tokens(w, h, factor, lo, max(lo, self.judge_max_pixels)))
        return min(full, max(4, self.judge_max_pixels // (factor * factor)))

    @property
    def judge_prefill_tokens(self) -> int:
        return self.judge_view_tokens(LARGE) + self.judge_text_tokens

    @property
    def small_prefill_tokens(self) -> int:
        return self.small_view_tokens + self.small_text_tokens

    @property
    def agent_prefill_tokens(self) -> int:
        return self.image_tokens + self.agent_text_tokens

    @property
    def tool_turn_prefill_tokens(self) -> int:
        return self.crop_tokens + self.tool_text_tokens

    # --- derived batch-1 costs (seconds) -------------------------------------------------------
    def _b1(self, cls: int, prefill_s: float, n_decode: int, ctx: int) -> float:
        return prefill_s + n_decode * (self.step_table(cls)[1] + ctx * self.kv_read(cls))

    def judge_s(self) -> float:
        """The published judge at batch 1 (the large model, its view of the image)."""
        img = self.judge_view_tokens(LARGE)
        return self._b1(
            LARGE, self.prefill_s(LARGE, self.judge_text_tokens, img), self.judge_decode_tokens,
            self.judge_prefill_tokens + self.judge_decode_tokens,
        )

    def small_s(self) -> float:
        return self._b1(
            SMALL, self.prefill_s(SMALL, self.small_text_tokens, self.small_view_tokens),
            self.small_decode_tokens, self.small_prefill_tokens + self.small_decode_tokens,
        )

    def mean_tool_calls(self) -> float:
        return float(np.dot(np.arange(len(self.tool_call_probs)), self.tool_call_probs))

    def _agent_parts(self) -> tuple[float, float, float, float]:
        """Mean batch-1 agent seconds split as (prefill, decode steps, KV reads, tool CPU)."""
        m = 0.5 * (self.turn_tokens_min + self.turn_tokens_max)
        a, tt = self.agent_prefill_tokens, self.tool_turn_prefill_tokens
        pre = dec = kv = tool = 0.0
        dec1, r = self.step_table(LARGE)[1], self.kv_read(LARGE)
        first = self.prefill_s(LARGE, self.agent_text_tokens, self.image_tokens)
        for k_calls, p in enumerate(self.tool_call_probs):
            ctx = float(a)
            for k in range(k_calls + 1):  # turn k: its prefill, then m decode steps
                if k == 0:
                    pre_k = first
                else:
                    pre_k = _tool_turn_prefill_s(self, ctx, k)
                    ctx += tt
                ctx += m
                pre += p * pre_k
                dec += p * m * dec1
                kv += p * m * ctx * r
            tool += p * k_calls * self.tool_s
        return pre, dec, kv, tool

    def agent_s(self) -> float:
        """Mean agent-loop seconds at batch 1 (mean turn lengths)."""
        return sum(self._agent_parts())

    # --- loading -------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostModel:
        """Field overrides, plus an optional ``measured`` block of per-query mean seconds at batch
        1 from real runs (``judge_s``, ``small_s``, ``agent_s``, e.g. the timings that
        ``speceyes eval`` logs): the large model's per-token prefill and decode step are solved
        from judge_s and agent_s (two linear equations, token counts as modelled), and the small
        model's costs are scaled together to match small_s."""
        data = dict(data)
        measured = data.pop("measured", None)
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown cost fields: {', '.join(unknown)}")
        costs = cls(**data)
        if measured:
            costs = costs.calibrated(**measured)
        costs.validate()
        return costs

    @classmethod
    def from_json(cls, path: str | Path) -> CostModel:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object of cost fields")
        return cls.from_dict(data)

    def calibrated(
        self,
        judge_s: float | None = None,
        small_s: float | None = None,
        agent_s: float | None = None,
    ) -> CostModel:
        c = replace(self)
        if judge_s is not None and agent_s is not None:
            # Linear in (prefill scale s_p, decode step d): the vision-encoder share is scaled
            # with the prefill, the KV reads are kept as modelled.
            f1 = c.step_table(LARGE)[1] / c.large_decode_s  # curve factor at b=1 (1 for gamma)
            judge_pre = c.prefill_s(LARGE, c.judge_text_tokens, c.judge_view_tokens(LARGE))
            judge_kv = c.judge_decode_tokens * (c.judge_prefill_tokens + c.judge_decode_tokens)
            judge_kv *= c.kv_read(LARGE)
            a_pre, a_dec, a_kv, a_tool = c._agent_parts()
            a = np.array(
                [
                    [judge_pre, c.judge_decode_tokens * f1],
                    [a_pre, a_dec / c.large_decode_s],
                ],
                dtype=np.float64,
            )
            rhs = np.array([judge_s - judge_kv, agent_s - a_tool - a_kv])
            sp, dec = np.linalg.solve(a, rhs)
            if sp <= 0 or dec <= 0:
                raise ValueError(
                    f"measured judge_s={judge_s}, agent_s={agent_s} do not fit the token counts "
                    f"(prefill scale {sp:.3g}, decode {dec:.3g} s/step): adjust image_tokens "
                    "or turn_tokens_*"
                )
            c.large_prefill_s_per_token *= float(sp)
            c.large_vit_s_per_token *= float(sp)
            c.large_decode_s = float(dec)
        elif judge_s is not None or agent_s is not None:
            # one number: scale the large model's costs together to match it
            target, model = (judge_s, c.judge_s()) if judge_s is not None else (agent_s, c.agent_s())
            s = float(target) / model
            c.large_prefill_s_per_token *= s
            c.large_vit_s_per_token *= s
            c.large_decode_s *= s
            c.large_kv_read_s_per_token *= s
        if small_s is not None:
            s = float(small_s) / c.small_s()
            c.small_prefill_s_per_token *= s
            c.small_vit_s_per_token *= s
            c.small_decode_s *= s
            c.small_kv_read_s_per_token *= s
        return c


def _curve_table(curve: Sequence[Sequence[float]], max_batch: int) -> list[float]:
    """Step-time factors for 0..max_batch from measured [b, t(b)/t(1)] points: piecewise linear,
    extended past the last point along the last segment (never flat: that would be free batching)."""
    pts = sorted((float(b), float(f)) for b, f in curve)
    if not pts or pts[0][0] > 1 or any(f <= 0 for _, f in pts):
        raise ValueError("batch curve needs positive [b, factor] points starting at b <= 1")
    bs = np.array([b for b, _ in pts])
    fs = np.array([f for _, f in pts])
    out = [0.0]
    slope = (fs[-1] - fs[-2]) / (bs[-1] - bs[-2]) if len(pts) > 1 else 0.0
    for b in range(1, max_batch + 1):
        f = np.interp(b, bs, fs) if b <= bs[-1] else fs[-1] + slope * (b - bs[-1])
        out.append(float(f))
    return out


# --- per-query random draws ------------------------------------------------------------------


@dataclass
class Draws:
    """What each query will do, drawn once per seed and shared by every schedule and C."""

    tool: np.ndarray  # judge says "tool" (prob 1 - beta)
    accept: np.ndarray  # the gate accepts the small answer (prob alpha)
    turns: np.ndarray  # agent turns = tool calls + 1
    turn_tokens: np.ndarray  # (n, max turns) decoded tokens per turn
    accept_tool: np.ndarray | None = None  # without a judge: the gate accepts a "tool" query

    def subset(self, idx: np.ndarray) -> Draws:
        return Draws(
            self.tool[idx], self.accept[idx], self.turns[idx], self.turn_tokens[idx],
            None if self.accept_tool is None else self.accept_tool[idx],
        )


def draw(
    costs: CostModel, n: int, beta: float, alpha: float, seed: int,
    alpha_tool: float = DEFAULT_ALPHA_TOOL,
) -> Draws:
    if not (0.0 <= beta <= 1.0 and 0.0 <= alpha <= 1.0 and 0.0 <= alpha_tool <= 1.0):
        raise ValueError(f"beta, alpha, alpha_tool must be in [0, 1], got {beta}, {alpha}, "
                         f"{alpha_tool}")
    rng = np.random.default_rng(seed)
    # uniforms first, thresholds after: changing beta/alpha keeps every other draw (fair sweeps)
    u_judge, u_gate = rng.random(n), rng.random(n)
    probs = np.asarray(costs.tool_call_probs, dtype=np.float64)
    k = rng.choice(probs.size, size=n, p=probs / probs.sum())
    tokens = rng.integers(
        costs.turn_tokens_min, costs.turn_tokens_max + 1, size=(n, probs.size)
    )
    return Draws(
        tool=u_judge >= beta, accept=u_gate < alpha, turns=k + 1, turn_tokens=tokens,
        accept_tool=u_gate < alpha_tool,
    )


def agent_latency_b1(costs: CostModel, d: Draws, first_prefill_s: float | None = None) -> np.ndarray:
    """Each query's agent-loop seconds alone on the engine (batch 1): the sum of its turn costs.
    ``first_prefill_s`` replaces the first turn's prefill (a prefix-cache hit)."""
    dec1, r = costs.step_table(LARGE)[1], costs.kv_read(LARGE)
    first = (
        costs.prefill_s(LARGE, costs.agent_text_tokens, costs.image_tokens)
        if first_prefill_s is None else first_prefill_s
    )
    out = np.empty(len(d.turns))
    for q in range(len(d.turns)):
        total, ctx = 0.0, costs.agent_prefill_tokens
        for k in range(int(d.turns[q])):
            tt = int(d.turn_tokens[q, k])
            if k == 0:
                pre = first
            else:
                pre = _tool_turn_prefill_s(costs, ctx, k)
                ctx += costs.tool_turn_prefill_tokens
                total += costs.tool_s
            ctx += tt
            total += pre + tt * (dec1 + ctx * r)
        out[q] = total
    return out


def _tool_turn_prefill_s(costs: CostModel, ctx: int, k: int) -> float:
    """Prefill of tool turn ``k`` (1-based) after ``ctx`` tokens of history."""
    if costs.prefix_caching:
        return costs.prefill_s(LARGE, costs.tool_text_tokens, costs.crop_tokens)
    img = costs.image_tokens + k * costs.crop_tokens
    return costs.prefill_s(LARGE, ctx + costs.tool_turn_prefill_tokens - img, img)


# --- the event engine ------------------------------------------------------------------------

Callback = Callable[[int, float], None]


class _Sim:
    __slots__ = ("heap", "seq")

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, Callable[[int, float], None], int]] = []
        self.seq = 0

    def at(self, t: float, fn: Callable[[int, float], None], arg: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, fn, arg))

    def run(self) -> None:
        heap, pop = self.heap, heapq.heappop
        while heap:
            t, _, fn, arg = pop(heap)
            fn(arg, t)


class _Model:
    """One model's share of an engine: its step costs, limits, queue and running sequences."""

    __slots__ = ("table", "max_batch", "kv", "kv_read", "budget", "waiting", "count", "kv_used")

    def __init__(self, costs: CostModel, cls: int) -> None:
        self.table = costs.step_table(cls)
        self.max_batch = costs.large_max_batch if cls == LARGE else costs.small_max_batch
        self.kv = costs.kv_tokens(cls)
        self.kv_read = costs.kv_read(cls)
        self.budget = costs.prefill_budget_tokens
        self.waiting: deque[tuple[int, float, int, int, Callback, int]] = deque()
        self.count = 0
        self.kv_used = 0

    def room(self, ctx: int) -> bool:
        """A new sequence fits: a batch slot and KV space (an empty model takes any request)."""
        return self.count < self.max_batch and (not self.count or self.kv_used + ctx <= self.kv)


class _Engine:
    """A continuous-batching server for one or two models (two = a shared GPU: each step runs
    both models' parts, so its time is the sum; each model keeps its own queue and limits)."""

    def __init__(self, sim: _Sim, models: dict[int, _Model]) -> None:
        self.sim = sim
        self.models = models
        self.active: list[tuple[int, int, int, int, Callback, int]] = []  # (finish step, seq, ...)
        self.n = 0
        self.step = 0  # completed steps at the current segment's start
        self.busy = False
        self.in_event = False
        self.version = 0
        self.seq = 0
        self.t0 = self.first = self.dec = 0.0
        self.end_step = 0
        self.busy_time = 0.0
        self.batch_time = 0.0
        self.jobs = 0

    def submit(
        self, t: float, cls: int, tokens: int, prefill_s: float, n_decode: int, ctx: int,
        cb: Callback, q: int,
    ) -> None:
        """A request of ``tokens`` prefill tokens (``prefill_s`` seconds), ``n_decode`` decoded
        tokens and ``ctx`` tokens of KV cache while it runs; ``cb(q, t)`` when it is done."""
        m = self.models[cls]
        m.waiting.append((tokens, prefill_s, n_decode, ctx, cb, q))
        self.jobs += 1
        if self.in_event:  # the boundary being processed admits it
            return
        if not self.busy:
            self._plan(t)
            return
        if len(m.waiting) > 1 or not m.room(ctx):
            return  # joins when a sequence leaves (or after the ones queued before it)
        # join at the first step boundary at or after t: cut the current segment there
        rel = t - self.t0
        j = 1 if rel <= self.first else 1 + math.ceil((rel - self.first) / self.dec)
        if self.step + j < self.end_step:
            self.end_step = self.step + j
            self.version += 1
            self.sim.at(max(t, self.t0 + self.first + (j - 1) * self.dec), self._boundary,
                        self.version)

    def _boundary(self, version: int, t: float) -> None:
        if version != self.version:
            return  # a segment that was cut short
        dt = t - self.t0
        self.busy_time += dt
        self.batch_time += self.n * dt
        self.step = step = self.end_step
        act = self.active
        done = []
        while act and act[0][0] <= step:
            _, _, cls, ctx, cb, q = heapq.heappop(act)
            m = self.models[cls]
            m.count -= 1
            m.kv_used -= ctx
            self.n -= 1
            done.append((cb, q))
        self.in_event = True
        for cb, q in done:
            cb(q, t)
        self.in_event = False
        self._plan(t)

    def _plan(self, t: float) -> None:
        act = self.active
        pre, more = 0.0, False
        for cls, m in self.models.items():
            w, budget, admitted = m.waiting, m.budget, 0
            while w:
                tokens, prefill_s, n_decode, ctx, cb, q = w[0]
                if not m.room(ctx):
                    break  # waits for a sequence of this model to leave
                if admitted and tokens > budget:
                    more = True  # the rest waits for the next step (chunked-prefill budget)
                    break
                w.popleft()
                budget -= tokens
                pre += prefill_s
                admitted += 1
                self.seq += 1
                heapq.heappush(act, (self.step + n_decode, self.seq, cls, ctx, cb, q))
                m.count += 1
                m.kv_used += ctx
                self.n += 1
        if not self.n:
            self.busy = False
            return
        self.busy = True
        dec = 0.0
        for m in self.models.values():
            if m.count:
                dec += m.table[m.count] + m.kv_used * m.kv_read
        self.t0, self.dec, self.first = t, dec, dec + pre
        end = act[0][0]
        if more:
            end = self.step + 1  # admit the rest at the next boundary
        self.end_step = end
        self.version += 1
        self.sim.at(t + self.first + (end - self.step - 1) * dec, self._boundary, self.version)


# --- schedules -------------------------------------------------------------------------------


@dataclass
class RunResult:
    schedule: str
    concurrency: int
    issued: np.ndarray
    finished: np.ndarray
    engines: dict[str, dict[str, float]]
    judge: str = "-"

    @property
    def latencies(self) -> np.ndarray:
        return self.finished - self.issued

    @property
    def makespan(self) -> float:
        return float(self.finished.max()) if self.finished.size else 0.0


class _Run:
    def __init__(
        self, schedule: str, costs: CostModel, d: Draws, concurrency: int,
        published_batch: int | None, judge: str = "large",
    ) -> None:
        if schedule not in ("agent-only", "published", "speceyes"):
            raise ValueError(f"unknown schedule {schedule!r}; choose from {', '.join(SCHEDULES)}")
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if judge not in JUDGES:
            raise ValueError(f"unknown judge {judge!r}; choose from {', '.join(JUDGES)}")
        if judge == "prefix" and (costs.judge_max_pixels or costs.judge_image_tokens is not None):
            raise ValueError("the prefix-shared judge sees the agent's own view of the image: "
                             "no judge view budget")
        self.schedule, self.c, self.costs, self.judge = schedule, concurrency, costs, judge
        self.sim = sim = _Sim()
        if costs.shared_gpu:
            self.large = self.small = _Engine(
                sim, {LARGE: _Model(costs, LARGE), SMALL: _Model(costs, SMALL)}
            )
        else:
            self.large = _Engine(sim, {LARGE: _Model(costs, LARGE)})
            self.small = _Engine(sim, {SMALL: _Model(costs, SMALL)})
        c = costs
        # the requests of phases I and II: (tokens, prefill seconds, decoded tokens, KV context)
        img = c.judge_view_tokens(LARGE)
        self.req_judge = (
            img + c.judge_text_tokens, c.prefill_s(LARGE, c.judge_text_tokens, img),
            c.judge_decode_tokens, img + c.judge_text_tokens + c.judge_decode_tokens,
        )
        simg = c.judge_view_tokens(SMALL)
        self.req_small_judge = (
            simg + c.judge_text_tokens, c.prefill_s(SMALL, c.judge_text_tokens, simg),
            c.judge_decode_tokens, simg + c.judge_text_tokens + c.judge_decode_tokens,
        )
        self.req_small = (
            c.small_prefill_tokens,
            c.prefill_s(SMALL, c.small_text_tokens, c.small_view_tokens),
            c.small_decode_tokens, c.small_prefill_tokens + c.small_decode_tokens,
        )
        # the judge question after a cached prefix (the agent's prompt, or the small answer's)
        tail = c.prefix_tail_tokens if c.prefix_caching else None
        a = c.agent_prefill_tokens
        self.req_prefix_judge = (
            a + c.prefix_judge_tokens,
            c.prefill_s(LARGE, c.agent_text_tokens + c.prefix_judge_tokens, c.image_tokens),
            c.judge_decode_tokens, a + c.prefix_judge_tokens + c.judge_decode_tokens,
        )
        if tail is not None:
            cont = (tail + c.prefix_judge_tokens, c.prefill_s(SMALL, tail + c.prefix_judge_tokens))
        else:
            cont = (c.small_prefill_tokens + c.prefix_judge_tokens,
                    c.prefill_s(SMALL, c.small_text_tokens + c.prefix_judge_tokens,
                                c.small_view_tokens))
        self.req_small_cont = (
            cont[0], cont[1], c.judge_decode_tokens,
            c.small_prefill_tokens + c.prefix_judge_tokens + c.judge_decode_tokens,
        )
        # the agent's first turn: after a prefix-shared judge, only the tail misses the cache
        full_first = c.prefill_s(LARGE, c.agent_text_tokens, c.image_tokens)
        self.first_hit = schedule == "speceyes" and judge == "prefix" and tail is not None
        self.first_tokens = tail if self.first_hit else a
        self.first_s = c.prefill_s(LARGE, tail) if self.first_hit else full_first
        # python lists: scalar indexing is several times faster than numpy's
        self.tool = d.tool.tolist()
        acc_tool = d.accept if d.accept_tool is None else d.accept_tool
        if judge == "none":  # the gate decides for every query
            self.accept = np.where(d.tool, acc_tool, d.accept).tolist()
        else:
            self.accept = d.accept.tolist()
        self.turns = d.turns.tolist()
        self.tt = d.turn_tokens.tolist()
        self.n = len(self.tool)
        self.turn = [0] * self.n
        self.ctx = [0] * self.n
        self.state = [0] * self.n
        self.issued = np.zeros(self.n)
        self.finished = np.zeros(self.n)
        self.next_q = 0
        self.pub_batch = published_batch or concurrency
        self.pending: list[int] = []
        self.pub_busy = False
        self.batch: list[int] = []
        self.outstanding = 0
        self.serial: deque[int] = deque()
        self.start_query: Callable[[int, float], None] = {
            "agent-only": self._agent_start,
            "published": self._pub_enqueue,
            "speceyes": self._spec_start,
        }[schedule]

    def run(self) -> RunResult:
        if self.schedule == "published":
            self.pub_busy = True  # collect the first C queries before the first batch
        for _ in range(min(self.c, self.n)):
            self._issue(0.0)
        if self.schedule == "published":
            self._pub_batch(0.0)
        self.sim.run()
        engines = {"large": _stats(self.large, self.makespan)}
        engines["small"] = _stats(self.small, self.makespan)
        judge = self.judge if self.schedule == "speceyes" else (
            "large" if self.schedule == "published" else "-"
        )
        return RunResult(self.schedule, self.c, self.issued, self.finished, engines, judge)

    @property
    def makespan(self) -> float:
        return float(self.finished.max()) if self.n else 0.0

    def _issue(self, t: float) -> None:
        q = self.next_q
        self.next_q += 1
        self.issued[q] = t
        self.start_query(q, t)

    def _complete(self, q: int, t: float) -> None:
        self.finished[q] = t
        if self.next_q < self.n:  # closed loop: this client sends its next query now
            self._issue(t)

    def _submit(self, engine: _Engine, t: float, cls: int, req: tuple, cb: Callback, q: int):
        engine.submit(t, cls, req[0], req[1], req[2], req[3], cb, q)

    # agent loop (phase IV), shared by all schedules
    def _agent_start(self, q: int, t: float) -> None:
        self.turn[q] = 0
        n = self.tt[q][0]
        self.ctx[q] = ctx = self.costs.agent_prefill_tokens + n
        self.large.submit(
            t, LARGE, self.first_tokens, self.first_s, n, ctx, self._agent_turn_done, q
        )

    def _agent_turn_done(self, q: int, t: float) -> None:
        k = self.turn[q] + 1
        if k >= self.turns[q]:
            self._agent_done(q, t)
            return
        self.turn[q] = k
        if self.costs.tool_s > 0:
            self.sim.at(t + self.costs.tool_s, self._agent_next, q)  # the crop runs on the CPU
        else:
            self._agent_next(q, t)

    def _agent_next(self, q: int, t: float) -> None:
        c, k = self.costs, self.turn[q]
        before = self.ctx[q]
        n = self.tt[q][k]
        self.ctx[q] = ctx = before + c.tool_turn_prefill_tokens + n
        tokens = c.tool_turn_prefill_tokens if c.prefix_caching else (
            before + c.tool_turn_prefill_tokens
        )
        self.large.submit(
            t, LARGE, tokens, _tool_turn_prefill_s(c, before, k), n, ctx,
            self._agent_turn_done, q,
        )

    def _agent_done(self, q: int, t: float) -> None:
        self._complete(q, t)
        if self.schedule == "published":
            self._pub_next_agent(t)

    # ours: judge and speculative answer at once; the gate is instant
    def _spec_start(self, q: int, t: float) -> None:
        j = self.judge
        self.state[q] = 0
        if j == "none":
            self.state[q] = 1  # nothing to judge: the gate decides on the answer alone
        elif j == "large":
            self._submit(self.large, t, LARGE, self.req_judge, self._spec_judged, q)
        elif j == "prefix":
            self._submit(self.large, t, LARGE, self.req_prefix_judge, self._spec_judged, q)
        elif j == "small":
            self._submit(self.small, t, SMALL, self.req_small_judge, self._spec_judged, q)
        # the small answer is wasted when the judge says "tool"; it is cheap and on its own GPU
        cb = self._spec_answered_then_judge if j == "small-prefix" else self._spec_answered
        self._submit(self.small, t, SMALL, self.req_small, cb, q)

    def _spec_answered_then_judge(self, q: int, t: float) -> None:
        # the answer's prompt is cached now: the judge question continues it (one image prefill)
        self.state[q] |= 2
        self._submit(self.small, t, SMALL, self.req_small_cont, self._spec_judged, q)

    def _spec_judged(self, q: int, t: float) -> None:
        if self.tool[q]:
            self._agent_start(q, t)
            return
        self.state[q] |= 1
        if self.state[q] == 3:
            self._gate(q, t)

    def _spec_answered(self, q: int, t: float) -> None:
        self.state[q] |= 2
        if self.state[q] == 3:
            self._gate(q, t)

    def _gate(self, q: int, t: float) -> None:
        if self.accept[q]:
            self._complete(q, t)
        else:
            self._agent_start(q, t)

    # published: batch phases I, II, III, then phase IV serially, then the next batch
    def _pub_enqueue(self, q: int, t: float) -> None:
        self.pending.append(q)
        if not self.pub_busy:
            self._pub_batch(t)

    def _pub_batch(self, t: float) -> None:
        if not self.pending:
            self.pub_busy = False
            return
        self.pub_busy = True
        self.batch = self.pending[: self.pub_batch]
        del self.pending[: self.pub_batch]
        self.outstanding = len(self.batch)
        for q in self.batch:
            self._submit(self.large, t, LARGE, self.req_judge, self._pub_judged, q)

    def _pub_judged(self, q: int, t: float) -> None:
        self.outstanding -= 1
        if self.outstanding:
            return
        free = [q for q in self.batch if not self.tool[q]]
        self.outstanding = len(free)
        if not free:
            self._pub_gate(t)
            return
        for q2 in free:
            self._submit(self.small, t, SMALL, self.req_small, self._pub_answered, q2)

    def _pub_answered(self, q: int, t: float) -> None:
        self.outstanding -= 1
        if not self.outstanding:
            self._pub_gate(t)

    def _pub_gate(self, t: float) -> None:
        batch = self.batch
        self.serial = deque(q for q in batch if self.tool[q] or not self.accept[q])
        for q in batch:
            if not self.tool[q] and self.accept[q]:
                self._complete(q, t)  # generous: an accepted answer returns before phase IV
        self._pub_next_agent(t)

    def _pub_next_agent(self, t: float) -> None:
        if self.serial:
            self._agent_start(self.serial.popleft(), t)
        else:
            self._pub_batch(t)


def _stats(e: _Engine, makespan: float) -> dict[str, float]:
    return {
        "mean_batch": e.batch_time / e.busy_time if e.busy_time > 0 else 0.0,
        "utilisation": e.busy_time / makespan if makespan > 0 else 0.0,
        "busy_s": e.busy_time,
        "jobs": float(e.jobs),
    }


def simulate_one(
    schedule: str, costs: CostModel, draws: Draws, concurrency: int,
    published_batch: int | None = None, judge: str = "large",
) -> RunResult:
    """One schedule at one concurrency; per-query issue and finish times."""
    if schedule.startswith("agent-only"):
        costs = replace(costs, shared_gpu=False)  # the large model alone on its GPU(s)
    if schedule == "agent-only-2gpu":
        return _agent_only_2gpu(costs, draws, concurrency)
    return _Run(schedule, costs, draws, concurrency, published_batch, judge).run()


def _agent_only_2gpu(costs: CostModel, d: Draws, concurrency: int) -> RunResult:
    """Agent-only on two GPUs, data parallel: two replicas, each with half the clients and the
    queries alternating between them (one replica when there is one client)."""
    n = len(d.turns)
    if concurrency < 2:
        r = _Run("agent-only", costs, d, concurrency, None).run()
        r.schedule = "agent-only-2gpu"
        return r
    issued, finished = np.zeros(n), np.zeros(n)
    engines: dict[str, dict[str, float]] = {}
    for part, c in ((0, concurrency // 2 + concurrency % 2), (1, concurrency // 2)):
        idx = np.arange(part, n, 2)
        r = _Run("agent-only", costs, d.subset(idx), c, None).run()
        issued[idx], finished[idx] = r.issued, r.finished
        engines[("large", "small")[part]] = r.engines["large"]  # replica 1, replica 2
    return RunResult("agent-only-2gpu", concurrency, issued, finished, engines)


# --- rows, analytic, outputs -----------------------------------------------------------------


@dataclass
class Row:
    schedule: str
    concurrency: int
    throughput: float  # queries per second
    p50_s: float
    p95_s: float
    mean_s: float
    large_batch: float  # time-weighted mean sequences per step while the engine is busy
    small_batch: float  # shared_gpu: both columns describe the one engine; 2gpu: the replicas
    large_util: float  # busy share of the makespan
    small_util: float
    vs_agent_only: float  # throughput / agent-only throughput (one GPU) at the same C
    of_ideal: float  # throughput / (agent-only throughput / (1 - beta*alpha))
    judge: str = "-"  # ours: the judge variant; published: "large"
    gpus: int = 1
    per_gpu_vs_agent_only: float = math.nan  # (throughput / gpus) / agent-only throughput
    vs_agent_only_2gpu: float = math.nan  # throughput / agent-only on two GPUs (data parallel)


@dataclass
class Analytic:
    c_judge: float
    c_small: float
    l_agent: float
    expected_latency: float  # E[L] = c_J + beta*c_S + (1 - beta*alpha)*L_agent (sequential)
    expected_latency_overlap: float  # ours at batch 1: judge and small answer run at once
    ideal_gain: float  # 1 / (1 - beta*alpha)


def analytic(costs: CostModel, beta: float, alpha: float) -> Analytic:
    cj, cs, la = costs.judge_s(), costs.small_s(), costs.agent_s()
    both = max(cj, cs)
    overlap = (1 - beta) * (cj + la) + beta * (both + (1 - alpha) * la)
    gain = 1.0 / (1.0 - beta * alpha) if beta * alpha < 1 else math.inf
    return Analytic(cj, cs, la, float(analytic_latency(cj, cs, la, beta, alpha)), overlap, gain)


def judge_costs(costs: CostModel) -> dict[str, dict[str, Any]]:
    """Per judge variant at batch 1: the model it runs on, its prefill tokens and seconds, and
    the agent's first-turn prefill it saves (a prefix-cache hit) for the queries that go on."""
    c = costs
    out: dict[str, dict[str, Any]] = {}
    img = c.judge_view_tokens(LARGE)
    out["large"] = {"model": "large", "tokens": img + c.judge_text_tokens, "s": c.judge_s()}
    tokens = c.agent_prefill_tokens + c.prefix_judge_tokens
    s = c._b1(LARGE, c.prefill_s(LARGE, c.agent_text_tokens + c.prefix_judge_tokens,
                                 c.image_tokens), c.judge_decode_tokens, tokens + 1)
    saved = c.prefill_s(LARGE, c.agent_text_tokens - c.prefix_tail_tokens, c.image_tokens)
    out["prefix"] = {"model": "large", "tokens": tokens, "s": s,
                     "saves_agent_s": saved if c.prefix_caching else 0.0}
    simg = c.judge_view_tokens(SMALL)
    out["small"] = {"model": "small", "tokens": simg + c.judge_text_tokens,
                    "s": c._b1(SMALL, c.prefill_s(SMALL, c.judge_text_tokens, simg),
                               c.judge_decode_tokens, simg + c.judge_text_tokens + 1)}
    cont = c.prefix_tail_tokens + c.prefix_judge_tokens
    if not c.prefix_caching:
        cont = c.small_prefill_tokens + c.prefix_judge_tokens
    cont_s = (c.prefill_s(SMALL, c.prefix_tail_tokens + c.prefix_judge_tokens)
              if c.prefix_caching else
              c.prefill_s(SMALL, c.small_text_tokens + c.prefix_judge_tokens, c.small_view_tokens))
    out["small-prefix"] = {"model": "small", "tokens": cont,
                           "s": c._b1(SMALL, cont_s, c.judge_decode_tokens,
                                      c.small_prefill_tokens + c.prefix_judge_tokens + 1)}
    out["none"] = {"model": "-", "tokens": 0, "s": 0.0}
    return out


def simulate(
    costs: CostModel | None = None,
    schedules: Sequence[str] = SCHEDULES,
    concurrencies: Sequence[int] = DEFAULT_CONCURRENCIES,
    n_queries: int = 10_000,
    beta: float = DEFAULT_BETA,
    alpha: float = DEFAULT_ALPHA,
    seed: int = 0,
    published_batch: int | None = None,
    judges: Sequence[str] = ("large",),
    alpha_tool: float = DEFAULT_ALPHA_TOOL,
) -> list[Row]:
    """Every schedule at every concurrency (ours once per judge variant), plus an ``ideal`` row
    per C when agent-only is run. The same seeded draws serve every run, so differences come
    from the schedule alone."""
    costs = costs or CostModel()
    costs.validate()
    if n_queries < 1:
        raise ValueError("n_queries must be >= 1")
    unknown = [s for s in schedules if s not in SCHEDULES]
    if unknown:
        raise ValueError(f"unknown schedule {unknown[0]!r}; choose from {', '.join(SCHEDULES)}")
    bad = [j for j in judges if j not in JUDGES]
    if bad or not judges:
        raise ValueError(f"unknown judge {bad[0] if bad else ''!r}; choose from {', '.join(JUDGES)}")
    d = draw(costs, n_queries, beta, alpha, seed, alpha_tool)
    gain = analytic(costs, beta, alpha).ideal_gain
    pair = 1 if costs.shared_gpu else 2  # GPUs of the two-model schedules
    runs: list[tuple[str, str]] = []
    for s in sorted(dict.fromkeys(schedules), key=SCHEDULES.index):
        runs.extend((s, j) for j in (judges if s == "speceyes" else ("-",)))
    rows: list[Row] = []
    for c in concurrencies:
        here: list[Row] = []
        for s, j in runs:
            r = simulate_one(s, costs, d, int(c), published_batch, j if j != "-" else "large")
            lat = r.latencies
            thr = n_queries / r.makespan if r.makespan > 0 else math.inf
            gpus = {"agent-only": 1, "agent-only-2gpu": 2}.get(s, pair)
            here.append(
                Row(
                    schedule=s, concurrency=int(c), throughput=thr,
                    p50_s=float(np.percentile(lat, 50)), p95_s=float(np.percentile(lat, 95)),
                    mean_s=float(lat.mean()),
                    large_batch=r.engines["large"]["mean_batch"],
                    small_batch=r.engines["small"]["mean_batch"],
                    large_util=r.engines["large"]["utilisation"],
                    small_util=r.engines["small"]["utilisation"],
                    vs_agent_only=math.nan, of_ideal=math.nan, judge=r.judge, gpus=gpus,
                )
            )
        base = next((r.throughput for r in here if r.schedule == "agent-only"), None)
        base2 = next((r.throughput for r in here if r.schedule == "agent-only-2gpu"), None)
        for row in here:
            if base is not None:
                row.vs_agent_only = row.throughput / base
                row.of_ideal = row.throughput / (base * gain)
                row.per_gpu_vs_agent_only = row.throughput / row.gpus / base
            if base2 is not None:
                row.vs_agent_only_2gpu = row.throughput / base2
        if base is not None:
            nan = math.nan
            here.append(
                Row(IDEAL, int(c), base * gain, nan, nan, nan, nan, nan, nan, nan, gain, 1.0,
                    judge="-", gpus=1, per_gpu_vs_agent_only=gain,
                    vs_agent_only_2gpu=base * gain / base2 if base2 else nan)
            )
        rows.extend(here)
    return rows


def _f(x: float, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def format_table(rows: Sequence[Row]) -> str:
    head = (
        "| schedule | C | judge | GPUs | queries/s | x agent-only | per GPU | x agent-only 2 GPUs "
        "| of ideal | p50 s | p95 s | large batch | large util | small batch | small util |"
    )
    lines = [head, "|" + "---|" * 15]
    for r in rows:
        lines.append(
            f"| {r.schedule} | {r.concurrency} | {r.judge} | {r.gpus} | "
            f"{_f(r.throughput, '.3f')} | {_f(r.vs_agent_only, '.2f')} | "
            f"{_f(r.per_gpu_vs_agent_only, '.2f')} | {_f(r.vs_agent_only_2gpu, '.2f')} | "
            f"{_f(r.of_ideal, '.0%')} | {_f(r.p50_s, '.2f')} | "
            f"{_f(r.p95_s, '.2f')} | {_f(r.large_batch, '.1f')} | {_f(r.large_util, '.0%')} | "
            f"{_f(r.small_batch, '.1f')} | {_f(r.small_util, '.0%')} |"
        )
    return "\n".join(lines)


_COLORS = {"agent-only": "tab:gray", "agent-only-2gpu": "tab:brown", "published": "tab:red",
           IDEAL: "black"}
_JUDGE_COLORS = {"large": "tab:blue", "prefix": "tab:cyan", "small": "tab:green",
                 "small-prefix": "tab:olive", "none": "tab:purple"}


def plot(rows: Sequence[Row], path: str | Path, title: str = "") -> Path:
    """Throughput vs concurrency (log2 x) per schedule plus the ideal; p50/p95 latency."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    series = list(dict.fromkeys((r.schedule, r.judge) for r in rows))
    for s, j in series:
        rs = sorted((r for r in rows if r.schedule == s and r.judge == j),
                    key=lambda r: r.concurrency)
        cs = [r.concurrency for r in rs]
        color = _JUDGE_COLORS.get(j, "tab:blue") if s == "speceyes" else _COLORS[s]
        style = "--" if s == IDEAL else "-"
        label = (
            "ideal: agent-only / (1 - beta*alpha)" if s == IDEAL
            else f"speceyes, judge {j}" if s == "speceyes" else s
        )
        ax1.plot(cs, [r.throughput for r in rs], style, marker="o", ms=3, color=color,
                 label=label)
        if s != IDEAL:
            ax2.plot(cs, [r.p50_s for r in rs], "-", marker="o", ms=3, color=color,
                     label=f"{label} p50")
            ax2.plot(cs, [r.p95_s for r in rs], ":", marker="^", ms=3, color=color,
                     label=f"{label} p95")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (clients in a closed loop)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    ax1.set_yscale("log")
    ax1.set_ylabel("throughput (queries/s)")
    ax2.set_yscale("log")
    ax2.set_ylabel("latency (s)")
    ax1.set_title("throughput")
    ax2.set_title("latency (p50 solid, p95 dotted)")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_outputs(
    rows: Sequence[Row], out_dir: str | Path, costs: CostModel, beta: float, alpha: float,
    n_queries: int, seed: int, note: str = "",
) -> list[Path]:
    """simulate.md (settings, analytic check, table), simulate.csv and simulate.png."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    a = analytic(costs, beta, alpha)
    jc = judge_costs(costs)
    md = [
        "# speceyes simulate",
        "",
        f"{n_queries} queries per run, closed loop, beta={beta}, alpha={alpha}, seed={seed}"
        + (f"; {note}" if note else "") + ".",
        "",
        f"Batch-1 costs: judge c_J={a.c_judge:.3f} s, small answer c_S={a.c_small:.3f} s, "
        f"agent loop L_agent={a.l_agent:.2f} s.",
        f"E[L] = c_J + beta*c_S + (1 - beta*alpha)*L_agent = {a.expected_latency:.3f} s "
        f"(overlapped phases I+II: {a.expected_latency_overlap:.3f} s); "
        f"ideal gain 1/(1 - beta*alpha) = {a.ideal_gain:.3f}.",
        "Judge variants at batch 1: "
        + "; ".join(f"{j} {v['s']:.3f} s on the {v['model']} model ({v['tokens']} prefill tokens)"
                    for j, v in jc.items() if j != "none")
        + f"; the prefix judge saves {jc['prefix']['saves_agent_s']:.3f} s of the agent's first "
        "turn.",
        f"KV cache: {costs.kv_tokens(LARGE)} tokens (large), {costs.kv_tokens(SMALL)} (small); "
        f"{'one GPU for both models' if costs.shared_gpu else 'one GPU per model'}; prefix "
        f"caching {'on' if costs.prefix_caching else 'off'}.",
        "",
        format_table(rows),
        "",
        "## Cost model",
        "",
        "```json",
        json.dumps(asdict(costs), indent=2),
        "```",
        "",
    ]
    paths = [out / MD_FILE, out / CSV_FILE, out / PNG_FILE]
    paths[0].write_text("\n".join(md))
    with paths[1].open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=[f.name for f in fields(Row)])
        w.writeheader()
        for r in rows:
            w.writerow(asdict(r))
    plot(rows, paths[2], title=f"beta={beta}, alpha={alpha}, {n_queries} queries"
         + (f", {note}" if note else ""))
    return paths
