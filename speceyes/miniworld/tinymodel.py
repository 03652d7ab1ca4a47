"""The mini-world's tiny models: their sizes and families, building a base folder (tokenizer,
processor, random weights), loading one as an ``HFBackend``, the stage-A head, checkpoints and
the training event log."""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from speceyes.miniworld.scenes import COLORS, SHAPES

ROLES = ("small", "large")
# Small = Qwen3-VL (the SpecEyes small model is Qwen3-VL-2B; its 16-px patches and full vision
# attention are also the cheaper tower on CPU). Large = Qwen2.5-VL (DeepEyes is Qwen2.5-VL-7B and
# speaks absolute-pixel boxes).
FAMILY = {"small": "qwen3_vl", "large": "qwen2_5_vl"}
# The model's view budget: low enough for CPU training (49 image tokens at 224x224).
VIEW_PIXELS = {"small": 224 * 224, "large": 224 * 224}


@dataclass
class ModelSize:
    text_hidden: int = 256
    text_layers: int = 4
    vision_hidden: int = 128
    vision_depth: int = 3


TINY = ModelSize(text_hidden=64, text_layers=2, vision_hidden=32, vision_depth=2)


def log_event(out: Path, rec: dict[str, Any]) -> None:
    """Print one JSON line and append it to ``out/log.jsonl`` (a run's event log)."""
    rec = {"time": round(time.time(), 1), **rec}
    line = json.dumps(rec)
    print(line, flush=True)
    with open(out / "log.jsonl", "a") as f:
        f.write(line + "\n")


def domain_corpus() -> list[str]:
    """Mini-world text for the tokenizer, so colour, shape and answer words are single tokens
    (with and without a leading space), as they are in a real vocabulary."""

    words = [*COLORS, *SHAPES, "left", "right", "yes", "no"]
    lines = [
        "What shape is the red object? What is the color of the triangle? Is there a green "
        "circle in the image? Is the red circle on the left or the right side of the blue "
        "triangle?",
        " ".join(words),
        "\n".join(words),
        " ".join(f"<answer>{w}</answer>" for w in words),
    ]
    return lines * 60


def build_base(
    role_dir: Path,
    role: str,
    size: ModelSize,
    seed: int,
    family: str | None = None,
    from_folder: Path | None = None,
    vision_pos: str = "random",
) -> Path:
    """A fresh random checkpoint of the role's family with its view budget, in role_dir/base;
    or, with ``from_folder`` (a save_pretrained model such as a bundled one), a copy of it, so a
    stage can start from the weights the repository ships when no run folder is left.
    ``vision_pos="sincos"``: a fresh Qwen3-VL model's vision position grid starts as
    :func:`init_vision_positions` writes it."""
    if vision_pos not in VISION_POS_INITS:
        raise ValueError(f"unknown vision position init {vision_pos!r}: {VISION_POS_INITS}")
    from speceyes.tiny import build_tiny_model

    base = role_dir / "base"
    if (base / "config.json").is_file():
        return base
    if from_folder is not None:
        tmp = role_dir / ".base.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(from_folder, tmp)
        os.replace(tmp, base)
        return base
    # Built aside and moved in whole: a crash part-way must not leave a base that a resumed
    # run would take as finished (its config written, its position grid not yet).
    tmp = role_dir / ".base.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    build_tiny_model(
        tmp,
        family or FAMILY[role],
        text_hidden=size.text_hidden,
        text_layers=size.text_layers,
        vision_hidden=size.vision_hidden,
        vision_depth=size.vision_depth,
        seed=seed,
        extra_corpus=domain_corpus(),
        vocab_size=720,
    )
    # The view budget lives in the image processor config, as in a real checkpoint.
    cfg_path = tmp / "preprocessor_config.json"
    cfg = json.loads(cfg_path.read_text())
    factor = cfg["patch_size"] * cfg["merge_size"]
    cfg["max_pixels"] = VIEW_PIXELS[role]
    cfg["min_pixels"] = 4 * factor * factor
    cfg["size"] = {"shortest_edge": 4 * factor * factor, "longest_edge": VIEW_PIXELS[role]}
    cfg_path.write_text(json.dumps(cfg, indent=2))
    if vision_pos == "sincos":
        init_vision_positions(tmp)
    os.replace(tmp, base)
    return base


