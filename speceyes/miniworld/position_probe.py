"""Can a model tell where the target is? Why level 1 asks no left/right question and the mini
world's Qwen2.5-VL large model does not write its own zoom boxes.

Two measurements:

- **Rotary reach** (analytic, from the config): the language model sees an image token's row
  and column only through multimodal rotary embeddings (M-RoPE), which give the head's frequency
  pairs to time, height and width. Qwen2.5-VL gives them in contiguous sections, the width last,
  i.e. the slowest frequencies; Qwen3-VL interleaves the three (t, h, w, t, h, w, ...), so width
  and height each get fast and slow ones. For each section this reports the largest rotation
  between the first and the last token of an image row or column: an angle near 0 means
  attention scores cannot depend on that coordinate. Qwen2.5-VL's vision tower adds nothing
  absolute (its 2-D rotary embedding is relative and its windows repeat across the image);
  Qwen3-VL's adds learned absolute position embeddings to its patches.
- **Linear probe** (measured): the language model's last hidden state at the answer position,
  for large targets of level-1 validation scenes, fitted by ridge regression to "left half?" and
  to "top half?" and scored on held-out folds. If the hidden state held the position, a linear
  read-out would find it.

Usage: ``speceyes miniworld position-probe MODEL_DIR [--scenes 160]``, where MODEL_DIR is a model
folder or a training run's role folder (its stage-B checkpoint is exported first); or
``speceyes miniworld position-probe --arch qwen3_vl`` for a freshly initialised large model of
that architecture at the bundled large model's sizes, with ``--rope-theta``, ``--head-dim`` and
``--mrope-section`` to change its language model's rotary embedding.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from speceyes.miniworld.tinymodel import VISION_POS_INITS


def section_frequencies(config: dict) -> dict[str, np.ndarray]:
    """Inverse frequencies (radians per position) of each M-RoPE section, t, h and w, of a
    Qwen2.5-VL (contiguous sections) or Qwen3-VL (``mrope_interleaved``) config."""
    text = config.get("text_config", config)
    head = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    base = float(rope.get("rope_theta", text.get("rope_theta", 10000.0)))
    sections = rope["mrope_section"]
    inv = 1.0 / base ** (np.arange(0, head, 2) / head)
    owner = np.zeros(len(inv), dtype=int)  # 0 = t, 1 = h, 2 = w, per frequency pair
    if rope.get("mrope_interleaved") or config.get("model_type") == "qwen3_vl":
        # As Qwen3-VL's rotary embedding recomposes them: pair i belongs to h when i % 3 == 1
        # and i < 3 * h, to w when i % 3 == 2 and i < 3 * w, to t otherwise.
        for dim in (1, 2):
            owner[dim : 3 * sections[dim] : 3] = dim
    else:
        owner = np.repeat(np.arange(3), sections)
    return {k: inv[owner == d] for d, k in enumerate("thw")}


def rotary_reach(config: dict, grid: tuple[int, int]) -> dict[str, float]:
    """Largest rotation (radians) across ``grid`` = (rows, cols) of merged image tokens, per
    M-RoPE section (t, h, w)."""
    span = {"t": 0, "h": grid[0] - 1, "w": grid[1] - 1}
    # The fastest frequency of a section bounds every rotation it can make over the span.
    return {k: float(f.max() * span[k]) for k, f in section_frequencies(config).items()}


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


def build_probe_model(
    dest: Path,
    arch: str,
    seed: int = 0,
    rope_theta: float | None = None,
    head_dim: int | None = None,
    mrope_section: Sequence[int] | None = None,
    vision_pos: str = "random",
) -> Path:
    """A large model of ``arch`` at the bundled large model's sizes, initialised as a training
    run from scratch initialises it (``dest/base``), with the rotary levers applied."""
    from speceyes.miniworld.tinymodel import ModelSize, build_base, rebuild_text_rope

    base = build_base(dest, "large", ModelSize(), seed, arch, vision_pos=vision_pos)
    if rope_theta is not None or head_dim is not None or mrope_section is not None:
        rebuild_text_rope(base, seed, rope_theta, head_dim, mrope_section)
    return base


def model_folder(path: Path) -> Path:
    """A model folder as given, or a training run's role folder (``base/`` and
    ``stage_B/ckpt.pt``) exported to its ``export/`` folder, as ``--stage eval`` does."""
    if (path / "config.json").is_file():
        return path
    if (path / "base").is_dir() and (path / "stage_B" / "ckpt.pt").is_file():
        from speceyes.miniworld.bundle import export

        return export(path, "B", path / "export")
    raise SystemExit(f"error: {path} is neither a model folder nor a run's role folder")


def _section(text: str) -> tuple[int, int, int]:
    t, h, w = (int(v) for v in text.split(","))
    return t, h, w


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="speceyes miniworld position-probe",
        description="Whether a model can tell where the target is: the reach of its rotary "
        "position embedding across the image, and linear read-outs of left/right and top/bottom "
        "from its hidden state (level-1 val scenes, large targets).",
    )
    ap.add_argument(
        "model",
        type=Path,
        nargs="?",
        help="a model folder (e.g. .../models/large) or a run's role folder (e.g. runs/x/large)",
    )
    ap.add_argument(
        "--arch",
        choices=("qwen2_5_vl", "qwen3_vl"),
        help="instead of MODEL: a freshly initialised large model of this architecture at the "
        "bundled large model's sizes",
    )
    ap.add_argument("--init-seed", type=int, default=0, help="--arch: weight seed (default 0)")
    ap.add_argument("--rope-theta", type=float, help="--arch: the text rotary base")
    ap.add_argument(
        "--head-dim", type=int, help="--arch: text head size (heads = hidden // head size)"
    )
    ap.add_argument(
        "--mrope-section", type=_section, help="--arch: M-RoPE frequency pairs t,h,w (e.g. 8,12,12)"
    )
    ap.add_argument(
        "--vision-pos", choices=VISION_POS_INITS, default="random",
        help="--arch qwen3_vl: the vision tower's learned position grid at initialisation: "
        "random (transformers' default) or a 2D sine-cosine grid (default random)",
    )  # fmt: skip
    ap.add_argument(
        "--build-dir", type=Path, help="--arch: where to write the model (default: a temp folder)"
    )
    ap.add_argument("--scenes", type=int, default=160, help="val scenes (default 160)")
    ap.add_argument("--seed", type=int, default=0, help="val split seed (default 0)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = ap.parse_args(argv)
    if (args.model is None) == (args.arch is None):
        ap.error("give either MODEL or --arch")
    levers = (args.rope_theta, args.head_dim, args.mrope_section)
    if args.arch is None and (any(v is not None for v in levers) or args.vision_pos != "random"):
        ap.error("--rope-theta, --head-dim, --mrope-section and --vision-pos need --arch")
    if args.vision_pos != "random" and args.arch != "qwen3_vl":
        ap.error("--vision-pos: only Qwen3-VL has a learned vision position grid")
    import tempfile

    import torch

    from speceyes.miniworld.tinymodel import load_backend

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        if args.arch is not None:
            folder = build_probe_model(
                args.build_dir or Path(tmp), args.arch, args.init_seed, *levers,
                vision_pos=args.vision_pos,
            )  # fmt: skip
        else:
            folder = model_folder(args.model)
        backend = load_backend(folder)
        config = json.loads((folder / "config.json").read_text())
        from PIL import Image

        view = backend.view_of(Image.new("RGB", (1024, 1024)))
        grid = (view.view_h // backend.factor, view.view_w // backend.factor)
        reach = rotary_reach(config, grid)
        res = hidden_position_probe(backend, args.scenes, args.seed)
    text = config.get("text_config", config)
    rope = text.get("rope_parameters") or {}
    print(
        f"{config['model_type']}: head size "
        f"{text.get('head_dim') or text['hidden_size'] // text['num_attention_heads']}, "
        f"rope_theta {rope.get('rope_theta'):g}, mrope_section {rope.get('mrope_section')}"
    )
    print(f"rotary reach across the {grid[0]}x{grid[1]} image tokens (radians, fastest frequency):")
    for k, v in reach.items():
        print(f"  {k}: {v:.4g}")
    print(
        f"linear read-out from the last hidden state, {res['n']} scenes, 5-fold held-out "
        f"accuracy (chance 0.5): left/right {res['left_right']:.3f}, "
        f"top/bottom {res['top_bottom']:.3f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
