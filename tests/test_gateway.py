"""OpenAIBackend's control flow in front of gateways and replicas, against in-process stand-ins:
a gateway that lists several models, replicas that record which calls reach them and with
which headers, a server that reports ``max_model_len``, and one that returns fewer finite top
logprobs than asked (vLLM's -9999.0 for -inf). What a real server computes is tested against
llama.cpp in test_openai_backend.py; these stand-ins only answer the shape of the API."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
from PIL import Image

from speceyes import prompts
from speceyes.backends.base import BackendError, estimate_prompt_tokens, estimate_text_tokens
from speceyes.judging import tool_probability
from tests.conftest import make_scene

pytest.importorskip("openai")
web = pytest.importorskip("aiohttp.web")

from speceyes.backends.openai import (  # noqa: E402
    OpenAIBackend,
    choose_model,
    parse_server_spec,
    with_model,
)
from speceyes.backends.routing import Replica, Router, digest  # noqa: E402
from tests.tools.server_thread import ServerThread  # noqa: E402


class StandIn:
    """An OpenAI-compatible stand-in: lists ``models`` (id -> max_model_len or None) and answers
    every chat completion with "yes", recording each request's model and headers."""

    def __init__(self, models=None, finite=None, cap=None, delay=0.0):
        self.models = {"only": None} if models is None else models
        self.finite, self.cap, self.delay = finite, cap, delay
        self.calls: list[dict] = []
        app = web.Application()
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_post("/v1/chat/completions", self.complete)
        self.server = ServerThread(app)

    async def list_models(self, request):
        data = []
        for mid, length in self.models.items():
            card = {"id": mid, "object": "model", "owned_by": "test"}
            if length is not None:
                card["max_model_len"] = length
            data.append(card)
        return web.json_response({"object": "list", "data": data})

    async def complete(self, request):
        body = await request.json()
        self.calls.append({"model": body["model"], "headers": {k.lower(): v for k, v in request.headers.items()}, "body": body})
        n = body.get("top_logprobs") or 0
        if self.cap is not None and n > self.cap:  # vLLM's refusal
            msg = f"Requested sample logprobs of {n}, which is greater than max allowed: {self.cap}"
            return web.json_response({"error": {"message": msg, "code": 400}}, status=400)
        if self.delay:
            await asyncio.sleep(self.delay)
        finite = n if self.finite is None else min(n, self.finite)
        top = [
            {"token": f"t{i}", "logprob": -0.1 * (i + 1) if i < finite else -9999.0}
            for i in range(n)
        ]
        if top:
            top[0]["token"] = "yes"
        logprobs = {"content": [{"token": "yes", "logprob": -0.1, "top_logprobs": top}]}
        return web.json_response(
            {
                "id": "x",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "yes"},
                        "finish_reason": "stop",
                        "logprobs": logprobs if body.get("logprobs") else None,
                    }
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )

    @property
    def url(self) -> str:
        return f"{self.server.url}/v1"

    def __enter__(self) -> StandIn:
        self.server.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop()


def _noise(seed: int, size=(120, 90)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))


# ---- which model behind one URL ---------------------------------------------------------------


def test_a_gateway_listing_several_models_needs_one_named():
    with StandIn({"qwen3-vl-2b": None, "deepeyes-7b": None}) as gw:
        with OpenAIBackend(gw.url, max_retries=0) as b:
            with pytest.raises(BackendError, match=r"serves 2 models \(qwen3-vl-2b, deepeyes-7b\)"):
                b.chat([[{"role": "user", "content": "hi"}]], max_new_tokens=1)
        assert gw.calls == []  # refused before any model call
        with OpenAIBackend(gw.url, "deepeyes-7b") as b:
            b.chat([[{"role": "user", "content": "hi"}]], max_new_tokens=1)
        with OpenAIBackend(gw.url, "gpt-4", max_retries=0) as b:
            with pytest.raises(BackendError, match=r"does not serve model 'gpt-4'.*qwen3-vl-2b"):
                b.chat([[{"role": "user", "content": "hi"}]], max_new_tokens=1)
    assert [c["model"] for c in gw.calls] == ["deepeyes-7b"]


