"""The model and funnel flags ``ask``, ``eval`` and ``serve`` share.

Every default shown in a help text is read from the type that owns it (``factory.Settings``,
``BackendSettings``, ``AgentSettings``, ``FunnelConfig``, the agent classes and
``protocols.loop_settings``); ``factory.Settings.from_args`` reads the flags back.
"""

from __future__ import annotations

import argparse

from speceyes import cascade, gate, protocols
from speceyes.agents import registry
from speceyes.backends.base import DECODING_POLICIES
from speceyes.backends.registry import ENGINES, VLLM_SHARED_MEMORY
from speceyes.factory import AgentSettings, BackendSettings, Settings
from speceyes.funnel import JUDGES, MODES, PLANS, SCHEDULES, FunnelConfig
from speceyes.operating_points import AUTO, PointChooser
from speceyes.types import DIRECT_PROMPTS, LARGE_DIRECT_STAGE, small_stage

_SEARCH = registry.AGENTS["search"]


def _per_protocol(read) -> str:
    """``fair 8; published: 6 deepeyes, 6 thyme`` for a loop setting ``read(LoopSettings)``."""
    fair = read(protocols.FAIR.loop_settings())
    published = ", ".join(
        f"{read(protocols.PUBLISHED.loop_settings(a))} {a}" for a in protocols.PUBLISHED_AGENTS
    )
    return f"fair {fair}; published: {published}"


def add_model_args(p: argparse.ArgumentParser, *, required: bool = True) -> None:
    b = BackendSettings
    g = p.add_argument_group("models")
    g.add_argument(
        "--small",
        required=required,
        help="small tool-free VLM: folder, hub id, or OpenAI-compatible URL(s) "
        "(http://host:8000/v1, comma-separated for replicas)",
    )
    g.add_argument(
        "--large", required=required, help="agentic VLM (DeepEyes): folder, hub id, or URL(s)"
    )
    g.add_argument(
        "--engine",
        default=b.engine,
        choices=list(ENGINES),
        help="runtime for folders/hub ids: hf (transformers in-process) or vllm (vLLM "
        f"offline) (default: {b.engine})",
    )
    g.add_argument(
        "--dtype", default=b.dtype, help=f"torch dtype for both models (default: {b.dtype})"
    )
    g.add_argument(
        "--device-map", default=b.device_map, help='e.g. "auto" or "cuda:0" (default: CPU)'
    )
    g.add_argument("--attn", default=b.attn, help="attention implementation, e.g. sdpa")
    g.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=b.tensor_parallel_size,
        help=f"vLLM engine only (default: {b.tensor_parallel_size})",
    )
    g.add_argument(
        "--small-family",
        default=Settings.small_family,
        help=f"model family behind a --small URL (default: {Settings.small_family})",
    )
    g.add_argument(
        "--large-family",
        default=Settings.large_family,
        help=f"model family behind a --large URL (default: {Settings.large_family})",
    )
    g.add_argument(
        "--max-logprobs",
        type=int,
        default=b.max_logprobs,
        help="top_logprobs cap of the servers behind URLs (vLLM: --max-logprobs) "
        f"(default: {b.max_logprobs})",
    )
    for role in ("small", "large"):
        g.add_argument(
            f"--{role}-model",
            default=None,
            metavar="ID",
            help=f"model id behind the --{role} URL, for a server or gateway that serves "
            f"several (the same as --{role} URL#model=ID) (default: the one /v1/models lists)",
        )
    g.add_argument(
        "--session-header",
        default=b.session_header,
        metavar="NAME",
        help="HTTP header (e.g. X-Session-Id) sent with every call to a URL, its value one "
        "query's key (a digest of its image), for gateways that route by session "
        "(default: none)",
    )
    g.add_argument(
        "--server-max-model-len",
        type=int,
        default=b.server_max_model_len,
        metavar="N",
        help="context length of the servers behind URLs; an agent turn that would pass it "
        "ends its loop (\"context budget\") (default: what /v1/models reports, vLLM and "
        "SGLang do; else no budget)",
    )
    for role in ("small", "large"):
        for bound, edge in (("min", "shortest_edge"), ("max", "longest_edge")):
            g.add_argument(
                f"--{role}-{bound}-pixels",
                type=int,
                default=None,
                help=f"{bound} pixels of the {role} model's view (default: its checkpoint's "
                f"preprocessor_config.json {edge}; behind a URL, the family's release's)",
            )
    g.add_argument(
        "--decoding",
        default=b.decoding,
        choices=DECODING_POLICIES,
        help="greedy decoding of every backend: checkpoint (with its generation_config's "
        "repetition_penalty, as transformers' generate and a vLLM server apply it) or "
        f"greedy-plain (no penalty) (default: {b.decoding})",
    )
    v = p.add_argument_group("vLLM engines (--engine vllm)")
    for role in ("small", "large"):
        v.add_argument(
            f"--{role}-vllm-memory",
            type=float,
            default=None,
            metavar="SHARE",
            help=f"share of the GPU's memory (on CPU: of RAM) for the {role} model's engine "
            f"(default: vLLM's; {VLLM_SHARED_MEMORY / 2:g} each when both models run here)",
        )
    v.add_argument(
        "--vllm-kv-cache-gib",
        type=float,
        default=None,
        metavar="GIB",
        help="KV cache per engine in GiB, in place of the memory share (on CPU the same as "
        "VLLM_CPU_KVCACHE_SPACE) (default: what the share leaves)",
    )
    v.add_argument(
        "--vllm-max-model-len",
        type=int,
        default=b.vllm_max_model_len,
        metavar="TOKENS",
        help="longest prompt plus answer an engine takes (default: the model's own)",
    )
    v.add_argument(
        "--vllm-eager",
        action="store_true",
        help="no CUDA graphs or torch.compile: starts faster, decodes slower",
    )


