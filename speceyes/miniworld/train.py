"""Train the mini-world's tiny small and large models on CPU, in stages, resumably.

    python -m speceyes.miniworld.train --out runs/mw --role small --stage A --minutes 8 --seed 0
    python -m speceyes.miniworld.train --out runs/mw --role small --stage B --minutes 15 --seed 0
    python -m speceyes.miniworld.train --out runs/mw --role small --stage eval
    (add --resume to continue a stage from its last checkpoint)

Stages (see docs/miniworld-training.md for the recipe and the measured results):

- ``A`` vision warm-start: the model's own vision tower (patch embed, blocks, merger) plus a
  temporary linear head on its attention-pooled merged tokens learns shape (3) and colour (8) of one
  easy-VQA sprite rendered in memory at a random size and place. Held-out accuracy on sprites of
  ``load_pool("test")``.
- ``B`` answers: the full model, next-token loss on the answer tokens only (everything else is
  masked), on mini-world questions rendered at the model's view. Inputs are built by
  ``HFBackend._prepare`` with the exact prompts of :mod:`speceyes.prompts` (small: the small-model
  prompt on the low-resolution full view and on zoom crops; large: also the judge prompt answered
  yes for small targets and no for large ones, and with ``--deepeyes`` DeepEyes turns:
  ``<answer>`` on the full view for large targets, and for small targets a zoom crop returned as
  the real tool response, then ``<answer>``; ``--boxes`` also trains the ``<tool_call>``).
- ``eval``: save_pretrained, load back through ``HFBackend`` (the path real checkpoints take) and
  score greedy answers on held-out val scenes: full views by target size, zoom crops, random
  zooms.
- ``bundle``: both roles' stage-B weights in bfloat16 plus the demo's ``manifest.json`` into
  ``speceyes/miniworld/models`` (what ``speceyes demo`` loads).

Stage B's data and losses (word answers, zoom questions, the per-token auxiliary loss, packed
conversations) are described with the measured results in docs/miniworld-training.md.

Every stage writes ``DIR/<role>/stage_<X>/ckpt.pt`` (model, head, optimizer, step, RNG states)
every ``--save-every`` seconds and at its end, and appends JSON lines to ``DIR/<role>/log.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from speceyes import prompts
from speceyes.miniworld.scenes import COLORS, SHAPES

ROLES = ("small", "large")
# Small = Qwen3-VL (the SpecEyes small model is Qwen3-VL-2B; its 16-px patches and full vision
# attention are also the cheaper tower on CPU). Large = Qwen2.5-VL (DeepEyes is Qwen2.5-VL-7B and
# speaks absolute-pixel boxes).
FAMILY = {"small": "qwen3_vl", "large": "qwen2_5_vl"}
# The model's view budget: low enough for CPU training (49 image tokens at 224x224).
VIEW_PIXELS = {"small": 224 * 224, "large": 224 * 224}
CANVAS = (1024, 1024)


@dataclass
class ModelSize:
    text_hidden: int = 256
    text_layers: int = 4
    vision_hidden: int = 128
    vision_depth: int = 3


TINY = ModelSize(text_hidden=64, text_layers=2, vision_hidden=32, vision_depth=2)


def _log(out: Path, rec: dict[str, Any]) -> None:
    rec = {"time": round(time.time(), 1), **rec}
    line = json.dumps(rec)
    print(line, flush=True)
    with open(out / "log.jsonl", "a") as f:
        f.write(line + "\n")


# ------------------------------------------------------------------------------------ model


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
) -> Path:
    """A fresh random checkpoint of the role's family with its view budget, in role_dir/base;
    or, with ``from_folder`` (a save_pretrained model such as a bundled one), a copy of it, so a
    stage can start from the weights the repository ships when no run folder is left."""
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
    build_tiny_model(
        base,
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
    cfg_path = base / "preprocessor_config.json"
    cfg = json.loads(cfg_path.read_text())
    factor = cfg["patch_size"] * cfg["merge_size"]
    cfg["max_pixels"] = VIEW_PIXELS[role]
    cfg["min_pixels"] = 4 * factor * factor
    cfg["size"] = {"shortest_edge": 4 * factor * factor, "longest_edge": VIEW_PIXELS[role]}
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return base


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


# ------------------------------------------------------------------------------------- data

_SPRITES: dict[str, list] = {}


def sprites(split: str, limit: int | None = None) -> list:
    """Usable sprites of an easy-VQA split (pixel-verified by the scene module), cached."""
    from speceyes.miniworld.scenes import load_pool

    key = f"{split}:{limit}"
    if key not in _SPRITES:
        pool = load_pool(split)
        ids = sorted(pool.labels)
        if limit:
            ids = ids[:: max(1, len(ids) // limit)][:limit]
        _SPRITES[key] = [s for s in (pool.sprite(i) for i in ids) if s is not None]
    return _SPRITES[key]


def render_object(rng: random.Random, sprite, view: int, lo: int = 10, hi: int = 80) -> Image.Image:
    """One sprite, its longer side ``lo``-``hi`` px (clipped to 90% of the view), at a random
    place on a light background. The default range covers targets as large targets appear in
    the 224-px scene view (33-75 px)."""
    from speceyes.miniworld.scenes import PALETTE, _scaled_alpha

    bg = tuple(rng.randint(232, 252) for _ in range(3))
    img = Image.new("RGB", (view, view), bg)
    side = rng.randint(min(lo, int(view * 0.9)), min(hi, int(view * 0.9)))
    alpha = _scaled_alpha(sprite, side)
    h, w = alpha.shape
    x, y = rng.randint(0, max(0, view - w)), rng.randint(0, max(0, view - h))
    mask = Image.fromarray(np.round(alpha * 255).astype(np.uint8))
    img.paste(Image.new("RGB", mask.size, PALETTE[sprite.color]), (x, y), mask)
    return img


def view_size(backend) -> tuple[int, int]:
    from speceyes.images import smart_resize

    h, w = smart_resize(
        CANVAS[1], CANVAS[0], backend.factor, backend.min_pixels, backend.max_pixels
    )
    return w, h


def zoom_box(size: tuple[int, int], bbox: Sequence[int]) -> tuple[int, int, int, int]:
    """The mini-world zoom: a square of 4x the target's side around it, inside the image."""
    x1, y1, x2, y2 = bbox
    side = max(x2 - x1, y2 - y1) * 4
    cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
    left = int(min(max(cx - side / 2, 0), size[0] - side))
    top = int(min(max(cy - side / 2, 0), size[1] - side))
    return left, top, left + side, top + side


