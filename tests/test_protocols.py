"""The ``published`` protocol against the bytes and rules of the authors' code.

References (github.com/MAC-AutoML/SpecEyes): ``eval_code_deepeyes/prompt.py`` (prompts),
``eval_code_deepeyes/SpecEyes.py`` (question block, judge rule, DeepEyes loop),
``eval_code_deepeyes/utils.py`` (smart_resize, abc_map), ``eval_code_thyme/SpecEyes.py``
(Thyme question text and its ``split('Please')``), ``eval_code_thyme/utils.py`` (Thyme loop)
and ``eval_code_thyme/sandbox.py`` (the names its code finds defined).
"""

from __future__ import annotations

import hashlib
import json
import re

import numpy as np
import pytest

from speceyes import gate, prompts, protocols
from speceyes.agents.published_zoom import PublishedZoomAgent
from speceyes.agents.zoom import ZoomAgent
from speceyes.judging import decode_rule_p_tool
from speceyes.protocols import FAIR, PUBLISHED
from speceyes.types import ChatTurn, Query, SpecAnswer
from tests.conftest import make_scene

# sha256 of SYSTEM_PROMPT in eval_code_deepeyes/prompt.py
DEEPEYES_SYSTEM_SHA256 = "e81e21b4428c5b8f9d0c6645a91a999cd4ec9bd5726c7f8ebd88b7315a02f19f"
# init_messages_judge_tc's templates, with the indentation the triple quotes keep.
VSTAR_BLOCK = "Question: What is the color of the cup?\n        Options: \nA. red\nB. blue\n\n        "
POPE_BLOCK = "Question: Is there a dog in the image?\n        "
# PROMPT_TEMPLATES_JTC['reliability_weighted'] in eval_code_deepeyes/prompt.py
JUDGE_SYSTEM = (
    'You decide based on answer reliability.\n\nAnswer "yes" if using a tool would significantly '
    'improve correctness or confidence of the answer.\n\nAnswer "no" if tools would add little or '
    'no value.\n\nOutput only "yes" or "no".\n'
)
JUDGE_USER = "\nWould tools significantly improve answer reliability? yes or no."
# USER_PROMPT and SYSTEM_PROMPT_ANSWER in eval_code_deepeyes/prompt.py
USER_PROMPT = (
    "\nThink first, call **image_zoom_in_tool** if needed, then answer. Format strictly as:  "
    "<think>...</think>  <tool_call>...</tool_call> (if tools needed)  <answer>...</answer> "
)
SMALL_SYSTEM = (
    "You are a helpful assistant. Output only the final answer itself. Do not include "
    "explanations, reasoning, labels, or any extra text."
)


def test_published_strings_are_the_reference_bytes():
    sys_prompt = protocols.PUBLISHED_DEEPEYES_SYSTEM
    assert hashlib.sha256(sys_prompt.encode()).hexdigest() == DEEPEYES_SYSTEM_SHA256
    assert '"required":["bbox_2d"]' in sys_prompt and sys_prompt.endswith("</tool_call>\n")
    assert sys_prompt != prompts.DEEPEYES_SYSTEM  # fair keeps the checkpoint's own eval prompt
    assert (prompts.JUDGE_SYSTEM, prompts.JUDGE_SUFFIX) == (JUDGE_SYSTEM, JUDGE_USER)
    assert (prompts.DEEPEYES_USER_SUFFIX, prompts.SMALL_SYSTEM) == (USER_PROMPT, SMALL_SYSTEM)


def test_question_blocks_deepeyes_layout():
    q, opts = "What is the color of the cup?", ["red", "blue"]
    assert protocols.published_question_block(q, opts) == VSTAR_BLOCK
    assert protocols.published_question_block("Is there a dog in the image?", None) == POPE_BLOCK
    # fair is the DeepEyes eval's layout, unchanged
    assert FAIR.question_text("deepeyes", q, opts) == prompts.question_block(q, opts)
    assert prompts.question_block(q, opts) == "Question: " + q + "\nOptions: \nA. red\nB. blue\n\n"
    with pytest.raises(ValueError, match="at most 6"):  # abc_map stops at F
        protocols.published_question_block(q, list("abcdefg"))


