"""One model input everywhere: every backend reads a checkpoint's pixel limits the same way."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoImageProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from speceyes.backends.base import (
    FAMILY_PIXELS,
    PROCESSOR_CONFIG,
    checkpoint_geometry,
    view_geometry,
)
from speceyes.backends.hf import HFBackend, ModelLoadError
from speceyes.backends.openai import OpenAIBackend
from speceyes.cli import build_parser
from speceyes.factory import BackendSettings, Settings, make_backend
from speceyes.images import resize_for_model
from speceyes.miniworld.demo import MODELS_DIR
from tests.conftest import make_scene
from tests.test_vllm_logic import stand_in_vllm


def _limits(be) -> tuple:
    return be.box_coords, be.factor, be.min_pixels, be.max_pixels


def test_vllm_sees_the_view_transformers_sees(monkeypatch):
    """The bundled mini-world models keep 224x224 views: vLLM took 1036x1036 from the family."""
    stand_in_vllm(monkeypatch)
    folder = MODELS_DIR / "small"
    geometry = checkpoint_geometry("qwen2_5_vl", folder)
    assert geometry.max_pixels == 224 * 224 and geometry.min_pixels == 3136
    engine = make_backend(str(folder), settings=BackendSettings(engine="vllm"))
    assert tuple(geometry) == _limits(engine)
    v = engine.view_of(make_scene(size=(1024, 1024)))
    assert (v.view_w, v.view_h) == (224, 224)
    assert engine.llm.kwargs["mm_processor_kwargs"] == {"min_pixels": 3136, "max_pixels": 50176}
    # transformers' own processor reads the same limits from that file.
    ip = AutoImageProcessor.from_pretrained(folder)
    assert tuple(view_geometry("qwen2_5_vl", ip)) == tuple(geometry)


@pytest.mark.parametrize("name", ["q25", "q3", "real_q25", "real_q3"])
def test_every_backend_takes_the_checkpoints_limits(request, monkeypatch, tiny_dirs, real_dirs,
                                                    name):
    hf: HFBackend = request.getfixturevalue(name)
    folder = (real_dirs if name.startswith("real") else tiny_dirs)[hf.family]
    stand_in_vllm(monkeypatch)
    engine = make_backend(str(folder), settings=BackendSettings(engine="vllm"))
    assert _limits(engine) == _limits(hf) == tuple(checkpoint_geometry(hf.family, folder))
    for size in ((1000, 600), (180, 120)):
        image = make_scene(size=size)
        assert engine.view_of(image) == hf.view_of(image)
        # The processor, given the view the backend made, keeps it as it is.
        view, _ = resize_for_model(image, hf.factor, hf.min_pixels, hf.max_pixels)
        grid = hf.image_processor(images=[view], size=hf._size)["image_grid_thw"][0].tolist()
        patch = hf.factor // hf.merge
        v = hf.view_of(image)
        assert (grid[1] * patch, grid[2] * patch) == (v.view_h, v.view_w) == view.size[::-1]


def test_qwen3_vl_smallest_view_agrees_across_backends(real_q3, monkeypatch):
    """Qwen3-VL's processor grows images to 65536 px; the vLLM and server paths took 4096."""
    stand_in_vllm(monkeypatch)
    served = OpenAIBackend("http://127.0.0.1:9/v1", family="qwen3_vl")  # no folder at hand
    assert real_q3.min_pixels == served.min_pixels == FAMILY_PIXELS["qwen3_vl"][0] == 65536
    image = make_scene(size=(180, 120))
    assert real_q3.view_of(image) == served.view_of(image)
    assert (real_q3.view_of(image).view_w, real_q3.view_of(image).view_h) == (320, 224)
    assert FAMILY_PIXELS["qwen2_5_vl"] == (3136, 12845056)