def add_funnel_args(p: argparse.ArgumentParser, *, schedule: str | None = None) -> None:
    """The funnel flags; ``schedule`` is the command's own default (None: the protocol's)."""
    f = FunnelConfig
    by_protocol = "; ".join(f"{p.name} {p.schedule}" for p in protocols.PROTOCOLS.values())
    schedule_shown = schedule or f"the protocol's: {by_protocol}"
    g = p.add_argument_group("funnel")
    g.add_argument(
        "--mode",
        default=f.mode,
        choices=MODES,
        help="speceyes, agent only, small only, both (log everything), or the SpecReason "
        f"baseline (small model proposes each agent step, large model scores it) (default: {f.mode})",
    )
    g.add_argument(
        "--agent",
        default=AgentSettings.kind,
        choices=registry.choices(),
        help="agent loop of the large model: deepeyes (zoom tool calls), thyme (Python code run "
        "in a process sandbox), or search (training-free zoom search scored by the model's own "
        f"P(yes) per region) (default: {AgentSettings.kind})",
    )
    g.add_argument(
        "--agent-options",
        default="",
        metavar="K=V,...",
        help="settings of the chosen agent; deepeyes: "
        f"{registry.settings_help(registry.agent_class('deepeyes'))}; search: as --search",
    )
    g.add_argument(
        "--search",
        default="",
        metavar="K=V,...",
        help=f"--agent search settings: {registry.settings_help(_SEARCH)}",
    )
    taus = ", ".join(f"{n} {registry.AGENTS[n].default_tau}" for n in registry.choices())
    g.add_argument(
        "--tau",
        type=float,
        default=None,
        help="gate threshold (default: published, on V*, HR-Bench or POPE: Table 1's per "
        f"backbone and benchmark; else the agent's own: {taus})",
    )
    g.add_argument(
        "--top-k", type=int, default=f.top_k, help=f"K for separability (default: {f.top_k})"
    )
    g.add_argument(
        "--agg",
        default=f.agg,
        choices=list(gate.AGGREGATIONS),
        help=f"aggregation (default: {f.agg})",
    )
    g.add_argument(
        "--judge-mode",
        default=f.judge_mode,
        choices=["logit", "decode"],
        help="logit: one forward step, P(yes) vs P(no); decode: published 10-token rule "
        f"(default: {f.judge_mode})",
    )
    g.add_argument(
        "--judge",
        default=None,
        choices=(*JUDGES, AUTO),
        help="phase I: large (published: the large model's judge prompt), prefix (the large "
        "model, the judge question after the agent's own first-turn prompt, so a server with "
        "prefix caching reuses that prefill for the agent), small (the small model's judge), "
        "small-prefix (the small model, after its own answer prompt), none (no judge: the "
        "gate alone decides), auto (per batch, the operating point of --points whose queries "
        f"have spent least time in the funnel at the load then); see docs/throughput.md (default: "
        f"{f.judge}; {AUTO} when --points is given)",
    )
    g.add_argument(
        "--points", default=None, metavar="JSON",
        help="--judge auto: its operating points, each a judge variant with its own tau and "
        "rates, as `speceyes calibrate --operating-points` writes them (its gate and judge "
        "mode are applied, other models refused), or a list of {judge, tau, beta, alpha, "
        "alpha_tool, judge_max_pixels}",
    )
    g.add_argument(
        "--auto-hold", type=float, default=None, metavar="M",
        help="--judge auto: at a load new to it, the points whose first trials came within this "
        f"share of the quickest take turns in up to {PointChooser.CONTEST_TRIALS} trials each "
        "until told apart, and the quickest is held; later, the point chosen last stays until "
        f"another's measured time is this share less (default: {f.auto_hold}; 0: the least "
        f"time, always; with one query in flight at most {PointChooser.SERIAL_HOLD_MARGIN}, "
        "since no queue mixes points there); halved for each trial in a row at whose end the "
        f"other point was the quickest, down to {PointChooser.SERIAL_HOLD_MARGIN}",
    )
    g.add_argument(
        "--judge-max-pixels",
        type=int,
        default=f.judge_max_pixels,
        help="judge view budget: the large or small judge sees the image at most this many "
        "pixels (e.g. 200704 = 256 visual tokens of Qwen2.5-VL) (default: the full image)",
    )
    g.add_argument(
        "--protocol",
        default=f.protocol,
        choices=protocols.PROTOCOLS,
        help="fair: our prompts and rules; published: the released SpecEyes code's question "
        "blocks, prompts, judge rule, view cap, loop rules and batch size "
        f"{protocols.PUBLISHED_BATCH_SIZE} (see README 'What is exact') (default: {f.protocol})",
    )
    g.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="queries per phase I-III batch (default: the protocol's: "
        f"{_per_protocol(lambda s: s.batch_size)})",
    )
    g.add_argument(
        "--schedule",
        default=schedule,
        choices=SCHEDULES,
        help="batched: each batch runs phases I-IV before the next; pipelined: phases I-III of "
        "later batches run while agent loops continue, and agent loops join one continuous "
        "batch (results in completion order); serial: batched, but one agent loop at a time "
        f"(default: {schedule_shown})",
    )
    g.add_argument(
        "--overlap", action="store_true", help="run phase II beside phase I (separate devices)"
    )
    g.add_argument(
        "--max-agent-loops",
        type=int,
        default=f.max_agent_loops,
        help=f"agent loops in flight (default: {f.max_agent_loops})",
    )
    g.add_argument(
        "--early-agent",
        type=int,
        default=f.early_agent,
        metavar="N",
        help="pipelined schedule: start a batch's agent loops beside the judge, the small "
        "model and the gate while at most N queries are in the system and fewer than half of "
        "the queries are answered early, and drop those the gate answers; a query that needs "
        "the agent then does not wait for them first. Answers are unchanged; only the large "
        f"model's idle time is spent (0: never; default: {f.early_agent}, a query alone in an "
        "idle server)",
    )
    g.add_argument(
        "--max-tool-calls",
        type=int,
        default=None,
        help="agent tool-call budget (default: the protocol's: "
        f"{_per_protocol(lambda s: s.max_tool_calls)})",
    )
    g.add_argument(
        "--agent-max-tokens",
        type=int,
        default=None,
        help="new tokens per agent turn (default: the protocol's: "
        f"{_per_protocol(lambda s: s.agent_max_tokens)})",
    )
    g.add_argument("--calibration", default=None, help="tau file written by speceyes calibrate")
    add_cascade_args(p)


