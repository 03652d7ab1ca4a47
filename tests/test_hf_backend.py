"""The transformers backend on tiny real Qwen2.5-VL and Qwen3-VL checkpoints."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from speceyes import gate, prompts
from speceyes.backends.base import context_limit, cut_at_stop, first_token_ids
from speceyes.backends.hf import HFBackend, ModelLoadError
from speceyes.judging import NO_VARIANTS, YES_VARIANTS, decode_rule_p_tool, tool_probability
from tests.conftest import make_scene
from tests.tools.backend_contract import assert_backend_contract

# The tiny Qwen2.5-VL and Qwen3-VL fixtures, and the real-shaped ones (real vocabulary, real
# processor, generation configs and chat templates).
MODELS = ["q25", "q3", "real_q25", "real_q3"]


def _msgs(img, q="What color is the square?", opts=("red", "green")):
    return prompts.small_messages(img, q, list(opts))


@pytest.mark.parametrize("name", MODELS)
def test_judge_logit_is_p_yes_over_p_yes_plus_no(request, name, scene):
    be: HFBackend = request.getfixturevalue(name)
    msgs = [prompts.judge_messages(scene, "Is it red?"), prompts.judge_messages(make_scene(), "Hm?")]
    p = tool_probability(be, msgs)
    assert len(p) == 2 and all(0.0 <= x <= 1.0 for x in p)
    # Recompute from one forward pass of the same inputs, over each distinct first token once.
    inputs = be._prepare(msgs)
    with torch.inference_mode():
        probs = torch.softmax(be.model(**inputs).logits[:, -1].float(), -1)
    ids = first_token_ids(be.tokenizer, YES_VARIANTS + NO_VARIANTS)
    yes_ids = sorted({i for i in ids[: len(YES_VARIANTS)] if i is not None})
    no_ids = sorted({i for i in ids[len(YES_VARIANTS) :] if i is not None})
    assert yes_ids and no_ids and set(yes_ids).isdisjoint(no_ids)
    yes, no = probs[:, yes_ids].sum(-1), probs[:, no_ids].sum(-1)
    np.testing.assert_allclose(p, (yes / (yes + no)).numpy(), rtol=1e-5)


def test_first_token_ids_count_each_token_once(q25):
    tok = q25.tokenizer
    ids = first_token_ids(tok, ["yes", "yes", "", "Yes", "YES"])
    assert ids[0] == tok.encode("yes", add_special_tokens=False)[0]
    assert ids[1] is None and ids[2] is None  # a repeat, and a word with no token
    first = [tok.encode(w, add_special_tokens=False)[0] for w in ("Yes", "YES")]
    # "Yes" and "YES" share their first token in the tiny vocabulary ("Y"): counted once
    assert ids[3] == first[0] and (ids[4] is None) == (first[1] == first[0])
    p = q25.next_token_probs([prompts.judge_messages(make_scene(), "Is it red?")], ["Yes", "YES"])
    assert p[0, 0] > 0 and (p[0, 1] == 0) == (first[1] == first[0])


@pytest.mark.parametrize("name", MODELS)
def test_judge_decode_mode_follows_published_rule(request, name, scene):
    be: HFBackend = request.getfixturevalue(name)
    msgs = [prompts.judge_messages(scene, "Is it red?")]
    p = tool_probability(be, msgs, mode="decode")
    text = be.chat(msgs, max_new_tokens=10)[0].text
    assert p == [decode_rule_p_tool(text)]
    assert decode_rule_p_tool(" No, it is fine") == 0.0
    assert decode_rule_p_tool("yes") == 1.0 and decode_rule_p_tool("") == 1.0


@pytest.mark.parametrize("name", MODELS)
def test_answer_topk_gate_equals_full_logits(request, name, scene):
    be: HFBackend = request.getfixturevalue(name)
    msgs = [_msgs(scene), _msgs(make_scene(box=(10, 10, 60, 60)), "Longer question here?")]
    answers = be.answer(msgs, max_new_tokens=8, top_k=64)
    for b, a in enumerate(answers):
        assert a.topk.shape == (len(a.token_ids), 64)
        assert np.all(np.diff(a.topk, axis=1) <= 0)  # sorted descending
        assert len(a.token_ids) > 0
        # Teacher-forced full-vocabulary logits at the generated positions, unpadded.
        gen = torch.tensor([a.token_ids])
        one = be._prepare([msgs[b]])
        seq = torch.cat([one["input_ids"], gen], 1)
        extra = {k: v for k, v in one.items() if k in ("pixel_values", "image_grid_thw")}
        with torch.inference_mode():
            logits = be.model(
                input_ids=seq,
                attention_mask=torch.ones_like(seq),
                mm_token_type_ids=(seq == be.image_token_id).long(),
                **extra,
            ).logits[0]
        n = one["input_ids"].shape[1]
        full = logits[n - 1 : n - 1 + len(a.token_ids)].float().numpy()
        for agg in ("min", "mean", "bottom"):
            c_full = gate.answer_confidence(full, agg=agg)
            c_topk = gate.answer_confidence(a.topk, agg=agg)
            assert abs(c_full - c_topk) < 1e-3, (agg, c_full, c_topk)


@pytest.mark.parametrize("name", MODELS)
def test_batched_left_padding_equals_one_at_a_time(request, name, scene):
    be: HFBackend = request.getfixturevalue(name)
    msgs = [_msgs(scene, "A?"), _msgs(make_scene(size=(200, 500)), "A much longer question, yes?")]
    batched = be.answer(msgs, max_new_tokens=6)
    single = [be.answer([m], max_new_tokens=6)[0] for m in msgs]
    for x, y in zip(batched, single, strict=True):
        assert x.token_ids == y.token_ids
        np.testing.assert_allclose(x.topk, y.topk, atol=1e-3)


def test_image_reaches_the_model(q25):
    a = q25.answer([_msgs(make_scene(color=(255, 0, 0)))], max_new_tokens=3)[0]
    b = q25.answer([_msgs(make_scene(color=(0, 0, 255)))], max_new_tokens=3)[0]
    assert not np.allclose(a.topk, b.topk)


def test_mm_token_type_ids_mark_image_tokens(q25, scene):
    inputs = q25._prepare([_msgs(scene)])
    n_img = int((inputs["input_ids"] == q25.image_token_id).sum())
    grid = inputs["image_grid_thw"][0]
    assert n_img == int(grid.prod()) // 4
    assert int(inputs["mm_token_type_ids"].sum()) == n_img


def test_view_of_uses_checkpoint_pixel_limits(q25):
    v = q25.view_of(make_scene(size=(1000, 600)))
    assert v.view_w % 28 == 0 and v.view_h % 28 == 0
    assert v.view_w * v.view_h <= q25.max_pixels


@pytest.mark.parametrize("name", MODELS)
def test_backend_contract(request, name):
    be = request.getfixturevalue(name)
    assert_backend_contract(be)
    assert (be.max_images, be.max_logprobs) == (None, None)  # in process: no caps
    assert be.scores == "logits"  # whole rows: answer(top_k >= vocabulary) returns them all
    rows = be.answer([_msgs(make_scene())], max_new_tokens=2, top_k=1 << 30)[0].topk
    assert rows.shape[1] == be.model.config.get_text_config().vocab_size
    # next_token_probs is the softmax of the same step the tool probability reads.
    msgs = [prompts.judge_messages(make_scene(), "Is there a red square?")]
    p = be.next_token_probs(msgs, ["yes", "no"])[0]
    yes, no = (be.tokenizer.encode(w, add_special_tokens=False)[0] for w in ("yes", "no"))
    with torch.inference_mode():
        logits = be.model(**be._prepare(msgs)).logits[0, -1].float()
    full = torch.softmax(logits, -1)
    np.testing.assert_allclose(p, [full[yes].item(), full[no].item()], rtol=1e-5)


def test_empty_answer_has_no_tokens(silent, scene):
    a = silent.answer([_msgs(scene)], max_new_tokens=5)[0]
    assert a.text == "" and a.token_ids == [] and a.topk.shape == (0, 64)
    assert np.isnan(gate.batch_confidence([a.topk])[0])


def test_chat_length_and_stop(q3, scene):
    t = q3.chat([_msgs(scene)], stop=("</answer>",), max_new_tokens=4)[0]
    assert t.finish_reason in ("length", "stop") and t.tokens <= 4
    assert cut_at_stop("a</tool_call> b</answer>", ["</answer>", "</tool_call>"]) == (
        "a</tool_call>",
        "</tool_call>",
    )
    assert cut_at_stop("plain", ["</answer>"]) == ("plain", None)


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        HFBackend(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="no config.json"):
        HFBackend(tmp_path)


# ---- the context length it declares --------------------------------------------------------

FOLDERS = {  # fixture -> (folders fixture, family)
    "q25": ("tiny_dirs", "qwen2_5_vl"),
    "q3": ("tiny_dirs", "qwen3_vl"),
    "real_q25": ("real_dirs", "qwen2_5_vl"),
    "real_q3": ("real_dirs", "qwen3_vl"),
}


def _declared_lengths(folder) -> tuple[int, int | None]:
    """The folder's own files: the text model's positions and the tokenizer's length (None
    where it writes transformers' "no limit" sentinel, about 1e30, or nothing)."""
    config = json.loads((folder / "config.json").read_text())
    positions = config.get("text_config", config)["max_position_embeddings"]
    length = json.loads((folder / "tokenizer_config.json").read_text()).get("model_max_length")
    return positions, length if isinstance(length, int) and length < 10**18 else None


