"""``speceyes serve`` on the tiny real models, through the official openai client (sync and async).

Servers run in-process on 127.0.0.1 (a free port) in a background thread with their own event
loop; the CLI test starts ``python -m speceyes serve`` as a subprocess and stops it with SIGINT.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")

from speceyes.agents.zoom import ZoomAgent  # noqa: E402
from speceyes.funnel import Funnel, FunnelConfig  # noqa: E402
from speceyes.images import to_data_uri  # noqa: E402
from speceyes.serve import API_KEY_ENV, STATE_KEY, ServeSettings, create_app  # noqa: E402
from speceyes.types import Query  # noqa: E402
from tests.conftest import make_scene  # noqa: E402
from tests.tools.hostile import hostile_requests, text_part  # noqa: E402
from tests.tools.hostile import image_part as _img  # noqa: E402
from tests.tools.hostile import user_request as _user  # noqa: E402
from tests.tools.server_thread import ServerThread  # noqa: E402

# Confidences of these tiny models on the scenes below sit around 0.81-0.85: this tau splits
# them, so both the "small" and the "agent_after_gate" routes go through the server.
TAU = 0.83
ROUTES = {"small", "agent_after_gate", "agent_after_judge"}


def scene_uri(i: int) -> str:
    return to_data_uri(make_scene(size=(64 + 8 * i, 48), box=(2, 2, 20 + i, 20)))


def messages(image_url: str, text: str = "What color is the box?") -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "ignored: the funnel has its own prompts"},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": image_url}},
                {"type": "text", "text": text},
            ],
        },
    ]


def make_funnel(q3, q25) -> Funnel:
    return Funnel(q3, q25, ZoomAgent(q25, max_new_tokens=16), FunnelConfig(tau=TAU, batch_size=8))


class Spy:
    """Records the batch sizes the funnel sees; the real run_batch does the work."""

    def __init__(self, funnel: Funnel, delay: float = 0.0) -> None:
        self.real = funnel.run_batch
        self.delay = delay
        self.sizes: list[int] = []
        funnel.run_batch = self  # type: ignore[method-assign]

    def __call__(self, queries: list[Query]):
        self.sizes.append(len(queries))
        if self.delay:
            time.sleep(self.delay)
        return self.real(queries)


@pytest.fixture(scope="module")
def served(q3, q25) -> Iterator[tuple[ServerThread, Funnel, Spy]]:
    funnel = make_funnel(q3, q25)
    spy = Spy(funnel)
    with ServerThread(create_app(funnel, batch_size=8, max_wait_ms=50, max_queue=64)) as srv:
        yield srv, funnel, spy


def client(srv: ServerThread):
    # max_retries=0: the tests must see every status, not the client's retries.
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)


def aclient(srv: ServerThread):
    return openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)


def http_full(
    url: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, Any, Any]:
    req = urllib.request.Request(url + path, data=body, method="POST" if body else "GET")
    req.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, raw, hdrs = r.status, r.read(), r.headers
    except urllib.error.HTTPError as e:
        status, raw, hdrs = e.code, e.read(), e.headers
    return status, json.loads(raw) if "json" in hdrs["Content-Type"] else raw.decode(), hdrs


def http(srv: ServerThread, path: str, body: bytes | None = None) -> tuple[int, Any]:
    status, body_, _ = http_full(srv.url, path, body)
    return status, body_


def post(srv: ServerThread, payload: Any) -> tuple[int, Any]:
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return http(srv, "/v1/chat/completions", body)


def parse_prometheus(text: str) -> dict[tuple[str, frozenset], float]:
    """Samples of a text exposition (format 0.0.4), strictly: every line must parse."""
    line_re = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
    label_re = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(?:,|$)')
    typed: dict[str, str] = {}
    out: dict[tuple[str, frozenset], float] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "histogram"), line
            typed[name] = kind
            continue
        if line.startswith("# HELP ") or not line:
            continue
        m = line_re.match(line)
        assert m, f"not a sample line: {line!r}"
        name, raw, value = m.groups()
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in typed or base in typed, f"sample before its TYPE: {line!r}"
        labels, pos = {}, 0
        while raw and pos < len(raw):
            lm = label_re.match(raw, pos)
            assert lm, f"bad labels: {line!r}"
            labels[lm.group(1)] = lm.group(2)
            pos = lm.end()
        out[(name, frozenset(labels.items()))] = float(value)
    return out


def metric(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


# ---- answers ------------------------------------------------------------------------------
def test_answer_with_speceyes_extra_field(served, q3, q25):
    srv, _, _ = served
    with client(srv) as c:
        r = c.chat.completions.create(
            model="speceyes",
            messages=messages(scene_uri(0)),
            extra_body={"options": ["red", "blue"]},
        )
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.role == "assistant"
    extra = r.model_extra["speceyes"]
    assert extra["route"] in ROUTES
    assert 0.0 <= extra["confidence"] <= 1.0 and 0.0 <= extra["p_tool"] <= 1.0
    assert r.choices[0].message.content == (
        extra["small_answer"] if extra["route"] == "small" else extra["agent_answer"]
    )
    t = extra["timings"]
    assert {"judge", "small", "gate", "intake", "queue", "total"} <= set(t)
    # the request's time in the app holds its intake (body and image decoded) and its wait
    assert 0 < t["intake"] and t["intake"] + t["queue"] + t["small"] < t["total"]
    assert r.usage is not None and r.model == "speceyes"
    # The extra field is the funnel's own result for this query, run directly.
    (d,) = make_funnel(q3, q25).run_batch(
        [
            Query(
                id="0",
                image=scene_uri(0),
                question="What color is the box?",
                options=["red", "blue"],
            )
        ]
    )
    got = (extra["route"], extra["tool_calls"], extra["invalid_tool_calls"], extra["agent_answer"])
    assert got == (d.route, d.tool_calls, d.invalid_tool_calls, d.agent_answer)


def test_concurrent_requests_are_batched_and_equal_direct_run_batch(served, q3, q25):
    srv, _, spy = served
    n = 8
    reqs = [
        (scene_uri(i), f"What color is box {i}?", ["red", "blue"] if i % 2 else None)
        for i in range(n)
    ]

    async def send_all():
        c = aclient(srv)
        async with c:
            return await asyncio.gather(
                *[
                    c.chat.completions.create(
                        model="speceyes",
                        messages=messages(url, text),
                        extra_body={"options": opts} if opts else None,
                    )
                    for url, text, opts in reqs
                ]
            )

    before = len(spy.sizes)
    served_res = asyncio.run(send_all())
    sizes = spy.sizes[before:]
    assert sum(sizes) == n and max(sizes) > 1, sizes  # micro-batched, every request once

    # The same queries straight through Funnel.run_batch, on the same models.
    direct = make_funnel(q3, q25).run_batch(
        [Query(id=str(i), image=u, question=t, options=o) for i, (u, t, o) in enumerate(reqs)]
    )
    assert all(abs(d.confidence - TAU) > 1e-4 for d in direct), "tau too close to a confidence"
    assert {d.route for d in direct} == {"small", "agent_after_gate"}  # both paths exercised
    for s, d in zip(served_res, direct, strict=True):
        extra = s.model_extra["speceyes"]
        assert s.choices[0].message.content == d.answer
        assert extra["route"] == d.route and extra["small_answer"] == d.small_answer
        assert extra["agent_answer"] == d.agent_answer and extra["tool_calls"] == d.tool_calls
        # Padding in a different batch composition moves logits by ~1e-7.
        assert math.isclose(extra["confidence"], d.confidence, abs_tol=1e-5)
        assert math.isclose(extra["p_tool"], d.p_tool, abs_tol=1e-5)


# ---- bad inputs ---------------------------------------------------------------------------
TEXT = text_part("What color?")


BAD = {
    "not json": (b"{not json", "invalid_json"),
    "not an object": ([1, 2], "invalid_body"),
    "no messages": ({"model": "speceyes"}, "missing_messages"),
    "text only": (
        {"model": "x", "messages": [{"role": "user", "content": "hi"}]},
        "missing_image",
    ),
    "no text": (_user(_img(scene_uri(0))), "missing_text"),
    "bad base64": (_user(_img("data:image/png;base64,@@not-base64@@"), TEXT), "invalid_image"),
    "corrupt image": (
        _user(_img("data:image/png;base64," + base64.b64encode(b"\x89PNG junk").decode()), TEXT),
        "invalid_image",
    ),
    "not an image type": (_user(_img("data:text/plain;base64,aGk="), TEXT), "invalid_image"),
    "remote url": (_user(_img("http://example.com/a.png"), TEXT), "unsupported_image_url"),
    "local file": (_user(_img("file:///etc/hosts"), TEXT), "local_files_disabled"),
    "two images": (_user(_img(scene_uri(0)), _img(scene_uri(1)), TEXT), "too_many_images"),
    "bad part": (_user({"type": "input_audio"}, TEXT), "invalid_content"),
    "bad options": ({**_user(_img(scene_uri(0)), TEXT), "options": "red"}, "invalid_options"),
    "stream": ({**_user(_img(scene_uri(0)), TEXT), "stream": True}, "unsupported_stream"),
}


def test_bad_inputs_get_400_json_and_the_server_keeps_serving(served):
    srv, _, _ = served
    for name, (payload, code) in BAD.items():
        status, body = post(srv, payload)
        assert status == 400, (name, status, body)
        err = body["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == code, (name, err)
        assert err["message"], name
    # The official client raises its typed error with the same body.
    with client(srv) as c, pytest.raises(openai.BadRequestError) as exc:
        c.chat.completions.create(model="speceyes", messages=[{"role": "user", "content": "hi"}])
    assert exc.value.body["code"] == "missing_image"
    status, body = http(srv, "/no/such/path")
    assert status == 404 and body["error"]["code"] == "not_found"
    status, body = post(srv, _user(_img(scene_uri(2)), TEXT))
    assert status == 200 and body["speceyes"]["route"] in ROUTES


def test_local_files_only_when_allowed(q3, q25, tmp_path: Path):
    path = tmp_path / "scene one.png"
    make_scene(size=(64, 48)).save(path)
    funnel = make_funnel(q3, q25)
    with ServerThread(create_app(funnel, allow_local_files=True)) as srv:
        status, body = post(srv, _user(_img(path.as_uri()), TEXT))
        assert status == 200 and body["speceyes"]["route"] in ROUTES
        status, body = post(srv, _user(_img((tmp_path / "missing.png").as_uri()), TEXT))
        assert status == 400 and "not found" in body["error"]["message"]


def test_request_too_large_is_413_json(q3, q25):
    with ServerThread(create_app(make_funnel(q3, q25), max_body_mb=0.01)) as srv:
        big = to_data_uri(make_scene(size=(64, 48))) + "A" * 20_000
        status, body = post(srv, _user(_img(big), TEXT))
        assert status == 413 and body["error"]["code"] == "request_too_large"


# ---- backpressure and timeouts ------------------------------------------------------------
def test_overload_gets_429_and_the_server_recovers(q3, q25):
    funnel = make_funnel(q3, q25)
    # Control-flow test: a wrapper sleeps before delegating to the real run_batch, so that the
    # queue fills up deterministically on any machine.
    spy = Spy(funnel, delay=0.4)
    app = create_app(funnel, batch_size=1, max_wait_ms=0, max_queue=2)
    with ServerThread(app) as srv:

        async def burst():
            c = aclient(srv)
            async with c:
                return await asyncio.gather(
                    *[
                        c.chat.completions.create(model="speceyes", messages=messages(scene_uri(i)))
                        for i in range(8)
                    ],
                    return_exceptions=True,
                )

        out = asyncio.run(burst())
        limited = [o for o in out if isinstance(o, openai.RateLimitError)]
        ok = [o for o in out if not isinstance(o, Exception)]
        assert len(limited) + len(ok) == len(out), out  # nothing else went wrong
        assert limited and len(ok) >= 2 and max(spy.sizes) == 1
        assert limited[0].body["code"] == "queue_full"
        assert limited[0].response.headers["Retry-After"] == "1"
        # Capacity comes back once the queue drains.
        with client(srv) as c:
            r = c.chat.completions.create(model="speceyes", messages=messages(scene_uri(0)))
        assert r.model_extra["speceyes"]["route"] in ROUTES
        samples = parse_prometheus(http(srv, "/metrics")[1])
        assert metric(samples, "speceyes_requests_total", status="429") == len(limited)
        assert metric(samples, "speceyes_requests_total", status="200") == len(ok) + 1
        assert metric(samples, "speceyes_queue_depth") == 0


def test_request_timeout_is_504(q3, q25):
    funnel = make_funnel(q3, q25)
    Spy(funnel, delay=1.0)  # control flow only: the real run_batch answers after the sleep
    with ServerThread(create_app(funnel, request_timeout=0.3)) as srv:
        status, body = post(srv, _user(_img(scene_uri(0)), TEXT))
        assert status == 504 and body["error"]["code"] == "request_timeout"
        assert http(srv, "/health")[1]["queue"] == 0


def test_a_failing_batch_is_500_and_the_next_one_runs(q3, q25, caplog):
    funnel = make_funnel(q3, q25)
    real = funnel.run_batch
    calls = []

    def flaky(queries):  # control flow only: the first batch raises, later ones are real
        calls.append(len(queries))
        if len(calls) == 1:
            raise RuntimeError("device lost")
        return real(queries)

    funnel.run_batch = flaky  # type: ignore[method-assign]
    with ServerThread(create_app(funnel)) as srv, caplog.at_level(logging.ERROR):
        body_bytes = json.dumps(_user(_img(scene_uri(0)), TEXT)).encode()
        status, body, headers = http_full(srv.url, "/v1/chat/completions", body_bytes)
        assert status == 500 and body["error"]["type"] == "server_error"
        # The client learns nothing internal, only the id under which the log has the details.
        rid = headers["X-Request-Id"]
        assert body["error"]["message"] == f"internal error (request id {rid})"
        assert any(rid in r.getMessage() and "device lost" in r.exc_text for r in caplog.records)
        status, body = post(srv, _user(_img(scene_uri(0)), TEXT))
        assert status == 200 and body["speceyes"]["route"] in ROUTES
        samples = parse_prometheus(http(srv, "/metrics")[1])
        assert metric(samples, "speceyes_batch_errors_total") == 1


# ---- health, models, metrics --------------------------------------------------------------
def test_health_models_and_metrics(served):
    srv, funnel, _ = served
    status, health = http(srv, "/health")
    assert status == 200 and health["status"] == "ok" and health["queue"] == 0
    assert health["mode"] == "speceyes" and health["tau"] == TAU
    with client(srv) as c:
        assert [m.id for m in c.models.list()] == ["speceyes"]
        assert c.models.retrieve("speceyes").owned_by == "speceyes"

    before = parse_prometheus(http(srv, "/metrics")[1])
    with client(srv) as c:
        r = c.chat.completions.create(model="speceyes", messages=messages(scene_uri(3)))
    route = r.model_extra["speceyes"]["route"]
    post(srv, {"model": "speceyes"})  # one 400
    status, text = http(srv, "/metrics")
    assert status == 200
    after = parse_prometheus(text)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("speceyes_requests_total", status="200") == 1
    assert delta("speceyes_requests_total", status="400") == 1
    assert delta("speceyes_routes_total", route=route) == 1
    assert delta("speceyes_request_seconds_count") == 1
    assert delta("speceyes_phase_seconds_count", phase="judge") == 1
    assert delta("speceyes_funnel_queries_total") == 1
    assert metric(after, "speceyes_early_agent_loops_total") == funnel.stats.early_agent
    assert metric(after, "speceyes_early_agent_dropped_total") == funnel.stats.agent_dropped
    assert metric(after, "speceyes_queue_depth") == 0
    assert metric(after, "speceyes_beta") == funnel.stats.beta
    assert metric(after, "speceyes_alpha") == pytest.approx(funnel.stats.alpha)
    for phase in ("judge", "small", "gate", "agent"):
        buckets = sorted(
            (float(dict(k[1])["le"]), v)
            for k, v in after.items()
            if k[0] == "speceyes_phase_seconds_bucket" and dict(k[1])["phase"] == phase
        )
        counts = [v for _, v in buckets]
        assert counts == sorted(counts) and buckets[-1][0] == math.inf  # cumulative, ends +Inf
        assert counts[-1] == metric(after, "speceyes_phase_seconds_count", phase=phase)
    assert metric(after, "speceyes_phase_seconds_count", phase="judge") > 0


# ---- the CLI ------------------------------------------------------------------------------
def _serve_cmd(tiny_dirs, *extra: str) -> list[str]:
    """``speceyes serve`` on the tiny models in small-only mode (no agent: quick answers)."""
    cmd = [sys.executable, "-m", "speceyes", "serve", "--small", str(tiny_dirs["qwen3_vl"])]
    return cmd + ["--large", str(tiny_dirs["qwen2_5_vl"]), "--mode", "small", "--port", "0", *extra]


def test_cli_serve_prints_url_answers_and_stops_on_ctrl_c(tiny_dirs):
    proc, url, lines = _start(_serve_cmd(tiny_dirs))
    try:
        with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as c:
            r = c.chat.completions.create(model="speceyes", messages=messages(scene_uri(0)))
        assert r.model_extra["speceyes"]["route"] == "small_only"
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=30)
        time.sleep(0.2)  # let the reader thread drain the last lines
        rest = []
        while not lines.empty():
            rest.append(lines.get())
        assert code == 0, rest  # what the server printed on its way out says why
        assert any("shutting down" in x for x in rest), rest
    finally:
        if proc.poll() is None:
            proc.kill()


def test_cli_serve_takes_the_api_key_from_the_environment(tiny_dirs):
    proc, url, _ = _start(_serve_cmd(tiny_dirs), env={API_KEY_ENV: "from-env"})
    try:
        body = json.dumps(_user(_img(scene_uri(0)), TEXT)).encode()
        status, err, headers = http_full(url, "/v1/chat/completions", body)
        assert status == 401 and err["error"]["code"] == "invalid_api_key"
        assert headers["WWW-Authenticate"] == "Bearer"
        assert http_full(url, "/v1/models")[0] == 401
        assert http_full(url, "/health")[0] == 200  # probes need no key
        bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0, timeout=60)
        with bad, pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model="speceyes", messages=messages(scene_uri(0)))
        good = openai.OpenAI(base_url=url + "/v1", api_key="from-env", max_retries=0, timeout=60)
        with good:
            r = good.chat.completions.create(model="speceyes", messages=messages(scene_uri(0)))
        assert r.model_extra["speceyes"]["route"] == "small_only"
        auth = {"Authorization": "Bearer from-env"}
        assert http_full(url, "/v1/chat/completions", body, auth)[0] == 200
    finally:
        if proc.poll() is None:
            proc.kill()


# ---- hostile inputs -----------------------------------------------------------------------
def test_hostile_requests_get_4xx_and_their_batch_mates_are_answered(served):
    srv, _, spy = served
    good = [
        _user(_img(scene_uri(i)), {"type": "text", "text": f"What color is box {i}?"})
        for i in range(4)
    ]
    bodies: list[tuple[str, bytes, int, str | None, dict[str, str]]] = [
        tuple(h) for h in hostile_requests(scene_uri(0))
    ]
    bodies += [(f"good {i}", json.dumps(g).encode(), 200, None, {}) for i, g in enumerate(good)]
    before = len(spy.sizes)
    with ThreadPoolExecutor(len(bodies)) as pool:  # all at once: hostile ones among valid ones
        got = list(
            pool.map(lambda b: http_full(srv.url, "/v1/chat/completions", b[1], b[4]), bodies)
        )
    for (name, _, status, code, _), (st, body, _) in zip(bodies, got, strict=True):
        assert st == status, (name, st, body)
        if code:
            assert body["error"]["code"] == code and body["error"]["message"], (name, body)
        else:
            assert body["speceyes"]["route"] in ROUTES, (name, body)
    assert sum(spy.sizes[before:]) == len(good)  # no hostile request reached the funnel
    assert http(srv, "/health")[1]["queue"] == 0


def test_decoded_pixels_in_flight_are_bounded(q3, q25):
    funnel = make_funnel(q3, q25)
    spy = Spy(funnel, delay=0.5)  # control flow only: the first request holds its pixels a while
    px = 64 * 48  # scene_uri(0)
    app = create_app(funnel, batch_size=1, max_image_pixels=px, max_pixels_in_flight=px + 100)
    with ServerThread(app) as srv:
        body = json.dumps(_user(_img(scene_uri(0)), TEXT)).encode()
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(http_full, srv.url, "/v1/chat/completions", body)
            deadline = time.monotonic() + 30
            while http(srv, "/health")[1]["inflight"] == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            status, err, headers = http_full(srv.url, "/v1/chat/completions", body)
            assert status == 429 and err["error"]["code"] == "pixel_budget"
            assert headers["Retry-After"] == "1"
            assert first.result()[0] == 200
        status, err, _ = http_full(srv.url, "/v1/chat/completions", body)
        assert status == 200  # the budget came back
        samples = parse_prometheus(http(srv, "/metrics")[1])
        assert metric(samples, "speceyes_pixels_in_flight") == 0
        assert spy.sizes == [1, 1]
        bigger = json.dumps(_user(_img(scene_uri(1)), TEXT)).encode()
        assert http_full(srv.url, "/v1/chat/completions", bigger)[1]["error"]["code"] == (
            "image_too_large"
        )


def test_a_poisoned_query_in_a_batch_is_answered_alone(q3, q25):
    # A 1x300 image: no model's image processor takes its aspect ratio, so loading it refuses
    # it (400, a clear image error) before the funnel; its batch-mates answer.
    funnel = make_funnel(q3, q25)
    poison = to_data_uri(make_scene(size=(300, 1), box=(0, 0, 1, 1)))
    bodies = [json.dumps(_user(_img(scene_uri(i)), TEXT)).encode() for i in range(3)]
    bodies.insert(1, json.dumps(_user(_img(poison), TEXT)).encode())
    with ServerThread(create_app(funnel, batch_size=4, max_wait_ms=500)) as srv:
        with ThreadPoolExecutor(len(bodies)) as pool:
            got = list(pool.map(lambda b: http_full(srv.url, "/v1/chat/completions", b), bodies))
    statuses = [g[0] for g in got]
    assert statuses == [200, 400, 200, 200], got
    assert got[1][1]["error"]["code"] == "invalid_image"
    assert "aspect ratio of 300" in got[1][1]["error"]["message"]
    assert funnel.stats.errors == 0


# ---- authentication -----------------------------------------------------------------------
def test_api_key_is_required_on_every_endpoint_but_health(q3, q25):
    app = create_app(make_funnel(q3, q25), api_key="s3cret")
    with ServerThread(app) as srv:
        for path in ("/v1/models", "/metrics", "/v1/models/speceyes"):
            status, body, headers = http_full(srv.url, path)
            assert status == 401 and body["error"]["code"] == "invalid_api_key", path
            assert headers["WWW-Authenticate"] == "Bearer"
        status, body, _ = http_full(srv.url, "/metrics", headers={"Authorization": "Bearer wrong"})
        assert status == 401
        assert http_full(srv.url, "/metrics", headers={"Authorization": "Bearer s3cret"})[0] == 200
        assert http(srv, "/health")[0] == 200  # probes need no key
        bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0, timeout=60)
        with bad, pytest.raises(openai.AuthenticationError) as exc:
            bad.chat.completions.create(model="speceyes", messages=messages(scene_uri(0)))
        assert exc.value.status_code == 401
        good = openai.OpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0, timeout=60)
        with good:
            r = good.chat.completions.create(model="speceyes", messages=messages(scene_uri(0)))
            assert r.model_extra["speceyes"]["route"] in ROUTES
            assert [m.id for m in good.models.list()] == ["speceyes"]
        samples = parse_prometheus(
            http_full(srv.url, "/metrics", headers={"Authorization": "Bearer s3cret"})[1]
        )
        assert metric(samples, "speceyes_requests_total", status="401") == 1


# ---- responsive under load, pipelined, shutdown -------------------------------------------
def test_health_answers_while_a_batch_runs(q3, q25):
    funnel = make_funnel(q3, q25)
    Spy(funnel, delay=1.0)  # the batch takes a second in the funnel thread
    with ServerThread(create_app(funnel, batch_size=1)) as srv:
        body = json.dumps(_user(_img(scene_uri(0)), TEXT)).encode()
        with ThreadPoolExecutor(1) as pool:
            done = pool.submit(http_full, srv.url, "/v1/chat/completions", body)
            seen = []
            while not done.done():
                seen.append(http(srv, "/health")[1]["inflight"])
            assert done.result()[0] == 200
        assert 1 in seen  # answered while the batch was in the funnel


def test_pipelined_server_answers_as_the_direct_run(q3, q25):
    cfg = FunnelConfig(tau=TAU, batch_size=4, schedule="pipelined", max_agent_loops=4)
    funnel = Funnel(q3, q25, ZoomAgent(q25, max_new_tokens=16), cfg)
    reqs = [(scene_uri(i), f"What color is box {i}?") for i in range(8)]
    with ServerThread(create_app(funnel, max_wait_ms=50)) as srv:
        bodies = [json.dumps(_user(_img(u), {"type": "text", "text": t})).encode() for u, t in reqs]
        with ThreadPoolExecutor(len(bodies)) as pool:
            got = list(pool.map(lambda b: http_full(srv.url, "/v1/chat/completions", b), bodies))
    direct = make_funnel(q3, q25).run_batch(
        [Query(id=str(i), image=u, question=t) for i, (u, t) in enumerate(reqs)]
    )
    assert {d.route for d in direct} == {"small", "agent_after_gate"}
    for (status, body, _), d in zip(got, direct, strict=True):
        assert status == 200
        assert (body["speceyes"]["route"], body["choices"][0]["message"]["content"]) == (
            d.route,
            d.answer,
        )


class _NoModels:  # control flow only: create_app reads the funnel's config, nothing runs
    config = FunnelConfig(batch_size=3)


def test_settings_are_checked_and_options_replace_single_fields():
    stub = _NoModels()
    bad = [
        (ServeSettings(max_queue=0), "max_queue"),
        (ServeSettings(max_wait_ms=-1), "max_wait_ms"),
        (ServeSettings(request_timeout=0), "request_timeout"),
        (ServeSettings(max_option_chars=0), "max_option_chars"),
        (ServeSettings(max_image_pixels=10, max_pixels_in_flight=9), "max_pixels_in_flight"),
        (ServeSettings(api_key="  "), "api_key"),
        (ServeSettings(batch_size=0), "batch_size"),
    ]
    for settings, what in bad:
        with pytest.raises(ValueError, match=what):
            create_app(stub, settings)
    state = create_app(stub, ServeSettings(max_queue=5, model_name="m"))[STATE_KEY]
    assert (state.batch_size, state.max_queue, state.model_name) == (3, 5, "m")  # the funnel's
    state = create_app(stub, ServeSettings(max_queue=5), batch_size=2, max_wait_ms=40)[STATE_KEY]
    assert (state.batch_size, state.max_queue, state.max_wait) == (2, 5, 0.04)
    with pytest.raises(TypeError):
        create_app(stub, no_such_setting=1)


STUCK_SERVER = """
import sys, time
from speceyes.funnel import FunnelConfig, FunnelStats
from speceyes.serve import ServeSettings, serve

