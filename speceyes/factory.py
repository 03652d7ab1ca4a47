"""One settings type for a funnel, resolved in one place, and the builders that use it.

:class:`Settings` comes from the CLI's flags (:meth:`Settings.from_args`), from a mini-world
models manifest (:meth:`Settings.from_manifest`) or from its own dict (:meth:`Settings.from_dict`,
the inverse of :meth:`Settings.to_dict`). A calibration file is applied by
:meth:`Settings.with_calibration`, which refuses a file made for another setup. Unset values
(``None``) stay unset until :meth:`Settings.resolved` fills them: the protocol's loop budgets,
batch size and schedule, and the gate threshold (the protocol's for the benchmark, else the
agent's own). None of these change their input.

:func:`build_funnel` loads the models a resolved settings object names and builds the funnel;
``ask``, ``eval``, ``serve`` and the demo all build through it, so a model spec, an agent name
or an agent setting means the same everywhere. An agent's settings use its own keyword names
(its ``Settings`` dataclass, :mod:`speceyes.agents.registry`), in ``--search K=V,...`` and in
the manifest's ``agent`` object alike.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speceyes import gate, protocols
from speceyes.agents import registry
from speceyes.agents.zoom import ZoomAgent
from speceyes.backends import registry as engines
from speceyes.funnel import FunnelConfig
from speceyes.operating_points import AUTO

if TYPE_CHECKING:
    import argparse
    import os

    from speceyes.agents.base import Agent
    from speceyes.backends.base import Backend
    from speceyes.bench.calibration_file import Calibration
    from speceyes.funnel import Funnel


@dataclass
class BackendSettings:
    """How to run a model given as a folder or hub id, and what servers behind URLs allow."""

    engine: str = "hf"  # a backends.registry.ENGINES name: "hf" (transformers), "vllm", ...
    dtype: str = "auto"
    device_map: str | None = None  # None: CPU
    attn: str | None = None  # attention implementation, e.g. "sdpa"
    tensor_parallel_size: int = 1  # vLLM only
    # Servers behind URLs (OpenAIBackend); the model id behind a URL is part of its spec
    # (URL#model=ID, which --small-model / --large-model write).
    max_logprobs: int = 20  # top_logprobs cap of the servers behind URLs
    session_header: str | None = None  # HTTP header carrying one query's session key
    server_max_model_len: int | None = None  # context length, when a server does not report it
    # ---- what every backend shows and decodes (folders, hub ids and URLs alike)
    # Pixel limits of each model's view; None: its checkpoint's preprocessor_config.json,
    # else (a URL's model) the family's released limits.
    small_min_pixels: int | None = None
    small_max_pixels: int | None = None
    large_min_pixels: int | None = None
    large_max_pixels: int | None = None
    decoding: str = "checkpoint"  # or "greedy-plain" (backends.base.DECODING_POLICIES)
    # ---- vLLM engines (--engine vllm)
    # Share of the GPU's memory (on CPU: of RAM) per engine; None: vLLM's default for one
    # engine, an even split of backends.registry.VLLM_SHARED_MEMORY when both models run in
    # this process.
    small_vllm_memory: float | None = None
    large_vllm_memory: float | None = None
    vllm_kv_cache_gib: float | None = None  # KV cache per engine; supersedes the share
    vllm_max_model_len: int | None = None  # None: the model's own
    vllm_eager: bool = False  # no CUDA graphs / torch.compile (faster start, slower steps)

    def pixels(self, role: str) -> tuple[int | None, int | None]:
        """(min_pixels, max_pixels) given for ``role`` ("small" or "large")."""
        return getattr(self, f"{role}_min_pixels"), getattr(self, f"{role}_max_pixels")


@dataclass
class AgentSettings:
    """The large model's agent loop: its registered name, its loop budgets (``None``: the
    protocol's, filled by ``Settings.resolved``) and its other settings by its own keyword
    names (see ``registry.AGENTS[kind].Settings``)."""

    kind: str = ZoomAgent.name
    max_tool_calls: int | None = None
    max_new_tokens: int | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def agent_class(self) -> type:
        return registry.agent_class(self.kind)

    def kwargs(self, cls: type | None = None) -> dict[str, Any]:
        """Keyword arguments of ``cls`` (default: this kind's class): the options and the
        budgets it takes that are set."""
        cls = cls or self.agent_class()
        kw = registry.check_options(cls, self.options)
        takes = {f.name for f in fields(cls.Settings)}
        for name in registry.BUDGETS:
            value = getattr(self, name)
            if name in takes and value is not None:
                kw[name] = value
        return kw


# What a models manifest means when it leaves a key out (the demo's world, agent and gate).
MANIFEST_TAU = 0.9
MANIFEST_AGENT: dict[str, Any] = {"kind": "search", "depth": 3, "answer_prompt": "small"}
MANIFEST_FUNNEL_KEYS = {"tau": float, "agg": str, "top_k": int, "batch_size": int}
MANIFEST = "manifest.json"  # the manifest's name in a models folder
MANIFEST_DTYPE = "float32"  # the mini-world models run in float32 (bundled as bfloat16)


@dataclass
class Settings:
    """Everything a funnel is built from. ``small``/``large`` are folders, hub ids or
    OpenAI-compatible URLs (comma-separated for replicas); families name the model behind a
    URL. ``extra`` carries a manifest's keys that are not funnel settings (its world and
    training metadata). ``bench`` is the benchmark's registry name where one is run (``eval``):
    the published protocol's tau depends on it."""

    small: str | None = None
    large: str | None = None
    small_family: str = "qwen3_vl"
    large_family: str = "qwen2_5_vl"
    backend: BackendSettings = field(default_factory=BackendSettings)
    agent: AgentSettings = field(default_factory=AgentSettings)
    funnel: FunnelConfig = field(default_factory=FunnelConfig)
    extra: dict[str, Any] = field(default_factory=dict)
    bench: str | None = None

    # ---- sources --------------------------------------------------------------------------
    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> Settings:
        """The settings the model, funnel and agent flags give (a flag a command lacks takes
        the default); ``--calibration FILE`` is applied. The namespace is only read."""

        def arg(name: str, default: Any = None) -> Any:
            value = getattr(ns, name, None)
            return default if value is None else value

        kind = arg("agent", AgentSettings.kind)
        agent_cls = registry.agent_class(kind)
        options = registry.parse_options(agent_cls, arg("agent_options", ""), "--agent-options")
        if agent_cls.name == "search":  # --search is read only for the search agent
            options.update(registry.parse_options(agent_cls, arg("search", ""), "--search"))
        f = FunnelConfig
        funnel = FunnelConfig(
            mode=arg("mode", f.mode),
            tau=arg("tau"),
            top_k=arg("top_k", f.top_k),
            agg=arg("agg", f.agg),
            judge_mode=arg("judge_mode", f.judge_mode),
            # a points file is for --judge auto, so it is the default where one is given
            judge=arg("judge", AUTO if arg("points") else f.judge),
            judge_max_pixels=arg("judge_max_pixels"),
            batch_size=arg("batch_size"),
            schedule=arg("schedule"),  # None: the protocol's
            overlap=bool(arg("overlap", f.overlap)),
            max_agent_loops=arg("max_agent_loops", f.max_agent_loops),
            early_agent=arg("early_agent", f.early_agent),
            protocol=arg("protocol", f.protocol),
            speculate_depth=arg("speculate_depth", f.speculate_depth),
            middle_tier=bool(arg("middle_tier", f.middle_tier)),
            direct_prompt=arg("direct_prompt", f.direct_prompt),
            small_agent=arg("small_agent"),
            auto_hold=arg("auto_hold", f.auto_hold),
        )
        b = BackendSettings
        settings = cls(
            small=_with_model(arg("small"), arg("small_model")),
            large=_with_model(arg("large"), arg("large_model")),
            small_family=arg("small_family", cls.small_family),
            large_family=arg("large_family", cls.large_family),
            backend=BackendSettings(
                engine=arg("engine", b.engine),
                dtype=arg("dtype", b.dtype),
                device_map=arg("device_map"),
                attn=arg("attn"),
                tensor_parallel_size=arg("tensor_parallel_size", b.tensor_parallel_size),
                max_logprobs=arg("max_logprobs", b.max_logprobs),
                session_header=arg("session_header"),
                server_max_model_len=arg("server_max_model_len"),
                small_min_pixels=arg("small_min_pixels"),
                small_max_pixels=arg("small_max_pixels"),
                large_min_pixels=arg("large_min_pixels"),
                large_max_pixels=arg("large_max_pixels"),
                decoding=arg("decoding", b.decoding),
                small_vllm_memory=arg("small_vllm_memory"),
                large_vllm_memory=arg("large_vllm_memory"),
                vllm_kv_cache_gib=arg("vllm_kv_cache_gib"),
                vllm_max_model_len=arg("vllm_max_model_len"),
                vllm_eager=bool(arg("vllm_eager", b.vllm_eager)),
            ),
            agent=AgentSettings(
                kind=kind,
                max_tool_calls=arg("max_tool_calls"),
                max_new_tokens=arg("agent_max_tokens"),
                options=options,
            ),
            funnel=funnel,
        )
        if arg("points"):
            settings = settings.with_points_file(arg("points"))
        calibration = arg("calibration")
        return settings if calibration is None else settings.with_calibration(calibration)

    @classmethod
    def from_manifest(cls, path: str | os.PathLike[str]) -> Settings:
        """The mini-world demo's settings from ``MODELS/manifest.json`` (a missing file or key
        takes the manifest's default); the models are ``small/`` and ``large/`` beside it, in
        float32. Keys that are not funnel settings (``canvas``, ``level``, ``test``, training
        metadata) are kept in ``extra``."""
        path = Path(path)
        raw: dict[str, Any] = {}
        if path.is_file():
            try:
                raw = json.loads(path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not valid JSON ({e.msg})") from e
            if not isinstance(raw, dict):
                raise ValueError(f"{path}: expected a JSON object")
        given = raw.get("agent")
        if given is not None and not isinstance(given, dict):
            raise ValueError(f"{path}: agent: expected an object")
        agent_raw = {**MANIFEST_AGENT, **(given or {})}
        kind = agent_raw.pop("kind")
        if registry.ALIASES.get(kind, kind) not in registry.choices():
            raise ValueError(
                f"{path}: agent.kind must be one of {', '.join(registry.choices())}, got {kind!r}"
            )
        agent_cls = registry.agent_class(kind)
        budgets = {k: agent_raw.pop(k, None) for k in registry.BUDGETS}
        if budgets["max_new_tokens"] is None:  # the agent's own answer budget, if it has one
            budgets["max_new_tokens"] = getattr(agent_cls.Settings, "max_new_tokens", None)
        known = registry.settings_fields(agent_cls)
        # The manifest's agent object may hold keys of another agent's (or no agent's)
        # settings; this agent takes its own.
        options = {k: v for k, v in agent_raw.items() if k in known}
        # batch_size unset: the protocol's
        funnel = FunnelConfig(tau=MANIFEST_TAU, batch_size=None)
        for key, read in MANIFEST_FUNNEL_KEYS.items():
            if key in raw:
                setattr(funnel, key, read(raw[key]))
        if funnel.agg not in gate.AGGREGATIONS:
            raise ValueError(f"{path}: unknown aggregation {funnel.agg!r}")
        folder = path.parent
        return cls(
            small=str(folder / "small"),
            large=str(folder / "large"),
            backend=BackendSettings(dtype=MANIFEST_DTYPE),
            agent=AgentSettings(kind=agent_cls.name, options=options, **budgets),
            funnel=funnel,
            extra={k: v for k, v in raw.items() if k not in (*MANIFEST_FUNNEL_KEYS, "agent")},
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Settings:
        """The inverse of :meth:`to_dict` (unknown keys are ignored)."""

        def build(kind: type, d: dict[str, Any] | None) -> Any:
            names = {f.name for f in fields(kind)}
            return kind(**{k: v for k, v in (d or {}).items() if k in names})

        top = {k: v for k, v in data.items() if k not in ("backend", "agent", "funnel")}
        return replace(
            build(cls, top),
            backend=build(BackendSettings, data.get("backend")),
            agent=build(AgentSettings, data.get("agent")),
            funnel=build(FunnelConfig, data.get("funnel")),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # ---- derived settings -----------------------------------------------------------------
    def with_calibration(self, cal: Calibration | str | os.PathLike[str]) -> Settings:
        """These settings with a calibration's gate and judge mode; refused (ValueError) unless
        the calibration was made for the setup these settings give (``setup_of``: these models,
        this agent and this judge; a tau is only valid for its setup). ``cal`` is a calibration
        or the path of its file. A tau given here wins over the file's."""
        from speceyes.bench.calibration_file import (
            Calibration,
            check_calibration,
            read_calibration,
            setup_of,
        )

        source = None if isinstance(cal, Calibration) else cal
        if not isinstance(cal, Calibration):
            cal = read_calibration(cal)
        check_calibration(cal, setup_of(self))
        f = self.funnel
        funnel = replace(
            f,
            tau=cal.tau if f.tau is None else f.tau,
            top_k=cal.top_k,
            agg=cal.agg,
            scale=cal.scale,
            judge_mode=cal.judge_mode or f.judge_mode,
            judge_threshold=f.judge_threshold
            if cal.judge_threshold is None
            else cal.judge_threshold,
        )
        cascade = _cascade_of(source)
        if cascade is not None:
            funnel = _with_cascade(funnel, cascade)
        return replace(self, funnel=funnel)

    def with_points_file(self, path: str | os.PathLike[str]) -> Settings:
        """These settings with a points file's gate and judge mode (as ``with_calibration``
        applies a calibration's); refused (ValueError) when the file records other models or
        another agent: its taus hold only for the setup they were calibrated on."""
        from speceyes.bench.calibration_file import CalibrationSetup, setup_of
        from speceyes.operating_points import read_points_file

        pf = read_points_file(path)
        f = self.funnel
        if pf.setup is not None:
            given = setup_of(self)
            recorded = CalibrationSetup(pf.setup.get("models"), pf.setup.get("agent"))
            differing = recorded.differences(
                CalibrationSetup(given.models, given.agent)
            )
            if differing:
                raise ValueError(
                    f"the points file {path} was calibrated for another setup "
                    f"({', '.join(differing)} differ: it records models "
                    f"{recorded.models} and agent {recorded.agent!r}); its taus hold only for "
                    "that setup: pass the same options, or calibrate on runs made with these"
                )
        gate_values = pf.gate or {}
        funnel = replace(
            f,
            points=[asdict(p) for p in pf.points],
            top_k=int(gate_values.get("top_k", f.top_k)),
            agg=str(gate_values.get("agg", f.agg)),
            scale=float(gate_values.get("scale", f.scale)),
            judge_mode=pf.judge_mode or f.judge_mode,
            judge_threshold=f.judge_threshold
            if pf.judge_threshold is None
            else float(pf.judge_threshold),
        )
        return replace(self, funnel=funnel)

    def with_funnel(self, **changes: Any) -> Settings:
        """These settings with some funnel fields changed (e.g. another ``mode``)."""
        return replace(self, funnel=replace(self.funnel, **changes))

    def resolved(self) -> Settings:
        """Every unset value filled: the loop budgets, batch size and schedule from the protocol
        (for the agent's family and the mode), tau from the protocol for the benchmark
        (``published``: Table 1's) or else the agent's ``default_tau``; the agent's name
        canonical."""
        a, f = self.agent, self.funnel
        cls = a.agent_class()
        protocol = protocols.get_protocol(f.protocol)
        family = _family(cls)
        budget = protocol.loop_settings(family, mode=f.mode)
        tau = _first(protocol.default_tau(family, self.bench), cls.default_tau)
        agent = replace(
            a,
            kind=cls.name,
            max_tool_calls=_first(a.max_tool_calls, budget.max_tool_calls),
            max_new_tokens=_first(a.max_new_tokens, budget.agent_max_tokens),
        )
        funnel = replace(
            f,
            tau=_first(f.tau, tau),
            batch_size=_first(f.batch_size, budget.batch_size),
            schedule=_first(f.schedule, protocol.schedule),
        )
        return replace(self, agent=agent, funnel=funnel)


def _with_model(spec: str | None, model: str | None) -> str | None:
    """A URL spec with ``--small-model`` / ``--large-model`` written in as ``#model=ID``."""
    if spec is None or model is None:
        return spec
    from speceyes.backends.openai import with_model

    return with_model(spec, model)


@dataclass(frozen=True)
class CertifiedCascade:
    """What a cascade calibration file certifies: per-stage thresholds, the cascade they hold
    for (speculation depth, middle tier and its prompt) and per-category thresholds ({}
    without ``--per-category``)."""

    taus: dict[str, float]
    depth: int
    middle: bool
    direct_prompt: str
    category_taus: dict[str, dict[str, float]]


def _cascade_of(path: str | os.PathLike[str] | None) -> CertifiedCascade | None:
    """A cascade calibration file's :class:`CertifiedCascade`; None for a file of the
    two-stage funnel (or a calibration given as a record)."""
    if path is None:
        return None
    raw = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(raw, dict) or "stages" not in raw:
        return None
    from speceyes.bench.cascade_calibration import read_category_taus, read_stage_taus

    taus = read_stage_taus(raw)
    block = raw.get("cascade") or {}
    depths = [int(s.split("@", 1)[1]) for s in taus if s.startswith("small@")]
    return CertifiedCascade(
        taus=taus,
        depth=int(block.get("speculate_depth", max(depths, default=0))),
        middle=bool(block.get("middle_tier", "large_direct" in taus)),
        # files written before the prompt could be chosen used the speculative one
        direct_prompt=str(block.get("direct_prompt", FunnelConfig.direct_prompt)),
        category_taus=read_category_taus(raw),
    )


def _with_cascade(f: FunnelConfig, c: CertifiedCascade) -> FunnelConfig:
    """The funnel with the cascade a calibration certified: its stages and their thresholds,
    per query category where it calibrated them (a category it does not name: the overall
    thresholds). The guarantee covers that cascade only (another depth, tier or direct prompt
    changes which queries reach each stage and what they answer), so a funnel that asks for
    another one is refused."""
    # a flag left at its default asks for nothing; one that was set must match the file
    if (f.speculate_depth and f.speculate_depth != c.depth) or (f.middle_tier and not c.middle):
        raise ValueError(
            f"the calibration certifies the cascade with --speculate-depth {c.depth}"
            f"{' and --middle-tier' if c.middle else ' without --middle-tier'}; its thresholds "
            "do not hold for another one (calibrate that cascade's own both-mode run)"
        )
    asked = f.direct_prompt != FunnelConfig.direct_prompt
    if c.middle and asked and f.direct_prompt != c.direct_prompt:
        raise ValueError(
            f"the calibration certifies the middle tier with --direct-prompt {c.direct_prompt}; "
            f"its threshold does not hold for --direct-prompt {f.direct_prompt}"
        )
    stage_taus = f.stage_taus if f.stage_taus is not None else c.taus
    return replace(
        f,
        speculate_depth=c.depth,
        middle_tier=c.middle,
        direct_prompt=c.direct_prompt if c.middle else FunnelConfig.direct_prompt,
        stage_taus=stage_taus,
        category_taus=c.category_taus or None,
    )


def _first(value: Any, default: Any) -> Any:
    return default if value is None else value


def _family(cls: type) -> str:
    """The agent family whose loop budgets apply (other agents take DeepEyes')."""
    return cls.name if cls.name in protocols.PUBLISHED_AGENTS else ZoomAgent.name


def make_backend(
    spec: str,
    family: str = Settings.large_family,
    settings: BackendSettings | None = None,
    *,
    role: str = "large",
    shares_device: bool = False,
) -> Backend:
    """A backend for a model given as a folder, a hub id, or OpenAI-compatible server URL(s);
    ``family`` names the model behind a URL (a folder's own config says it). ``role`` picks the
    per-model settings; ``shares_device``: another vLLM engine runs in this process. A folder
    or hub id runs on the engine ``settings.engine`` names (:mod:`speceyes.backends.registry`)."""
    b = settings or BackendSettings()
    if _is_url(spec):
        from speceyes.backends.openai import OpenAIBackend, parse_server_spec

        min_pixels, max_pixels = b.pixels(role)
        server = parse_server_spec(spec)
        return OpenAIBackend(
            list(server.urls),
            server.model,
            family=family,
            max_logprobs=b.max_logprobs,
            min_pixels=min_pixels,
            max_pixels=max_pixels,
            decoding=b.decoding,
            session_header=b.session_header,
            max_model_len=b.server_max_model_len,
        )
    return engines.engine(b.engine)(spec, b, role=role, shares_device=shares_device)


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
    cls = a.agent_class()
    if mode == "specreason":
        from speceyes.agents.specreason import SpecReasonAgent

        if cls is not ZoomAgent:
            raise ValueError("--mode specreason runs the DeepEyes loop; use --agent deepeyes")
        if small is None:
            raise ValueError("--mode specreason needs the small model")
        return SpecReasonAgent(small, large, **a.kwargs(SpecReasonAgent))
    if getattr(cls, "needs_small", False):
        raise ValueError(f"the {cls.name} agent is chosen by --mode {cls.name}")
    if protocols.check_protocol(protocol) == "published":
        cls = registry.published_loop(cls)  # the authors' own loop (agents/published_*.py)
    return cls(large, **a.kwargs(cls))


def load_backends(settings: Settings) -> tuple[Backend | None, Backend | None]:
    """(small, large) as the funnel's mode needs them; one model named twice loads once."""
    s, mode = settings, settings.funnel.mode
    if mode != "agent" and s.small is None:
        raise ValueError(f"mode {mode!r} needs the small model")
    if mode != "small" and s.large is None:
        raise ValueError(f"mode {mode!r} needs the large model")
    specs = {"small": s.small if mode != "agent" else None}
    specs["large"] = s.large if mode != "small" and s.large != specs["small"] else None
    engines = [x for x in specs.values() if x is not None and not _is_url(x)]
    shares = s.backend.engine == "vllm" and len(engines) == 2
    small = None
    if specs["small"] is not None:
        small = make_backend(
            s.small, s.small_family, s.backend, role="small", shares_device=shares
        )
    large = None
    if mode != "small":
        large = small if specs["large"] is None else make_backend(
            s.large, s.large_family, s.backend, role="large", shares_device=shares
        )
    return small, large


def _is_url(spec: str) -> bool:
    return spec.startswith(("http://", "https://"))


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
    # Servers are checked once before the run (their model, context length and, for the
    # small model, the finite top logprobs the gate reads), not mid-run by a failed query.
    checked: list[Backend] = []
    large_top_k = config.top_k if config.middle_tier else None  # the middle tier is gated
    for backend, top_k in ((small, config.top_k), (large, large_top_k)):
        check = getattr(backend, "check_servers", None)
        if check is not None and all(backend is not b for b in checked):
            check(top_k)
            checked.append(backend)
    if large is None:
        agent = None
    elif isinstance(agent, AgentSettings):
        agent = make_agent(agent, large, small, mode=mode, protocol=config.protocol)
    return Funnel(small, large, agent, config)


def build_funnel(
    settings: Settings,
    backends: tuple[Backend | None, Backend | None] | None = None,
    agent: Agent | None = None,
) -> Funnel:
    """The funnel ``settings`` describe (resolved here), over the models it names, loaded here
    unless ``backends`` (small, large) are given; ``agent`` shares one ready agent."""
    s = settings.resolved()
    small, large = load_backends(s) if backends is None else backends
    return assemble_funnel(s.funnel, small, large, s.agent if agent is None else agent)