def test_question_text_thyme_layout():
    q = "What is the color of the cup?"
    mcq = protocols.published_thyme_question(q, ["red", "blue"])
    assert mcq == (
        "Question: What is the color of the cup?\nOptions:\nA. red\nB. blue\n"
        "Please select the correct answer from the options above."
    )
    pope = protocols.published_thyme_question("Is there a dog?", None, "yorn")
    assert pope == "Question: Is there a dog?\nPlease answer 'yes' or 'no'."
    # phases I and II see question_text.split('Please')[0]
    assert PUBLISHED.question_text("thyme", q, ["red", "blue"]) == (
        "Question: What is the color of the cup?\nOptions:\nA. red\nB. blue\n"
    )
    assert PUBLISHED.question_text("thyme", "Is there a dog?", None) == (
        "Question: Is there a dog?\n"
    )
    # ... including a "Please" inside the question, as the published split does
    assert PUBLISHED.question_text("thyme", "Please look: red?", ["a", "b"]) == (
        "Question: "
    )


def test_judge_and_small_messages(scene):
    fair_j = FAIR.judge_messages("deepeyes", scene, "Is it red?", ["yes", "no"])
    assert fair_j == prompts.judge_messages(scene, "Is it red?", ["yes", "no"])
    pub = PUBLISHED.judge_messages("deepeyes", scene, "What is the color of the cup?", ["red", "blue"])
    assert pub[0] == {"role": "system", "content": JUDGE_SYSTEM}
    assert pub[1]["content"][1]["text"] == VSTAR_BLOCK + JUDGE_USER
    small = PUBLISHED.small_messages("deepeyes", scene, "Is there a dog in the image?")
    assert small[0]["content"] == SMALL_SYSTEM
    assert small[1]["content"][1]["text"] == POPE_BLOCK + "\nAnswer:"


def test_published_smart_resize_and_view_cap():
    # values of eval_code_deepeyes/utils.py smart_resize(width, height)
    cases = {
        (1000, 600): (1008, 588),
        (3840, 2160): (3836, 2156),
        (7680, 4320): (4760, 2688),
        (10, 10): (56, 56),
        (2246, 1582): (2240, 1568),
    }
    for (w, h), want in cases.items():
        assert protocols.published_smart_resize(w, h) == want
    # The small model (Qwen3-VL, factor 32, up to 16384*32*32 px) is shown at most
    # 16384*28*28 pixels: the image is resized before it reaches the model's own processor.
    big = make_scene(size=(7680, 4320), box=(10, 10, 50, 50))
    msgs = PUBLISHED.small_messages("deepeyes", big, "Is there a dog?")
    shown = msgs[1]["content"][0]["image"]
    assert shown.size == (4760, 2688) and shown.width * shown.height <= 16384 * 28 * 28
    fair = FAIR.small_messages("deepeyes", big, "Is there a dog?")
    assert fair[1]["content"][0]["image"].size == (7680, 4320)


def test_judge_decode_rule():
    tool = protocols.published_judge_tool
    assert not tool("no") and not tool("No.") and not tool("None of them")
    assert tool("yes") and tool(" no") and tool("\nno")  # no strip: leading space means tools
    assert decode_rule_p_tool(" no") == 0.0  # fair's decode rule strips (unchanged)

    class Replies:
        def __init__(self, texts):
            self.texts, self.calls = texts, []

        def chat(self, batch, stop=(), max_new_tokens=1024):
            self.calls.append((tuple(stop), max_new_tokens))
            return [ChatTurn(text=t, finish_reason="stop") for t in self.texts]

    be = Replies(["No", " no", "yes"])
    assert PUBLISHED.tool_probability(be, [[], [], []], "logit", "deepeyes") == [0.0, 1.0, 1.0]
    assert be.calls == [(prompts.DEEPEYES_STOP, 10)]
    PUBLISHED.tool_probability(be, [[], [], []], "logit", "thyme")
    assert be.calls[-1] == (prompts.THYME_STOP, 10)
    # fair's decode mode: the same 10 tokens, no stop strings, the stripping rule
    assert FAIR.tool_probability(be, [[], [], []], "decode", "deepeyes") == [0.0, 0.0, 1.0]
    assert be.calls[-1] == ((), 10)


def test_loop_settings_and_batch_size():
    assert PUBLISHED.loop_settings("deepeyes") == protocols.LoopSettings(6, 512, 6)
    assert PUBLISHED.loop_settings("thyme") == protocols.LoopSettings(6, 2048, 5)
    assert FAIR.loop_settings("thyme") == protocols.LoopSettings(8, 1024, 5)
    assert protocols.get_protocol("fair") is FAIR and protocols.get_protocol("published") is PUBLISHED
    assert list(protocols.PROTOCOLS) == ["fair", "published"]
    with pytest.raises(ValueError, match="unknown protocol"):
        protocols.get_protocol("paper")
    with pytest.raises(ValueError, match="deepeyes and thyme"):
        PUBLISHED.family_of("search")
    assert FAIR.family_of("search") == "deepeyes" and FAIR.family_of("thyme") == "thyme"
    # small-only: the small-model script's layout (scripts/small_model_batch_inference.py:379-387)
    assert PUBLISHED.family_of(None) == protocols.DRAFT_FAMILY
    assert FAIR.family_of(None) == "deepeyes"


