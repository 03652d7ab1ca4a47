"""Can a model tell where the target is? Why level 1 asks no left/right question and the mini
world's large model does not write its own zoom boxes.

Two measurements:

- **Rotary reach** (analytic, from the config): Qwen2.5-VL's language model sees an image token's
  row and column only through multimodal rotary embeddings, which give the head dimensions in
  contiguous sections to time, height and width, the width last, i.e. the slowest frequencies.
  For each section this reports the largest rotation between the first and the last token of an
  image row or column: an angle near 0 means attention scores cannot depend on that coordinate.
  The vision tower adds nothing absolute: its 2-D rotary embedding is relative and its windows
  repeat across the image.
- **Linear probe** (measured): the language model's last hidden state at the answer position,
  for large targets of level-1 validation scenes, fitted by ridge regression to "left half?" and
  to "top half?" and scored on held-out folds. If the hidden state held the position, a linear
  read-out would find it.

Usage: ``speceyes miniworld position-probe MODEL_DIR [--scenes 160]``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np


def rotary_reach(config: dict, grid: tuple[int, int]) -> dict[str, float]:
    """Largest rotation (radians) across ``grid`` = (rows, cols) of merged image tokens, per
    M-RoPE section, for a Qwen2.5-VL text config (contiguous sections: t, h, w)."""
    text = config.get("text_config", config)
    head = text["hidden_size"] // text["num_attention_heads"]
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    base = float(rope.get("rope_theta", text.get("rope_theta", 10000.0)))
    sections = rope["mrope_section"]
    inv = 1.0 / base ** (np.arange(0, head, 2) / head)
    starts = np.cumsum([0, *sections])[:-1]
    span = {"t": 0, "h": grid[0] - 1, "w": grid[1] - 1}
    # The fastest frequency of a section bounds every rotation it can make over the span.
    return {k: float(inv[s] * span[k]) for k, s in zip("thw", starts, strict=True)}


def _ridge_cv(x: np.ndarray, y: np.ndarray, folds: int = 5, lam: float = 1.0) -> float:
    """Held-out accuracy of a ridge classifier (targets -1/+1) over ``folds`` folds."""
    n = len(y)
    idx = np.arange(n)
    hits = 0
    for f in range(folds):
        test = idx % folds == f
        xtr, ytr = x[~test], y[~test]
        mu, sd = xtr.mean(0), xtr.std(0) + 1e-6
        a = np.c_[(xtr - mu) / sd, np.ones(len(xtr))]
        w = np.linalg.solve(a.T @ a + lam * np.eye(a.shape[1]), a.T @ (2.0 * ytr - 1))
        pred = np.c_[(x[test] - mu) / sd, np.ones(test.sum())] @ w > 0
        hits += int((pred == y[test]).sum())
    return hits / n


def hidden_position_probe(backend, scenes: int = 160, seed: int = 0) -> dict[str, float]:
    """Held-out accuracy of linear read-outs of the target's half (left/right, top/bottom) from
    the last hidden state, on large targets of level-1 val scenes (chance 0.5)."""
    import torch

    from speceyes import prompts
    from speceyes.miniworld.level1 import LEVEL1_CANVAS, generate_level1_scene, level1_rng
    from speceyes.miniworld.scenes import load_pool

    pool = load_pool("train")
    feats, left, top = [], [], []
    for i in range(scenes):
        scene = generate_level1_scene(level1_rng("val", seed, i), pool, regime="large")
        (obj,) = scene.objects
        msgs = prompts.small_messages(scene.image, f"What shape is the {obj.color} object?")
        inputs = backend._prepare([msgs], add_generation_prompt=True)
        with torch.no_grad():
            out = backend.model(**inputs, output_hidden_states=True)
        feats.append(out.hidden_states[-1][0, -1].float().numpy())
        cx, cy = obj.center
        left.append(cx < LEVEL1_CANVAS[0] / 2)
        top.append(cy < LEVEL1_CANVAS[1] / 2)
    x = np.stack(feats)
    return {
        "n": scenes,
        "left_right": _ridge_cv(x, np.array(left)),
        "top_bottom": _ridge_cv(x, np.array(top)),
        "share_left": float(np.mean(left)),
        "share_top": float(np.mean(top)),
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="speceyes miniworld position-probe",
        description="Whether a model can tell where the target is: the reach of its rotary "
        "position embedding across the image, and linear read-outs of left/right and top/bottom "
        "from its hidden state (level-1 val scenes, large targets).",
    )
    ap.add_argument("model", type=Path, help="a checkpoint folder (e.g. .../models/large)")
    ap.add_argument("--scenes", type=int, default=160, help="val scenes (default 160)")
    ap.add_argument("--seed", type=int, default=0, help="val split seed (default 0)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = ap.parse_args(argv)
    import torch

    from speceyes.miniworld.tinymodel import load_backend

    torch.set_num_threads(args.threads)
    backend = load_backend(args.model)
    config = json.loads((args.model / "config.json").read_text())
    from PIL import Image

    view = backend.view_of(Image.new("RGB", (1024, 1024)))
    grid = (view.view_h // backend.factor, view.view_w // backend.factor)
    reach = rotary_reach(config, grid)
    print(f"rotary reach across the {grid[0]}x{grid[1]} image tokens (radians, fastest frequency):")
    for k, v in reach.items():
        print(f"  {k}: {v:.4g}")
    res = hidden_position_probe(backend, args.scenes, args.seed)
    print(
        f"linear read-out from the last hidden state, {res['n']} scenes, 5-fold held-out "
        f"accuracy (chance 0.5): left/right {res['left_right']:.3f}, "
        f"top/bottom {res['top_bottom']:.3f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
