"""The vLLM backend runs only where vLLM and a CUDA device exist; elsewhere it skips cleanly."""

from __future__ import annotations

import numpy as np
import pytest

from speceyes import gate, prompts
from speceyes.judging import tool_probability
from tests.conftest import make_scene

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (CUDA-only wheels)")
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():  # pragma: no cover - depends on the machine
    pytest.skip("vLLM needs a CUDA device", allow_module_level=True)


@pytest.fixture(scope="module")
def engine(tiny_dirs):  # pragma: no cover - GPU only
    from speceyes.backends.vllm import VLLMBackend

    return VLLMBackend(str(tiny_dirs["qwen2_5_vl"]), gpu_memory_utilization=0.2, max_model_len=4096)


def test_judge_answer_chat_on_gpu(engine):  # pragma: no cover - GPU only
    img = make_scene()
    p = tool_probability(engine, [prompts.judge_messages(img, "Is it red?")])
    assert 0 <= p[0] <= 1
    a = engine.answer([prompts.small_messages(img, "Color?")], max_new_tokens=5, top_k=20)[0]
    assert a.topk.shape == (len(a.token_ids), 20)
    if len(a.token_ids):
        assert np.isfinite(gate.answer_confidence(a.topk, top_k=20))
    t = engine.chat([prompts.deepeyes_messages(img, "Color?")], stop=prompts.DEEPEYES_STOP, max_new_tokens=8)
    assert t[0].tokens <= 8
