"""The Thyme loop: real code extractor, real process sandbox, real backend inputs.

A random tiny model cannot write Thyme's format, so ``ScriptedBackend`` supplies the assistant
text only (a test double for the model's words). Everything else is the product path: code
blocks go through the real extractor and rewrites and run in the real sandbox, and the real
tiny Qwen2.5-VL backend encodes every conversation - the continued assistant turn with its
<sandbox_output> images included - on every step.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import threading

import numpy as np
import pytest
from PIL import Image

from speceyes import prompts
from speceyes.agents.code import (
    THYME_MODULES,
    CodeAgent,
    CodeBlockError,
    clamp_crop,
    extract_code,
    rewrite_code,
)
from speceyes.agents.sandbox import Sandbox
from speceyes.images import resize_for_model
from speceyes.types import ChatTurn, Query
from tests.conftest import make_scene

# sha256 of REASONING_SYS_PROMPT in github.com/yfzhang114/Thyme
# eval/VLMEvalKit/vlmeval/vlm/thyme/utils.py (identical in swift/trainers/rlhf_trainer/grpo_trainer.py)
THYME_SYSTEM_SHA256 = "c5e7db63596377f9a1afef0dd131d282b2f9e6c873058c056c5c0aa5a89f99a7"


@pytest.fixture(scope="module")
def sandbox():
    sb = Sandbox(pool_size=1, allowed_modules=THYME_MODULES)
    yield sb
    sb.close()


class ScriptedBackend:
    """Wraps a real backend; the assistant text of each step comes from a script."""

    def __init__(self, real, scripts: list[list[str]]):
        self.real = real
        self.box_coords = real.box_coords
        self.factor, self.min_pixels, self.max_pixels = real.factor, real.min_pixels, real.max_pixels
        self.max_images, self.max_logprobs = real.max_images, real.max_logprobs
        self.scripts = [list(s) for s in scripts]
        self.seen: list[list[list[dict]]] = []

    def view_of(self, image):
        return self.real.view_of(image)

    def chat(self, batch, stop=(), max_new_tokens=1024):
        assert tuple(stop) == prompts.THYME_STOP
        # The real model reads every conversation (sandbox images included) for one token.
        self.real.chat(batch, stop=stop, max_new_tokens=1)
        self.seen.append([list(m) for m in batch])
        out = []
        for messages in batch:
            idx = int(re.search(r"#(\d+)", messages[1]["content"][1]["text"]).group(1))
            text = self.scripts[idx].pop(0) if self.scripts[idx] else "<answer>?</answer>"
            out.append(ChatTurn(text=text, finish_reason="stop"))
        return out


def code(body: str, think: str = "<think>let me look</think>\n") -> str:
    return f"{think}<code>\n```python\n{body}\n```\n</code>"


def q(i: int, image=None, **kw) -> Query:
    return Query(id=str(i), image=make_scene() if image is None else image, question=f"#{i} what?", **kw)


def noise(size=(1400, 1000), seed=0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


def sandbox_output(parts: list[dict], k: int = -1) -> list[dict]:
    """The k-th <sandbox_output> ... </sandbox_output> block of an assistant turn's parts."""
    opens = [i for i, p in enumerate(parts) if p.get("text") == prompts.SANDBOX_OPEN]
    start = opens[k]
    end = next(i for i in range(start, len(parts)) if parts[i].get("text") == prompts.SANDBOX_CLOSE)
    return parts[start + 1 : end]


