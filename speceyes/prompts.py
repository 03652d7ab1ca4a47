"""Prompt text per backbone family, as data.

These strings are what the published checkpoints were trained or evaluated with; they are kept
byte-exact. Change them only together with a checkpoint that expects the change.
"""

from __future__ import annotations

from collections.abc import Sequence

from speceyes.limits import OPTION_LETTERS

# --- Phase I: tool-need judgment (large model) -------------------------------------------------
JUDGE_SYSTEM = (
    "You decide based on answer reliability.\n\n"
    'Answer "yes" if using a tool would significantly improve correctness or confidence of the '
    "answer.\n\n"
    'Answer "no" if tools would add little or no value.\n\n'
    'Output only "yes" or "no".\n'
)
JUDGE_SUFFIX = "\nWould tools significantly improve answer reliability? yes or no."

# --- Phase II: speculative answer (small model) ------------------------------------------------
SMALL_SYSTEM = (
    "You are a helpful assistant. Output only the final answer itself. Do not include "
    "explanations, reasoning, labels, or any extra text."
)
SMALL_SUFFIX = "\nAnswer:"
# The middle tier's question after the agent's own first turn (--direct-prompt agent-prefix):
# the speculative answer's instructions (SMALL_SYSTEM less its greeting, then SMALL_SUFFIX),
# with the tool declined, as one more user turn, the way the prefix judge asks its question.
DIRECT_TURN_TEXT = (
    "Do not call any tool. " + SMALL_SYSTEM.removeprefix("You are a helpful assistant. ")
    + SMALL_SUFFIX
)

# --- DeepEyes (Qwen2.5-VL-7B, image_zoom_in_tool) -----------------------------------------------
# The tool schema below is the checkpoint's evaluation prompt byte for byte, including its
# `"required":["bbox"]` (the argument itself is named bbox_2d): the model saw this text.
_DEEPEYES_TOOL_SCHEMA = (
    '{"type":"function","function":{"name":"image_zoom_in_tool","description":"Zoom in on a '
    "specific region of an image by cropping it based on a bounding box (bbox) and an optional "
    'object label.","parameters":{"type":"object","properties":{"bbox_2d":{"type":"array",'
    '"items":{"type":"number"},"minItems":4,"maxItems":4,"description":"The bounding box of the '
    "region to zoom in, as [x1, y1, x2, y2], where (x1, y1) is the top-left corner and (x2, y2) "
    'is the bottom-right corner."},"label":{"type":"string","description":"The name or label of '
    'the object in the specified bounding box (optional)."}},"required":["bbox"]}}}'
)
DEEPEYES_SYSTEM = (
    "You are a helpful assistant.\n\n"
    "# Tools\n"
    "You may call one or more functions to assist with the user query.\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n" + _DEEPEYES_TOOL_SCHEMA + "\n</tools>\n\n"
    "# How to call a tool\n"
    "Return a json object with function name and arguments within <tool_call></tool_call> XML "
    "tags:\n"
    "<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>\n\n"
    "**Example**:  \n"
    "<tool_call>  \n"
    '{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [10, 20, 100, 200], "label": '
    '"the apple on the desk"}}  \n'
    "</tool_call>"
)
DEEPEYES_USER_SUFFIX = (
    "\nThink first, call **image_zoom_in_tool** if needed, then answer. Format strictly as:  "
    "<think>...</think>  <tool_call>...</tool_call> (if tools needed)  <answer>...</answer> "
)
DEEPEYES_STOP = ("</tool_call>", "</answer>", "<|im_end|>")
ZOOM_TOOL_NAME = "image_zoom_in_tool"


def deepeyes_system_prompt() -> str:
    return DEEPEYES_SYSTEM


def question_block(question: str, options: Sequence[str] | None = None) -> str:
    """`Question: {q}` and, for multiple choice, an `Options:` list as the DeepEyes eval wrote it."""
    if not options:
        return f"Question: {question}"
    if len(options) > len(OPTION_LETTERS):
        raise ValueError(f"at most {len(OPTION_LETTERS)} options are supported, got {len(options)}")
    lines = "".join(f"{OPTION_LETTERS[i]}. {opt}\n" for i, opt in enumerate(options))
    return f"Question: {question}\nOptions: \n{lines}\n"


def image_part(image) -> dict:
    """An OpenAI-style image content part holding an in-memory PIL image."""
    return {"type": "image", "image": image}


def text_part(text: str) -> dict:
    return {"type": "text", "text": text}


def judge_messages(image, question: str, options: Sequence[str] | None = None) -> list[dict]:
    return [
        {"role": "system", "content": JUDGE_SYSTEM},
        {
            "role": "user",
            "content": [image_part(image), text_part(question_block(question, options) + JUDGE_SUFFIX)],
        },
    ]


def small_messages(image, question: str, options: Sequence[str] | None = None) -> list[dict]:
    return [
        {"role": "system", "content": SMALL_SYSTEM},
        {
            "role": "user",
            "content": [image_part(image), text_part(question_block(question, options) + SMALL_SUFFIX)],
        },
    ]


def deepeyes_messages(image, question: str, options: Sequence[str] | None = None) -> list[dict]:
    return [
        {"role": "system", "content": DEEPEYES_SYSTEM},
        {
            "role": "user",
            "content": [
                image_part(image),
                text_part(question_block(question, options) + DEEPEYES_USER_SUFFIX),
            ],
        },
    ]