def test_log_aggregation_over_the_full_vocabulary():
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(5, 300)) * 3.0  # whole logit rows of a 300-token vocabulary
    logp = protocols.to_logprobs(rows, top_k=20)
    assert logp.shape == (5, 20)
    # separability is unchanged by the per-token shift
    assert np.allclose(gate.token_separability(logp, 20), gate.token_separability(rows, 20), atol=1e-4)
    soft = np.exp(rows - rows.max(1, keepdims=True))
    soft /= soft.sum(1, keepdims=True)
    want = float(np.exp(np.log(soft.max(1)).mean()))  # the released code's `log` mode

    class WholeRows:  # a backend that declares whole logit rows: every row on request
        scores = "logits"

        def answer(self, batch, max_new_tokens=20, top_k=64):
            k = min(top_k, rows.shape[1])
            return [SpecAnswer(text="A", topk=-np.sort(-rows, axis=1)[:, :k]) for _ in batch]

    be = WholeRows()
    answers = PUBLISHED.answers(be, [[]], max_new_tokens=20, top_k=20, agg="log")
    conf = PUBLISHED.confidence(be, answers, top_k=20, agg="log", scale=0.6)
    assert conf[0] == pytest.approx(want, rel=1e-5)
    topk_only = gate.batch_confidence([rows], top_k=20, agg="log")[0]  # fair: top-K softmax
    assert topk_only > want * 1.1  # top-K renormalisation overstates p_max
    fair = FAIR.answers(be, [[]], max_new_tokens=20, top_k=20, agg="log")
    assert fair[0].topk.shape == (5, 20)  # fair asks for the top-K only
    assert FAIR.confidence(be, fair, top_k=20, agg="log", scale=0.6)[0] == pytest.approx(topk_only)

    class Logprobs(WholeRows):  # a server's top logprobs: taken as they come
        scores = "logprobs"

    be = Logprobs()
    served = PUBLISHED.answers(be, [[]], max_new_tokens=20, top_k=20, agg="log")
    assert served[0].topk.shape == (5, 20)
    served[0].topk = logp
    assert PUBLISHED.confidence(be, served, top_k=20, agg="log", scale=0.6)[0] == pytest.approx(
        want, rel=1e-5
    )


# ---- the DeepEyes loop ----------------------------------------------------------------------
class Scripted:
    """The model's words come from a script; messages, crops and geometry are the agent's own."""

    box_coords = "absolute"
    factor, min_pixels, max_pixels = 28, 4 * 28 * 28, 16384 * 28 * 28
    max_images = max_logprobs = None

    def __init__(self, script):
        self.script, self.seen, self.tokens = list(script), [], []

    def view_of(self, image):
        raise AssertionError("published uses SpecEyes' own resize, not the backend's")

    def chat(self, batch, stop=(), max_new_tokens=1024):
        self.seen.append([list(m) for m in batch])
        self.tokens.append(max_new_tokens)
        return [ChatTurn(text=self.script.pop(0), finish_reason="stop") for _ in batch]


def _call(box):
    args = {"name": "image_zoom_in_tool", "arguments": {"bbox_2d": box}}
    return f"<think>zoom</think>\n<tool_call>\n{json.dumps(args)}\n</tool_call>"


def _query():
    return Query(id="1", image=make_scene(size=(1000, 600)), question="What is the color of the cup?",
                 options=["red", "blue"])  # fmt: skip


