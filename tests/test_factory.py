"""speceyes.factory: one settings type and one way to build backends, agents and the funnel
(CLI, serve and demo)."""

from __future__ import annotations

import argparse
import json

import pytest

from speceyes import factory, protocols
from speceyes.agents import registry
from speceyes.agents.base import LoopAgent
from speceyes.agents.code import CodeAgent
from speceyes.agents.search import SearchAgent
from speceyes.agents.specreason import SpecReasonAgent
from speceyes.agents.zoom import ZoomAgent
from speceyes.factory import AgentSettings, Settings
from speceyes.funnel import FunnelConfig
from speceyes.miniworld import demo


class _Stub:
    """Enough of a backend for construction: agents and the funnel only keep it."""

    def __init__(self, max_logprobs: int | None = None) -> None:
        self.max_logprobs = max_logprobs
        self.max_images = None
        self.max_pixels = 28 * 28 * 1024


def test_agents_are_registered_under_their_own_names():
    assert {n: c.name for n, c in registry.AGENTS.items()} == {
        n: n for n in ("deepeyes", "thyme", "search", "specreason")
    }
    assert registry.choices() == ("deepeyes", "thyme", "search")  # specreason: by --mode
    assert registry.agent_class("zoom") is ZoomAgent  # the manifest's old name
    with pytest.raises(ValueError, match="unknown agent 'teleport'"):
        registry.agent_class("teleport")


def test_search_settings_parse_and_reject_bad_keys():
    def parse(text):
        return registry.parse_options(SearchAgent, text)

    assert parse("depth=3,grid=3,overlap=0.2,min_region=64,answer_prompt=small") == {
        "depth": 3,
        "grid": 3,
        "overlap": 0.2,
        "min_region": 64,
        "answer_prompt": "small",
    }
    assert parse("") == {}
    assert parse("stay=1") == {"stay": True}
    assert parse("stay=off,beam=2") == {"stay": False, "beam": 2}
    assert parse("fill_view=1,min_box=10") == {"fill_view": True, "min_box": 10}
    with pytest.raises(ValueError, match="stay needs 1 or 0"):
        parse("stay=maybe")
    with pytest.raises(ValueError, match="K=V"):
        parse("zoom=3")
    with pytest.raises(ValueError, match="K=V"):  # budgets have their own flags
        parse("max_new_tokens=3")
    with pytest.raises(ValueError, match="depth needs a int"):
        parse("depth=two")
    with pytest.warns(FutureWarning, match="'answer' is now 'answer_prompt'"):
        assert parse("answer=small,depth=1") == {"answer_prompt": "small", "depth": 1}


def test_the_parser_reads_every_field_the_agent_takes():
    """Each Settings field is a keyword argument with the same default (one source), and the
    K=V text of any value reads back to it."""
    import inspect

    for cls in registry.AGENTS.values():
        for name, (f, _) in registry.settings_fields(cls).items():
            # the first __init__ up the class chain that names it (others pass **kw on)
            params = next(
                ps for c in cls.__mro__ if name in (ps := inspect.signature(c.__init__).parameters)
            )
            assert params[name].default == f.default, (cls.name, name)
    given = {"depth": 4, "overlap": 0.5, "min_region": 32, "answer_prompt": "small", "stay": True}
    text = ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in given.items())
    assert registry.parse_options(SearchAgent, text) == given


def test_manifest_and_search_flag_use_the_same_names():
    manifest = json.loads((demo.MODELS_DIR / factory.MANIFEST).read_text())["agent"]
    search = {k: v for k, v in manifest.items() if k != "kind"}
    assert set(search) <= set(registry.settings_fields(SearchAgent))
    text = ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in search.items())
    assert registry.parse_options(SearchAgent, text) == search
    s = Settings.from_manifest(demo.MODELS_DIR / factory.MANIFEST)
    assert s.agent.kind == "search" and s.agent.options == search
    # the manifest's search agent keeps its own answer budget; the CLI's is the protocol's
    assert s.resolved().agent.max_new_tokens == SearchAgent.Settings.max_new_tokens