def test_url_fragment_and_model_flag_name_the_model():
    from speceyes.factory import make_backend

    with StandIn({"a": None, "b": None}) as gw:
        for spec in (f"{gw.url}#model=b", with_model(gw.url, "b")):
            be = make_backend(spec, "qwen2_5_vl")
            try:
                be.chat([[{"role": "user", "content": "hi"}]], max_new_tokens=1)
            finally:
                be.close()
    assert [c["model"] for c in gw.calls] == ["b", "b"]


def test_server_spec_parsing():
    assert parse_server_spec("http://a/v1,http://b/v1#model=m") == parse_server_spec(
        "http://a/v1#model=m,http://b/v1#model=m"
    )
    spec = parse_server_spec("http://a/v1, http://b/v1#model=org/m-7B")
    assert spec.urls == ("http://a/v1", "http://b/v1") and spec.model == "org/m-7B"
    assert parse_server_spec("http://a/v1").model is None
    with pytest.raises(ValueError, match="two model ids"):
        parse_server_spec("http://a/v1#model=x,http://b/v1#model=y")
    with pytest.raises(ValueError, match="two model ids"):
        with_model("http://a/v1#model=x", "y")
    assert with_model("http://a/v1#model=x", "x") == "http://a/v1#model=x"
    with pytest.raises(ValueError, match="behind a URL"):
        with_model("/models/small", "x")
    with pytest.raises(ValueError, match="only URL fragment"):
        parse_server_spec("http://a/v1#revision=3")
    assert choose_model(["m"], None, "s") == "m"
    with pytest.raises(BackendError, match="lists no models"):
        choose_model([], None, "s")


def test_model_flags_reach_the_settings():
    import argparse

    from speceyes.cli.options import add_model_args
    from speceyes.factory import Settings

    p = argparse.ArgumentParser()
    add_model_args(p)
    ns = p.parse_args(
        ["--small", "http://g/v1", "--small-model", "qwen3-vl-2b", "--large", "http://g/v1",
         "--large-model", "deepeyes-7b", "--session-header", "X-Session-Id",
         "--server-max-model-len", "8192"]
    )  # fmt: skip
    s = Settings.from_args(ns)
    assert s.small == "http://g/v1#model=qwen3-vl-2b" and s.large == "http://g/v1#model=deepeyes-7b"
    assert s.backend.session_header == "X-Session-Id" and s.backend.server_max_model_len == 8192
    assert Settings.from_dict(s.to_dict()) == s
    folder = p.parse_args(["--small", "/m/small", "--small-model", "x", "--large", "/m/large"])
    with pytest.raises(ValueError, match="behind a URL"):
        Settings.from_args(folder)


# ---- replica affinity and the session header --------------------------------------------------


def _query_calls(be: OpenAIBackend, image) -> None:
    """What the funnel and the agent send for one query: its judge call, then its agent's turn."""
    tool_probability(be, [prompts.judge_messages(image, "Is there a cup?")])
    be.chat([prompts.deepeyes_messages(image, "What color is the cup?")], max_new_tokens=4)


def test_a_querys_calls_stay_on_one_replica_and_carry_one_session():
    with StandIn() as a, StandIn() as b:
        with OpenAIBackend([a.url, b.url], session_header="X-Session-Id") as be:
            for seed in range(12):
                na, nb = len(a.calls), len(b.calls)
                _query_calls(be, _noise(seed))
                got = (len(a.calls) - na, len(b.calls) - nb)
                assert got in ((2, 0), (0, 2)), f"query {seed} was split {got}"
                new = a.calls[na:] or b.calls[nb:]
                sessions = {c["headers"]["x-session-id"] for c in new}
                assert len(sessions) == 1
    # the keys spread: both replicas serve some queries, and every query has its own session
    assert a.calls and b.calls
    ids = {c["headers"]["x-session-id"] for c in a.calls + b.calls}
    assert len(ids) == 12


