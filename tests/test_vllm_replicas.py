"""Replica affinity on two real vLLM servers of the bundled mini-world large model.

The funnel is built as a user builds it: the manifest's settings, the small model in process
from its folder, and the large model as two comma-separated server URLs (``--large
URL1,URL2``), with the DeepEyes agent loop, in ``both`` mode (judge, speculative answer, gate
and agent for every query) with the ``prefix`` judge, whose prompt is the agent's first-turn
prompt plus the judge question. Queries go one at a time, so the load bound never moves a call
(tests/test_gateway.py covers the bound), each on its own scene.

Per query the servers' own counters (``/metrics``) show that its judge call and every agent
turn reached one server and the other got nothing; the backend's request record names that
server for each call and reports the prompt tokens each call found in the server's prefix
cache, which add up to the server's own count. The agent's first turn finds more of its prompt
cached than the judge did: the judge found only text earlier queries share (no request before
it carried its image), the turn also the blocks holding the image, which only the judge had
put in that server's cache. Queries are drawn from a pool of scenes until both servers have
served some (each scene's image places it: a pool of 16 leaves one replica idle with
probability 2**-15).

The replicas are the session's vLLM server and a second one started beside it (about 2.6 GiB
of memory each, measured as proportional set size over the server's processes, 1 GiB of it
the KV cache; see tests/vllm_support.py). Runs under the vLLM environment's interpreter.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from speceyes import factory
from speceyes.agents.zoom import ZoomAgent
from speceyes.backends.base import checkpoint_geometry
from speceyes.miniworld import demo
from tests.vllm_support import ALIAS, MAX_LOGPROBS, SERVED_MODEL, session_server_and_replica

pytest.importorskip("openai", reason="OpenAIBackend needs the openai package")

FINISHED = "vllm:request_success_total"  # requests a server has answered
CACHED = "vllm:prompt_tokens_cached_total"  # prompt tokens it served from its prefix cache
POOL_SCENES = 16
MIN_QUERIES = 6
# Seed 7, not the session's seed 0: no earlier test has shown a server these images.
POOL_SEED = 7


@pytest.fixture(scope="module")
def replicas(request, tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm-replica") / "server.log"
    with session_server_and_replica(request, log) as servers:
        yield servers


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """(first question of each scene, a second question on the first scene)."""
    from speceyes.bench.datasets import load_jsonl
    from speceyes.miniworld.splits import level_defaults, make_split

    canvas, clutter = level_defaults(1)
    out = tmp_path_factory.mktemp("miniworld-pool")
    make_split(
        out, "test", POOL_SCENES, seed=POOL_SEED, canvas=canvas, clutter=clutter, level=1
    )
    queries = list(load_jsonl(out / "questions.jsonl"))
    firsts = [q for q in queries if q.id.endswith("-q0")]
    again = next(q for q in queries if q.image == firsts[0].image and q.id.endswith("-q1"))
    assert len(firsts) == POOL_SCENES and len({q.image for q in firsts}) == POOL_SCENES
    return firsts, again


def replicated_funnel(urls: list[str]):
    """The mini-world demo's funnel with its large model behind ``urls``, as
    ``--large URL1,URL2 --max-logprobs 64 --large-min-pixels ... --large-max-pixels ...
    --agent deepeyes --mode both --judge prefix --batch-size 1`` builds it."""
    s = factory.Settings.from_manifest(demo.MODELS_DIR / factory.MANIFEST)
    # A client cannot read the served folder's pixel limits from a URL: they are given.
    _, _, lo, hi = checkpoint_geometry("qwen2_5_vl", SERVED_MODEL)
    backend = replace(
        s.backend, max_logprobs=MAX_LOGPROBS, large_min_pixels=lo, large_max_pixels=hi
    )
    agent = factory.AgentSettings(kind=ZoomAgent.name, max_tool_calls=2, max_new_tokens=48)
    # The second replica serves the model under two names: the one both serve is named.
    large = f"{','.join(urls)}#model={SERVED_MODEL}"
    s = replace(s, large=large, backend=backend, agent=agent)
    return factory.build_funnel(s.with_funnel(mode="both", judge="prefix", batch_size=1))


def run_one(funnel, replicas, query):
    """Run ``query``; returns (its result, its model calls as the backend recorded them, the
    requests each server answered meanwhile, the prompt tokens each served from its cache)."""
    large = funnel.large
    before = [s.counters() for s in replicas]
    seen = len(large.recent_requests())
    (result,) = funnel.run([query])
    after = [s.counters() for s in replicas]
    calls = large.recent_requests()[seen:]
    finished = [a[FINISHED] - b.get(FINISHED, 0.0) for a, b in zip(after, before, strict=True)]
    cached = [a[CACHED] - b.get(CACHED, 0.0) for a, b in zip(after, before, strict=True)]
    return result, calls, finished, cached


def test_a_querys_judge_and_agent_turns_reach_one_replica_and_its_cache(replicas, pool):
    firsts, again = pool
    urls = [s.url for s in replicas]
    funnel = replicated_funnel(urls)
    homes: dict[str, int] = {}  # query id -> index of the server that answered it
    judge_cached, turn_cached = [], []  # per query: prompt tokens its judge / first turn found
    try:
        assert type(funnel.large).__name__ == "OpenAIBackend" and funnel.large._urls == urls
        for q in firsts:
            if len(homes) >= MIN_QUERIES and set(homes.values()) == {0, 1}:
                break
            result, calls, finished, cached = run_one(funnel, replicas, q)
            turns = sum(t["type"] == "assistant" for t in result.trace)
            assert result.error is None and result.p_tool is not None and turns >= 1, q.id
            # (a) The servers' own count: the judge and every agent turn on one server.
            assert sorted(finished) == [0, 1 + turns], f"{q.id}: split {finished}"
            home = finished.index(1 + turns)
            assert [c.what for c in calls] == ["next token"] + ["chat"] * turns, q.id
            assert {c.url for c in calls} == {urls[home]} and len({c.key for c in calls}) == 1
            # The record's cached tokens are the server's: per call, summed per query.
            assert sum(c.cached_tokens for c in calls) == cached[home] and cached[1 - home] == 0
            # (c) The first turn reuses the judge's prefill, image included.
            judge, first_turn = calls[0], calls[1]
            assert first_turn.cached_tokens > judge.cached_tokens >= 0, (q.id, judge, first_turn)
            assert first_turn.cached_tokens < first_turn.prompt_tokens
            judge_cached.append(judge.cached_tokens)
            turn_cached.append(first_turn.cached_tokens)
            homes[q.id] = home
        # Every judge prompt begins with the same text and no judge's image was cached before
        # it: what a first turn finds beyond the most any judge found is its image's blocks.
        assert min(turn_cached) > max(judge_cached), (judge_cached, turn_cached)
        # (b) Images spread over the replicas.
        assert set(homes.values()) == {0, 1}, f"every query went to one replica: {homes}"
        # Another question on a scene already asked goes where that scene's image went.
        _, calls, finished, _ = run_one(funnel, replicas, again)
        assert finished[1 - homes[firsts[0].id]] == 0 and {c.url for c in calls} == {
            urls[homes[firsts[0].id]]
        }
    finally:
        funnel.large.close()


def test_a_server_with_two_model_names_needs_one_named(replicas):
    """Behind one URL a gateway may serve several models: unnamed, the backend refuses and
    lists them; named (``URL#model=ID``, as ``--large-model ID`` writes it), its calls carry
    that id and the server answers them under it."""
    from speceyes.backends.base import BackendError
    from speceyes.backends.openai import OpenAIBackend

    url = replicas[1].url
    unnamed = OpenAIBackend(url, family="qwen2_5_vl", max_logprobs=MAX_LOGPROBS)
    try:
        with pytest.raises(BackendError, match="serves 2 models") as e:
            unnamed.check_servers()
        assert ALIAS in str(e.value) and str(SERVED_MODEL) in str(e.value)
    finally:
        unnamed.close()
    named = OpenAIBackend(url, ALIAS, family="qwen2_5_vl", max_logprobs=MAX_LOGPROBS)
    try:
        named.check_servers()
        assert named.model == ALIAS
        before = replicas[1].counters().get(FINISHED, 0.0)
        (turn,) = named.chat([[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]],
                             max_new_tokens=2)
        assert isinstance(turn.text, str)
        assert replicas[1].counters()[FINISHED] == before + 1
    finally:
        named.close()