def crop_at_view(image: Image.Image, box: Sequence[int], backend) -> Image.Image:
    """``box`` of ``image`` shown at the model's full view budget, as a zoom tool returns it."""
    from speceyes.images import resize_for_model

    crop = image.crop(tuple(box))
    return resize_for_model(crop, backend.factor, backend.max_pixels, backend.max_pixels)[0]


COLORS_AND_SHAPES = (*COLORS, *SHAPES)


def name_of(obj_layout: Sequence) -> tuple[str, str]:
    """(colour, shape) of a :func:`layout_in` entry."""
    return COLORS[obj_layout[4]], SHAPES[obj_layout[5]]


def layout_in(objects: Sequence, box: Sequence[int], out_size: tuple[int, int]) -> list[tuple]:
    """Objects as (x1, y1, x2, y2, colour id, shape id) in the pixels of ``box`` resized to
    ``out_size`` (for the auxiliary per-token loss)."""

    sx = out_size[0] / (box[2] - box[0])
    sy = out_size[1] / (box[3] - box[1])
    out = []
    for o in objects:
        x1, y1, x2, y2 = o.bbox
        out.append(
            (
                (x1 - box[0]) * sx,
                (y1 - box[1]) * sy,
                (x2 - box[0]) * sx,
                (y2 - box[1]) * sy,
                COLORS.index(o.color),
                SHAPES.index(o.shape),
            )
        )
    return out


def _crop_target(q, objects: Sequence, regime: str, rng: random.Random):
    """Box to zoom on for a question: its target, else (absent-object questions) a random
    regime-size object, as a search would land on something."""
    if q.target_bbox is not None:
        return q.target_bbox
    return rng.choice([o for o in objects if o.size == regime]).bbox


def make_questions(
    split: str,
    seed: int,
    n_scenes: int,
    backend,
    crops: bool,
    zoom_max: float = 12.0,
    zoom_crops: int = 2,
    search_cells: int = 0,
    near_misses: int = 0,
    elsewhere: int = 4,
    level: int = 1,
    search_depths: int = 2,
) -> list[dict]:
    """Scenes rendered on the fly (in memory), kept only as the model's view (+ zoom crops of
    the small-regime questions, relative position excepted: its reference is outside the crop).
    ``level`` 1 is the one-target world (:mod:`speceyes.miniworld.level1`), 2 the multi-object
    one; at level 1 both regimes get search-cell questions (the agent searches every query)."""
    from speceyes.images import resize_for_model
    from speceyes.miniworld.level1 import LEVEL1_CLUTTER, generate_level1_scene, level1_rng
    from speceyes.miniworld.scenes import generate_scene, load_pool, scene_rng

    pool = load_pool("test" if split == "test" else "train")
    rows = []
    for i in range(n_scenes):
        regime = "small" if i % 2 else "large"
        if level == 1:
            scene = generate_level1_scene(
                level1_rng(split, seed, i), pool, CANVAS, regime, clutter=LEVEL1_CLUTTER
            )
        else:
            scene = generate_scene(scene_rng(split, seed, i), pool, canvas=CANVAS, regime=regime)
        view = resize_for_model(
            scene.image, backend.factor, backend.min_pixels, backend.max_pixels
        )[0]
        crop_rng = random.Random(f"crop-{split}-{seed}-{i}")
        view_objs = layout_in(scene.objects, (0, 0, *scene.image.size), view.size)
        for q in scene.questions:
            row = {
                "scene": i,
                "view": view,
                "question": q.question,
                "options": q.options,
                "answer": q.answer,
                "answer_text": (
                    q.options[prompts.OPTION_LETTERS.index(q.answer)] if q.options else q.answer
                ),
                "category": q.category,
                "target_size": q.target_size,
                "target_bbox": q.target_bbox,
                "view_box": None,
                "objs": view_objs,
            }
            if crops and regime == "small" and q.category != "relative_position":
                box = _crop_target(q, scene.objects, regime, crop_rng)
                zb = zoom_box(scene.image.size, box)
                row["crop"] = crop_at_view(scene.image, zb, backend)
                row["crop_objs"] = layout_in(scene.objects, zb, row["crop"].size)
                sx = view.width / CANVAS[0]
                sy = view.height / CANVAS[1]
                row["view_box"] = [
                    round(box[0] * sx),
                    round(box[1] * sy),
                    round(box[2] * sx),
                    round(box[3] * sy),
                ]
            rows.append(row)
        if crops:
            rows.extend(zoom_questions(scene, crop_rng, backend, zoom_crops, zoom_max))
        if search_cells and (regime == "small" or level == 1):
            rows.extend(
                search_cell_questions(
                    scene,
                    crop_rng,
                    backend,
                    search_cells,
                    near_misses=near_misses,
                    elsewhere=elsewhere,
                    depths=search_depths,
                )
            )
    return rows


def _inside(obj, box: Sequence[int], min_share: float = 0.6) -> bool:
    """Whether an object counts as shown in a crop: its centre inside and most of its box."""
    x1, y1, x2, y2 = obj.bbox
    ix = max(0, min(x2, box[2]) - max(x1, box[0]))
    iy = max(0, min(y2, box[3]) - max(y1, box[1]))
    cx, cy = obj.center
    centre_in = box[0] <= cx < box[2] and box[1] <= cy < box[3]
    return centre_in and ix * iy >= min_share * (x2 - x1) * (y2 - y1)