@pytest.mark.parametrize("name", MODELS)
def test_max_model_len_is_the_checkpoints_context(request, name):
    be: HFBackend = request.getfixturevalue(name)
    dirs, family = FOLDERS[name]
    positions, length = _declared_lengths(request.getfixturevalue(dirs)[family])
    want = positions if length is None else min(positions, length)
    assert be.max_model_len == want and context_limit(be) == want


def test_a_tighter_tokenizer_length_is_the_limit(tiny_dirs, tmp_path):
    folder = shutil.copytree(tiny_dirs["qwen2_5_vl"], tmp_path / "q25")
    tok_config = folder / "tokenizer_config.json"
    settings = json.loads(tok_config.read_text())
    positions, _ = _declared_lengths(folder)
    settings["model_max_length"] = positions // 2
    tok_config.write_text(json.dumps(settings))
    assert HFBackend(folder).max_model_len == positions // 2


def test_the_context_budget_ends_only_the_loop_that_would_not_fit(q25):
    """Agent loops on transformers read the declared length: a question longer than the
    model's positions ends its loop before the turn, the other runs."""
    from speceyes.agents.zoom import ZoomAgent
    from speceyes.types import Query

    long_question = "Describe the square. " * (q25.max_model_len // 2)
    queries = [
        Query(id="short", image=make_scene(), question="What color is the square?"),
        Query(id="long", image=make_scene(), question=long_question),
    ]
    agent = ZoomAgent(q25, max_new_tokens=4, max_tool_calls=1)
    short, long = agent.run(queries)
    assert short.error is None and short.turns >= 1
    assert long.error is None and long.turns == 0 and agent.context_budget_ends == 1
    assert [t["reason"] for t in long.trace if t["type"] == "limit"] == ["context budget"]
