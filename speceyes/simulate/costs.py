"""The cost model: what each model call costs on the engines (token counts, prefill, decode
steps, KV cache), the image tokens of each benchmark, and the batch-1 analytics built on them."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from speceyes.backends.base import FAMILY_PIXELS, MODEL_FAMILIES
from speceyes.bench.benchmarks import BenchImages, image_profiles
from speceyes.funnel import FunnelConfig
from speceyes.images import smart_resize
from speceyes.rates import analytic_latency

LARGE, SMALL = 0, 1  # model classes on an engine
AGENT_WORKLOADS: tuple[str, ...] = ("deepeyes", "search")


# --- image tokens per benchmark ----------------------------------------------------------------

# Qwen2.5-VL (the DeepEyes agent and the judge): 28 px per visual token (14 px patches, 2x2
# merge), DeepEyes' pixel limits. Qwen3-VL (the small model): 32 px per token, its released
# processor's limits. The backends' family table is the one source of both.
LARGE_FACTOR = MODEL_FAMILIES["qwen2_5_vl"][1]
LARGE_MIN_PIXELS, LARGE_MAX_PIXELS = FAMILY_PIXELS["qwen2_5_vl"]
SMALL_FACTOR = MODEL_FAMILIES["qwen3_vl"][1]
SMALL_MIN_PIXELS, SMALL_MAX_PIXELS = FAMILY_PIXELS["qwen3_vl"]
# A DeepEyes zoom box is this share of the image's width and height (an assumption: about 600
# tokens of crop on a V* image); the crop is cut from the ORIGINAL image and smart_resized.
CROP_SIDE_FRACTION = 0.36


# The typical image of each benchmark lives on its registry entry (one source).
BENCH_IMAGES: dict[str, BenchImages] = image_profiles()


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
    vLLM on A100-80GB GPUs. Every field can be overridden from JSON (:meth:`from_file`); the
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
    # CPU seconds a server spends decoding and resizing a query's full image before its first
    # request with it can start (once per server: a later request with the same image hits
    # vLLM's multimodal processor cache). 0 by default: tens of ms with a fast processor next
    # to the GPU's seconds; docs/throughput.md gives what it measured on a CPU here.
    image_preprocess_s: float = 0.0
    # Seconds per query outside the funnel where a serving app stands in front (``speceyes
    # serve``): the client sending the request, the app reading its body and decoding its
    # image, and the reply. A delay before the query's first request, spent in the app's own
    # threads beside the engines, not on their devices (measured on the CPU engine: the servers
    # leave part of the cores idle, and serial there it made loaded answers too slow; see
    # docs/throughput.md, run 64). 0 by default, as for an eval that holds its images already.
    app_intake_s: float = 0.0

    # Per-request fixed costs (0 by default: beside a GPU's prefill they are noise). On a CPU
    # server every call also pays HTTP, chat templating, image processing and scheduling.
    # ``*_request_s`` is the part that does not batch: paid serially in the step the request
    # joins, as a prefill is; ``*_request_latency_s`` is the part that runs beside the engine
    # (client and API-server work overlapping other requests): a delay before the request joins.
    large_request_s: float = 0.0
    small_request_s: float = 0.0
    large_request_latency_s: float = 0.0
    small_request_latency_s: float = 0.0
    # Every prompt was served before (a benchmark cycling through a few questions after a
    # warm-up): the prefix cache holds all of it, images included, but the last partial block
    # of ``cache_block_tokens`` (vLLM caches full blocks only), so a request of P prefill
    # tokens prefills P mod block text tokens (at least one). Needs prefix_caching.
    warm_cache: bool = False
    cache_block_tokens: int = 16  # vLLM's default block size on GPUs (its CPU backend: 128)
    # Ours' phases I and II side by side on every query (the funnel's --overlap; the default
    # here, so the small answer never waits for the judge); False: the funnel's own default
    # order, the judge first, then the small answer on the queries it judged tool-free.
    phase_overlap: bool = True
    # The funnel's pipelined schedule as ``speceyes serve`` runs it (search workload only):
    # queries wait for a front batch (up to ``front_batch``, closed ``front_wait_s`` after its
    # oldest, one batch at a time, each phase waiting for the whole batch), and one agent
    # driver steps at most ``max_agent_loops`` loops together: a step cuts every searching
    # loop's crops (``tool_s`` each, one after another), sends all their cells, waits for all,
    # then the answers of the loops that finished searching; a loop joins at a step's start.
    # False (default): every query and loop on its own.
    funnel_pipeline: bool = False
    # The client's CPU (``tool_s``, ``image_preprocess_s``) runs on the engine's own device,
    # serially with its steps (a CPU server whose clients share its cores), instead of beside
    # it. With it the image preprocessing is the client's: resizing and encoding a query's view
    # before each request that sends the whole image.
    client_cpu_on_engine: bool = False
    # With ``client_cpu_on_engine`` and a server per model: the client's CPU work runs on the
    # other server's device when the requesting one is busy and the other idle (the OS puts the
    # client's thread on a free core), and on the requesting server's when both are busy.
    client_cpu_free_core: bool = False
    front_batch: int = 16  # the funnel's batch_size
    front_wait_s: float = 0.01  # the serve app's max_wait_ms
    max_agent_loops: int = 32  # the funnel's max_agent_loops
    # the funnel's early_agent (funnel_pipeline only): a front batch opened while at most this
    # many queries are in the system (and fewer than EARLY_AGENT_MAX_SHARE of those settled
    # were answered early) starts its agent loops at once; the loops of the queries the front
    # answers leave after their step in flight. 0: never.
    early_agent: int = FunnelConfig.early_agent

    # The agent's shape. "deepeyes": turns of 100-300 tokens with tool calls (the fields above).
    # "search": the search agent (speceyes.agents.search): ``search_depth`` rounds, each scoring
    # ``search_grid`` x ``search_grid`` crops with one request per cell (a fresh conversation:
    # the crop, ``crop_tokens`` image tokens, and a short question; one decoded token), the
    # rounds one after another with ``tool_s`` of CPU (cropping) before each, then one answer
    # request on the final crop.
    agent_workload: str = "deepeyes"
    search_depth: int = 3
    search_grid: int = 3
    search_cell_text_tokens: int = 40  # uncached text of a cell-scoring request
    search_cell_decode_tokens: int = 1
    search_answer_text_tokens: int = 60  # uncached text of the answer on the final crop
    search_answer_decode_tokens: int = 2  # a one-token answer and its end-of-sequence token

    def validate(self) -> None:
        p = np.asarray(self.tool_call_probs, dtype=np.float64)
        if p.ndim != 1 or p.size == 0 or (p < 0).any() or abs(p.sum() - 1.0) > 1e-6:
            raise ValueError(f"tool_call_probs must be probabilities summing to 1, got {p}")
        if min(self.large_decode_s, self.small_decode_s) <= 0:
            raise ValueError("decode step times must be positive")
        costs = (
            self.large_prefill_s_per_token, self.small_prefill_s_per_token, self.tool_s,
            self.image_preprocess_s, self.app_intake_s, self.large_request_s,
            self.small_request_s,
            self.large_request_latency_s, self.small_request_latency_s,
            self.large_vit_s_per_token, self.small_vit_s_per_token,
            self.large_kv_read_s_per_token, self.small_kv_read_s_per_token,
        )
        if min(costs) < 0:
            raise ValueError("prefill, KV-read and tool costs must be non-negative")
        if min(self.large_max_batch, self.small_max_batch, self.prefill_budget_tokens) < 1:
            raise ValueError("max batch and prefill budget must be >= 1")
        if min(self.judge_decode_tokens, self.small_decode_tokens, self.turn_tokens_min) < 1:
            raise ValueError("every model call decodes at least one token")
        if self.agent_workload not in AGENT_WORKLOADS:
            raise ValueError(
                f"agent_workload must be one of {', '.join(AGENT_WORKLOADS)}, "
                f"got {self.agent_workload!r}"
            )
        if self.agent_workload == "search" and (
            self.search_depth < 0 or self.search_grid < 1
            or min(self.search_cell_decode_tokens, self.search_answer_decode_tokens) < 1
            or min(self.search_cell_text_tokens, self.search_answer_text_tokens) < 0
        ):
            raise ValueError("search workload: need depth >= 0, grid >= 1, token counts >= 0 "
                             "and at least one decoded token per request")
        if self.funnel_pipeline and self.agent_workload != "search":
            raise ValueError("funnel_pipeline models the search agent's driver only")
        if self.client_cpu_free_core and not self.client_cpu_on_engine:
            raise ValueError("client_cpu_free_core places the client's CPU work among the "
                             "servers' devices: it needs client_cpu_on_engine")
        if self.early_agent < 0:
            raise ValueError("early_agent must be >= 0")
        if min(self.front_batch, self.max_agent_loops) < 1 or self.front_wait_s < 0:
            raise ValueError("front_batch and max_agent_loops must be >= 1, front_wait_s >= 0")
        if self.cache_block_tokens < 1:
            raise ValueError("cache_block_tokens must be >= 1")
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

    def request_s(self, cls: int) -> float:
        """Fixed seconds per request that do not batch (paid in the step it joins)."""
        return self.large_request_s if cls == LARGE else self.small_request_s

    def request_latency_s(self, cls: int) -> float:
        """Fixed seconds per request spent beside the engine before it joins."""
        return self.large_request_latency_s if cls == LARGE else self.small_request_latency_s

    def warm_prefill_s(self, cls: int, tokens: int) -> float | None:
        """The prefill of a request of ``tokens`` prefill tokens under ``warm_cache`` (its
        last partial block only); None without it."""
        if not (self.warm_cache and self.prefix_caching):
            return None
        return self.prefill_s(cls, int(tokens) % self.cache_block_tokens or 1)

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
        fixed = self.request_s(cls) + self.request_latency_s(cls)
        warm = self.warm_prefill_s(cls, ctx - n_decode)  # ctx: the prompt and what it decodes
        if warm is not None:
            prefill_s = warm
        return fixed + prefill_s + n_decode * (self.step_table(cls)[1] + ctx * self.kv_read(cls))

    # --- the search agent's requests -------------------------------------------------------------
    @property
    def search_cells(self) -> int:
        """Cell-scoring requests per search round."""
        return self.search_grid * self.search_grid

    @property
    def search_requests(self) -> int:
        """Large-model requests per search loop: every round's cells, then the answer."""
        return self.search_depth * self.search_cells + 1

    def search_cell_request(self) -> tuple[int, float, int, int]:
        """(prefill tokens, prefill seconds, decoded tokens, KV context) of one cell score."""
        t, img, n = self.search_cell_text_tokens, self.crop_tokens, self.search_cell_decode_tokens
        return t + img, self.prefill_s(LARGE, t, img), n, t + img + n

    def search_answer_request(self) -> tuple[int, float, int, int]:
        """The answer on the final crop (the whole image when there are no rounds)."""
        img = self.crop_tokens if self.search_depth else self.image_tokens
        t, n = self.search_answer_text_tokens, self.search_answer_decode_tokens
        return t + img, self.prefill_s(LARGE, t, img), n, t + img + n

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
        """Mean batch-1 agent seconds split as (prefill, decode steps, KV reads, tool CPU).
        Per-request fixed costs count as prefill (serial on the engine) and as tool time (off
        the engine); the search workload's cells of a round run together, so a round costs
        one cell's time at batch 1 plus its cells' serial parts."""
        if self.agent_workload == "search":
            return self._search_parts()
        m = 0.5 * (self.turn_tokens_min + self.turn_tokens_max)
        a, tt = self.agent_prefill_tokens, self.tool_turn_prefill_tokens
        pre = dec = kv = tool = 0.0
        dec1, r = self.step_table(LARGE)[1], self.kv_read(LARGE)
        first = self.prefill_s(LARGE, self.agent_text_tokens, self.image_tokens)
        for k_calls, p in enumerate(self.tool_call_probs):
            ctx = float(a)
            for k in range(k_calls + 1):  # turn k: its prefill, then m decode steps
                if k == 0:
                    pre_k, tokens_k = first, a
                else:
                    pre_k = tool_turn_prefill_s(self, ctx, k)
                    tokens_k = tt if self.prefix_caching else int(ctx) + tt
                    ctx += tt
                ctx += m
                warm = self.warm_prefill_s(LARGE, tokens_k)
                pre += p * (pre_k if warm is None else warm)
                dec += p * m * dec1
                kv += p * m * ctx * r
            tool += p * k_calls * self.tool_s
        turns = 1.0 + self.mean_tool_calls()
        pre += turns * self.large_request_s
        tool += turns * self.large_request_latency_s
        return pre, dec, kv, tool

    def _search_parts(self) -> tuple[float, float, float, float]:
        dec1, r = self.step_table(LARGE)[1], self.kv_read(LARGE)
        _, cell_pre, cell_n, cell_ctx = self.search_cell_request()
        _, ans_pre, ans_n, ans_ctx = self.search_answer_request()
        d, g = self.search_depth, self.search_cells
        cell_warm = self.warm_prefill_s(LARGE, self.search_cell_request()[0])
        if cell_warm is not None:
            cell_pre = cell_warm
            ans_pre = self.warm_prefill_s(LARGE, self.search_answer_request()[0]) or 0.0
        pre = d * g * (cell_pre + self.large_request_s) + ans_pre + self.large_request_s
        dec = (d * cell_n + ans_n) * dec1
        kv = (d * cell_n * cell_ctx + ans_n * ans_ctx) * r
        tool = d * self.tool_s + (d + 1) * self.large_request_latency_s
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
    def from_file(cls, path: str | Path, base: CostModel | None = None) -> CostModel:
        """A JSON file of cost fields (and an optional ``measured`` block, see :meth:`from_dict`)
        over ``base``'s fields (default: the built-in model), e.g. over a benchmark's token
        counts from :func:`bench_costs`."""
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object of cost fields")
        kept = {k: v for k, v in asdict(base or cls()).items() if k not in data}
        return cls.from_dict({**kept, **data})

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
            # the per-request fixed costs are kept as given, outside the scaled parts
            bare = replace(c, large_request_s=0.0, large_request_latency_s=0.0)
            a_pre, a_dec, a_kv, a_tool = bare._agent_parts()
            a_tool += c.agent_s() - bare.agent_s()
            judge_kv += c.request_s(LARGE) + c.request_latency_s(LARGE)
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


def tool_turn_prefill_s(costs: CostModel, ctx: int, k: int) -> float:
    """Prefill of tool turn ``k`` (1-based) after ``ctx`` tokens of history."""
    if costs.prefix_caching:
        return costs.prefill_s(LARGE, costs.tool_text_tokens, costs.crop_tokens)
    img = costs.image_tokens + k * costs.crop_tokens
    return costs.prefill_s(LARGE, ctx + costs.tool_turn_prefill_tokens - img, img)


# --- batch-1 analytics -----------------------------------------------------------------------


def ideal_gain(skipped: float) -> float:
    """Throughput over agent-only if a share ``skipped`` of the queries never reached the agent
    and the rest cost nothing more: 1 / (1 - skipped)."""
    return 1.0 / (1.0 - skipped) if skipped < 1 else math.inf


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
    gain = ideal_gain(beta * alpha)
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
                     # the search agent's own requests score crops: none repeats the prefix
                     "saves_agent_s": saved if c.prefix_caching and c.agent_workload == "deepeyes"
                     else 0.0}
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