VISION_POS_INITS = ("random", "sincos")
# --vision-pos sincos: the grid's norm as a multiple of a patch embedding's. At 1x the
# position read-out of a fresh Qwen3-VL large model reached left/right 0.87 (seed 0); at 3x
# 0.91-0.93 on three weight seeds, at 5x and 10x no better (docs/miniworld-training.md).
SINCOS_SCALE = 3.0


def sincos_grid(side: int, dim: int) -> np.ndarray:
    """A ``side`` x ``side`` grid of 2D sine-cosine position codes, one row per cell in
    row-major order, each of unit norm: a quarter of ``dim`` each for sin and cos of the row and
    of the column, at frequencies from pi / side (a half turn across the grid) to pi (one cell
    apart), geometrically spaced, so that near cells get near codes and every cell a distinct
    one (the fixed 2D embedding of MAE, He et al. 2022, at these frequencies)."""
    if dim % 4:
        raise ValueError(f"the vision width must be a multiple of 4, got {dim}")
    k = dim // 4
    freqs = np.pi / side * 2.0 ** np.linspace(0.0, np.log2(side), k)
    rows, cols = np.divmod(np.arange(side * side, dtype=np.float64), side)
    code = np.concatenate([np.sin(np.outer(rows, freqs)), np.cos(np.outer(rows, freqs)),
                           np.sin(np.outer(cols, freqs)), np.cos(np.outer(cols, freqs))], axis=1)
    return code / np.linalg.norm(code, axis=1, keepdims=True)


def init_vision_positions(folder: Path, scale: float = SINCOS_SCALE) -> Path:
    """Replace a Qwen3-VL folder's learned vision position grid (``visual.pos_embed``, random
    at initialisation) by :func:`sincos_grid` at ``scale`` times a patch embedding's mean norm,
    in place. At random initialisation that grid is so small beside the patch embeddings that a
    fresh model hardly tells left from right (read-out 0.63-0.73); the sine-cosine grid gives
    every image token its place from the first step (0.91-0.93), which box coordinates need."""
    import torch
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    vis = getattr(model.model, "visual", None)
    if vis is None or not hasattr(vis, "pos_embed"):
        raise ValueError(f"{folder}: no learned vision position grid (a Qwen3-VL model has one)")
    n, dim = vis.pos_embed.weight.shape
    side = int(round(n**0.5))
    cfg = vis.config
    patch = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
    with torch.no_grad():  # a patch embedding's typical norm, on pixels the processor's range
        g = torch.Generator().manual_seed(0)
        norm = vis.patch_embed(torch.rand(256, patch, generator=g) * 2 - 1).norm(dim=-1).mean()
        grid = torch.from_numpy(sincos_grid(side, dim)).float() * norm * scale
        vis.pos_embed.weight.copy_(grid)
    model.save_pretrained(folder)
    return folder