def _overlaps(obj, box: Sequence[int]) -> bool:
    """Whether any part of an object is in a crop (then it is shown, or unclear, never absent)."""
    x1, y1, x2, y2 = obj.bbox
    return x1 < box[2] and x2 > box[0] and y1 < box[3] and y2 > box[1]


def objects_in_crop(objects: Sequence, box: Sequence[int]) -> tuple[list, list]:
    """``(shown, cut)``: the objects a crop shows, and those it cuts by its edge. A question about
    a cut object's attributes has no clear answer, so it is neither yes nor no."""
    shown = [o for o in objects if _inside(o, box)]
    return shown, [o for o in objects if o not in shown and _overlaps(o, box)]


def zoom_questions(
    scene, rng: random.Random, backend, n_crops: int = 2, zoom_max: float = 12.0
) -> list[dict]:
    """Questions about random zooms of a scene, answered from what each crop shows.

    A crop is a square around a random object, 2.5-``zoom_max`` times its side (the scales a search passes
    through, from unreadable dot to readable shape), the object anywhere inside. Questions:
    existence of a colour-shape pair, a colour, a shape (yes from the crop's objects, no from
    near misses), and attribute questions when the attribute is unique in the crop. This is
    what the search agent asks ("Is there a {target} in the image?") and what a zoom answers.
    """
    from speceyes.miniworld.scenes import ALL_PAIRS

    w, h = scene.image.size
    rows = []
    for _ in range(n_crops):
        anchor = rng.choice(scene.objects)
        side = int(min(min(w, h), max(64, anchor.side * rng.uniform(2.5, zoom_max))))
        x1, y1, x2, y2 = anchor.bbox
        left = rng.randint(max(0, x2 - side), max(0, min(x1, w - side)))
        top = rng.randint(max(0, y2 - side), max(0, min(y1, h - side)))
        box = (left, top, left + side, top + side)
        crop = crop_at_view(scene.image, box, backend)
        objs = layout_in(scene.objects, box, crop.size)
        # Partly shown objects make any answer about them ambiguous: leave their attributes out.
        shown, partial = objects_in_crop(scene.objects, box)
        pairs = {(o.color, o.shape) for o in shown}
        colors, shapes = {c for c, _ in pairs}, {s for _, s in pairs}
        unclear_c = {o.color for o in partial}
        unclear_s = {o.shape for o in partial}
        qs: list[tuple[str, list[str] | None, str]] = []
        if shown:
            c, s = rng.choice(sorted(pairs))
            qs.append((f"Is there a {c} {s} in the image?", None, "yes"))
            qs.append(
                (f"Is there a {rng.choice(sorted(colors))} object in the image?", None, "yes")
            )
            qs.append((f"Is there a {rng.choice(sorted(shapes))} in the image?", None, "yes"))
        near = [
            p
            for p in ALL_PAIRS
            if p not in pairs
            and (p[0] in colors or p[1] in shapes)
            and p[0] not in unclear_c
            and p[1] not in unclear_s
        ]
        if near:
            c, s = rng.choice(near)
            qs.append((f"Is there a {c} {s} in the image?", None, "no"))
        absent_c = [c for c in COLORS if c not in colors and c not in unclear_c]
        absent_s = [s for s in SHAPES if s not in shapes and s not in unclear_s]
        if absent_c:
            qs.append((f"Is there a {rng.choice(absent_c)} object in the image?", None, "no"))
        if absent_s:
            qs.append((f"Is there a {rng.choice(absent_s)} in the image?", None, "no"))
        for o in shown:
            if sum(p.color == o.color for p in shown) == 1 and o.color not in unclear_c:
                opts = list(SHAPES)
                rng.shuffle(opts)
                qs.append((f"What shape is the {o.color} object?", opts, o.shape))
            if sum(p.shape == o.shape for p in shown) == 1 and o.shape not in unclear_s:
                others = [c for c in COLORS if c != o.color]
                rng.shuffle(others)
                opts = [o.color, *others[:3]]
                rng.shuffle(opts)
                qs.append((f"What is the color of the {o.shape}?", opts, o.color))
        for q, opts, ans in qs:
            rows.append(
                {
                    "view": crop,
                    "question": q,
                    "options": opts,
                    "answer_text": ans,
                    "category": "zoom",
                    "target_size": anchor.size,
                    "zoom": round(side / max(1, anchor.side), 2),
                    "objs": objs,
                }
            )
    return rows


def _existence_answers(shown: Sequence, partial: Sequence, names: Sequence[tuple[str, str]]):
    """Yes/no answers for the search's three target phrasings (pair, colour, shape) of each
    ``(colour, shape)`` in ``names``; a phrasing a partly shown object makes unclear is left out."""
    sp = {(o.color, o.shape) for o in shown}
    pp = {(o.color, o.shape) for o in partial}
    out: dict[str, str] = {}
    for c, s in names:
        for phrase, has, unclear in (
            (f"{c} {s}", (c, s) in sp, (c, s) in pp),
            (f"{c} object", any(x == c for x, _ in sp), any(x == c for x, _ in pp)),
            (s, any(y == s for _, y in sp), any(y == s for _, y in pp)),
        ):
            if has:
                out[phrase] = "yes"
            elif not unclear:
                out[phrase] = "no"
    return out


def _near_misses(shown: Sequence, partial: Sequence, rng: random.Random, n: int) -> list:
    """Up to ``n`` pairs that share a colour or a shape with an object in the crop but are in
    neither what it shows nor what it cuts: the crop's adversarial negatives."""
    seen = {(o.color, o.shape) for o in (*shown, *partial)}
    near = {
        p
        for o in shown
        for p in [*((o.color, s) for s in SHAPES), *((c, o.shape) for c in COLORS)]
        if p not in seen
    }
    return rng.sample(sorted(near), min(n, len(near)))


