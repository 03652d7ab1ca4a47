"""A blank speculative answer is never accepted, however peaked its logits."""

from __future__ import annotations

import numpy as np
import pytest

from speceyes import gate
from speceyes.agents.zoom import ZoomAgent
from speceyes.funnel import Funnel, FunnelConfig
from speceyes.protocols import FAIR, PUBLISHED
from speceyes.types import Query, SpecAnswer
from tests.conftest import make_scene


def _peaked(tokens: int, k: int = 64) -> np.ndarray:
    """Top-K logprob rows of a token the model is all but sure of."""
    rows = np.full((tokens, k), -30.0)
    rows[:, 0] = -1e-6
    return rows


def test_blank_answers_score_zero_under_every_protocol_and_aggregation():
    answers = [
        SpecAnswer(text="\n\n", topk=_peaked(2), token_ids=[198, 198]),
        SpecAnswer(text="  ", topk=_peaked(1), token_ids=[220]),
        SpecAnswer(text="red", topk=_peaked(1), token_ids=[1151]),
        SpecAnswer(text="", topk=np.zeros((0, 64))),  # no tokens: no score at all
    ]
    raw = gate.batch_confidence([a.topk for a in answers[:3]])
    assert np.all(raw > 0.99)  # the logits alone would accept them
    for protocol in (FAIR, PUBLISHED):
        for agg in gate.AGGREGATIONS:
            conf = protocol.confidence(None, answers, top_k=64, agg=agg, scale=0.6)
            assert conf[0] == conf[1] == gate.BLANK_CONFIDENCE == 0.0, (protocol.name, agg)
            assert conf[2] > 0.9 and np.isnan(conf[3])
            assert not any(gate.accept(c, 0.0) for c in conf[[0, 1, 3]])
    assert gate.is_blank(" \t\n") and gate.is_blank(None) and not gate.is_blank(" a ")


class _Whitespace:
    """A small model that answers with newlines it is sure of (a random tiny model did)."""

    name, box_coords, factor, min_pixels, max_pixels = "ws", "absolute", 28, 3136, 50176
    scores, max_images, max_logprobs = "logprobs", None, None
    decoding = {"policy": "checkpoint", "repetition_penalty": 1.0}

    def __init__(self, real):
        self.real = real

    def view_of(self, image):
        return self.real.view_of(image)

    def next_token_probs(self, batch, words, top_logprobs=None):
        out = np.zeros((len(batch), len(words)))
        out[:, [i for i, w in enumerate(words) if w.strip().lower() == "no"][:1]] = 1.0
        return out  # the judge says: no tools

    def answer(self, batch, max_new_tokens=20, top_k=64):
        return [SpecAnswer(text="\n" * 3, topk=_peaked(3, top_k), token_ids=[198] * 3)
                for _ in batch]

    def chat(self, batch, stop=(), max_new_tokens=1024):
        return self.real.chat(batch, stop, max_new_tokens)


def test_blank_answer_goes_to_the_agent(q25):
    queries = [Query(id=f"q{i}", image=make_scene(), question="Color?", options=["red", "blue"])
               for i in range(2)]
    funnel = Funnel(_Whitespace(q25), q25, ZoomAgent(q25, max_new_tokens=8),
                    FunnelConfig(tau=0.5))
    for r in funnel.run(queries):
        assert r.judge_tool is False and r.small_answer.strip() == ""
        assert r.confidence == pytest.approx(0.0) and r.route == "agent_after_gate"
    assert funnel.stats.blank == 2 and funnel.stats.accepted == 0  # counted
    from speceyes.bench.runner import summarize

    assert summarize([r.to_dict() for r in funnel.run(queries)], "jsonl")["n_blank_answers"] == 2
