"""What every backend must do for the funnel and every agent, checked by calling it."""

from __future__ import annotations

import numpy as np

from speceyes import gate, prompts
from speceyes.backends.base import DECODING_FIELDS, DECODING_POLICIES, Backend
from speceyes.judging import (
    JUDGE_LOGPROBS,
    JUDGE_WORDS,
    decode_rule_p_tool,
    p_tool_from_word_probs,
    tool_probability,
)
from tests.conftest import make_scene


def _judge_batch() -> list[list[dict]]:
    return [
        prompts.judge_messages(make_scene(), "Is there a red square?"),
        prompts.judge_messages(make_scene(color=(30, 30, 220)), "Is there a red square?"),
    ]


def assert_backend_contract(be: Backend) -> None:
    """Capabilities, geometry, ``next_token_probs``, ``answer``, ``chat`` and the tool
    probability built on them behave as ``Backend`` and ``speceyes.judging`` document them."""
    assert be.box_coords in ("absolute", "relative1000") and isinstance(be.name, str)
    assert be.factor in (28, 32) and 0 < be.min_pixels <= be.max_pixels
    assert be.scores in ("logits", "logprobs")
    for limit in (be.max_images, be.max_logprobs):
        assert limit is None or (isinstance(limit, int) and limit >= 1)
    # The decoding policy and the greedy settings it decodes with, by their generation_config
    # names (a server under "checkpoint" applies its model's own, unknown here).
    assert be.decoding["policy"] in DECODING_POLICIES
    assert set(be.decoding) - {"policy"} <= set(DECODING_FIELDS)
    for size in ((1000, 600), (60, 40)):  # shrunk to max_pixels, grown to min_pixels
        v = be.view_of(make_scene(size=size))
        assert (v.orig_w, v.orig_h) == size
        assert v.view_w % be.factor == 0 and v.view_h % be.factor == 0
        assert be.min_pixels <= v.view_w * v.view_h <= be.max_pixels
    batch = _judge_batch()

    # next_token_probs: probabilities per word; a repeated word is counted once.
    p = be.next_token_probs(batch, ["yes", "no", "Yes", "yes"])
    assert p.shape == (2, 4) and np.all(p >= 0) and np.all(p.sum(axis=1) <= 1 + 1e-6)
    assert np.all(p[:, 3] == 0)
    assert be.next_token_probs([], ["yes"]).shape == (0, 1)

    # answer: greedy text and top-K rows of `scores`, sorted descending, one per token.
    k = 8 if be.max_logprobs is None else min(8, be.max_logprobs)
    answers = be.answer([prompts.small_messages(make_scene(), "What color?")] * 2, 3, k)
    assert len(answers) == 2 and be.answer([], 3, k) == []
    for a in answers:
        assert isinstance(a.text, str) and a.topk.ndim == 2 and a.topk.shape[1] == k
        assert 0 <= a.topk.shape[0] <= 3
        finite = np.where(np.isfinite(a.topk), a.topk, -1e30)
        assert np.all(np.diff(finite, axis=1) <= 0)
        if be.scores == "logprobs":
            assert np.all(a.topk <= 1e-6)  # logprobs never exceed 0
    assert answers[0].text == answers[1].text  # greedy: the same input, the same answer
    conf = gate.batch_confidence([a.topk for a in answers], top_k=k)
    assert np.all(np.isnan(conf) | ((conf >= 0) & (conf <= 1)))

    # chat: one turn per conversation, at most max_new_tokens long, a known finish reason.
    turns = be.chat(batch, max_new_tokens=4)
    assert len(turns) == 2 and be.chat([], max_new_tokens=4) == []
    for t in turns:
        assert isinstance(t.text, str) and t.finish_reason in ("stop", "length")
        assert t.tokens <= 4 and (t.finish_reason == "stop" or t.stop is None)

    # The tool probability: logit mode from the judge words' next-token probabilities,
    # decode mode from a greedy turn and the published rule.
    p_tool = tool_probability(be, batch)
    assert len(p_tool) == 2 and all(0.0 <= x <= 1.0 for x in p_tool)
    want = p_tool_from_word_probs(be.next_token_probs(batch, JUDGE_WORDS, JUDGE_LOGPROBS))
    np.testing.assert_allclose(p_tool, want, rtol=1e-6)
    decoded = tool_probability(be, batch, "decode")
    assert decoded == [decode_rule_p_tool(t.text) for t in be.chat(batch, max_new_tokens=10)]
    assert tool_probability(be, []) == []
