"""Training and evaluation rows for the mini-world models: scenes rendered in memory at the
model's view, zoom crops, the search agent's cells, and the (prompt, answer) examples and packed
conversations built from them."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence

import numpy as np
from PIL import Image

from speceyes import prompts
from speceyes.miniworld.scenes import COLORS, SHAPES

CANVAS = (1024, 1024)  # the training and demo canvas


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
    from speceyes.miniworld.sprites import PALETTE, scaled_alpha

    bg = tuple(rng.randint(232, 252) for _ in range(3))
    img = Image.new("RGB", (view, view), bg)
    side = rng.randint(min(lo, int(view * 0.9)), min(hi, int(view * 0.9)))
    alpha = scaled_alpha(sprite, side)
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


def zoom_box(
    size: tuple[int, int], bbox: Sequence[int], min_side: int = 0
) -> tuple[int, int, int, int]:
    """The mini-world zoom: a square of 4x the target's side (at least ``min_side``) around
    it, inside the image."""
    x1, y1, x2, y2 = bbox
    side = min(max((x2 - x1) * 4, (y2 - y1) * 4, min_side), *size)
    cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
    left = int(min(max(cx - side / 2, 0), size[0] - side))
    top = int(min(max(cy - side / 2, 0), size[1] - side))
    return left, top, left + side, top + side


def min_zoom_side(view: Image.Image, view_px: int) -> int:
    """The smallest zoom square's side in canvas pixels: ``view_px`` pixels of the model's
    view on each axis."""
    return math.ceil(max(view_px * CANVAS[0] / view.width, view_px * CANVAS[1] / view.height))


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
    min_zoom_view_px: int = 0,
) -> list[dict]:
    """Scenes rendered on the fly (in memory), kept only as the model's view (+ zoom crops of
    the small-regime questions, relative position excepted: its reference is outside the crop).
    The crop is the zoom square whose box a large model learns to write in its ``<tool_call>``;
    ``min_zoom_view_px`` makes each side at least that many pixels of the model's view (the
    DeepEyes tool refuses a box under ``agents.zoom.MIN_BOX``: a square of 4x a small target's
    side is under it on the mini world's view, and a model trained on it wrote boxes the tool
    refused).
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
        min_side = min_zoom_side(view, min_zoom_view_px)
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
                zb = zoom_box(scene.image.size, box, min_side)
                row["crop"] = crop_at_view(scene.image, zb, backend)
                row["crop_objs"] = layout_in(scene.objects, zb, row["crop"].size)
                # the tool call's box: the crop it returns, in the model's own convention:
                # view pixels (Qwen2.5-VL) or 0..1000 of the view (Qwen3-VL), as zoom.py
                # reads it back
                relative = backend.box_coords == "relative1000"
                sx = (1000 if relative else view.width) / CANVAS[0]
                sy = (1000 if relative else view.height) / CANVAS[1]
                row["view_box"] = [
                    round(zb[0] * sx),
                    round(zb[1] * sy),
                    round(zb[2] * sx),
                    round(zb[3] * sy),
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


def inside_crop(obj, box: Sequence[int], min_share: float = 0.6) -> bool:
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
    shown = [o for o in objects if inside_crop(o, box)]
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


def near_miss_pairs(shown: Sequence, partial: Sequence, rng: random.Random, n: int) -> list:
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
        home = [c for c in level if inside_crop(anchor, c, 1.0)]
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
                pairs = near_miss_pairs(shown, partial, rng, near_misses)
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


def examples_for(
    row: dict, role: str, boxes: bool, deepeyes: bool = False, direct: bool = False
) -> list[Example]:
    """Training examples of one question for a role. Small: the small prompt on the view and on
    the zoom crop. Large: the same, the judge (yes for small targets, no for large), with
    ``direct`` the middle tier's direct answer after the DeepEyes first turn (the answer word,
    as the speculative prompt's), and with ``deepeyes`` the DeepEyes turns (``<answer>`` on the
    view, or after the crop returned as the tool response; ``boxes`` adds the ``<tool_call>``
    itself)."""
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
    msgs = prompts.deepeyes_messages(row["view"], q, opts)
    if direct:
        out.append(([*msgs, prompts.direct_turn()], ans, [row["objs"]]))
    if not deepeyes:
        return out
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