def rebuild_text_rope(
    folder: Path,
    seed: int,
    rope_theta: float | None = None,
    head_dim: int | None = None,
    mrope_section: Sequence[int] | None = None,
) -> Path:
    """Rewrite a base folder's language-model rotary settings and re-initialise its weights
    (same hidden size and parameter count; tokenizer and processor untouched): the levers of
    position read-out. ``head_dim`` changes the number of heads (hidden // head_dim) and of
    key-value heads (their width stays); the M-RoPE sections then scale with it unless
    ``mrope_section`` (t, h, w) is given."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText, GenerationConfig

    config = AutoConfig.from_pretrained(folder)
    text = config.text_config
    rope = dict(text.rope_parameters)
    if rope_theta is not None:
        rope["rope_theta"] = float(rope_theta)
    if head_dim is not None:
        old_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        heads = text.hidden_size // head_dim
        if heads * head_dim != text.hidden_size:
            raise ValueError(f"head_dim {head_dim} does not divide hidden {text.hidden_size}")
        # Keys and values keep their width (kv heads x head size), so the parameters stay.
        kv = max(1, text.num_key_value_heads * old_dim // head_dim)
        if heads % kv:
            raise ValueError(f"{heads} heads cannot share {kv} key-value heads")
        text.num_attention_heads = heads
        text.num_key_value_heads = kv
        if hasattr(text, "head_dim"):
            text.head_dim = head_dim
        if mrope_section is None:
            h, w = (round(s * head_dim / old_dim) for s in rope["mrope_section"][1:])
            rope["mrope_section"] = [head_dim // 2 - h - w, h, w]
    if mrope_section is not None:
        rope["mrope_section"] = [int(s) for s in mrope_section]
    text.rope_parameters = rope
    generation = GenerationConfig.from_pretrained(folder)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config)
    model.generation_config = generation
    model.save_pretrained(folder)
    return folder


def load_backend(folder: Path):
    from speceyes.backends.hf import HFBackend

    return HFBackend(folder, dtype="float32")


class Head:
    """Temporary heads (shape, colour) on attention-pooled merged vision tokens.

    A learned query scores every merged token; the softmax-weighted sum is classified. Mean
    pooling learned colour but left shape at chance (the object is a few of many tokens).
    """

    def __init__(self, dim: int, seed: int) -> None:
        import torch

        g = torch.Generator().manual_seed(seed)
        self.query = torch.nn.Linear(dim, 2, bias=False)  # one pooling query per task
        self.shape = torch.nn.Linear(dim, 3)
        self.color = torch.nn.Linear(dim, 8)
        with torch.no_grad():
            for lin in (self.query, self.shape, self.color):
                lin.weight.normal_(0, 0.02, generator=g)
                if lin.bias is not None:
                    lin.bias.zero_()
        self.modules = {"query": self.query, "shape": self.shape, "color": self.color}

    def parameters(self):
        return [p for m in self.modules.values() for p in m.parameters()]

    def state_dict(self):
        return {k: m.state_dict() for k, m in self.modules.items()}

    def load_state_dict(self, sd):
        for k, m in self.modules.items():
            m.load_state_dict(sd[k])

    def __call__(self, tokens: list):
        """Per-image token tensors [n_i, dim] -> (shape logits, colour logits)."""
        import torch

        pooled = []
        for t in tokens:
            w = torch.softmax(self.query(t), dim=0)  # [n_i, 2]
            pooled.append(w.T @ t)  # [2, dim]
        p = torch.stack(pooled)
        return self.shape(p[:, 0]), self.color(p[:, 1])


def vision_tokens(backend, pixel_values, grid) -> list:
    """Each image's merged vision tokens (what the language model sees): list of [n_i, dim]."""
    import torch

    out = backend.model.model.get_image_features(pixel_values, grid)
    feats = out.pooler_output if hasattr(out, "pooler_output") else out
    if isinstance(feats, (list, tuple)):
        feats = torch.cat(list(feats), 0)
    counts = (grid.prod(-1) // backend.merge**2).tolist()
    return list(torch.split(feats, counts))


def rng_state() -> dict:
    import torch

    return {"py": random.getstate(), "np": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(s: dict) -> None:
    import torch

    random.setstate(s["py"])
    np.random.set_state(s["np"])
    torch.set_rng_state(s["torch"])


def save_ckpt(path: Path, backend, head: Head | None, opt, step: int, extra: dict) -> None:
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "model": backend.model.state_dict(),
            "head": head.state_dict() if head else None,
            "opt": opt.state_dict(),
            "step": step,
            "rng": rng_state(),
            **extra,
        },
        tmp,
    )
    os.replace(tmp, path)


def load_ckpt(path: Path):
    import torch

    return torch.load(path, map_location="cpu", weights_only=False)