def test_zoom_published_loop_rules():
    be = Scripted([
        "<think>hmm</think>",  # neither call nor answer: the user prompt again, as a user turn
        "<tool_call>{bad json}</tool_call>",  # not JSON: the prompt in an assistant turn
        _call([100, 100, 110, 108]),  # 10x8 px: no 28-px check under published
        "<answer>A</answer> and <answer>B</answer>",
    ])  # fmt: skip
    out = PublishedZoomAgent(be).run([_query()])[0]
    assert out.error is None and out.answer == "A"  # the first answer of the turn
    assert be.tokens == [512] * 4
    first = be.seen[0][0]
    assert first[0]["content"] == protocols.PUBLISHED_DEEPEYES_SYSTEM
    assert first[1]["content"][1]["text"] == VSTAR_BLOCK + USER_PROMPT
    assert first[1]["content"][0]["image"].size == (1008, 588)
    last = be.seen[-1][0]
    assert last[3] == {"role": "user", "content": USER_PROMPT}
    assert last[5] == {"role": "assistant", "content": USER_PROMPT}
    crop = last[7]["content"][1]["image"]
    assert last[7]["content"][0]["text"] == "<tool_response>"
    # box x: int(100 * 1000/1008) = 99 .. int(110 * 1000/1008) = 109; resized to SpecEyes' grid
    zoom = [s for s in out.trace if s["type"] == "zoom"][0]
    assert zoom["crop_box"][0] == 99 and zoom["crop_box"][2] == 109
    assert crop.size == protocols.published_smart_resize(10, zoom["crop_box"][3] - zoom["crop_box"][1])


def test_the_protocol_picks_the_agent_loop():
    from speceyes.agents.code import CodeAgent
    from speceyes.agents.published_code import PublishedCodeAgent
    from speceyes.factory import AgentSettings, make_agent

    be = Scripted([])
    fair, pub = make_agent(AgentSettings(), be), make_agent(AgentSettings(), be, protocol="published")
    assert type(fair) is ZoomAgent and (fair.protocol, fair.max_tool_calls, fair.max_new_tokens) == (
        "fair", 5, 1024
    )
    assert type(pub) is PublishedZoomAgent and (pub.protocol, pub.max_tool_calls) == ("published", 6)
    thyme = AgentSettings(kind="thyme", max_tool_calls=2)
    with make_agent(thyme, be) as c, make_agent(thyme, be, protocol="published") as pc:
        assert type(c) is CodeAgent and type(pc) is PublishedCodeAgent
        assert (pc.max_tool_calls, pc.max_new_tokens) == (2, 2048)  # a given budget wins
    with pytest.raises(ValueError, match="unknown protocol"):
        make_agent(AgentSettings(), be, protocol="paper")


def test_zoom_published_errors():
    six = PublishedZoomAgent(Scripted(["<think>x</think>"] * 7)).run([_query()])[0]
    assert six.turns == 6 and six.error == "Step exceeds maximum number of steps"
    no_box = Scripted(['<tool_call>{"name": "image_zoom_in_tool", "arguments": {}}</tool_call>'])
    out = PublishedZoomAgent(no_box).run([_query()])[0]
    assert out.error.startswith("KeyError")
    empty = PublishedZoomAgent(Scripted([_call([5, 5, 5, 5])])).run([_query()])[0]
    assert empty.error.startswith("ZeroDivisionError")
    unclosed = PublishedZoomAgent(Scripted(["<answer>red"])).run([_query()])[0]
    assert unclosed.error is None and unclosed.answer == "<answer>red"


# ---- the Thyme loop -------------------------------------------------------------------------
def _code(body: str) -> str:
    return f"<think>compute</think>\n<code>\n```python\n{body}\n```\n</code>"


def test_thyme_published_loop_rules():
    from speceyes.agents.code import THYME_MODULES
    from speceyes.agents.published_code import PublishedCodeAgent
    from speceyes.agents.sandbox import Sandbox

    be = Scripted([
        _code("print(1 / 0)"),  # fails: dropped from the turn, the model generates again
        _code("print(np.zeros((2, 3)).shape, os.path.join(temp_output_dir, 'x.png'))"),  # preloads
        "<answer>yes</answer>",
    ])  # fmt: skip
    query = Query(id="7", image=make_scene(), question="Is there a dog?", category="adversarial")
    with Sandbox(pool_size=1, allowed_modules=THYME_MODULES) as sb, PublishedCodeAgent(
        be, sandbox=sb
    ) as agent:
        out = agent.run([query])[0]
    assert out.error is None and out.answer == "yes"
    assert be.tokens == [2048] * 3 and out.turns == 3 and out.invalid_tool_calls == 1
    user = be.seen[0][0][1]["content"][1]["text"]
    assert user.startswith("<image>\nQuestion: Is there a dog?\nPlease answer 'yes' or 'no'.\n\n")
    turn = be.seen[-1][0][-1]["content"]
    text = "".join(p["text"] for p in turn if p.get("type") == "text")
    assert "1 / 0" not in text  # the failed segment left no trace in the conversation
    # temp_output_dir is the published output folder (sandbox.py:71), here in the sandbox
    assert re.search(r"<sandbox_output>\(2, 3\) /\S*temp_processed_images/x\.png</sandbox_output>", text)