# ---- pure pieces -------------------------------------------------------------------------------
def test_prompts_are_thyme_byte_exact():
    assert hashlib.sha256(prompts.THYME_SYSTEM.encode()).hexdigest() == THYME_SYSTEM_SHA256
    msgs = prompts.thyme_messages("IMG", "Which?", ["red", "blue"], "17127.jpg", (1920, 1080))
    text = msgs[1]["content"][1]["text"]
    assert text == (
        "<image>\nQuestion: Which?\nOptions:\nA. red\nB. blue\n"
        "Please select the correct answer from the options above.\n\n"
        '### User Image Path:** "17127.jpg"\n### User Image Size:** "1920x1080"\n\n'
        "### **Output Format (strict adherence required):**\n\n"
        "<think>Your detailed reasoning process, including any code, should go here.</think>\n"
        "<answer>Your final answer to the user's question goes here.</answer>\n"
    )
    assert prompts.thyme_question("Is it red?", kind="yorn") == "Is it red? Please answer yes or no."
    assert prompts.thyme_question("Color?").endswith("short words or phrases if possible.")
    assert prompts.THYME_STOP == ("</code>", "</answer>", "<|im_end|>")


def test_extract_code_cases():
    assert extract_code(code("print(1)")) == "print(1)"
    assert extract_code("<code>print(2)</code>") == "print(2)"  # no fences
    assert extract_code("<code>\n```python\nprint(3)\n</code>") == "print(3)"  # no closing fence
    assert extract_code("<code>\nprint(4)\n```\n</code>") == "print(4)"  # no opening fence
    two = code("print('a')") + "<sandbox_output>a</sandbox_output>" + code("print('b')")
    assert extract_code(two) == "print('b')"  # the last block
    for text, needle in [
        ("<code>\n```python\nprint(1)\n```\n", "not closed with </code>"),
        ("<code>```python\n```</code>", "empty"),
        ("no code at all", "no <code>"),
    ]:
        with pytest.raises(CodeBlockError, match=needle):
            extract_code(text)


def test_rewrites_follow_thyme():
    src = (
        "x1, y1, x2, y2 = (10, 10, 20, 20)\n"
        "crop_box = (390, -5, 900, 30)\n"
        "crop = image[0:10, 5:2000]\n"
        'image_path = "/data/somewhere/else.jpg"\n'
        "cv.imwrite('/mnt/data/temp_processed_images/a.png', crop)\n"
        "print(f'{v:.2f}')"
    )
    out = rewrite_code(src, 400, 300, "photo.png")
    assert "x1, y1, x2, y2 = (10, 10, 74, 74)" in out  # widened to 64 px
    assert "crop_box = (390, -5, 900, 30)" in out  # a negative literal is not a number node
    assert "image[0:64, 5:400]" in out  # clamped to the image, at least 64 px
    assert "image_path = 'photo.png'" in out
    assert "cv2.imwrite('./a.png', crop)" in out
    assert ":.8f}" in out
    assert clamp_crop([380, 280, 500, 290], 400, 300) == [336.0, 236.0, 400.0, 300.0]
    assert clamp_crop([0, 0, 10, 10], 30, 20) == [0.0, 0.0, 30.0, 20.0]  # smaller than 64
    # The code regex strips the first line's indentation; Thyme re-aligns it to the second.
    assert rewrite_code("import math\n    print(1)", 9, 9, "p.png") == "import math\nprint(1)"
    assert rewrite_code("while True:\n    pass", 9, 9, "p.png") == "while True:\n    pass"
    bad = "x = (1,\ny = 2"
    assert rewrite_code(bad, 400, 300, "p.png") == bad  # left to fail in the sandbox


# ---- the loop on the tiny real model -------------------------------------------------------------
CROP = "from PIL import Image\nimg = Image.open(image_path)\nimg.crop((700, 300, 924, 524)).save('crop.png')\nprint('crop.png')"  # noqa: E501


