"""The middle tier on a real vLLM server: ``--direct-prompt agent-prefix`` reuses the image
prefill that the prefix judge put in the server's cache; the speculative prompt does not.

The funnel is built as a user builds it (the manifest's settings, the small model in process,
the large model behind the session's vLLM server of the bundled mini-world large model, the
DeepEyes agent loop) in ``both`` mode with the ``prefix`` judge and ``--middle-tier``, so every
query runs the judge, the direct answer and the agent. Each query is a scene no earlier request
carried, so its image's blocks can only be in the cache because an earlier call of the same
query put them there. Per query the backend's request record gives each call's prompt tokens
and how many of them the server served from its prefix cache (``cached_tokens``): the direct
answer on the agent's prefix finds the image the judge prefilled, and prefills fewer tokens
than the speculative prompt does, although its prompt is longer (the agent's tool text).
Runs under the vLLM environment's interpreter.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from speceyes import factory
from speceyes.agents.zoom import ZoomAgent
from speceyes.backends.base import checkpoint_geometry
from speceyes.miniworld import demo
from tests.vllm_support import MAX_LOGPROBS, SERVED_MODEL

pytest.importorskip("openai", reason="OpenAIBackend needs the openai package")

SCENES_PER_PROMPT = 2
# Seed 11: no other test shows the server these scenes' images.
POOL_SEED = 11


@pytest.fixture(scope="module")
def fresh_queries(tmp_path_factory):
    """The first question of each of 2 x SCENES_PER_PROMPT scenes (one image each)."""
    from speceyes.bench.datasets import load_jsonl
    from speceyes.miniworld.splits import level_defaults, make_split

    canvas, clutter = level_defaults(1)
    out = tmp_path_factory.mktemp("miniworld-fresh")
    n = 2 * SCENES_PER_PROMPT
    make_split(out, "test", n, seed=POOL_SEED, canvas=canvas, clutter=clutter, level=1)
    firsts = [q for q in load_jsonl(out / "questions.jsonl") if q.id.endswith("-q0")]
    assert len({q.image for q in firsts}) == n
    return firsts


def middle_tier_funnel(url: str, direct_prompt: str):
    """``--large URL --max-logprobs 64 --large-min-pixels .. --large-max-pixels .. --agent
    deepeyes --mode both --judge prefix --middle-tier --direct-prompt D --batch-size 1``."""
    s = factory.Settings.from_manifest(demo.MODELS_DIR / factory.MANIFEST)
    _, _, lo, hi = checkpoint_geometry("qwen2_5_vl", SERVED_MODEL)
    backend = replace(
        s.backend, max_logprobs=MAX_LOGPROBS, large_min_pixels=lo, large_max_pixels=hi
    )
    agent = factory.AgentSettings(kind=ZoomAgent.name, max_tool_calls=1, max_new_tokens=32)
    s = replace(s, large=url, backend=backend, agent=agent)
    return factory.build_funnel(
        s.with_funnel(mode="both", judge="prefix", batch_size=1, middle_tier=True,
                      direct_prompt=direct_prompt)
    )  # fmt: skip


def direct_calls(vllm_server, queries, direct_prompt: str):
    """Per query: (its judge call, its direct answer call), as the backend recorded them."""
    funnel = middle_tier_funnel(vllm_server.url, direct_prompt)
    out = []
    for q in queries:
        seen = len(funnel.large.recent_requests())
        (result,) = funnel.run([q])
        assert result.error is None and result.p_tool is not None, q.id
        assert [s["stage"] for s in result.stages][-1] == "large_direct", q.id
        calls = funnel.large.recent_requests()[seen:]
        kinds = [c.what for c in calls]
        # the judge first, then the direct answer, then the agent's turns
        assert kinds[:2] == ["next token", "answer"] and set(kinds[2:]) == {"chat"}, kinds
        out.append((calls[0], calls[1]))
    return out


def test_the_direct_answer_on_the_agents_prefix_reuses_the_judges_image_prefill(
    vllm_server, fresh_queries
):
    shared = direct_calls(vllm_server, fresh_queries[:SCENES_PER_PROMPT], "agent-prefix")
    apart = direct_calls(vllm_server, fresh_queries[SCENES_PER_PROMPT:], "speculative")
    for judge, direct in shared:
        # it found what the judge found (shared text) and the judge's image blocks besides
        assert direct.cached_tokens > judge.cached_tokens >= 0, (judge, direct)
    shared_work = [d.prompt_tokens - d.cached_tokens for _, d in shared]
    apart_work = [d.prompt_tokens - d.cached_tokens for _, d in apart]
    # the speculative prompt is shorter, yet prefills more: its image is not in the cache
    assert max(d.prompt_tokens for _, d in apart) < min(d.prompt_tokens for _, d in shared)
    assert max(shared_work) < min(apart_work), (shared_work, apart_work)
