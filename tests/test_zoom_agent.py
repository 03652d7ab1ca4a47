"""The DeepEyes loop: real parser, real cropper, real backend inputs.

A random tiny model cannot write the tool-call format, so ``ScriptedBackend`` supplies the
assistant text (a test double for the model's words only). Everything else is the product path:
the real tiny backend computes the view geometry and still encodes every conversation, crops
included, through its real input builder and model on each turn.
"""

from __future__ import annotations

import json

import pytest

from speceyes.agents.zoom import ToolCallError, ZoomAgent, parse_tool_call
from speceyes.types import ChatTurn, Query
from tests.conftest import make_scene


class ScriptedBackend:
    """Wraps a real backend; the assistant text of each turn comes from a script."""

    def __init__(self, real, scripts: list[list[str]]):
        self.real = real
        self.box_coords = real.box_coords
        self.factor, self.min_pixels, self.max_pixels = real.factor, real.min_pixels, real.max_pixels
        self.max_images, self.max_logprobs = real.max_images, real.max_logprobs
        self.scripts = [list(s) for s in scripts]
        self.seen: list[list[dict]] = []

    def view_of(self, image):
        return self.real.view_of(image)

    def chat(self, batch, stop=(), max_new_tokens=1024):
        # The real model reads every conversation (crops included) for one token.
        self.real.chat(batch, stop=stop, max_new_tokens=1)
        self.seen.append([list(m) for m in batch])
        out = []
        for messages in batch:
            idx = int(messages[1]["content"][1]["text"].split("#")[1].split(" ")[0])
            text = self.scripts[idx].pop(0) if self.scripts[idx] else "<answer>?</answer>"
            out.append(ChatTurn(text=text, finish_reason="stop", stop="</tool_call>"))
        return out


def call(box, name="image_zoom_in_tool", label="the red square"):
    args = {"bbox_2d": box, "label": label}
    return f'<think>look closer</think>\n<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def q(i, size=(1000, 600), box=(600, 100, 700, 200)):
    return Query(id=str(i), image=make_scene(size=size, box=box), question=f"#{i} what color?")


def test_parse_tool_call_cases():
    ok = parse_tool_call(call([1, 2, 30, 40]))
    assert ok == {"bbox_2d": [1, 2, 30, 40], "label": "the red square"}
    bad = {
        "<tool_call>{not json}</tool_call>": "not valid JSON",
        "<tool_call>[1, 2]</tool_call>": "JSON object",
        '<tool_call>{"name": "rm", "arguments": {}}</tool_call>': "unknown tool",
        '<tool_call>{"name": "image_zoom_in_tool"}</tool_call>': "arguments",
        '<tool_call>{"name": "image_zoom_in_tool", "arguments": {"label": "x"}}</tool_call>': "bbox_2d",
        '<tool_call>{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [1,2,3,4]}': "not closed",
        "__import__('os').system('x')": "no <tool_call>",
    }
    for text, msg in bad.items():
        with pytest.raises(ToolCallError, match=msg):
            parse_tool_call(text)
    # Python literals are not JSON: never eval'd.
    with pytest.raises(ToolCallError, match="JSON"):
        parse_tool_call("<tool_call>{'name': 'image_zoom_in_tool', 'arguments': {'bbox_2d': (1,2,3,4)}}</tool_call>")


