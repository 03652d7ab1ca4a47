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

The ideal is ``throughput(agent-only, C) / (1 - beta*alpha)`` (without a judge the share that
skips the agent is ``beta*alpha + (1 - beta)*alpha_tool``); the analytic batch-1 latency is
``E[L] = c_J + beta*c_S + (1 - beta*alpha)*L_agent`` (DESIGN.md section 1).
"""

from speceyes.simulate.costs import (
    BENCH_IMAGES,
    LARGE,
    SMALL,
    Analytic,
    BenchImages,
    CostModel,
    analytic,
    bench_costs,
    image_tokens,
    judge_costs,
)
from speceyes.simulate.report import (
    CSV_FILE,
    MD_FILE,
    PNG_FILE,
    format_table,
    plot,
    write_outputs,
)
from speceyes.simulate.runs import (
    DEFAULT_ALPHA,
    DEFAULT_ALPHA_TOOL,
    DEFAULT_BETA,
    DEFAULT_CONCURRENCIES,
    IDEAL,
    JUDGES,
    SCHEDULES,
    Draws,
    Row,
    RunResult,
    agent_latency_b1,
    draw,
    simulate,
    simulate_one,
)

__all__ = [
    "BENCH_IMAGES",
    "CSV_FILE",
    "DEFAULT_ALPHA",
    "DEFAULT_ALPHA_TOOL",
    "DEFAULT_BETA",
    "DEFAULT_CONCURRENCIES",
    "IDEAL",
    "JUDGES",
    "LARGE",
    "MD_FILE",
    "PNG_FILE",
    "SCHEDULES",
    "SMALL",
    "Analytic",
    "BenchImages",
    "CostModel",
    "Draws",
    "Row",
    "RunResult",
    "agent_latency_b1",
    "analytic",
    "bench_costs",
    "draw",
    "format_table",
    "image_tokens",
    "judge_costs",
    "plot",
    "simulate",
    "simulate_one",
    "write_outputs",
]
