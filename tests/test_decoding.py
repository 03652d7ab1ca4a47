"""One decoding policy for every backend: the checkpoint's generation_config or plain greedy."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from speceyes import prompts
from speceyes.backends.base import decoding_settings
from speceyes.backends.hf import HFBackend
from speceyes.backends.openai import OpenAIBackend
from speceyes.cli import main
from speceyes.factory import BackendSettings, make_backend
from speceyes.rundir import RunDir
from tests.conftest import make_scene
from tests.test_vllm_logic import stand_in_vllm

PENALTY = 1.05  # Qwen2.5-VL-Instruct's generation_config (and its fine-tunes')


@pytest.fixture(scope="module")
def penalised(tiny_dirs, tmp_path_factory):
    """The tiny Qwen2.5-VL checkpoint with a repetition penalty in its generation_config."""
    folder = tmp_path_factory.mktemp("penalised") / "q25"
    shutil.copytree(tiny_dirs["qwen2_5_vl"], folder)
    path = folder / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "repetition_penalty": PENALTY}))
    return folder


def _msgs():
    return [prompts.small_messages(make_scene(), "What color is the square?", ["red", "green"])]


def test_settings_follow_the_checkpoint_or_are_neutral():
    assert decoding_settings("checkpoint", {"repetition_penalty": 1.05, "top_k": 1}) == {
        "repetition_penalty": 1.05
    }
    assert decoding_settings("checkpoint", None) == {"repetition_penalty": 1.0}
    assert decoding_settings("checkpoint", {"repetition_penalty": None}) == {
        "repetition_penalty": 1.0
    }
    assert decoding_settings("greedy-plain", {"repetition_penalty": 1.05}) == {
        "repetition_penalty": 1.0
    }
    with pytest.raises(ValueError, match="greedy-plain"):
        decoding_settings("sampled", None)


def test_hf_decodes_as_generate_does_or_plain(penalised):
    msgs = _msgs()
    follow = HFBackend(penalised)
    plain = HFBackend(penalised, decoding="greedy-plain")
    assert follow.decoding == {"policy": "checkpoint", "repetition_penalty": PENALTY}
    assert plain.decoding == {"policy": "greedy-plain", "repetition_penalty": 1.0}
    inputs = follow._prepare(msgs)
    n = inputs["input_ids"].shape[1]

    def generate(**kw) -> list[int]:
        with torch.inference_mode():
            out = follow.model.generate(
                **inputs, do_sample=False, max_new_tokens=12, pad_token_id=0, **kw
            )
        return follow._trim(out[0, n:].tolist())

    # "checkpoint" is what transformers' generate does with the checkpoint's own config.
    assert follow.answer(msgs, max_new_tokens=12)[0].token_ids == generate()
    assert plain.answer(msgs, max_new_tokens=12)[0].token_ids == generate(repetition_penalty=1.0)
    assert generate() != generate(repetition_penalty=1.0)  # the penalty changes this answer
    assert follow.chat(msgs, max_new_tokens=12)[0].text != plain.chat(msgs, max_new_tokens=12)[0].text


def test_vllm_engine_decodes_with_the_same_settings(penalised, monkeypatch):
    stand_in_vllm(monkeypatch)
    hf = HFBackend(penalised)
    for policy in ("checkpoint", "greedy-plain"):
        be = make_backend(str(penalised), settings=BackendSettings(engine="vllm", decoding=policy))
        want = PENALTY if policy == "checkpoint" else 1.0
        assert be.decoding == {"policy": policy, "repetition_penalty": want}
        be.answer(_msgs(), max_new_tokens=3, top_k=4)
        be.chat(_msgs(), max_new_tokens=3)
        be.next_token_probs(_msgs(), ["yes"])
        assert [params.repetition_penalty for _, params, _ in be.llm.calls] == [want] * 3
        if policy == "checkpoint":
            assert be.decoding == hf.decoding  # the same settings as transformers' generate


def test_server_requests_carry_plain_settings_only_when_asked():
    follow = OpenAIBackend("http://127.0.0.1:9/v1")
    assert follow.decoding == {"policy": "checkpoint"} and follow.extra_body == {}
    plain = make_backend(
        "http://127.0.0.1:9/v1", settings=BackendSettings(decoding="greedy-plain")
    )
    assert plain.extra_body == {"repetition_penalty": 1.0}
    assert plain.decoding == {"policy": "greedy-plain", "repetition_penalty": 1.0}
    own = OpenAIBackend(
        "http://127.0.0.1:9/v1", decoding="greedy-plain", extra_body={"repetition_penalty": 1.1}
    )
    assert own.extra_body == {"repetition_penalty": 1.1}  # an explicit body wins


def test_eval_records_each_models_decoding_in_run_json(penalised, tmp_path):
    data = tmp_path / "data.jsonl"
    image = tmp_path / "scene.png"
    make_scene().save(image)
    row = {"id": "q0", "image": str(image), "question": "Color?", "options": ["red", "blue"],
           "answer": "A"}
    data.write_text(json.dumps(row) + "\n")
    out = tmp_path / "run"
    argv = ["eval", "--bench", "jsonl", "--data", str(data), "--output", str(out), "--small",
            str(penalised), "--large", str(penalised), "--mode", "small", "--no-progress",
            "--decoding", "greedy-plain"]
    assert main(argv) == 0
    run = RunDir(out)
    config = run.read_state()["config"]
    assert config["decoding"] == {
        "small": {"policy": "greedy-plain", "repetition_penalty": 1.0},
        "large": None,
    }
    # A run logged before the field existed still resumes.
    state = run.read_state()
    del state["config"]["decoding"]
    run.write_state(state)
    assert main([*argv, "--resume"]) == 0
    assert "decoding" in run.read_state()["config"]
