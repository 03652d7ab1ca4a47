"""Build backends, agents and the funnel from one settings object.

The CLI (``ask``, ``eval``, ``serve``) fills :class:`Settings` from its flags and the mini-world
demo from its models manifest; both build through here, so a model spec, an agent kind or a
search setting means the same in either. Search settings use the search agent's own keyword
names, in ``--search K=V,...`` and in the manifest's ``agent`` object alike.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from speceyes.funnel import FunnelConfig

if TYPE_CHECKING:
    from speceyes.agents.base import Agent
    from speceyes.backends.base import Backend
    from speceyes.funnel import Funnel

AGENTS: tuple[str, ...] = ("deepeyes", "thyme", "search")


def flag(text: str) -> bool:
    """1/0, true/false, yes/no, on/off -> bool; anything else is a ValueError."""
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


# The search agent's settings (SearchAgent keyword arguments) and how to read each from text.
SEARCH_KEYS: dict[str, Callable[[str], Any]] = {
    "depth": int,
    "grid": int,
    "overlap": float,
    "min_region": int,
    "answer_prompt": str,
    "stay": flag,
    "beam": int,
    "fill_view": flag,
    "min_box": int,
}
_OLD_SEARCH_KEYS = {"answer": "answer_prompt"}  # the names --search used before


def parse_search(text: str) -> dict[str, Any]:
    """``depth=3,grid=3,answer_prompt=small,stay=1`` -> SearchAgent keyword arguments."""
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, val = part.partition("=")
        if sep and key in _OLD_SEARCH_KEYS:
            new = _OLD_SEARCH_KEYS[key]
            warnings.warn(
                f"--search: {key!r} is now {new!r} (the name the demo manifest uses); "
                f"the old name will go",
                FutureWarning,
                stacklevel=2,
            )
            key = new
        if not sep or key not in SEARCH_KEYS:
            raise ValueError(
                f"--search: expected K=V with K in {', '.join(SEARCH_KEYS)}, got {part!r}"
            )
        read = SEARCH_KEYS[key]
        try:
            out[key] = read(val)
        except ValueError:
            what = "1 or 0" if read is flag else f"a {getattr(read, '__name__', 'value')}"
            raise ValueError(f"--search: {key} needs {what}, got {val!r}") from None
    return out


@dataclass
class BackendSettings:
    """How to run a model given as a folder or hub id, and what servers behind URLs allow."""

    engine: str = "hf"  # "hf" (transformers in-process) or "vllm" (offline engine)
    dtype: str = "auto"
    device_map: str | None = None
    attn: str | None = None  # attention implementation, e.g. "sdpa"
    tensor_parallel_size: int = 1  # vLLM only
    max_logprobs: int = 20  # top_logprobs cap of the servers behind URLs
    # Image limits of the models behind URLs (a folder states its own); None: the family's.
    min_pixels: int | None = None
    max_pixels: int | None = None


@dataclass
class AgentSettings:
    """The large model's agent loop. ``None`` budgets take the protocol's defaults."""

    kind: str = "deepeyes"  # see AGENTS
    max_tool_calls: int | None = None
    max_new_tokens: int | None = None
    search: dict[str, Any] = field(default_factory=dict)  # search only: see SEARCH_KEYS


@dataclass
class Settings:
    """Everything a funnel is built from. ``small``/``large`` are folders, hub ids or
    OpenAI-compatible URLs (comma-separated for replicas); families name the model behind a URL."""

    small: str | None = None
    large: str | None = None
    small_family: str = "qwen3_vl"
    large_family: str = "qwen2_5_vl"
    backend: BackendSettings = field(default_factory=BackendSettings)
    agent: AgentSettings = field(default_factory=AgentSettings)
    funnel: FunnelConfig = field(default_factory=FunnelConfig)


def make_backend(
    spec: str, family: str = "qwen2_5_vl", settings: BackendSettings | None = None
) -> Backend:
    """A backend for a model given as a folder, a hub id, or OpenAI-compatible server URL(s);
    ``family`` names the model behind a URL (a folder's own config says it)."""
    b = settings or BackendSettings()
    if spec.startswith(("http://", "https://")):
        from speceyes.backends.openai import OpenAIBackend

        return OpenAIBackend(
            [u.strip() for u in spec.split(",") if u.strip()],
            family=family,
            max_logprobs=b.max_logprobs,
            min_pixels=b.min_pixels,
            max_pixels=b.max_pixels,
        )
    if b.engine == "vllm":
        from speceyes.backends.vllm import VLLMBackend

        return VLLMBackend(spec, dtype=b.dtype, tensor_parallel_size=b.tensor_parallel_size)
    from speceyes.backends.hf import HFBackend

    return HFBackend(spec, dtype=b.dtype, device_map=b.device_map, attn_implementation=b.attn)


def make_agent(
    settings: AgentSettings,
    large: Backend,
    small: Backend | None = None,
    *,
    mode: str = "speceyes",
    protocol: str = "fair",
) -> Agent:
    """The agent loop on ``large``; ``mode="specreason"`` drafts each step on ``small``."""
    a = settings
    loop_kw: dict[str, Any] = {
        "max_tool_calls": a.max_tool_calls,
        "max_new_tokens": a.max_new_tokens,
        "protocol": protocol,
    }
    if mode == "specreason":
        from speceyes.agents.specreason import SpecReasonAgent

        if a.kind != "deepeyes":
            raise ValueError("--mode specreason runs the DeepEyes loop; use --agent deepeyes")
        if small is None:
            raise ValueError("--mode specreason needs the small model")
        return SpecReasonAgent(small, large, **loop_kw)
    if a.kind == "thyme":
        from speceyes.agents.code import CodeAgent

        return CodeAgent(large, **loop_kw)
    if a.kind == "search":
        from speceyes.agents.search import SearchAgent

        unknown = set(a.search) - set(SEARCH_KEYS)
        if unknown:
            raise ValueError(f"unknown search settings {sorted(unknown)}; use {list(SEARCH_KEYS)}")
        kw = dict(a.search)
        if a.max_new_tokens is not None:
            kw["max_new_tokens"] = a.max_new_tokens
        return SearchAgent(large, **kw)
    if a.kind != "deepeyes":
        raise ValueError(f"unknown agent {a.kind!r}; choose from {', '.join(AGENTS)}")
    from speceyes.agents.zoom import ZoomAgent

    return ZoomAgent(large, **loop_kw)


def load_backends(settings: Settings) -> tuple[Backend | None, Backend | None]:
    """(small, large) as the funnel's mode needs them; one model named twice loads once."""
    s, mode = settings, settings.funnel.mode
    small = None
    if mode != "agent":
        if s.small is None:
            raise ValueError(f"mode {mode!r} needs the small model")
        small = make_backend(s.small, s.small_family, s.backend)
    large = None
    if mode != "small":
        if s.large is None:
            raise ValueError(f"mode {mode!r} needs the large model")
        same = s.large == s.small and small is not None
        large = small if same else make_backend(s.large, s.large_family, s.backend)
    return small, large


def assemble_funnel(
    config: FunnelConfig,
    small: Backend | None,
    large: Backend | None,
    agent: AgentSettings | Agent | None,
) -> Funnel:
    """The funnel over loaded backends, given only what ``config.mode`` uses; ``agent`` is
    built here from its settings, or given ready (one agent shared by several funnels)."""
    from speceyes.funnel import Funnel

    mode = config.mode
    small = small if mode != "agent" else None
    large = large if mode != "small" else None
    cap = None if small is None else small.max_logprobs
    if cap is not None and config.top_k > cap:
        raise ValueError(
            f"--top-k {config.top_k} exceeds the {cap} logprobs the small model's server returns; "
            f"pass --top-k {cap}, or start the server with a higher cap (vLLM: --max-logprobs "
            f"{config.top_k}) and pass --max-logprobs {config.top_k}"
        )
    if large is None:
        agent = None
    elif isinstance(agent, AgentSettings):
        agent = make_agent(agent, large, small, mode=mode, protocol=config.protocol)
    return Funnel(small, large, agent, config)


def build_funnel(settings: Settings) -> Funnel:
    """Load the models ``settings`` names and build the funnel over them."""
    small, large = load_backends(settings)
    return assemble_funnel(settings.funnel, small, large, settings.agent)