def test_valid_zoom_maps_box_to_original_and_returns_crop(q25):
    query = q(0)
    view = q25.view_of(query.image)
    # The red square [600,100,700,200] of the 1000x600 original, in the model's view pixels.
    vb = [600 / view.scale_x, 100 / view.scale_y, 700 / view.scale_x, 200 / view.scale_y]
    be = ScriptedBackend(q25, [[call(vb), "<think>red</think> <answer>red</answer>"]])
    out = ZoomAgent(be).run([query])[0]
    assert out.answer == "red" and out.tool_calls == 1 and out.invalid_tool_calls == 0
    zoom = next(s for s in out.trace if s["type"] == "zoom")
    x1, y1, x2, y2 = zoom["crop_box"]
    assert abs(x1 - 600) <= 1 and abs(y1 - 100) <= 1 and abs(x2 - 700) <= 1 and abs(y2 - 200) <= 1
    # Second turn saw the crop in a user turn wrapped in <tool_response>.
    second = be.seen[1][0]
    assert second[-2] == {"role": "assistant", "content": call(vb)}
    parts = second[-1]["content"]
    assert second[-1]["role"] == "user"
    assert parts[0]["text"] == "<tool_response>" and parts[-1]["text"] == "</tool_response>"
    crop = parts[1]["image"]
    assert crop.getpixel((crop.width // 2, crop.height // 2)) == (220, 30, 30)


def test_fill_view_shows_the_crop_at_the_views_pixels_and_the_default_at_its_own(q25):
    # A 100x100 crop of a 1000x600 image: at its own size by default (DeepEyes' processor
    # floor), upscaled to the full image's view with fill_view (what the mini world trained on).
    query = q(0)
    view = q25.view_of(query.image)
    vb = [600 / view.scale_x, 100 / view.scale_y, 700 / view.scale_x, 200 / view.scale_y]
    sizes = {}
    for fill in (False, True):
        be = ScriptedBackend(q25, [[call(vb), "<answer>red</answer>"]])
        (out,) = ZoomAgent(be, fill_view=fill).run([query])
        sizes[fill] = next(s for s in out.trace if s["type"] == "zoom")["crop_size"]
        assert be.seen[1][0][-1]["content"][1]["image"].size == tuple(sizes[fill])
    assert sizes[False][0] * sizes[False][1] <= 112 * 112
    w, h = sizes[True]  # rounded to the patch grid, so about the view's pixels
    assert 0.8 * view.view_w * view.view_h <= w * h <= q25.max_pixels


@pytest.mark.parametrize(
    "text,needle",
    [
        (call([300, 50, 100, 150]), "inverted"),
        (call([100, 100, 100, 150]), "empty"),
        (call([5000, 5000, 6000, 6000]), "outside"),
        (call([10, 10, 20, 20]), "small"),
        (call([1, 2, 3]), "4 numbers"),
        (call(["a", 2, 3, 4]), "4 numbers"),
        (call([0, 0, 100, 100], name="image_zoom_out_tool"), "unknown tool"),
        ("<tool_call>\n{oops}\n</tool_call>", "JSON"),
    ],
)
def test_bad_calls_get_a_message_back_and_the_loop_goes_on(q25, text, needle):
    be = ScriptedBackend(q25, [[text, "<answer>blue</answer>"]])
    out = ZoomAgent(be).run([q(0)])[0]
    assert out.answer == "blue" and out.invalid_tool_calls == 1 and out.tool_calls == 0
    err = next(s for s in out.trace if s["type"] == "tool_error")["error"]
    assert needle in err.lower() or needle in err
    reply = be.seen[1][0][-1]
    assert reply["role"] == "user" and needle.lower() in reply["content"][1]["text"].lower()


def test_partly_outside_box_is_clamped(q25):
    view = q25.view_of(q(0).image)
    be = ScriptedBackend(q25, [[call([view.view_w - 60, 10, view.view_w + 500, 90]), "<answer>x</answer>"]])
    out = ZoomAgent(be).run([q(0)])[0]
    zoom = next(s for s in out.trace if s["type"] == "zoom")
    assert zoom["crop_box"][2] == 1000 and out.tool_calls == 1


def test_at_most_five_tool_calls(q25):
    be = ScriptedBackend(q25, [[call([0, 0, 200, 200])] * 9])
    out = ZoomAgent(be).run([q(0)])[0]
    assert out.tool_calls == 5 and out.turns == 6
    assert any(s["type"] == "limit" for s in out.trace)


def test_format_break_and_last_answer(q25):
    be = ScriptedBackend(q25, [["I think it is red."], ["<answer>a</answer> then <answer>b</answer>"]])
    outs = ZoomAgent(be).run([q(0), q(1)])
    assert outs[0].answer == "I think it is red." and outs[0].trace[-2]["type"] == "format_error"
    assert outs[1].answer == "b"


def test_loops_advance_together_in_one_batch(q25):
    be = ScriptedBackend(
        q25,
        [[call([0, 0, 300, 300]), "<answer>a</answer>"], ["<answer>b</answer>"], [call([0, 0, 90, 90]), call([0, 0, 90, 90]), "<answer>c</answer>"]],
    )
    outs = ZoomAgent(be).run([q(0), q(1), q(2)])
    assert [o.answer for o in outs] == ["a", "b", "c"]
    assert [len(step) for step in be.seen] == [3, 2, 1]


def test_corrupt_image_is_an_error_outcome_not_a_crash(q25, tmp_path):
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    be = ScriptedBackend(q25, [[], ["<answer>b</answer>"]])
    outs = ZoomAgent(be).run([Query(id="0", image=str(bad), question="#0 x"), q(1)])
    assert outs[0].error and "bad.jpg" in outs[0].error
    assert outs[1].answer == "b"


@pytest.mark.parametrize("name", ["q25", "q3"])
def test_real_model_loop_survives_its_own_output(request, name):
    be = request.getfixturevalue(name)
    out = ZoomAgent(be, max_new_tokens=24).run([q(0), q(1, size=(300, 800))])
    assert all(o.turns >= 1 and o.error is None for o in out)