def search_cell_questions(
    scene,
    rng: random.Random,
    backend,
    cells: int = 4,
    grid: int = 3,
    overlap: float = 0.25,
    near_misses: int = 0,
    elsewhere: int = 4,
    depths: int = 2,
) -> list[dict]:
    """Existence questions on the very cells the search agent scores, at its first ``depths``.

    The search ranks the cells of a grid by the model's P(yes) to "Is there a {target} in the
    image?", so this is what it must answer: yes in the cells that show a scene object, no in the
    cells that do not although the object is elsewhere in the scene. Depth 1 is the grid over
    the whole canvas; depth 2 the grid inside a depth-1 cell holding a random small object. Up
    to ``cells`` cells per depth, always including one that holds the object; each gets up to
    4 yes and ``elsewhere`` no questions about the scene's own objects, and ``near_misses`` more
    no's about pairs one attribute away from an object it shows (what a search lands on for an
    absent target).
    """
    from speceyes.agents.search import grid_boxes

    w, h = scene.image.size
    small = [o for o in scene.objects if o.size == "small"] or list(scene.objects)
    anchor = rng.choice(small)
    names = sorted({(o.color, o.shape) for o in scene.objects})
    rows = []
    region: tuple[float, float, float, float] = (0.0, 0.0, float(w), float(h))
    for _ in range(depths):
        level = [tuple(round(v) for v in c) for c in grid_boxes(region, grid, overlap)]
        home = [c for c in level if _inside(anchor, c, 1.0)]
        if not home:
            break
        pick = rng.choice(home)
        chosen = [pick, *rng.sample([c for c in level if c != pick], min(cells, len(level)) - 1)]
        for box in chosen:
            crop = crop_at_view(scene.image, box, backend)
            objs = layout_in(scene.objects, box, crop.size)
            shown, partial = objects_in_crop(scene.objects, box)
            answers = list(_existence_answers(shown, partial, names).items())
            rng.shuffle(answers)
            yes = [a for a in answers if a[1] == "yes"][:4]
            no = [a for a in answers if a[1] == "no"][:elsewhere]
            if near_misses:
                pairs = _near_misses(shown, partial, rng, near_misses)
                no += [(f"{c} {sh}", "no") for c, sh in pairs]
            for phrase, ans in yes + no:
                rows.append(
                    {
                        "view": crop,
                        "question": f"Is there a {phrase} in the image?",
                        "options": None,
                        "answer_text": ans,
                        "category": "zoom",
                        "target_size": anchor.size,
                        "zoom": round(w / max(1, box[2] - box[0]), 2),
                        "objs": objs,
                    }
                )
        region = pick
    return rows


def answer_text(row: dict) -> str:
    """The answer as a word (the option's text, or yes / no): the small prompt asks for "the
    final answer itself", and scoring accepts an option's text as well as its letter."""
    return row["answer_text"]


Example = tuple[list[dict], str, list]  # messages, assistant text, per-image object layouts


def examples_for(row: dict, role: str, boxes: bool, deepeyes: bool = False) -> list[Example]:
    """Training examples of one question for a role. Small: the small prompt on the view and on
    the zoom crop. Large: the same, the judge (yes for small targets, no for large) and, with
    ``deepeyes``, the DeepEyes turns (``<answer>`` on the view, or after the crop returned as
    the tool response; ``boxes`` adds the ``<tool_call>`` itself)."""
    q, opts, ans = row["question"], row["options"], answer_text(row)
    if row["category"] == "zoom":  # a question about a random zoom: the small prompt, any role
        return [(prompts.small_messages(row["view"], q, opts), ans, [row["objs"]])]
    out: list[Example] = [(prompts.small_messages(row["view"], q, opts), ans, [row["objs"]])]
    if row.get("crop") is not None:
        out.append((prompts.small_messages(row["crop"], q, opts), ans, [row["crop_objs"]]))
    if role == "small":
        return out
    judge = "yes" if row["target_size"] == "small" else "no"
    out.append((prompts.judge_messages(row["view"], q, opts), judge, [row["objs"]]))
    if not deepeyes:
        return out
    msgs = prompts.deepeyes_messages(row["view"], q, opts)
    if row.get("crop") is not None:
        call = (
            "<tool_call>\n"
            + json.dumps(
                {"name": prompts.ZOOM_TOOL_NAME, "arguments": {"bbox_2d": row["view_box"]}}
            )
            + "\n</tool_call>"
        )
        if boxes:
            out.append((msgs, call, [row["objs"]]))
        turn = [
            *msgs,
            {"role": "assistant", "content": call},
            prompts.deepeyes_tool_response(row["crop"]),
        ]
        out.append((turn, f"<answer>{ans}</answer>", [row["objs"], row["crop_objs"]]))
    else:
        out.append((msgs, f"<answer>{ans}</answer>", [row["objs"]]))
    return out