@pytest.mark.parametrize("source", ["path", "bytes", "pil"])
def test_crop_comes_back_from_the_full_resolution_original(q25, sandbox, tmp_path, source):
    original = noise()
    if source == "path":
        image = tmp_path / "scene 1.png"
        original.save(image)
    elif source == "bytes":
        buf = io.BytesIO()
        original.save(buf, format="PNG")
        image = buf.getvalue()
    else:
        image = original.copy()
    be = ScriptedBackend(q25, [[code(CROP), "<think>seen</think><answer>noise</answer>"]])
    out = CodeAgent(be, sandbox=sandbox).run([q(0, image)])[0]
    assert out.answer == "noise" and out.tool_calls == 1 and out.invalid_tool_calls == 0
    assert out.error is None and out.turns == 2
    # The model was told the file name and size of what its code opens.
    user_text = be.seen[0][0][1]["content"][1]["text"]
    name = "scene_1.png" if source == "path" else "0.png"
    assert f'User Image Path:** "{name}"' in user_text and '"1400x1000"' in user_text
    # Second step: the SAME assistant turn continues, the crop inside <sandbox_output>.
    last = be.seen[1][0][-1]
    assert last["role"] == "assistant" and last["continue"] is True
    assert last["content"][0]["text"] == code(CROP)
    (part,) = sandbox_output(last["content"])
    crop = part["image"]
    assert crop.size == (224, 224)  # within the model's pixel limits: shown as saved
    assert np.array_equal(np.asarray(crop), np.asarray(original.crop((700, 300, 924, 524))))
    step = next(s for s in out.trace if s["type"] == "code")
    assert step["ok"] and step["images"] == 1 and step["isolation"] and step["elapsed"] >= 0


def test_hf_backend_continues_the_assistant_turn(q25):
    parts = [
        prompts.text_part(code("print(1)")),
        prompts.text_part(prompts.SANDBOX_OPEN),
        prompts.image_part(make_scene()),
        prompts.text_part(prompts.SANDBOX_CLOSE),
    ]
    msgs = prompts.thyme_messages(make_scene(), "what?", None, "x.png", (400, 300))
    msgs.append({"role": "assistant", "content": parts, "continue": True})
    ids = q25._prepare([msgs])["input_ids"][0].tolist()
    text = q25.tokenizer.decode(ids)
    assert "</code><sandbox_output><|vision_start|>" in text
    assert text.endswith("<|vision_end|></sandbox_output>")
    assert text.count("<|im_start|>assistant") == 1 and text.count("<|im_end|>") == 2
    # Without the flag a new turn is opened, as before.
    msgs[-1] = {"role": "assistant", "content": parts}
    fresh = q25.tokenizer.decode(q25._prepare([msgs])["input_ids"][0].tolist())
    assert fresh.endswith("</sandbox_output><|im_end|>\n<|im_start|>assistant\n")


def test_printed_text_comes_back(q25, sandbox):
    be = ScriptedBackend(q25, [[code("print(6 * 7)"), "<answer>42</answer>"]])
    out = CodeAgent(be, sandbox=sandbox).run([q(0)])[0]
    assert out.answer == "42" and out.tool_calls == 1
    assert [p["text"] for p in sandbox_output(be.seen[1][0][-1]["content"])] == ["42"]


@pytest.mark.parametrize(
    "body,needle",
    [
        ("def f(:\n    pass", "SyntaxError"),
        ("print(open('/etc/passwd').read())", "/etc/passwd"),
        ("import socket\nsocket.create_connection(('example.com', 80))", "Execution denied"),
        ("import os\nos.remove(image_path)", "Execution denied"),
        ("import subprocess as sp\nsp.run(['ls'])", "ImportError"),
        ("x = undefined_name + 1", "NameError"),
        ("while True:\n    pass", "time limit"),
    ],
)
def test_errors_go_back_to_the_model_and_the_loop_goes_on(q25, sandbox, body, needle):
    be = ScriptedBackend(q25, [[code(body), "<answer>blue</answer>"]])
    slow = needle == "time limit"
    sb = Sandbox(pool_size=0, cpu_seconds=1, wall_seconds=3) if slow else sandbox
    try:
        out = CodeAgent(be, sandbox=sb).run([q(0)])[0]
    finally:
        if slow:
            sb.close()
    assert out.answer == "blue" and out.invalid_tool_calls == 1 and out.tool_calls == 0
    (reply,) = sandbox_output(be.seen[1][0][-1]["content"])
    assert reply["text"].startswith("Sandbox for 0: ") and needle in reply["text"]
    assert needle in next(s for s in out.trace if s["type"] == "tool_error")["error"]
    assert "root:" not in json.dumps(out.trace)  # nothing of the host's passwd file came back


