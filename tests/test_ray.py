"""``speceyes eval --ray`` and the Ray Serve app on the tiny real models, in one Ray session
(skipped without the extra speceyes[ray], whose missing-extra error is tested here too).

The session is local (127.0.0.1, 2 CPUs, no dashboard, usage statistics off) and shared by the
module: Ray fixes two of its ports (44217, 44227), so Ray tests run one session at a time.

* A 2-shard ``eval --ray`` whose shard 0 actor exits abruptly after its first record equals the
  same eval run whole in this process (rows but their timings, metrics, config): Ray restarts
  the actor, which resumes its shard.
* The Ray Serve app (funnel ingress over the small and large model deployments) answers the
  official openai client as ``speceyes serve`` does on the same models, API key included.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import sys
import urllib.request
from collections.abc import Iterator

import pytest

openai = pytest.importorskip("openai")

from speceyes.bench.shards import Shard  # noqa: E402
from speceyes.cli import build_parser  # noqa: E402
from speceyes.rundir import RunDir  # noqa: E402
from speceyes.scale.ray_eval import EXIT_AFTER_ENV, shard_folder  # noqa: E402
from tests.test_serve import TAU, messages, scene_uri  # noqa: E402
from tests.test_shards import N_PER_CAT, _eval, _eval_args, _untimed, tiny_vstar  # noqa: E402
from tests.tools.server_thread import ServerThread  # noqa: E402

API_KEY = "ray-test-key"


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    ray = pytest.importorskip("ray")
    saved = os.environ.get("RAY_USAGE_STATS_ENABLED")
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # no usage report leaves the machine
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        object_store_memory=200 * 1024**2,
        log_to_driver=False,
    )
    try:
        yield
    finally:
        from ray import serve

        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            if saved is None:
                os.environ.pop("RAY_USAGE_STATS_ENABLED", None)
            else:
                os.environ["RAY_USAGE_STATS_ENABLED"] = saved


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Torch on one thread, as in a Ray actor of one CPU (Ray sets OMP_NUM_THREADS to an
    actor's CPUs): another thread count sums in another order and moves the last bits."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def vstar(tmp_path_factory):
    return tiny_vstar(tmp_path_factory.mktemp("vstar-ray") / "vstar", N_PER_CAT)


# ---------------------------------------------------------------------------- eval --ray


def test_without_ray_the_error_names_the_extra(tiny_dirs, vstar, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed: import fails
    args = _eval_args(tiny_dirs, vstar, tmp_path / "run", "--ray", "local", "--shards", "2")
    with pytest.raises(ImportError, match=re.escape('pip install "speceyes[ray]"')):
        args.func(args)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_ray_eval_with_a_killed_actor_equals_the_whole_run(
    ray_session, tiny_dirs, vstar, tmp_path, monkeypatch
):
    from speceyes.factory import Settings, build_funnel

    whole = tmp_path / "whole"
    args = _eval_args(tiny_dirs, vstar, whole)
    with one_thread():
        _eval(args, build_funnel(Settings.from_args(args)))

    out = tmp_path / "ray"
    monkeypatch.setenv(EXIT_AFTER_ENV, "0:1")  # shard 0's actor dies after its first record
    args = _eval_args(tiny_dirs, vstar, out, "--ray", "auto", "--shards", "2")
    assert args.func(args) == 0

    segments = [RunDir(shard_folder(out, Shard(i, 2))).read_state()["segments"] for i in range(2)]
    assert len(segments[0]) == 2, "shard 0 ran twice: the actor was restarted and resumed"
    assert len(segments[1]) == 1
    got, want = RunDir(out).records(), RunDir(whole).records()
    assert [_untimed(r) for r in got] == [_untimed(r) for r in want]
    res, ref = RunDir(out).read_results(), RunDir(whole).read_results()
    for key in ("metrics", "accuracy", "n", "n_errors", "beta", "alpha_accept", "routes"):
        assert res[key] == ref[key], key
    assert res["config"] == ref["config"]
    assert [m["shard"] for m in RunDir(out).read_state()["merged_from"]] == ["0/2", "1/2"]


@pytest.mark.slow
def test_ray_eval_refuses_before_starting_actors(ray_session, tiny_dirs, vstar, tmp_path):
    args = _eval_args(tiny_dirs, vstar, tmp_path / "a", "--ray", "auto", "--shard", "0/2")
    with pytest.raises(ValueError, match="drop --shard"):
        args.func(args)
    # 6 queries cannot fill 64 shards.
    args = _eval_args(tiny_dirs, vstar, tmp_path / "b", "--ray", "auto", "--shards", "64")
    with pytest.raises(ValueError, match="would hold none of the 6 queries"):
        args.func(args)
    # Shard folders of an earlier run are continued only with --resume.
    stale = shard_folder(tmp_path / "c", Shard(1, 2))
    stale.mkdir(parents=True)
    (stale / "samples.jsonl").write_text("")
    args = _eval_args(tiny_dirs, vstar, tmp_path / "c", "--ray", "auto", "--shards", "2")
    with pytest.raises(Exception, match="pass --resume"):
        args.func(args)


# ---------------------------------------------------------------------------- Ray Serve


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_flags(tiny_dirs) -> dict[str, str]:
    return {
        "small": str(tiny_dirs["qwen3_vl"]),
        "large": str(tiny_dirs["qwen2_5_vl"]),
        "tau": str(TAU),
        "agent_max_tokens": "16",
        "batch_size": "1",
        "api_key": API_KEY,
    }


def _ask(url: str, n: int) -> list[dict]:
    with openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        out = []
        for i in range(n):  # one at a time: each request is a batch of its own on both servers
            reply = c.chat.completions.create(
                model="speceyes",
                messages=messages(scene_uri(i), f"What color is box {i}?"),
                extra_body={"options": ["red", "blue"]} if i % 2 else None,
            )
            out.append(reply.model_dump())
    return out


def _answers(replies: list[dict]) -> list[tuple]:
    return [
        (
            r["choices"][0]["message"]["content"],
            r["speceyes"]["route"],
            r["speceyes"]["small_answer"],
            r["speceyes"]["agent_answer"],
            r["speceyes"]["confidence"],
            r["speceyes"]["tool_calls"],
        )
        for r in replies
    ]


@pytest.mark.slow
def test_ray_serve_app_answers_as_speceyes_serve(ray_session, tiny_dirs):
    from ray import serve

    from speceyes.cli.serve import serve_settings
    from speceyes.factory import Settings, build_funnel
    from speceyes.scale.ray_serve import APP_NAME, build_app
    from speceyes.serve import create_app

    flags = _serve_flags(tiny_dirs)
    argv = ["serve"] + [x for k, v in flags.items() for x in (f"--{k.replace('_', '-')}", v)]
    args = build_parser().parse_args(argv)
    funnel = build_funnel(Settings.from_args(args))
    n = 4
    app = create_app(funnel, serve_settings(args, funnel.config.batch_size))
    with one_thread(), ServerThread(app) as srv:
        want = _ask(srv.url, n)

    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(flags), name=APP_NAME, route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    try:
        got = _ask(url, n)
        assert _answers(got) == _answers(want)
        assert {r["speceyes"]["route"] for r in got} == {"small", "agent_after_gate"}

        bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0, timeout=60)
        with bad, pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model="speceyes", messages=messages(scene_uri(0)))
        with urllib.request.urlopen(url + "/health", timeout=60) as resp:  # open without key
            health = json.loads(resp.read())
        assert health["status"] == "ok" and health["tau"] == TAU and health["queries"] == n
    finally:
        serve.delete(APP_NAME)