def token_labels(layouts: Sequence[list], grids, cell: int):
    """Per merged vision token: (colour id or 8 = background, shape id or 3 = background) of the
    object covering most of its ``cell`` x ``cell`` px square (a quarter of the square, or half
    of a smaller object, counts as covering)."""
    import torch

    colors, shapes = [], []
    for objs, (_, gh, gw) in zip(layouts, grids.tolist(), strict=True):
        mh, mw = gh // 2, gw // 2
        c = torch.full((mh, mw), 8, dtype=torch.long)
        sh = torch.full((mh, mw), 3, dtype=torch.long)
        best = torch.zeros((mh, mw))
        for x1, y1, x2, y2, ci, si in objs:
            area = max(1e-6, (x2 - x1) * (y2 - y1))
            for r in range(max(0, int(y1 // cell)), min(mh, int(math.ceil(y2 / cell)))):
                for k in range(max(0, int(x1 // cell)), min(mw, int(math.ceil(x2 / cell)))):
                    ix = min(x2, (k + 1) * cell) - max(x1, k * cell)
                    iy = min(y2, (r + 1) * cell) - max(y1, r * cell)
                    inter = max(0.0, ix) * max(0.0, iy)
                    share = max(inter / cell**2, 0.5 * inter / area)
                    if share >= 0.25 and share > best[r, k]:
                        best[r, k], c[r, k], sh[r, k] = share, ci, si
        colors.append(c.flatten())
        shapes.append(sh.flatten())
    return torch.cat(colors), torch.cat(shapes)


def pack_examples(examples: Sequence[Example], max_turns: int, rng: random.Random) -> list:
    """Several questions about the same image with the same system prompt (small or judge) as
    one multi-turn conversation (the image once, then question/answer turns): one image
    forward teaches several answers. DeepEyes examples stay single-turn. Packed ones carry a 4th element True."""
    groups: dict[tuple, list[Example]] = {}
    out: list = []
    for ex in examples:
        msgs = ex[0]
        if msgs[0]["content"] in (prompts.SMALL_SYSTEM, prompts.JUDGE_SYSTEM) and len(msgs) == 2:
            key = (msgs[0]["content"], id(msgs[1]["content"][0]["image"]))
            groups.setdefault(key, []).append(ex)
        else:
            out.append(ex)
    for group in groups.values():
        rng.shuffle(group)
        for i in range(0, len(group), max_turns):
            part = group[i : i + max_turns]
            msgs = list(part[0][0])
            for prev, ex in zip(part, part[1:], strict=False):
                text = ex[0][1]["content"][1]["text"]
                msgs += [
                    {"role": "assistant", "content": prev[1]},
                    {"role": "user", "content": [prompts.text_part(text)]},
                ]
            out.append((msgs, part[-1][1], part[0][2], True))
    return out


def batch_inputs(backend, pairs: Sequence[Sequence]):
    """Model inputs of full conversations with labels on the assistant answers only (the last
    one, or every one in a packed conversation), each answer with its ``<|im_end|>``."""
    import torch

    convs = [[*p[0], {"role": "assistant", "content": p[1]}] for p in pairs]
    inputs = backend._prepare(convs, add_generation_prompt=False)
    ids = inputs["input_ids"]
    labels = torch.full_like(ids, -100)
    tok = backend.tokenizer
    start = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    for b, p in enumerate(pairs):
        a = p[1]
        tail = tok(a + "<|im_end|>\n", add_special_tokens=False)["input_ids"]
        n = len(tail)
        if ids[b, -n:].tolist() != tail:  # pragma: no cover - template/tokenizer mismatch
            raise RuntimeError("answer tokens not at the end of the sequence")
        labels[b, -n:-1] = ids[b, -n:-1]  # answer tokens and <|im_end|>, not the final newline
        if len(p) > 3 and p[3]:
            row = ids[b].tolist()
            k = len(start)
            for i in range(len(row) - k):
                if row[i : i + k] == start:
                    j = i + k
                    while j < len(row) and row[j] != end:
                        j += 1
                    labels[b, i + k : j + 1] = ids[b, i + k : j + 1]
    inputs["labels"] = labels
    return inputs


# ------------------------------------------------------------------------------- checkpoints


def _rng_state() -> dict:
    import torch

    return {"py": random.getstate(), "np": np.random.get_state(), "torch": torch.get_rng_state()}


def _set_rng_state(s: dict) -> None:
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
            "rng": _rng_state(),
            **extra,
        },
        tmp,
    )
    os.replace(tmp, path)


def load_ckpt(path: Path):
    import torch

    return torch.load(path, map_location="cpu", weights_only=False)


# ------------------------------------------------------------------------------------ stages


def _eval_head(backend, head: Head, test: list, batch: int = 32) -> dict:
    import torch

    correct_s = correct_c = 0
    backend.model.eval()
    with torch.no_grad():
        for i in range(0, len(test), batch):
            chunk = test[i : i + batch]
            pix = backend.image_processor(images=[im for im, _, _ in chunk], return_tensors="pt")
            ls, lc = head(vision_tokens(backend, pix["pixel_values"], pix["image_grid_thw"]))
            correct_s += (ls.argmax(-1) == torch.tensor([s for _, s, _ in chunk])).sum().item()
            correct_c += (lc.argmax(-1) == torch.tensor([c for _, _, c in chunk])).sum().item()
    backend.model.train()
    n = len(test)
    return {"val_shape": round(correct_s / n, 4), "val_color": round(correct_c / n, 4), "val_n": n}


def stage_a(args, role_dir: Path, size: ModelSize) -> dict:
    """Vision warm-start: vision tower + linear heads on shape and colour of one sprite."""
    import torch

    base = build_base(role_dir, args.role, size, args.seed, args.family)
    backend = load_backend(base)
    model = backend.model
    head = Head(size.text_hidden, args.seed)
    vis = list(model.model.visual.parameters())
    opt = torch.optim.AdamW([*vis, *head.parameters()], lr=args.lr, weight_decay=0.01)
    ck = role_dir / "stage_A" / "ckpt.pt"
    step, seconds, _ = _seed_or_resume(args, role_dir, "A", ck, model, opt, {"head": head})
    train_sprites = sprites("train", args.sprite_limit)
    test_sprites = sprites("test", args.sprite_limit)
    vw = args.object_view
    trng = random.Random(12345)
    test = [
        (render_object(trng, sp, vw), SHAPES.index(sp.shape), COLORS.index(sp.color))
        for sp in trng.sample(test_sprites, min(args.val_n, len(test_sprites)))
    ]
    model.train()
    start = time.time() - seconds
    last_save = time.time()
    deadline = time.time() + args.minutes * 60
    losses: list[float] = []
    res: dict = {}
    while time.time() < deadline and (args.max_steps is None or step < args.max_steps):
        chunk = [random.choice(train_sprites) for _ in range(args.batch)]
        imgs = [render_object(random, sp, vw, args.object_min, args.object_max) for sp in chunk]
        pix = backend.image_processor(images=imgs, return_tensors="pt")
        ls, lc = head(vision_tokens(backend, pix["pixel_values"], pix["image_grid_thw"]))
        ys = torch.tensor([SHAPES.index(sp.shape) for sp in chunk])
        yc = torch.tensor([COLORS.index(sp.color) for sp in chunk])
        loss = torch.nn.functional.cross_entropy(ls, ys) + torch.nn.functional.cross_entropy(lc, yc)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_([*vis, *head.parameters()], 1.0)
        opt.step()
        step += 1
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            raise RuntimeError(f"loss is {losses[-1]} at step {step}")
        if step % args.log_every == 0:
            res = (
                _eval_head(backend, head, test)
                if step % (args.log_every * args.eval_every) == 0
                else {}
            )
            _log(
                role_dir,
                {
                    "stage": "A",
                    "step": step,
                    "loss": round(float(np.mean(losses)), 4),
                    "seconds": round(time.time() - start, 1),
                    **res,
                },
            )
            losses = []
        if time.time() - last_save > args.save_every:
            save_ckpt(ck, backend, head, opt, step, {"seconds": time.time() - start})
            last_save = time.time()
    res = _eval_head(backend, head, test)
    save_ckpt(ck, backend, head, opt, step, {"seconds": time.time() - start})
    rec = {
        "stage": "A",
        "event": "end",
        "step": step,
        "seconds": round(time.time() - start, 1),
        **res,
    }
    _log(role_dir, rec)
    return rec


def _seed_or_resume(args, role_dir: Path, stage: str, ck: Path, model, opt, extra: dict):
    """Seed every RNG; with ``--resume`` and a checkpoint, restore the model, the optimizer,
    the ``extra`` modules saved under their names (heads), the RNG states and the step.
    Returns ``(step, seconds, resumed)``: ``(0, 0.0, False)`` for a fresh start."""
    import torch

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    if not (args.resume and ck.is_file()):
        return 0, 0.0, False
    s = load_ckpt(ck)
    model.load_state_dict(s["model"])
    for name, module in extra.items():
        if s.get(name):
            module.load_state_dict(s[name])
    opt.load_state_dict(s["opt"])
    _set_rng_state(s["rng"])
    _log(role_dir, {"stage": stage, "event": "resume", "step": s["step"]})
    return s["step"], s.get("seconds", 0.0), True


def _matching(own: dict, saved: dict) -> dict:
    """The tensors of ``saved`` that ``own`` has, with the same shape."""
    return {k: v for k, v in saved.items() if k in own and own[k].shape == v.shape}


def _load_from_previous(
    backend, role_dir: Path, stage: str, init_from: Path | None, extra: dict | None = None
) -> None:
    """Start from ``init_from`` (any checkpoint of this size) or the previous stage's. Tensors
    whose shape differs (an embedding of another vocabulary) keep their fresh initialisation.
    The ``extra`` modules (auxiliary heads) are carried over where the checkpoint has them under
    the same name: fresh heads would send noise into a trained vision tower for the first
    hundred steps of a continuation."""
    prev = {"B": "A"}.get(stage)
    p = init_from or (role_dir / f"stage_{prev}" / "ckpt.pt" if prev else None)
    if p and p.is_file():
        saved = load_ckpt(p)
        sd = _matching(backend.model.state_dict(), saved["model"])
        backend.model.load_state_dict(sd, strict=False)
        heads = []
        for name, module in (extra or {}).items():
            own = module.state_dict()
            got = _matching(own, saved.get(name) or {})
            if got and len(got) == len(own):
                module.load_state_dict(got)
                heads.append(name)
        _log(
            role_dir,
            {
                "stage": stage,
                "event": "init_from",
                "path": str(p),
                "tensors": len(sd),
                "heads": heads,
            },
        )


def stage_b(args, role_dir: Path, size: ModelSize) -> dict:
    """Answers: next-token loss on the answer tokens of the role's prompts."""
    import torch

    folder = args.init_from if args.init_from is not None and args.init_from.is_dir() else None
    base = build_base(role_dir, args.role, size, args.seed, args.family, from_folder=folder)
    backend = load_backend(base)
    model = backend.model
    ck = role_dir / "stage_B" / "ckpt.pt"
    vis = [
        p
        for n, p in model.named_parameters()
        if ".visual." in f".{n}" or n.startswith("model.visual")
    ]
    vis_ids = {id(p) for p in vis}
    rest = [p for p in model.parameters() if id(p) not in vis_ids]
    # Auxiliary per-token heads (colour, shape of the object under each merged vision token):
    # keeps the vision features local and semantic, so the answer tokens have something to read.
    aux = torch.nn.ModuleDict(
        {
            "color": torch.nn.Linear(size.text_hidden, 9),
            "shape": torch.nn.Linear(size.text_hidden, 4),
        }
    )
    opt = torch.optim.AdamW(
        [
            {"params": rest, "lr": args.lr},
            {"params": vis, "lr": args.lr * args.vision_lr_mult},
            {"params": list(aux.parameters()), "lr": args.lr},
        ],
        weight_decay=0.01,
    )
    captured: dict = {}
    model.model.visual.register_forward_hook(lambda m, i, o: captured.__setitem__("v", o))
    cell = backend.factor  # one merged token covers patch x merge pixels per side
    tok = backend.tokenizer

    def _word_id(w: str) -> int:
        ids = tok(" " + w, add_special_tokens=False)["input_ids"]
        return ids[0] if len(ids) == 1 else tok(w, add_special_tokens=False)["input_ids"][0]

    word_ids = (
        torch.tensor([_word_id(c) for c in COLORS]),
        torch.tensor([_word_id(sh) for sh in SHAPES]),
    )
    step, seconds, resumed = _seed_or_resume(args, role_dir, "B", ck, model, opt, {"aux": aux})
    if not resumed and folder is None:  # a model folder's weights are already the base's
        _load_from_previous(backend, role_dir, "B", args.init_from, {"aux": aux})
    t0 = time.time()
    train = make_questions(
        "train",
        args.seed,
        args.scenes,
        backend,
        True,
        args.zoom_max,
        args.zoom_crops,
        args.search_cells,
        args.cell_near_misses,
        args.cell_elsewhere,
        args.level,
        args.search_depth,
    )
    pairs = [p for r in train for p in examples_for(r, args.role, args.boxes, args.deepeyes)]
    if args.pack > 1:
        pairs = pack_examples(pairs, args.pack, random.Random(args.seed))
    _log(
        role_dir,
        {
            "stage": "B",
            "event": "data",
            "scenes": args.scenes,
            "questions": len(train),
            "examples": len(pairs),
            "seconds": round(time.time() - t0, 1),
        },
    )
    model.train()
    start = time.time() - seconds
    last_save = time.time()
    deadline = time.time() + args.minutes * 60
    losses: list[float] = []
    aux_losses: list[float] = []
    lm_losses: list[float] = []
    order: list[int] = []
    ce = torch.nn.functional.cross_entropy
    while time.time() < deadline and (args.max_steps is None or step < args.max_steps):
        if len(order) < args.batch:
            order += random.sample(range(len(pairs)), len(pairs))
        idx, order = order[: args.batch], order[args.batch :]
        chunk = [pairs[i] for i in idx]
        inputs = batch_inputs(backend, chunk)
        loss = model(**inputs).loss
        lm_losses.append(loss.item())
        if args.aux_weight > 0:
            feats = captured["v"].pooler_output
            feats = torch.cat(list(feats)) if isinstance(feats, (list, tuple)) else feats
            yc, ys = token_labels(
                [lay for p in chunk for lay in p[2]], inputs["image_grid_thw"], cell
            )
            # Background tokens dominate: weigh them down so objects are not ignored.
            wc = torch.tensor([1.0] * 8 + [0.1])
            ws = torch.tensor([1.0] * 3 + [0.1])
            la = ce(aux["color"](feats), yc, weight=wc) + ce(aux["shape"](feats), ys, weight=ws)
            if args.word_align > 0:
                # Object tokens point at the word embeddings of their colour and shape (as the
                # question spells them), LLaVA-style alignment of vision tokens to the LM's
                # input space: "is there a red triangle" becomes matching a token it can see.
                obj = yc < 8
                if obj.any():
                    logits = feats[obj] @ model.get_input_embeddings().weight.T
                    logp = torch.log_softmax(logits, -1)
                    wl = (
                        -(
                            logp.gather(1, word_ids[0][yc[obj]][:, None])
                            + logp.gather(1, word_ids[1][ys[obj]][:, None])
                        ).mean()
                        / 2
                    )
                    la = la + args.word_align * wl
            aux_losses.append(la.item())
            loss = loss + args.aux_weight * la
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            raise RuntimeError(f"loss is {losses[-1]} at step {step}")
        if step % args.log_every == 0:
            _log(
                role_dir,
                {
                    "stage": "B",
                    "step": step,
                    "loss": round(float(np.mean(losses)), 4),
                    "lm": round(float(np.mean(lm_losses)), 4),
                    "aux": round(float(np.mean(aux_losses)), 4) if aux_losses else None,
                    "seconds": round(time.time() - start, 1),
                },
            )
            losses, aux_losses, lm_losses = [], [], []
        if time.time() - last_save > args.save_every:
            save_ckpt(
                ck,
                backend,
                None,
                opt,
                step,
                {"seconds": time.time() - start, "aux": aux.state_dict()},
            )
            last_save = time.time()
    save_ckpt(
        ck, backend, None, opt, step, {"seconds": time.time() - start, "aux": aux.state_dict()}
    )
    rec = {"stage": "B", "event": "end", "step": step, "seconds": round(time.time() - start, 1)}
    _log(role_dir, rec)
    return rec


def export(role_dir: Path, stage: str, dest: Path, dtype: str = "float32") -> Path:
    """save_pretrained the stage's weights with the base folder's tokenizer and processor."""
    import torch

    backend = load_backend(role_dir / "base")
    backend.model.load_state_dict(load_ckpt(role_dir / f"stage_{stage}" / "ckpt.pt")["model"])
    if dtype != "float32":
        backend.model.to(getattr(torch, dtype))
    dest.mkdir(parents=True, exist_ok=True)
    backend.model.save_pretrained(dest)
    for f in (role_dir / "base").iterdir():
        if f.name not in ("config.json", "model.safetensors", "generation_config.json"):
            shutil.copy(f, dest / f.name)
    return dest


def _correct(pred: str, gold: str) -> bool:
    return pred.strip().strip(".").lower() == gold.lower()


def evaluate(
    folder: Path, role: str, scenes: int, seed: int = 0, batch: int = 16, level: int = 1
) -> dict:
    """Greedy accuracy through HFBackend.answer on held-out test-pool scenes: on the full view
    by target size and category, and on the zoom crops of the small-target questions."""
    from collections import Counter, defaultdict

    backend = load_backend(folder)
    rows = make_questions("val", seed, scenes, backend, crops=True, level=level)
    items = [("zoom" if r["category"] == "zoom" else "view", r, r["view"]) for r in rows]
    rows = [r for r in rows if r["category"] != "zoom"]
    items += [("crop", r, r["crop"]) for r in rows if r.get("crop") is not None]
    hits: dict[str, list[int]] = defaultdict(list)
    preds = Counter()
    for i in range(0, len(items), batch):
        chunk = items[i : i + batch]
        msgs = [prompts.small_messages(im, r["question"], r["options"]) for _, r, im in chunk]
        for (where, r, _), a in zip(chunk, backend.answer(msgs), strict=True):
            ok = int(_correct(a.text, r["answer_text"]))
            preds[a.text[:12]] += 1
            size = r["target_size"]
            for key in (f"{where}", f"{where}/{size}", f"{where}/{size}/{r['category']}"):
                hits[key].append(ok)
    # The prior: always answering each category's most common gold answer (on this set).
    prior: dict[str, list[int]] = defaultdict(list)
    by_cat: dict[str, Counter] = defaultdict(Counter)
    for r in rows:
        by_cat[r["category"]][r["answer_text"]] += 1
    for r in rows:
        ok = int(by_cat[r["category"]].most_common(1)[0][0] == r["answer_text"])
        for key in ("all", r["target_size"]):
            prior[key].append(ok)
    out = {
        k: {"acc": round(sum(v) / len(v), 4), "correct": sum(v), "n": len(v)}
        for k, v in sorted(hits.items())
    }
    out["prior"] = {k: round(sum(v) / len(v), 4) for k, v in prior.items()}
    out["predictions"] = dict(preds.most_common(8))
    return out


def stage_eval(args, role_dir: Path) -> dict:
    dest = role_dir / "export"
    export(role_dir, args.from_stage, dest)
    t = time.time()
    res = evaluate(dest, args.role, args.val_scenes, seed=args.seed, level=args.level)
    rec = {
        "stage": "eval",
        "from": args.from_stage,
        "scenes": args.val_scenes,
        "seconds": round(time.time() - t, 1),
        **res,
    }
    _log(role_dir, rec)
    return rec


MODELS_DIR = Path(__file__).resolve().parent / "models"


def bundle(small_dir: Path, large_dir: Path, dest: Path, settings: dict[str, Any]) -> Path:
    """Write both trained models (stage B, bfloat16) and the demo's ``manifest.json`` to
    ``dest`` (by default the package's ``models`` folder, which ``speceyes demo`` loads)."""
    for role, src in (("small", small_dir), ("large", large_dir)):
        tmp = dest / f".{role}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        export(src, "B", tmp, dtype="bfloat16")
        shutil.rmtree(dest / role, ignore_errors=True)
        os.replace(tmp, dest / role)
    steps = {
        role: load_ckpt(src / "stage_B" / "ckpt.pt")["step"]
        for role, src in (("small", small_dir), ("large", large_dir))
    }
    manifest = {"canvas": list(CANVAS), **settings, "trained_steps": steps}
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return dest


def stage_bundle(args) -> None:
    settings = json.loads(args.settings.read_text()) if args.settings else {}
    dest = bundle(args.small_dir, args.large_dir, args.dest, settings)
    size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    print(f"bundled into {dest} ({size / 1e6:.1f} MB)")


# -------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="speceyes miniworld train", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--out", type=Path, help="run folder (stages A, B, eval)")
    p.add_argument("--role", choices=ROLES, default="small")
    p.add_argument("--stage", choices=("A", "B", "eval", "bundle"), required=True)
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--vision-lr-mult", type=float, default=0.3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--scenes", type=int, default=600, help="training scenes for stage B")
    p.add_argument("--val-scenes", type=int, default=60, help="held-out scenes for eval")
    p.add_argument("--val-n", type=int, default=300, help="held-out sprites for stage A")
    p.add_argument("--object-view", type=int, default=128, help="stage A image side (px)")
    p.add_argument("--object-min", type=int, default=10, help="stage A: smallest object side (px)")
    p.add_argument("--object-max", type=int, default=80, help="stage A: largest object side (px)")
    p.add_argument("--sprite-limit", type=int, default=None)
    p.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="stage B: start from this ckpt.pt, or from a model folder (e.g. the bundled "
        "speceyes/miniworld/models/large), whose files then become the run's base",
    )
    p.add_argument(
        "--level",
        type=int,
        choices=(1, 2),
        default=1,
        help="mini-world level of the training and eval scenes: 1 one target among clutter "
        "(the demo's default), 2 the multi-object world",
    )
    p.add_argument("--small-dir", type=Path, help="bundle: the small role's folder")
    p.add_argument("--large-dir", type=Path, help="bundle: the large role's folder")
    p.add_argument("--dest", type=Path, default=MODELS_DIR, help="bundle: where to write")
    p.add_argument("--settings", type=Path, help="bundle: JSON of demo settings (tau, agent)")
    p.add_argument("--aux-weight", type=float, default=0.5, help="stage B: per-token aux loss")
    p.add_argument(
        "--word-align", type=float, default=0.0, help="stage B: align object tokens to words"
    )
    p.add_argument(
        "--zoom-max", type=float, default=12.0, help="stage B: widest random zoom (x object side)"
    )
    p.add_argument("--zoom-crops", type=int, default=2, help="stage B: random zooms per scene")
    p.add_argument(
        "--search-cells",
        type=int,
        default=0,
        help="stage B: search-grid cells per depth with existence questions (small scenes)",
    )
    p.add_argument(
        "--cell-near-misses",
        type=int,
        default=0,
        help="stage B: extra no-questions per search cell about near misses of what it shows",
    )
    p.add_argument(
        "--cell-elsewhere",
        type=int,
        default=4,
        help="stage B: at most this many no-questions per search cell about scene objects "
        "outside it (default 4)",
    )
    p.add_argument(
        "--search-depth",
        type=int,
        default=2,
        help="stage B: search depths that get search-cell questions (the agent's depth)",
    )
    p.add_argument("--pack", type=int, default=1, help="stage B: questions per conversation")
    p.add_argument("--deepeyes", action="store_true", help="large role: train DeepEyes turns too")
    p.add_argument("--boxes", action="store_true", help="large role: train the <tool_call> box too")
    p.add_argument("--from-stage", default="B", help="eval: which stage's checkpoint")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=5, help="stage A: evaluate every N logs")
    p.add_argument("--save-every", type=float, default=120.0, help="seconds between checkpoints")
    p.add_argument(
        "--family",
        choices=("qwen2_5_vl", "qwen3_vl"),
        default=None,
        help="override the role's architecture (only when its base is first built)",
    )
    p.add_argument("--tiny", action="store_true", help="a very small model (smoke tests)")
    p.add_argument("--threads", type=int, default=2)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.stage == "bundle":
        if not (args.small_dir and args.large_dir):
            print("error: --stage bundle needs --small-dir and --large-dir", file=sys.stderr)
            return 2
        stage_bundle(args)
        return 0
    if args.out is None:
        print("error: --out is required for stages A, B and eval", file=sys.stderr)
        return 2
    role_dir = args.out / args.role
    role_dir.mkdir(parents=True, exist_ok=True)
    size = TINY if args.tiny else ModelSize()
    if args.stage == "A":
        stage_a(args, role_dir, size)
    elif args.stage == "B":
        stage_b(args, role_dir, size)
    else:
        stage_eval(args, role_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