def test_missing_closing_fence_runs_and_missing_close_tag_is_reported(q25, sandbox):
    be = ScriptedBackend(
        q25,
        [["<code>\n```python\nprint('hi')\n</code>", "<code>\n```python\nprint(2)\n```", "<answer>x</answer>"]],
    )
    out = CodeAgent(be, sandbox=sandbox).run([q(0)])[0]
    assert out.answer == "x" and out.tool_calls == 1 and out.invalid_tool_calls == 1
    parts = be.seen[2][0][-1]["content"]
    assert sandbox_output(parts, 0)[0]["text"] == "hi"
    assert "not closed with </code>" in sandbox_output(parts, 1)[0]["text"]


def test_at_most_five_iterations(q25, sandbox):
    be = ScriptedBackend(q25, [[code(f"print({i})") for i in range(9)]])
    out = CodeAgent(be, sandbox=sandbox).run([q(0)])[0]
    assert out.tool_calls == 5 and out.turns == 6
    assert any(s["type"] == "limit" for s in out.trace)
    assert out.answer == ""  # nothing after </think> before the sixth, unrun block


def test_answer_format_break_and_small_crop_widened(q25, sandbox):
    small = "from PIL import Image\nx1, y1, x2, y2 = 5, 5, 10, 10\nImage.open(image_path).crop((x1, y1, x2, y2)).save('s.png')"  # noqa: E501
    be = ScriptedBackend(
        q25,
        [
            ["<answer>a</answer> then <answer>b</answer>"],
            ["I think it is red."],
            [code(small), "<answer>c</answer>"],
        ],
    )
    outs = CodeAgent(be, sandbox=sandbox).run([q(0), q(1), q(2)])
    assert [o.answer for o in outs] == ["b", "I think it is red.", "c"]
    assert outs[1].trace[-2]["type"] == "format_error"
    step = next(s for s in outs[2].trace if s["type"] == "code")
    assert "(5, 5, 69, 69)" in step["ran"] and step["ok"]  # Thyme's 64 px minimum
    assert [len(b) for b in be.seen] == [3, 1]  # loops advance together in one batch


def test_image_limits_and_bad_aspect_ratio(q25, sandbox):
    save = "from PIL import Image\nImage.new('RGB', ({w}, {h}), (9, 9, 9)).save('o.png')"
    be = ScriptedBackend(
        q25,
        [
            [code(save.format(w=100, h=100)), code(save.format(w=100, h=100)), "<answer>1</answer>"],
            [code(save.format(w=2000, h=5)), "<answer>2</answer>"],
        ],
    )
    outs = CodeAgent(be, sandbox=sandbox, max_images=2).run([q(0), q(1)])
    assert outs[0].tool_calls == 1 and outs[0].invalid_tool_calls == 1
    assert "image limit" in sandbox_output(be.seen[2][0][-1]["content"])[0]["text"]
    assert "aspect_ratio" in sandbox_output(be.seen[1][1][-1]["content"])[0]["text"]
    assert outs[1].answer == "2"


def test_unscripted_tiny_model_run_does_not_crash(q25, sandbox):
    agent = CodeAgent(q25, sandbox=sandbox, max_new_tokens=12)
    outs = agent.run([q(0), q(1, options=["red", "blue"])], max_active=1)
    for o in outs:
        assert o.error is None and isinstance(o.answer, str) and 1 <= o.turns <= 6
    agent.close()  # the shared sandbox is not the agent's: it stays open
    assert sandbox.run("print(1)").stdout == "1\n"


def test_agent_owns_and_closes_its_sandbox(q25):
    be = ScriptedBackend(q25, [[code("print('own')"), "<answer>k</answer>"]])
    with CodeAgent(be, workers=1) as agent:
        out = agent.run([q(0)])[0]
        sb = agent.sandbox
    assert out.answer == "k" and out.tool_calls == 1
    with pytest.raises(RuntimeError, match="closed"):
        sb.run("print(1)")