def test_recent_requests_name_each_calls_replica_key_and_usage():
    with StandIn() as a, StandIn() as b:
        with OpenAIBackend([a.url, b.url]) as be:
            be.check_servers()  # not a model call: not recorded
            for seed in range(4):
                _query_calls(be, _noise(seed))
            records = be.recent_requests()
    assert [r.what for r in records] == ["next token", "chat"] * 4
    served = {url: len(s.calls) for url, s in ((a.url, a), (b.url, b)) if s.calls}
    assert {url: sum(r.url == url for r in records) for url in served} == served
    for judge, turn in zip(records[::2], records[1::2], strict=True):
        assert (judge.url, judge.key) == (turn.url, turn.key) and judge.key is not None
    # the stand-in's usage names no cached tokens
    assert {(r.prompt_tokens, r.cached_tokens, r.completion_tokens) for r in records} == {(1, None, 1)}


def test_no_session_header_unless_asked():
    with StandIn() as a:
        with OpenAIBackend(a.url) as be:
            _query_calls(be, _noise(0))
    assert not any("x-session-id" in c["headers"] for c in a.calls)


def test_least_loaded_routing_spreads_one_query():
    with StandIn() as a, StandIn() as b:
        with OpenAIBackend([a.url, b.url], routing="least-loaded") as be:
            _query_calls(be, _noise(0))
    assert (len(a.calls), len(b.calls)) == (1, 1)  # ties rotate: the old behaviour


def test_one_hot_image_is_bounded_not_piled_on_one_replica():
    """Eight conversations on one image in flight together: the load bound moves some on."""
    with StandIn(delay=0.3) as a, StandIn(delay=0.3) as b:
        with OpenAIBackend([a.url, b.url]) as be:
            img = _noise(7)
            tool_probability(be, [prompts.judge_messages(img, f"q{i}") for i in range(8)])
    loads = sorted((len(a.calls), len(b.calls)))
    # ceil(1.25 * 8 / 2) = 5 at most on the image's own replica
    assert loads == [3, 5]


def test_router_prefers_a_keys_replica_and_skips_a_cooling_one():
    reps = [Replica(url=f"http://r{i}/v1", client=None) for i in range(3)]
    router = Router(reps)
    keys = [digest(f"image {i}") for i in range(200)]
    homes = {k: router.pick(k) for k in keys}
    assert {r.url for r in homes.values()} == {r.url for r in reps}  # every replica gets keys
    assert all(router.pick(k) is homes[k] for k in keys)  # and each key the same one
    down = homes[keys[0]]
    down.down_until = math.inf
    after = router.pick(keys[0])
    assert after is not down and after is next(r for r in router.preference(keys[0]) if r is not down)
    with pytest.raises(ValueError, match="routing"):
        Router(reps, "random")  # type: ignore[arg-type]


# ---- start-up checks: the logprobs really returned, the context length --------------------------


def test_startup_probe_refuses_a_server_whose_extra_logprobs_are_minus_inf():
    # vLLM started with --max-logprobs 64 that still gives 20 real values and the rest -9999.0
    with StandIn(finite=20) as s:
        with OpenAIBackend(s.url, max_logprobs=64) as be:
            with pytest.raises(BackendError, match=r"returned 20 finite top logprobs of the 64"):
                be.check_servers(top_k=64)
            assert be.replica_stats()[0]["finite_logprobs"] == 20
            with pytest.raises(ValueError, match=r"exceeds the 20 finite top logprobs"):
                be.answer([[{"role": "user", "content": "hi"}]], max_new_tokens=1, top_k=64)
            # -9999.0 is read as -inf, so such a row is never accepted by the gate
            (ans,) = be.answer([[{"role": "user", "content": "hi"}]], max_new_tokens=1, top_k=20)
            assert np.isfinite(ans.topk).all()
        with OpenAIBackend(s.url, max_logprobs=28) as be:
            be.check_servers(top_k=20)  # 20 finite are enough for K = 20
            (ans,) = be.answer([[{"role": "user", "content": "hi"}]], max_new_tokens=1, top_k=20)
            assert np.isfinite(ans.topk).all() and ans.topk.shape == (1, 20)