def test_processor_config_is_read_as_the_processor_reads_it():
    both = {"patch_size": 16, "merge_size": 2, "min_pixels": 4096, "max_pixels": 50176,
            "size": {"shortest_edge": 1024, "longest_edge": 999999}}
    only_size = {"patch_size": 14, "merge_size": 2,
                 "size": {"shortest_edge": 3136, "longest_edge": 200704}}
    for config, family in ((both, "qwen3_vl"), (only_size, "qwen2_5_vl")):
        ours = view_geometry(family, config)
        theirs = Qwen2VLImageProcessorPil(**config)  # min_pixels/max_pixels override size
        assert ours == view_geometry(family, theirs)
        assert (ours.min_pixels, ours.max_pixels) == (
            theirs.size["shortest_edge"], theirs.size["longest_edge"]
        )
    # Neither key: the family's released limits; explicit limits always win.
    assert view_geometry("qwen3_vl", {"patch_size": 16})[2:] == FAMILY_PIXELS["qwen3_vl"]
    assert view_geometry("qwen2_5_vl", only_size, max_pixels=50176).max_pixels == 50176
    assert checkpoint_geometry("qwen3_vl", None) == view_geometry("qwen3_vl")


def test_pixel_flags_reach_every_backend(monkeypatch, tiny_dirs):
    argv = ["ask", "i.png", "q", "--small", "http://127.0.0.1:9/v1", "--large", "l",
            "--small-max-pixels", "50176", "--small-min-pixels", "3136",
            "--large-max-pixels", "100352"]
    b = Settings.from_args(build_parser().parse_args(argv)).backend
    assert b.pixels("small") == (3136, 50176) and b.pixels("large") == (None, 100352)
    served = make_backend("http://127.0.0.1:9/v1", "qwen2_5_vl", b, role="small")
    assert (served.min_pixels, served.max_pixels) == (3136, 50176)
    stand_in_vllm(monkeypatch)
    folder = str(tiny_dirs["qwen2_5_vl"])
    for engine in ("hf", "vllm"):
        be = make_backend(folder, settings=BackendSettings(engine=engine, large_max_pixels=100352))
        assert be.max_pixels == 100352
        assert be.min_pixels == checkpoint_geometry("qwen2_5_vl", folder).min_pixels


# ---- a hub id resolved from the local HF cache ----------------------------------------------------


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, real_dirs):
    """An HF cache holding the real-shaped Qwen2.5-VL as ``org/deepeyes-like`` with its chat
    template only in chat_template.json (not in the tokenizer config), offline."""
    import huggingface_hub.constants as hub

    cache = tmp_path / "hub"
    snapshot = cache / "models--org--deepeyes-like" / "snapshots" / ("0" * 40)
    shutil.copytree(real_dirs["qwen2_5_vl"], snapshot)
    (snapshot / "chat_template.jinja").unlink()
    tok_config = snapshot / "tokenizer_config.json"
    tok_config.write_text(
        json.dumps({k: v for k, v in json.loads(tok_config.read_text()).items()
                    if k != "chat_template"})
    )
    # A smaller view than the release's, so that reading it from the cache is seen.
    pre = snapshot / PROCESSOR_CONFIG
    pre.write_text(json.dumps({**json.loads(pre.read_text()), "max_pixels": 200704}))
    refs = snapshot.parent.parent / "refs"
    refs.mkdir()
    (refs / "main").write_text("0" * 40)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return Path(snapshot)


def test_hub_id_with_the_template_only_in_chat_template_json(hub_cache, monkeypatch):
    be = HFBackend("org/deepeyes-like", dtype="float32")
    want = json.loads((hub_cache / "chat_template.json").read_text())["chat_template"]
    assert be.tokenizer.chat_template == want
    assert be.max_pixels == 200704  # the cached processor config
    text = be.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>")
    stand_in_vllm(monkeypatch)
    engine = make_backend("org/deepeyes-like", "qwen2_5_vl", BackendSettings(engine="vllm"))
    assert _limits(engine) == _limits(be)
    assert engine.decoding == be.decoding == {"policy": "checkpoint", "repetition_penalty": 1.05}
    # With no template anywhere the error says so.
    (hub_cache / "chat_template.json").unlink()
    with pytest.raises(ModelLoadError, match="no chat template"):
        HFBackend("org/deepeyes-like")