def test_vllm_backend_splits_continued_and_new_turns():
    """vLLM takes continue_final_message per call: a mixed batch is two calls, order kept."""
    from speceyes.backends.vllm import VLLMBackend

    calls = []

    class FakeLLM:
        def chat(self, convs, params, use_tqdm=False, **kw):
            calls.append((len(convs), kw))
            return [(c[-1]["content"], kw.get("continue_final_message", False)) for c in convs]

    be = object.__new__(VLLMBackend)
    be.llm, be.factor, be.min_pixels, be.max_pixels = FakeLLM(), 28, 3136, 50176
    be._lock = threading.Lock()
    user = {"role": "user", "content": "u"}
    batch = [
        [user],
        [user, {"role": "assistant", "content": "a1", "continue": True}],
        [user, {"role": "assistant", "content": "done"}],
        [user, {"role": "assistant", "content": "a3", "continue": True}],
    ]
    out = be._chat(batch, params=None)
    assert out == [("u", False), ("a1", True), ("done", False), ("a3", True)]
    assert calls == [
        (2, {}),
        (2, {"add_generation_prompt": False, "continue_final_message": True}),
    ]


def test_cli_agent_thyme_end_to_end(tiny_dirs, tmp_path, capsys):
    from speceyes import cli
    from speceyes.factory import Settings

    model = str(tiny_dirs["qwen2_5_vl"])
    img = tmp_path / "scene.png"
    make_scene().save(img)
    args = cli.build_parser().parse_args(["ask", str(img), "q", "--small", model, "--large", model, "--agent", "thyme"])  # noqa: E501
    assert Settings.from_args(args).resolved().funnel.tau == 0.95  # Thyme's default threshold
    rc = cli.main(
        ["ask", str(img), "What color is the square?", "--small", model, "--large", model,
         "--agent", "thyme", "--mode", "agent", "--agent-max-tokens", "12", "--json"]
    )  # fmt: skip
    result = json.loads(capsys.readouterr().out)
    assert rc == 0 and result["route"] == "agent_only" and result["error"] is None
    assert any(s["type"] == "assistant" for s in result["trace"])
    rc = cli.main(
        ["ask", str(img), "Color?", "--small", model, "--large", model, "--agent", "thyme",
         "--mode", "both", "--agent-max-tokens", "8"]
    )  # fmt: skip
    assert rc == 0 and "(tau 0.95)" in capsys.readouterr().out


# ---- the published loop (github.com/MAC-AutoML/SpecEyes@90d950f eval_code_thyme/) ------------
# ScriptedBackend writes the model's words; the real tiny backend encodes every conversation
# and the real process sandbox runs every block.
def _published(be, sandbox):
    from speceyes.agents.published_code import PublishedCodeAgent

    return PublishedCodeAgent(be, sandbox=sandbox)


def _texts(messages: list[dict]) -> str:
    out = []
    for m in messages:
        content = m["content"]
        parts = content if isinstance(content, list) else [{"type": "text", "text": content}]
        out += [p["text"] for p in parts if p.get("type") == "text"]
    return "".join(out)


