"""Judge variants over a real OpenAI-compatible server (llama.cpp), as tests/test_openai_backend.py
serves it: one tiny Qwen2.5-VL GGUF (the yes/no edit applied) plays both the small and the large
model, so every variant's messages - the judge turn after a shared prefix included - go through
a real chat template, image encoder and logprobs API."""

from __future__ import annotations

import logging
import os

import pytest

from speceyes.agents.zoom import ZoomAgent
from speceyes.funnel import JUDGES, PREFIX_JUDGE_TEXT, Funnel, FunnelConfig
from tests.test_judge_variants import Recorder, queries

# Skips this module, as that one, when the server's packages are missing (fails under CI).
from tests.test_openai_backend import GREEDY, SMALL_PIXELS, OpenAIBackend, _boost_yes_no, _Server


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    from speceyes.tiny import build_tiny_model
    from tests.tools.tiny_gguf import convert_both, find_converter

    converter = find_converter()
    if converter is None:
        why = "llama.cpp's converter is not cached: `python -m tests.tools.tiny_gguf --fetch-converter-only`"
        if os.environ.get("CI"):
            pytest.fail(why, pytrace=False)
        pytest.skip(why)
    root = tmp_path_factory.mktemp("judge-gguf")
    hf = build_tiny_model(
        root / "hf", "qwen2_5_vl", vision_depth=3, seed=2, lm_head_scale=4.0, vocab="qwen"
    )
    _boost_yes_no(hf)
    model, mmproj = convert_both(hf, root / "m.gguf", root / "mmproj.gguf", converter=converter)
    server = _Server(model, mmproj, root / "server.log")
    try:
        with OpenAIBackend(server.url, family="qwen2_5_vl", extra_body=GREEDY, **SMALL_PIXELS) as b:
            yield b
    finally:
        server.stop()


def _run(backend, **cfg):
    log: list = []
    small, large = Recorder(backend, log, "small"), Recorder(backend, log, "large")
    agent = ZoomAgent(large, max_new_tokens=12, max_tool_calls=1)
    f = Funnel(small, large, agent, FunnelConfig(top_k=20, max_new_tokens=3, **cfg))
    return f, f.run(queries(2)), log


@pytest.mark.parametrize("judge", JUDGES)
def test_every_judge_variant_over_the_server(backend, judge, caplog):
    with caplog.at_level(logging.WARNING, logger="speceyes.judging"):
        f, res, log = _run(backend, judge=judge, tau=0.5)
    assert [r.id for r in res] == ["q0", "q1"]
    assert all(r.error is None and r.route != "error" for r in res)
    judges = [c for c in log if c[1] == "judge"]
    if judge == "none":
        assert judges == [] and all(r.p_tool is None for r in res)
        return
    assert [c[0] for c in judges] == ["small" if "small" in judge else "large"]
    assert all(0.0 <= r.p_tool <= 1.0 for r in res)
    assert "neither yes nor no" not in caplog.text  # both came back among the top logprobs
    if judge.endswith("prefix"):
        for m in judges[0][2]:
            assert m[-1]["content"][0]["text"] == PREFIX_JUDGE_TEXT


def test_prefix_judge_over_the_server_then_the_agent_shares_its_prompt(backend):
    f, res, log = _run(backend, judge="prefix", judge_threshold=0.0)  # all to the agent
    judge = next(c for c in log if c[1] == "judge")
    first_chat = next(c for c in log if c[1] == "chat")
    # the same images reach the server as the same data URIs: the prefix (image included) is
    # byte-identical in the two requests
    for jm, am in zip(judge[2], first_chat[2], strict=True):
        assert backend._convert(jm)[:-1] == backend._convert(am)
    assert all(r.route == "agent_after_judge" for r in res)


def test_judge_view_budget_over_the_server(backend):
    f, res, log = _run(backend, judge="large", judge_max_pixels=16 * 28 * 28, tau=0.5)
    judge = next(c for c in log if c[1] == "judge")
    assert all(m[1]["content"][0]["image"].width * m[1]["content"][0]["image"].height
               <= 16 * 28 * 28 for m in judge[2])
    assert all(r.error is None for r in res)
