"""OpenAIBackend's own logic, no server needed: stop-string inference, logprob rows, word
probabilities from top logprobs, request bodies, construction and a dead server's error.

These run without llama.cpp; the tests against a real server are in test_openai_backend.py.
"""

from __future__ import annotations

import math
import socket
import time

import numpy as np
import pytest

from speceyes import gate, prompts
from speceyes.backends.base import BackendError
from speceyes.backends.openai import OpenAIBackend, word_probs
from speceyes.judging import tool_probability
from tests.conftest import make_scene

pytest.importorskip("openai")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there once the socket closed


def test_dead_server_raises_backend_error_naming_the_url():
    url = dead_url()
    b = OpenAIBackend(url, max_retries=2, backoff=0.05, timeout=5)
    t0 = time.monotonic()
    with pytest.raises(BackendError, match=r"failed after 3 attempts.*127\.0\.0\.1"):
        tool_probability(b, [prompts.judge_messages(make_scene(), "q")])
    assert time.monotonic() - t0 < 10
    assert url in str(b.replica_stats()) and b.replica_stats()[0]["total_failures"] == 3
    b.close()


def test_no_server_needed_to_construct():
    # Construction touches no network; only the first call does.
    b = OpenAIBackend(["http://127.0.0.1:9/v1"], family="qwen3_vl")
    assert b.max_pixels == 16384 * 32 * 32 and b.min_pixels == 65536  # the release processor's
    with pytest.raises(ValueError, match="family"):
        OpenAIBackend("http://127.0.0.1:9/v1", family="llava")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="base_urls"):
        OpenAIBackend([])


def test_continued_assistant_turn_asks_the_server_to_continue():
    """Thyme's sandbox output goes into the same assistant turn: the request says "continue"."""
    b = OpenAIBackend(dead_url(), model="m")
    seen = []

    async def capture(converted, what, **kw):
        seen.append((converted[-1], kw.get("extra_body")))

    b._complete = capture  # the request body is the unit under test; no server involved
    b._send(
        [
            [{"role": "user", "content": "q"}],
            [{"role": "user", "content": "q"},
             {"role": "assistant", "content": "<code>x</code>", "continue": True}],
        ],
        "chat",
        max_tokens=3,
    )
    b.close()
    assert seen[0][1] is None
    assert seen[1][1] == {"continue_final_message": True, "add_generation_prompt": False}
    assert seen[1][0] == {"role": "assistant", "content": "<code>x</code>"}


# ---- which stop string ended a turn, when the server does not say -----------------------------


class _Choice:
    def __init__(self, **extra):
        self.model_extra = extra


@pytest.mark.parametrize(
    ("text", "extra", "want"),
    [
        ('<think>x</think>\n<tool_call>\n{"name": "z"}\n', {}, "</tool_call>"),
        ("<think>x</think> <answer>red", {}, "</answer>"),
        ("<answer>a</answer> <tool_call>{", {}, "</tool_call>"),
        ("<tool_call>{}</tool_call> <answer>b", {}, "</answer>"),
        ("plain end of text", {}, None),
        ("<answer>red", {"stop_reason": None}, None),  # vLLM: EOS ended it
        ("<answer>red", {"stop_reason": "</answer>"}, "</answer>"),
        ("anything", {"matched_stop": "</tool_call>"}, "</tool_call>"),  # SGLang
        ("ends with the stop</answer>", {}, "</answer>"),  # a server that keeps it
    ],
)
def test_which_stop(text, extra, want):
    b = OpenAIBackend("http://127.0.0.1:9/v1", model="m")
    assert b._which_stop(_Choice(**extra), text, prompts.DEEPEYES_STOP) == want


class _Top:
    def __init__(self, token, logprob):
        self.token, self.logprob = token, logprob


class _Entry(_Top):
    def __init__(self, token, tops):
        super().__init__(token, tops[0][1] if tops else None)
        self.top_logprobs = [_Top(t, lp) for t, lp in tops]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_rows_are_sorted_padded_and_eos_is_not_scored():
    b = OpenAIBackend("http://127.0.0.1:9/v1", model="m")
    # Unsorted, one None (-inf), and fewer than K values (llama.cpp merges same-text tokens).
    row = b._row(_Entry("a", [("b", -2.0), ("a", -0.5), ("c", None)]), 4)
    assert row.tolist() == [-0.5, -2.0, -np.inf, -np.inf]
    content = [_Entry("yes", [("yes", -0.1)]), _Entry("<|im_end|>", [("<|im_end|>", -0.2)])]
    assert [e.token for e in b._strip_eos(content, "stop")] == ["yes"]  # vLLM sends EOS
    assert len(b._strip_eos(content, "length")) == 2
    # A padded row cannot be scored: its answer is never accepted.
    conf = gate.batch_confidence([np.stack([row, row])], top_k=4)
    assert not gate.accept(float(conf[0]), 0.0)

# ---- word probabilities from one token's top logprobs ------------------------------------------


def test_word_probs_take_exact_tokens_and_leave_the_rest_unknown():
    top = [("yes", math.log(0.5)), (" yes", math.log(0.2)), ("no", math.log(0.1)), ("7", -1.0)]
    p = word_probs(top, ["yes", "no", "maybe", "7"])
    # " yes" is another token, not the word; "maybe" is beyond the cap: 0, not a share of the rest.
    np.testing.assert_allclose(p, [0.5, 0.1, 0.0, math.exp(-1.0)])
    assert p.sum() < 1.0


def test_word_probs_keep_the_best_of_tokens_that_share_a_text():
    # llama.cpp keys top logprobs by text and vLLM may list two ids that decode alike.
    p = word_probs([("a", -3.0), ("a", -0.5), ("b", -math.inf)], ["a", "b"])
    np.testing.assert_allclose(p, [math.exp(-0.5), 0.0])
    assert word_probs([], ["a"]).tolist() == [0.0]
    # each token counts once: a repeated word, and a blank one, get 0
    assert word_probs([("a", -0.5), (" ", -1.0)], ["a", "a", " "]).tolist() == [math.exp(-0.5), 0, 0]