def test_published_failed_first_block_continues_the_user_turn(q25, sandbox):
    # utils.py:117-125: add_generation_prompt only at iteration 0, later the rendered chat with
    # its last "<|im_end|>\n" cut; after a dropped first block (:191-194) that is the user turn.
    be = ScriptedBackend(q25, [[code("print(1 / 0)"), code("print('hi')"), "<answer>x</answer>"]])
    out = _published(be, sandbox).run([q(0)])[0]
    assert out.answer == "x" and out.error is None and out.turns == 3
    assert out.invalid_tool_calls == 1 and out.tool_calls == 1
    second = be.seen[1][0]
    assert [m["role"] for m in second] == ["system", "user"] and second[-1]["continue"] is True
    rendered = q25.tokenizer.decode(q25._prepare([second])["input_ids"][0].tolist())
    assert rendered.endswith("goes here.</answer>\n")  # the user's text goes on, "\n" kept
    assert "<|im_start|>assistant" not in rendered
    # The segment written so becomes the assistant turn (:242-243); the next call continues it.
    third = be.seen[2][0]
    assert third[1].get("continue") is None and third[-1]["role"] == "assistant"
    assert [p["text"] for p in sandbox_output(third[-1]["content"])] == ["hi"]
    rendered = q25.tokenizer.decode(q25._prepare([third])["input_ids"][0].tolist())
    assert rendered.endswith("</code><sandbox_output>hi</sandbox_output>")
    assert rendered.count("<|im_start|>assistant") == 1
    # The model is never told why a block failed (utils.py:193 only prints it).
    assert all("division by zero" not in _texts(conv) for step in be.seen for conv in step)
    assert "division by zero" in json.dumps(out.trace)


@pytest.mark.parametrize(
    "body,shown",
    [
        ("def f():\n    return image_path\nprint(f())", None),  # exec(code, globals, locals)
        ("print(len(set([1])))", None),  # sandbox.py:478-496: no set() among the builtins
        ("class A:\n    pass\nprint(1)", None),  # ... nor __build_class__
        ("import os\nos.remove(image_path)", None),  # :766 denied: nothing comes back
        ("print(f'{math.pi:.2f}')", "3.14159265"),  # :656 every {:.Nf} becomes {:.8f}
        ("print(np.zeros(3).shape, string.digits[:2])", "(3,) 01"),  # :498-511 globals
        ("print(temp_output_dir.endswith('temp_processed_images'))", "True"),  # :519
        ("print('  padded  ')", "padded"),  # :659 the print is stripped
    ],
)
def test_published_blocks_run_as_the_released_sandbox_runs_them(q25, sandbox, body, shown):
    be = ScriptedBackend(q25, [[code(body), "<answer>x</answer>"]])
    out = _published(be, sandbox).run([q(0)])[0]
    assert out.turns == 2
    conv = be.seen[1][0]
    if shown is None:  # dropped: the second generation continues the user turn
        assert (out.tool_calls, out.invalid_tool_calls) == (0, 1)
        assert [m["role"] for m in conv] == ["system", "user"] and conv[-1]["continue"]
    else:
        assert (out.tool_calls, out.invalid_tool_calls) == (1, 0)
        assert [p["text"] for p in sandbox_output(conv[-1]["content"])] == [shown]


def test_published_image_path_crop_and_processed_path(q25, sandbox, tmp_path):
    folder = tmp_path / "direct_attributes"
    folder.mkdir()
    img = noise((640, 480), seed=3)
    img.save(folder / "sa_7.jpg", quality=95)
    query = Query(id="direct_attributes/sa_7", image=str(folder / "sa_7.jpg"), question="#0 what?",
                  options=["red", "blue"], category="direct_attributes")  # fmt: skip
    body = (
        'image = Image.open("data/vstar/direct_attributes/sa_7.jpg")\n'  # the prompt's path
        "x1, y1, x2, y2 = (10, 20, 30, 40)\n"
        "crop = image.crop((x1, y1, x2, y2))\n"
        'processed_path = "/mnt/data/temp_processed_images/crop.png"\n'
        "crop.save(processed_path)\n"
        "print(processed_path)"
    )
    shown = code("print(image_path)")
    be = ScriptedBackend(q25, [[shown, code(body), shown, "<answer>A</answer>"]])
    out = _published(be, sandbox).run([query])[0]
    assert out.answer == "A" and out.tool_calls == 3, out.trace
    user = be.seen[0][0][1]["content"][1]["text"]
    assert '### User Image Path:** "data/vstar/direct_attributes/sa_7.jpg"' in user
    assert '### User Image Size:** "640x480"' in user
    steps = [s for s in out.trace if s["type"] == "code"]
    assert "(10, 20, 74, 84)" in steps[1]["ran"]  # sandbox.py:259-308, 64 px minimum
    assert 'image_path = "data/vstar' not in steps[1]["ran"]  # the literal names the image
    parts = be.seen[3][0][-1]["content"]
    original, crop, again = (sandbox_output(parts, k)[0]["image"] for k in (0, 1, 2))
    limits = (q25.factor, q25.min_pixels, q25.max_pixels)
    # utils.py:205-213: printed text naming an existing file is shown as that image (the
    # folder is empty: 0 files for 1 printed name, sandbox.py:690-703)
    assert original.size == resize_for_model(img, *limits)[0].size
    assert crop.size == resize_for_model(Image.new("RGB", (64, 64)), *limits)[0].size
    # The same print once crop.png is in the folder: 1 printed name, 1 file: that file is
    # shown (sandbox.py:694-697), an earlier block's crop.
    assert steps[2]["earlier_images"] == 1
    assert np.array_equal(np.asarray(again), np.asarray(crop))


