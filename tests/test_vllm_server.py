"""OpenAIBackend against a real vLLM OpenAI server (the bundled mini-world large model).

The server is started once per session from the vLLM environment (tests/vllm_support.py); the
backend gets the model folder's own pixel limits, so it sends the view transformers sees, and
its answers, top-K logprobs and judge probabilities are checked against transformers on the
same folder. Every request goes to 127.0.0.1; each test makes a bounded number of them.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from speceyes import gate, prompts
from speceyes.backends.base import BackendError
from speceyes.bench.scoring import is_correct
from speceyes.images import load_image
from tests.tools.backend_contract import assert_backend_contract
from tests.vllm_support import MAX_IMAGES, MAX_LOGPROBS, SERVED_MODEL

openai = pytest.importorskip("openai", reason="OpenAIBackend needs the openai package")

from speceyes.backends.openai import OpenAIBackend  # noqa: E402

TOP_K = 64  # speceyes' default, the server's --max-logprobs
ATOL = 1e-3


@pytest.fixture(scope="module")
def hf_large():
    from speceyes.backends.hf import HFBackend

    return HFBackend(SERVED_MODEL, dtype="float32")


@pytest.fixture(scope="module")
def served(vllm_server, hf_large):
    with OpenAIBackend(
        vllm_server.url,
        family="qwen2_5_vl",
        max_logprobs=MAX_LOGPROBS,
        max_images=MAX_IMAGES,
        min_pixels=hf_large.min_pixels,  # the folder's preprocessor_config.json limits
        max_pixels=hf_large.max_pixels,
    ) as backend:
        yield backend


@pytest.fixture(scope="module")
def images(miniworld_queries):
    return {q.image: load_image(q.image) for q in miniworld_queries}


def _small(q, images):
    return prompts.small_messages(images[q.image], q.question, q.options)


def test_contract_and_the_served_model(served, vllm_server):
    assert_backend_contract(served)
    assert served.model == str(SERVED_MODEL)  # the first model /v1/models lists
    assert (served.box_coords, served.factor, served.max_logprobs) == ("absolute", 28, 64)


def test_answers_with_top64_logprobs_agree_with_transformers(
    served, hf_large, miniworld_queries, images
):
    batch = [_small(q, images) for q in miniworld_queries]
    got = served.answer(batch, max_new_tokens=8, top_k=TOP_K)
    ref = hf_large.answer(batch, max_new_tokens=8, top_k=TOP_K)
    for q, a, r in zip(miniworld_queries, got, ref, strict=True):
        assert a.text == r.text, q.id
        assert a.topk.shape == r.topk.shape and a.topk.shape[1] == TOP_K, q.id
        assert np.all(np.isfinite(a.topk)) and np.all(np.diff(a.topk, axis=1) <= 0)
        # HF rows are logits, vLLM's logprobs: equal up to one shift per row.
        np.testing.assert_allclose(a.topk - a.topk[:, :1], r.topk - r.topk[:, :1], atol=5 * ATOL)
        conf, ref_conf = (gate.answer_confidence(x.topk, top_k=TOP_K) for x in (a, r))
        assert conf == pytest.approx(ref_conf, abs=ATOL), q.id
    # The trained model answers the mini world: most answers are right.
    right = sum(is_correct(q, a.text) for q, a in zip(miniworld_queries, got, strict=True))
    assert right >= len(batch) // 2


def test_judge_probability_agrees_with_transformers(
    served, hf_large, miniworld_queries, images, caplog
):
    from speceyes.judging import tool_probability

    batch = [
        prompts.judge_messages(images[q.image], q.question, q.options) for q in miniworld_queries
    ]
    with caplog.at_level(logging.WARNING, logger="speceyes.judging"):
        p = tool_probability(served, batch)
    assert not caplog.records  # no fallback: yes/no always among the top 20
    assert p == pytest.approx(tool_probability(hf_large, batch), abs=ATOL)
    assert 0.0 < min(p) and max(p) < 1.0
    assert tool_probability(served, batch[:2]) == pytest.approx(p[:2], abs=1e-6)  # repeatable


def test_chat_turn_with_stop_strings(served, hf_large, miniworld_queries, images):
    q = miniworld_queries[0]
    batch = [prompts.deepeyes_messages(images[q.image], q.question, q.options)]
    (turn,) = served.chat(batch, stop=prompts.DEEPEYES_STOP, max_new_tokens=48)
    (ref,) = hf_large.chat(batch, stop=prompts.DEEPEYES_STOP, max_new_tokens=48)
    assert (turn.text, turn.stop, turn.finish_reason) == (ref.text, ref.stop, ref.finish_reason)
    assert 0 < turn.tokens <= 48


def test_prefix_caching_is_on_and_reported(served, vllm_server, miniworld_queries, images):
    client = openai.OpenAI(base_url=vllm_server.url, api_key="EMPTY", max_retries=0, timeout=60)
    messages = served._convert(_small(miniworld_queries[0], images))
    try:
        usages = [
            client.chat.completions.create(
                model=served.model, messages=messages, max_tokens=1, temperature=0
            ).usage
            for _ in range(2)
        ]
    finally:
        client.close()
    cached = usages[1].prompt_tokens_details.cached_tokens
    assert 0 < cached <= usages[1].prompt_tokens  # the second request reused the first's prefill
    status, metrics = vllm_server.get("/metrics")
    assert status == 200 and "vllm:prefix_cache_hits" in metrics


def test_logprobs_over_the_server_cap_are_refused(vllm_server, miniworld_queries, images):
    over = MAX_LOGPROBS + 1
    with OpenAIBackend(vllm_server.url, family="qwen2_5_vl", max_logprobs=over, max_retries=0) as b:
        with pytest.raises(BackendError, match="refused"):
            b.answer([_small(miniworld_queries[0], images)], max_new_tokens=2, top_k=over)


def test_load_benchmark_app_process_serves_on_the_engine_and_stops(vllm_server, tmp_path):
    """``bench_load_vllm.py --apps process``: a mode's app in a process of its own answers a
    client's request through the real engine, reports its own time, and exits cleanly when the
    benchmark closes its stdin."""
    import asyncio
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_load_vllm.py"
    spec = importlib.util.spec_from_file_location("bench_load_vllm_app", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    queries = bench.question_set(tmp_path / "mw", 1, seed=0)
    bodies = bench.request_bodies(queries)
    url_file = tmp_path / "app.url"
    agent_only = bench.modes_of([])[0]  # the large model only: the one this server serves
    app = bench.AppProcess(
        bench.app_spec(agent_only, vllm_server.url, vllm_server.url, None, None, url_file),
        url_file, tmp_path / "app.log",
    )  # fmt: skip
    try:
        url = app.wait_ready(120)
        run = asyncio.run(bench.closed_loop(url, bodies, queries, 0, 2, 1, warm=0))
    finally:
        app.stop()
    assert run.errors == 0 and len(run.samples) == 2
    for s in run.samples:
        assert s.route == "agent_only" and s.server_s is not None and 0 < s.server_s <= s.latency_s
    assert app.proc.returncode == 0
