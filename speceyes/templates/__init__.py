"""Chat templates of the released Qwen-VL checkpoints, for the real-shaped test checkpoints
(``speceyes.tiny.build_real_shaped``); a user's checkpoint always brings its own.

* ``qwen2_vl.jinja``: the template of Qwen2-VL and Qwen2.5-VL Instruct (DeepEyes and Thyme are
  Qwen2.5-VL-7B fine-tunes), as published in the ``chat_template`` of Qwen2-VL-2B-Instruct's
  ``tokenizer_config.json`` and ``chat_template.json``. A default system prompt ("You are a
  helpful assistant.") opens a conversation that has none.
* ``qwen3_vl_instruct.jinja``: the Qwen3-VL Instruct template, transcribed from a third-party
  copy of Qwen3-VL-Instruct's ``chat_template.json`` (the ``chat_template_qwen3vl`` string of a
  GUI-agent project's ``constants.py``); not compared with the hub's file. It has no default
  system prompt and renders only the text of assistant turns (no images).
"""

from __future__ import annotations

from importlib import resources

TEMPLATES = {"qwen2_5_vl": "qwen2_vl.jinja", "qwen3_vl": "qwen3_vl_instruct.jinja"}


def chat_template(family: str) -> str:
    """The released chat template of a model family (``TEMPLATES``)."""
    return (resources.files(__package__) / TEMPLATES[family]).read_text(encoding="utf-8")