def add_cascade_args(p: argparse.ArgumentParser) -> None:
    """The cascade's flags (docs/cascade.md); their defaults are the paper's funnel."""
    f = FunnelConfig
    gated = ", ".join(m for m, plan in PLANS.items() if plan.gate == "accept")
    g = p.add_argument_group("cascade (modes " + gated + "; docs/cascade.md)")
    g.add_argument(
        "--speculate-depth",
        type=int,
        default=f.speculate_depth,
        metavar="N",
        help=f"stages {small_stage(1)}..{small_stage(2)}..: the small model runs its own tool "
        "loop for up to N calls and answers after each, gated at each depth; the first answer "
        f"that passes is accepted (default: {f.speculate_depth}, the paper's "
        f"{small_stage(0)} only)",
    )
    g.add_argument(
        "--middle-tier",
        action="store_true",
        help=f"stage {LARGE_DIRECT_STAGE}: the large model answers from the full image without "
        "tools, gated, before its agent loop (default: off)",
    )
    g.add_argument(
        "--direct-prompt",
        default=f.direct_prompt,
        choices=DIRECT_PROMPTS,
        help=f"the prompt of --middle-tier: speculative (the small model's answer prompt, on the "
        "large model; its image prefill is added) or agent-prefix (the agent's own first turn, "
        "then a direct question: a prefix-caching server prefills the image once for the prefix "
        "judge, the direct answer and the agent's first turn; for a large model that follows "
        f"instructions after the agent's prompt) (default: {f.direct_prompt})",
    )
    g.add_argument(
        "--small-agent",
        default=f.small_agent,
        choices=cascade.SMALL_AGENTS,
        help="the small model's loop for --speculate-depth: search (scores grid cells with the "
        "small model's P(yes); no tool calls to write) or deepeyes (the zoom-tool loop, for a "
        f"small model that writes tool calls) (default: {cascade.default_small_agent(_SEARCH.name)} "
        f"beside --agent {_SEARCH.name}, else {cascade.default_small_agent(None)}; the large "
        "agent's settings where the kinds match)",
    )
