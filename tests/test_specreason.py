"""SpecReason baseline on tiny real models: the small model proposes, the large one scores."""

from __future__ import annotations

import numpy as np
import pytest

from speceyes import prompts
from speceyes.agents.specreason import DIGITS, SpecReasonAgent
from speceyes.funnel import Funnel, FunnelConfig
from tests.test_zoom_agent import q


def test_step_score_is_probability_weighted_digit(q3, q25):
    agent = SpecReasonAgent(q3, q25, max_new_tokens=6)
    loop = agent.start_loop(q(0))
    probs = q25.next_token_probs(
        [[*loop.messages, {"role": "assistant", "content": "x"},
          {"role": "user", "content": prompts.STEP_SCORE_PROMPT}]],
        DIGITS,
    )[0]
    score = agent._scores([loop], ["x"])[0]
    assert score == pytest.approx(float((probs * np.arange(10)).sum() / probs.sum()))
    assert 0 <= score <= 9


@pytest.mark.parametrize("threshold,accepted", [(0.0, True), (10.0, False)])
def test_accept_or_rewrite(q3, q25, threshold, accepted):
    agent = SpecReasonAgent(q3, q25, accept_score=threshold, max_new_tokens=6, max_tool_calls=1)
    out = agent.run([q(0)])[0]
    steps = [s for s in out.trace if s["type"] == "step_score"]
    assert steps and all(s["accepted"] is accepted for s in steps)
    first = next(s for s in out.trace if s["type"] == "assistant")["text"]
    writer = q3 if accepted else q25
    expected = writer.chat([agent.start_loop(q(0)).messages], stop=prompts.DEEPEYES_STOP,
                           max_new_tokens=6)[0].text
    assert first == expected


def test_specreason_mode_in_the_funnel(q3, q25):
    agent = SpecReasonAgent(q3, q25, max_new_tokens=6)
    res = Funnel(q3, q25, agent, FunnelConfig(mode="specreason")).run([q(0), q(1)])
    assert all(r.route == "specreason" and "agent" in r.timings for r in res)