def test_manifest_defaults_and_errors(tmp_path):
    s = Settings.from_manifest(tmp_path / "missing.json")
    assert (s.funnel.tau, s.funnel.agg, s.funnel.top_k) == (factory.MANIFEST_TAU, "min", 64)
    assert s.agent.options == {"depth": 3, "answer_prompt": "small"}
    assert (s.small, s.large) == (str(tmp_path / "small"), str(tmp_path / "large"))
    assert s.backend.dtype == "float32"
    r = s.resolved()
    assert r.funnel.batch_size == protocols.FAIR.loop_settings().batch_size
    assert (r.agent.max_tool_calls, r.funnel.tau) == (5, factory.MANIFEST_TAU)
    p = tmp_path / "m.json"
    p.write_text(json.dumps({"agent": {"kind": "zoom", "depth": 2}, "batch_size": 4, "x": 1}))
    s = Settings.from_manifest(p)
    assert s.agent.kind == "deepeyes" and s.agent.options == {}  # depth is not a zoom setting
    assert s.funnel.batch_size == 4 and s.extra == {"x": 1}
    assert s.resolved().agent.max_new_tokens == protocols.FAIR.loop_settings().agent_max_tokens
    for bad, match in (
        ({"agent": {"kind": "teleport"}}, "agent.kind"),
        ({"agent": {"kind": "specreason"}}, "agent.kind"),
        ({"agg": "max"}, "aggregation"),
        ([1], "expected a JSON object"),
    ):
        p.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=match):
            Settings.from_manifest(p)


def _ns(**kw) -> argparse.Namespace:
    return argparse.Namespace(small="s", large="l", **kw)


def test_resolved_fills_budgets_and_tau_by_agent_and_protocol():
    for kind, cls in (("deepeyes", ZoomAgent), ("thyme", CodeAgent), ("search", SearchAgent)):
        for protocol in protocols.PROTOCOLS:
            s = Settings.from_args(_ns(agent=kind, protocol=protocol))
            assert (s.funnel.tau, s.funnel.batch_size, s.agent.max_tool_calls) == (None,) * 3
            r = s.resolved()
            family = kind if kind in protocols.PUBLISHED_AGENTS else "deepeyes"
            want = protocols.get_protocol(protocol).loop_settings(family)
            assert r.funnel.tau == cls.default_tau
            assert (r.funnel.batch_size, r.agent.max_tool_calls, r.agent.max_new_tokens) == (
                want.batch_size,
                want.max_tool_calls,
                want.agent_max_tokens,
            )
    given = Settings.from_args(_ns(tau=0.5, batch_size=3, max_tool_calls=1, agent_max_tokens=9))
    r = given.resolved()
    assert (r.funnel.tau, r.funnel.batch_size, r.agent.max_tool_calls) == (0.5, 3, 1)
    assert r.agent.max_new_tokens == 9
    assert given.funnel.tau == 0.5 and given.resolved() == r.resolved()  # pure, idempotent


def test_from_args_only_reads_the_namespace():
    ns = _ns(agent="search", search="depth=3")
    before = dict(vars(ns))
    s = Settings.from_args(ns).resolved()
    assert vars(ns) == before
    assert s.agent.options == {"depth": 3} and s.funnel.batch_size == 8


def test_agent_options_set_the_chosen_agents_settings():
    s = Settings.from_args(_ns(agent="deepeyes", agent_options="fill_view=1,min_box=10"))
    assert s.agent.options == {"fill_view": True, "min_box": 10}
    agent = factory.make_agent(s.resolved().agent, _Stub())
    assert isinstance(agent, ZoomAgent) and (agent.fill_view, agent.min_box) == (True, 10)
    both = Settings.from_args(_ns(agent="search", agent_options="depth=1", search="grid=3"))
    assert both.agent.options == {"depth": 1, "grid": 3}
    with pytest.raises(ValueError, match="--agent-options: expected K=V"):
        Settings.from_args(_ns(agent="deepeyes", agent_options="depth=3"))  # a search setting


def test_to_dict_round_trips():
    s = Settings.from_args(_ns(agent="search", search="depth=3,stay=1", tau=0.7)).resolved()
    d = json.loads(json.dumps(s.to_dict()))
    assert Settings.from_dict(d) == s
    assert d["funnel"]["tau"] == 0.7 and d["agent"]["options"] == {"depth": 3, "stay": True}