def user_turn(text: str) -> dict:
    """A text-only user turn (one more question after a conversation's first turn)."""
    return {"role": "user", "content": [text_part(text)]}


def direct_turn() -> dict:
    """The middle tier's question as one more user turn after the agent's first-turn messages
    (``--direct-prompt agent-prefix``)."""
    return user_turn(DIRECT_TURN_TEXT)


def deepeyes_tool_response(crop) -> dict:
    """The user turn that returns a zoomed crop, exactly as the DeepEyes loop builds it."""
    return {
        "role": "user",
        "content": [
            text_part("<tool_response>"),
            image_part(crop),
            text_part(DEEPEYES_USER_SUFFIX),
            text_part("</tool_response>"),
        ],
    }


# --- SpecReason baseline: the large model scores a proposed step in one token ------------------
STEP_SCORE_PROMPT = (
    "Evaluate the assistant's last step above: is it correct and useful for answering the "
    "question? Rate it from 0 (wrong or useless) to 9 (correct and useful). Output only the digit."
)


# --- Thyme (Kwai-Keye/Thyme-RL, Qwen2.5-VL-7B writing Python in <code>) ------------------------
# Byte for byte from the published Thyme repository (github.com/yfzhang114/Thyme):
# REASONING_SYS_PROMPT and generate_prompt_final_qa in eval/VLMEvalKit/vlmeval/vlm/thyme/utils.py
# (the same system prompt is in swift/trainers/rlhf_trainer/grpo_trainer.py, used for RL), the
# question formats of eval/VLMEvalKit/vlmeval/vlm/thyme/prompt.py (ThymePromptMixin) and the
# stop strings SPECIAL_STRING_LIST (+ <|im_end|>, the end of an assistant turn).
THYME_SYSTEM = (
    "You are a helpful assistant.\n\n"
    "Solve the following problem step by step, and optionally write Python code for image "
    "manipulation to enhance your reasoning process. The Python code will be executed by an "
    "external sandbox, and the processed image or result (wrapped in "
    "<sandbox_output></sandbox_output>) can be returned to aid your reasoning and help you arrive "
    "at the final answer.\n\n"
    "**Reasoning & Image Manipulation (Optional but Encouraged):**\n"
    "    * You have the capability to write executable Python code to perform image manipulations "
    "(e.g., cropping to a Region of Interest (ROI), resizing, rotation, adjusting contrast) or "
    "perform calculation for better reasoning.\n"
    "    * The code will be executed in a secure sandbox, and its output will be provided back to "
    "you for further analysis.\n"
    "    * All Python code snippets **must** be wrapped as follows:\n"
    "    <code>\n"
    "    ```python\n"
    "    # your code.\n"
    "    ```\n"
    "    </code>\n"
    "    * At the end of the code, print the path of the processed image (processed_path) or the "
    "result for further processing in a sandbox environment."
)
# generate_prompt_final_qa: the published inference keeps the literal "<image>" line after the
# real image part (training replaced it by the image tokens); path and size are the file's.
THYME_USER_TEMPLATE = (
    "<image>\n"
    "{question}\n\n"
    '### User Image Path:** "{image_path}"\n'
    '### User Image Size:** "{image_size}"\n\n'
    "### **Output Format (strict adherence required):**\n\n"
    "<think>Your detailed reasoning process, including any code, should go here.</think>\n"
    "<answer>Your final answer to the user's question goes here.</answer>\n"
)
THYME_MCQ_EN = "Please select the correct answer from the options above."
THYME_MCQ_CN = "请直接回答选项字母。"
THYME_VQA_SUFFIX = "\nPlease try to answer the question with short words or phrases if possible."
THYME_YORN_SUFFIX = " Please answer yes or no."
THYME_STOP = ("</code>", "</answer>", "<|im_end|>")
SANDBOX_OPEN, SANDBOX_CLOSE = "<sandbox_output>", "</sandbox_output>"


def thyme_question(
    question: str, options: Sequence[str] | None = None, kind: str | None = None
) -> str:
    """The question text as Thyme's VLMEvalKit prompt builds it: multiple choice (``options``),
    yes/no (``kind="yorn"``) or short-answer VQA (default)."""
    if options:
        if len(options) > len(OPTION_LETTERS):
            raise ValueError(f"at most {len(OPTION_LETTERS)} options are supported")
        prompt = f"Question: {question}\nOptions:\n"
        prompt += "".join(f"{OPTION_LETTERS[i]}. {opt}\n" for i, opt in enumerate(options))
        cn = any("\u4e00" <= c <= "\u9fff" for c in prompt)
        return (prompt + (THYME_MCQ_CN if cn else THYME_MCQ_EN)).rstrip()
    if kind == "yorn":
        return question + THYME_YORN_SUFFIX
    return question + THYME_VQA_SUFFIX


def thyme_messages(
    image,
    question: str,
    options: Sequence[str] | None,
    image_path: str,
    image_size: tuple[int, int],
    kind: str | None = None,
) -> list[dict]:
    """System + user turn; ``image_path``/``image_size`` name the file the code will open."""
    text = THYME_USER_TEMPLATE.format(
        question=thyme_question(question, options, kind),
        image_path=image_path,
        image_size=f"{image_size[0]}x{image_size[1]}",
    )
    return [
        {"role": "system", "content": THYME_SYSTEM},
        {"role": "user", "content": [image_part(image), text_part(text)]},
    ]