def test_startup_probe_names_the_server_cap_flag():
    with StandIn(cap=20) as s:
        with OpenAIBackend(s.url, max_logprobs=64) as be:
            with pytest.raises(BackendError, match=r"--max-logprobs 64"):
                be.check_servers(top_k=64)


def test_minus_9999_rows_are_minus_inf():
    with StandIn(finite=3) as s:
        with OpenAIBackend(s.url, max_logprobs=20) as be:
            (ans,) = be.answer([[{"role": "user", "content": "hi"}]], max_new_tokens=1, top_k=8)
    assert np.isfinite(ans.topk[0, :3]).all() and np.isneginf(ans.topk[0, 3:]).all()


def test_cli_refuses_before_the_run(tmp_path, capsys):
    from speceyes.cli import main

    img = tmp_path / "x.png"
    make_scene().save(img)
    with StandIn(finite=20) as s:
        rc = main(["ask", str(img), "Is it red?", "--small", s.url, "--large", s.url,
                   "--top-k", "64", "--max-logprobs", "64"])  # fmt: skip
        err = capsys.readouterr().err
        assert rc != 0 and "20 finite top logprobs" in err
        probes = [c for c in s.calls if c["body"].get("max_tokens") == 1]
        assert len(s.calls) == len(probes) == 1  # one probe, no query sent


def test_max_model_len_is_read_from_the_listing_or_given():
    with StandIn({"m": 4096}) as s:
        with OpenAIBackend(s.url) as be:
            assert be.max_model_len == 4096
            assert be.check_servers()[0]["max_model_len"] == 4096
        with OpenAIBackend(s.url, max_model_len=2048) as be:
            assert be.max_model_len == 2048  # given: wins
    with StandIn({"m": None}) as s, OpenAIBackend(s.url) as be:
        assert be.max_model_len is None  # not reported, not given: no budget


def test_the_context_budget_ends_a_loop_before_the_server_would_refuse():
    from speceyes.agents.zoom import ZoomAgent
    from speceyes.types import Query

    with StandIn({"m": 600}) as s, OpenAIBackend(s.url) as be:
        agent = ZoomAgent(be, max_new_tokens=64, max_tool_calls=3)
        fits = Query(id="a", image=make_scene(size=(200, 150)), question="Color?")
        first = estimate_prompt_tokens(be, agent.first_messages(fits))
        assert first + 64 <= 600 < first + 64 + 600  # the first turn fits, a long one not
        big = Query(id="b", image=make_scene(size=(200, 150)), question="Color? " * 200)
        out_fit, out_big = agent.run([fits, big])
        assert agent.context_budget_ends == 1
    assert out_fit.error is None and out_fit.turns == 1
    assert out_big.error is None and out_big.turns == 0 and out_big.answer == ""
    (limit,) = [t for t in out_big.trace if t["type"] == "limit"]
    assert limit["reason"] == "context budget" and "max_model_len 600" in limit["error"]
    assert len(s.calls) == 1  # only the query that fits reached the server


def test_text_estimate_is_stated_and_bounded():
    assert estimate_text_tokens("") == 0
    assert estimate_text_tokens("yes") == 1 and estimate_text_tokens("1234") == 4
    assert estimate_text_tokens("internationalization") == 3  # 20 letters: one per 8 more