def test_agents_by_kind_and_mode():
    large, small = _Stub(), _Stub()
    z = factory.make_agent(AgentSettings(max_tool_calls=2, max_new_tokens=7), large)
    assert isinstance(z, ZoomAgent) and (z.max_tool_calls, z.max_new_tokens) == (2, 7)
    pub = factory.make_agent(AgentSettings(), large, protocol="published")
    assert pub.protocol == "published"
    s = factory.make_agent(
        AgentSettings(kind="search", max_new_tokens=5, options={"depth": 1, "beam": 2}), large
    )
    assert isinstance(s, SearchAgent) and (s.depth, s.beam, s.max_new_tokens) == (1, 2, 5)
    own = factory.make_agent(AgentSettings(kind="search", max_tool_calls=3), large)
    assert own.max_new_tokens == SearchAgent.Settings.max_new_tokens  # no budget: its own
    sr = factory.make_agent(AgentSettings(), large, small, mode="specreason")
    assert isinstance(sr, SpecReasonAgent) and sr.small is small and sr.backend is large
    with pytest.raises(ValueError, match="use --agent deepeyes"):
        factory.make_agent(AgentSettings(kind="search"), large, small, mode="specreason")
    with pytest.raises(ValueError, match="unknown agent"):
        factory.make_agent(AgentSettings(kind="teleport"), large)
    with pytest.raises(ValueError, match="--mode specreason"):
        factory.make_agent(AgentSettings(kind="specreason"), large, small)
    with pytest.raises(ValueError, match="unknown search setting 'zoom'"):
        factory.make_agent(AgentSettings(kind="search", options={"zoom": 3}), large)
    with pytest.warns(FutureWarning):
        old = factory.make_agent(AgentSettings(kind="search", options={"answer": "small"}), large)
    assert old.answer_prompt == "small"


def test_funnel_takes_what_its_mode_uses():
    small, large = _Stub(), _Stub()
    f = factory.assemble_funnel(FunnelConfig(mode="small"), small, large, AgentSettings())
    assert (f.small, f.large, f.agent) == (small, None, None)
    f = factory.assemble_funnel(FunnelConfig(mode="agent"), small, large, AgentSettings())
    assert f.small is None and f.large is large and isinstance(f.agent, ZoomAgent)
    shared = ZoomAgent(large)
    assert factory.assemble_funnel(FunnelConfig(), small, large, shared).agent is shared
    with pytest.raises(ValueError, match="exceeds the 8 logprobs"):
        factory.assemble_funnel(FunnelConfig(top_k=16), _Stub(8), large, AgentSettings())


def test_build_funnel_resolves_and_shares_given_parts():
    small, large = _Stub(), _Stub()
    s = Settings.from_args(_ns(agent="thyme", protocol="published"))
    f = factory.build_funnel(s, (small, large))
    assert f.config.tau == CodeAgent.default_tau and f.config.batch_size == 6
    assert isinstance(f.agent, CodeAgent) and f.agent.max_new_tokens == 2048
    shared = ZoomAgent(large)
    g = factory.build_funnel(Settings(funnel=FunnelConfig(mode="agent")), (None, large), shared)
    assert g.agent is shared and g.config.tau == ZoomAgent.default_tau


def test_a_funnel_config_without_tau_takes_the_agents():
    from speceyes.funnel import Funnel

    small, large = _Stub(), _Stub()
    assert FunnelConfig().tau is None
    thyme = CodeAgent(large)
    assert Funnel(small, large, thyme, FunnelConfig()).config.tau == CodeAgent.default_tau
    base = LoopAgent.default_tau
    assert Funnel(small, None, None, FunnelConfig(mode="small")).config.tau == base
    assert Funnel(small, large, thyme, FunnelConfig(tau=0.5)).config.tau == 0.5


def test_one_model_named_twice_loads_once(monkeypatch):
    made = []
    monkeypatch.setattr(factory, "make_backend", lambda spec, *a, **kw: made.append(spec) or _Stub())
    s = Settings(small="m", large="m")
    small, large = factory.load_backends(s)
    assert small is large and made == ["m"]
    s.funnel = FunnelConfig(mode="agent")
    assert factory.load_backends(s)[0] is None
    with pytest.raises(ValueError, match="needs the large model"):
        factory.load_backends(Settings(small="m"))