class Stuck:  # control flow only: a funnel whose model call never returns
    config, stats = FunnelConfig(batch_size=1), FunnelStats()
    def iter_batches(self, batches):
        for _ in batches:
            time.sleep(3600)
        yield from ()

serve(Stuck(), ServeSettings(port=0, drain_timeout=float(sys.argv[1])))
"""


def _start(
    cmd: list[str], env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, str, queue.Queue[str]]:
    """Start a server process, wait for its "listening on" line; returns it, its URL and its
    output lines (read by a thread: a hung child must fail the test, not block it on readline).
    ``env`` adds variables; a key set in the caller's environment is not inherited."""
    inherited = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    env = {**inherited, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    deadline, seen = time.monotonic() + 90, []
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            seen.append(lines.get(timeout=1))
        except queue.Empty:
            continue
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", seen[-1])
        if m:
            return proc, m.group(1), lines
    proc.kill()
    raise AssertionError("".join(seen))


def test_sigterm_exits_after_the_drain_timeout_even_with_a_stuck_model():
    proc, url, _ = _start([sys.executable, "-c", STUCK_SERVER, "1.0"])
    try:
        body = json.dumps(_user(_img(scene_uri(0)), TEXT)).encode()
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(http_full, url, "/v1/chat/completions", body)
            while http_full(url, "/health")[1]["inflight"] == 0:
                time.sleep(0.02)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
            status, err, _ = fut.result()
        assert status == 503 and err["error"]["code"] == "shutting_down"
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_sigterm_drains_admitted_requests(tiny_dirs):
    proc, url, _ = _start(_serve_cmd(tiny_dirs, "--batch-size", "1", "--max-wait-ms", "0"))
    try:
        body = json.dumps(_user(_img(scene_uri(0)), TEXT)).encode()
        with ThreadPoolExecutor(16) as pool:
            futs = [pool.submit(http_full, url, "/v1/chat/completions", body) for _ in range(16)]
            while True:  # until every request has arrived (admitted, in the funnel or answered)
                health = http_full(url, "/health")[1]
                if health["queue"] + health["inflight"] + sum(f.done() for f in futs) >= 16:
                    break
                time.sleep(0.005)
            proc.send_signal(signal.SIGTERM)  # with requests still queued
            statuses = [f.result()[0] for f in futs]
        assert proc.wait(timeout=60) == 0
        assert statuses == [200] * 16  # every admitted request answered
    finally:
        if proc.poll() is None:
            proc.kill()
