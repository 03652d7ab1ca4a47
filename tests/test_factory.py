"""speceyes.factory: one way to build backends, agents and the funnel (CLI, serve and demo)."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest

from speceyes import factory
from speceyes.agents.search import SearchAgent
from speceyes.agents.specreason import SpecReasonAgent
from speceyes.agents.zoom import ZoomAgent
from speceyes.funnel import FunnelConfig
from speceyes.miniworld import demo


class _Stub:
    """Enough of a backend for construction: agents and the funnel only keep it."""

    def __init__(self, max_logprobs: int | None = None) -> None:
        self.max_logprobs = max_logprobs
        self.max_images = None
        self.max_pixels = 28 * 28 * 1024


def test_search_settings_parse_and_reject_bad_keys():
    parse = factory.parse_search
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
    with pytest.raises(ValueError, match="depth needs a int"):
        parse("depth=two")
    with pytest.warns(FutureWarning, match="'answer' is now 'answer_prompt'"):
        assert parse("answer=small,depth=1") == {"answer_prompt": "small", "depth": 1}


def test_manifest_and_search_flag_use_the_same_names():
    manifest = json.loads((demo.MODELS_DIR / demo.MANIFEST).read_text())["agent"]
    search = {k: v for k, v in manifest.items() if k != "kind"}
    assert set(search) == set(factory.SEARCH_KEYS)
    text = ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in search.items())
    assert factory.parse_search(text) == search
    assert set(factory.SEARCH_KEYS) <= {f.name for f in fields(demo.AgentSettings)}
    a = demo.agent_settings(demo.load_settings(demo.MODELS_DIR / demo.MANIFEST).agent)
    assert a.kind == "search" and a.search == search and a.max_new_tokens == 64


def test_agents_by_kind_and_mode():
    large, small = _Stub(), _Stub()
    z = factory.make_agent(factory.AgentSettings(max_tool_calls=2, max_new_tokens=7), large)
    assert isinstance(z, ZoomAgent) and (z.max_tool_calls, z.max_new_tokens) == (2, 7)
    pub = factory.make_agent(factory.AgentSettings(), large, protocol="published")
    assert pub.protocol == "published"
    s = factory.make_agent(
        factory.AgentSettings(kind="search", max_new_tokens=5, search={"depth": 1, "beam": 2}),
        large,
    )
    assert isinstance(s, SearchAgent) and (s.depth, s.beam, s.max_new_tokens) == (1, 2, 5)
    sr = factory.make_agent(factory.AgentSettings(), large, small, mode="specreason")
    assert isinstance(sr, SpecReasonAgent) and sr.small is small and sr.backend is large
    with pytest.raises(ValueError, match="use --agent deepeyes"):
        factory.make_agent(factory.AgentSettings(kind="search"), large, small, mode="specreason")
    with pytest.raises(ValueError, match="unknown agent"):
        factory.make_agent(factory.AgentSettings(kind="teleport"), large)
    with pytest.raises(ValueError, match="unknown search settings"):
        factory.make_agent(factory.AgentSettings(kind="search", search={"answer": "x"}), large)


def test_funnel_takes_what_its_mode_uses():
    small, large = _Stub(), _Stub()
    f = factory.assemble_funnel(FunnelConfig(mode="small"), small, large, factory.AgentSettings())
    assert (f.small, f.large, f.agent) == (small, None, None)
    f = factory.assemble_funnel(FunnelConfig(mode="agent"), small, large, factory.AgentSettings())
    assert f.small is None and f.large is large and isinstance(f.agent, ZoomAgent)
    shared = ZoomAgent(large)
    assert factory.assemble_funnel(FunnelConfig(), small, large, shared).agent is shared
    with pytest.raises(ValueError, match="exceeds the 8 logprobs"):
        factory.assemble_funnel(FunnelConfig(top_k=16), _Stub(8), large, factory.AgentSettings())


def test_one_model_named_twice_loads_once(monkeypatch):
    made = []
    monkeypatch.setattr(factory, "make_backend", lambda spec, *a: made.append(spec) or _Stub())
    s = factory.Settings(small="m", large="m")
    small, large = factory.load_backends(s)
    assert small is large and made == ["m"]
    s.funnel = FunnelConfig(mode="agent")
    assert factory.load_backends(s)[0] is None
    with pytest.raises(ValueError, match="needs the large model"):
        factory.load_backends(factory.Settings(small="m"))