def test_thyme_published_no_answer_is_an_error():
    from speceyes.agents.published_code import PublishedCodeAgent

    with PublishedCodeAgent(Scripted(["<think>I am not sure</think>"])) as agent:
        out = agent.run([_query()])[0]
    assert out.error and out.answer == "No answer tag found in the final output."


# ---- speceyes prompts / report --protocol / eval --image-dir -----------------------------------
def _vstar_root(tmp_path):
    for cat in ("direct_attributes", "relative_position"):
        folder = tmp_path / cat
        folder.mkdir()
        make_scene(size=(1000, 600)).save(folder / "sa_1.jpg")
        ann = {"question": "What is the color of the cup?", "options": ["red", "blue"]}
        (folder / "sa_1.json").write_text(json.dumps(ann))
    return tmp_path


def test_prompts_command_shows_the_reference_judge_text(tmp_path, capsys):
    from speceyes.cli import main

    root = _vstar_root(tmp_path)
    args = ["prompts", "--bench", "vstar", "--data", str(root), "--limit", "1", "--no-shuffle"]
    assert main([*args, "--protocol", "published"]) == 0
    out = json.loads(capsys.readouterr().out)[0]
    judge_text = out["judge"][1]["content"][1]["text"]
    assert judge_text == VSTAR_BLOCK + JUDGE_USER  # byte for byte
    assert out["judge"][1]["content"][0] == {"type": "image", "size": [1008, 588]}
    assert out["agent_first_turn"][0]["content"] == protocols.PUBLISHED_DEEPEYES_SYSTEM
    assert main([*args, "--protocol", "fair", "--agent", "thyme"]) == 0
    fair = json.loads(capsys.readouterr().out)[0]
    assert fair["judge"][1]["content"][1]["text"] == prompts.question_block(
        "What is the color of the cup?", ["red", "blue"]
    ) + JUDGE_USER
    assert fair["agent_first_turn"][0]["content"] == prompts.THYME_SYSTEM


def test_report_rescores_a_run_both_ways(tmp_path, capsys):
    from speceyes.cli import main

    run = tmp_path / "run"
    run.mkdir()
    samples = [
        {"id": "1", "category": "direct_attributes", "question": "q", "options": ["red", "blue"],
         "answer": "A", "prediction": "A", "correct": True, "route": "small", "error": None},
        {"id": "2", "category": "direct_attributes", "question": "q", "options": ["red", "blue"],
         "answer": "A", "prediction": "red", "correct": True, "route": "small", "error": None},
        {"id": "3", "category": "direct_attributes", "question": "q", "options": ["red", "blue"],
         "answer": "A", "prediction": "", "correct": False, "route": "agent_after_judge",
         "error": "Step exceeds maximum number of steps"},
    ]  # fmt: skip
    (run / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    (run / "results.json").write_text(json.dumps({"config": {"bench": "vstar"}}))
    assert main(["report", str(run), "--protocol", "fair"]) == 0
    fair = capsys.readouterr().out
    assert "| 3 | 1 (wrong) | 66.67 |" in fair
    assert main(["report", str(run), "--protocol", "published"]) == 0
    pub = capsys.readouterr().out
    assert "| 2 | 1 (dropped) | 50.00 |" in pub and "1 rows need the LLM judge" in pub and ": 2" in pub


def test_eval_passes_image_dir_to_the_pope_jsonl_loader(tmp_path):
    from speceyes.cli import build_parser

    args = build_parser().parse_args(
        ["eval", "--bench", "pope", "--data", "coco_pope_random.json", "--image-dir", "val2014",
         "--small", "s", "--large", "l"]
    )  # fmt: skip
    assert args.image_dir == "val2014"
    from speceyes.bench.datasets import load_pope

    img_dir = tmp_path / "val2014"
    img_dir.mkdir()
    make_scene().save(img_dir / "COCO_val2014_000000000001.jpg")
    line = {"question_id": 1, "image": "COCO_val2014_000000000001.jpg",
            "text": "Is there a dog in the image?", "label": "no"}  # fmt: skip
    path = tmp_path / "coco_pope_random.json"
    path.write_text(json.dumps(line) + "\n")
    (q,) = list(load_pope(path, image_dir=img_dir))
    assert q.answer == "no" and q.category == "random"