def test_published_output_folder_is_shared_by_the_run(q25, sandbox):
    # sandbox.py:690-699: with no path found, the printed names are counted against every
    # image in the (never emptied) output folder; the run's earlier files count too.
    def save(name):
        return code(
            f"img = Image.open(image_path)\nimg.save('/mnt/data/temp_processed_images/{name}')\n"
            f"print('saved {name}')"
        )

    be = ScriptedBackend(
        q25, [[save("a.png"), "<answer>x</answer>"], [save("b.png"), "<answer>y</answer>"]]
    )
    agent = _published(be, sandbox)
    first = agent.run([q(0)])[0]
    second = agent.run([q(1)])[0]
    assert (first.tool_calls, first.invalid_tool_calls) == (1, 0)  # 1 name, 1 file
    assert (second.tool_calls, second.invalid_tool_calls) == (0, 1)  # 1 name, 2 files
    assert agent.folder.snapshot() == ["a.png", "b.png"]


def test_published_rewrites_follow_the_released_sandbox():
    from speceyes.agents.published_thyme_exec import published_rewrite

    def ran(src):
        return published_rewrite(src, "data/vstar/x/sa_1.jpg", 400, 300)[0]

    # :316-344 a 4-tuple of names clamps only when one is a coordinate name
    assert "(10, 10, 74, 74)" in ran("x1, y1, x2, y2 = (10, 10, 20, 20)")
    assert "(10, 10, 20, 20)" in ran("a, b, c, d = (10, 10, 20, 20)")
    assert "(336, 10, 400, 74)" in ran("crop_box = (390, 10, 900, 20)")  # :349-367, :289-292
    assert "image[0:10, 5:2000]" in ran("crop = image[0:10, 5:2000]")  # :374 ast.Index: never
    assert "'data/vstar/x/sa_1.jpg'" in ran('image_path = "/elsewhere/photo.jpg"')  # :201-212
    assert '"data/vstar/x/sa_1.jpg"' in ran('image_path = "data/vstar/x/sa_1.jpg"')  # kept as is
    assert "cv2.imread" in ran("cv.imread(image_path)")  # :423-455
    # :536 the first line always takes the second's indentation, then dedent (:539): an
    # indented body under a first line is flattened (parsing or not), as there.
    from speceyes.agents import published_thyme_exec

    if published_thyme_exec.autopep8 is None:  # autopep8 (:541) would reformat further
        assert ran("import os\n    x = 1") == "import os\nx = 1"
        assert ran("for i in range(2):\n    print(i)") == "for i in range(2):\nprint(i)"


def test_published_rewrite_formats_with_autopep8():
    # sandbox.py:25, :537-546; the authors' requirements.txt:5 (in the dev extra here)
    import autopep8  # noqa: F401

    from speceyes.agents.published_thyme_exec import published_rewrite

    ran, formatted = published_rewrite("if x == None: pass", "a.jpg", 10, 10)
    assert formatted and "if x is None:\n    pass" in ran
