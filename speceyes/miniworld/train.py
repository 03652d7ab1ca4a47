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
  prompt on the low-resolution full view; large: the judge prompt answered yes for small targets
  and no for large ones, and DeepEyes turns: ``<answer>`` on the full view for large targets, and
  for small targets a zoom crop returned as the real tool response, then ``<answer>``;
  ``--boxes`` also trains the ``<tool_call>`` with the target's box).
- ``eval``: save_pretrained, load back through ``HFBackend`` (the path real checkpoints take) and
  score greedy answers on held-out test-pool scenes, split by target size.

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


def build_base(
    role_dir: Path, role: str, size: ModelSize, seed: int, family: str | None = None
) -> Path:
    """A fresh random checkpoint of the role's family with its view budget, in role_dir/base."""
    from speceyes.tiny import build_tiny_model

    base = role_dir / "base"
    if (base / "config.json").is_file():
        return base
    build_tiny_model(
        base,
        family or FAMILY[role],
        text_hidden=size.text_hidden,
        text_layers=size.text_layers,
        vision_hidden=size.vision_hidden,
        vision_depth=size.vision_depth,
        seed=seed,
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


def zoom_crop_of(image: Image.Image, bbox: Sequence[int], backend) -> Image.Image:
    """The mini-world zoom: a square crop of 4x the target's side around it, at the view budget."""
    from speceyes.images import resize_for_model

    x1, y1, x2, y2 = bbox
    side = max(x2 - x1, y2 - y1) * 4
    cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
    left = int(min(max(cx - side / 2, 0), image.width - side))
    top = int(min(max(cy - side / 2, 0), image.height - side))
    crop = image.crop((left, top, left + side, top + side))
    return resize_for_model(crop, backend.factor, backend.max_pixels, backend.max_pixels)[0]


def make_questions(split: str, seed: int, n_scenes: int, backend, crops: bool) -> list[dict]:
    """Scenes rendered on the fly (in memory), kept only as the model's view (+ zoom crops)."""
    from speceyes.images import resize_for_model
    from speceyes.miniworld.scenes import generate_scene, load_pool, scene_rng

    pool = load_pool("test" if split == "test" else "train")
    rows = []
    for i in range(n_scenes):
        rng = scene_rng(split, seed, i)
        regime = "small" if i % 2 else "large"
        scene = generate_scene(rng, pool, canvas=CANVAS, regime=regime)
        view = resize_for_model(
            scene.image, backend.factor, backend.min_pixels, backend.max_pixels
        )[0]
        for q in scene.questions:
            row = {
                "scene": i,
                "view": view,
                "question": q.question,
                "options": q.options,
                "answer": q.answer,
                "category": q.category,
                "target_size": q.target_size,
                "target_bbox": q.target_bbox,
                "view_box": None,
            }
            if crops and q.target_bbox is not None and q.target_size == "small":
                row["crop"] = zoom_crop_of(scene.image, q.target_bbox, backend)
                sx = view.width / CANVAS[0]
                sy = view.height / CANVAS[1]
                b = q.target_bbox
                row["view_box"] = [
                    round(b[0] * sx),
                    round(b[1] * sy),
                    round(b[2] * sx),
                    round(b[3] * sy),
                ]
            rows.append(row)
    return rows


def answer_text(row: dict) -> str:
    return row["answer"]


def examples_for(row: dict, role: str, boxes: bool) -> list[tuple[list[dict], str]]:
    """(messages, assistant text) training pairs of one question for a role."""
    q, opts, ans = row["question"], row["options"], answer_text(row)
    if role == "small":
        return [(prompts.small_messages(row["view"], q, opts), ans)]
    out = [
        (
            prompts.judge_messages(row["view"], q, opts),
            "yes" if row["target_size"] == "small" else "no",
        )
    ]
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
            out.append((msgs, call))
        turn = [
            *msgs,
            {"role": "assistant", "content": call},
            prompts.deepeyes_tool_response(row["crop"]),
        ]
        out.append((turn, f"<answer>{ans}</answer>"))
    else:
        out.append((msgs, f"<answer>{ans}</answer>"))
    return out


def batch_inputs(backend, pairs: Sequence[tuple[list[dict], str]]):
    """Model inputs of full conversations with labels on the assistant answer only."""
    import torch

    convs = [[*m, {"role": "assistant", "content": a}] for m, a in pairs]
    inputs = backend._prepare(convs, add_generation_prompt=False)
    ids = inputs["input_ids"]
    labels = torch.full_like(ids, -100)
    tok = backend.tokenizer
    for b, (_, a) in enumerate(pairs):
        tail = tok(a + "<|im_end|>\n", add_special_tokens=False)["input_ids"]
        n = len(tail)
        if ids[b, -n:].tolist() != tail:  # pragma: no cover - template/tokenizer mismatch
            raise RuntimeError("answer tokens not at the end of the sequence")
        labels[b, -n:-1] = ids[b, -n:-1]  # answer tokens and <|im_end|>, not the final newline
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

    from speceyes.miniworld.scenes import COLORS, SHAPES

    base = build_base(role_dir, args.role, size, args.seed, args.family)
    backend = load_backend(base)
    model = backend.model
    head = Head(size.text_hidden, args.seed)
    vis = list(model.model.visual.parameters())
    opt = torch.optim.AdamW([*vis, *head.parameters()], lr=args.lr, weight_decay=0.01)
    ck = role_dir / "stage_A" / "ckpt.pt"
    step, seconds = 0, 0.0
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    if args.resume and ck.is_file():
        s = load_ckpt(ck)
        model.load_state_dict(s["model"])
        head.load_state_dict(s["head"])
        opt.load_state_dict(s["opt"])
        step, seconds = s["step"], s.get("seconds", 0.0)
        _set_rng_state(s["rng"])
        _log(role_dir, {"stage": "A", "event": "resume", "step": step})
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


def _load_from_previous(backend, role_dir: Path, stage: str) -> None:
    prev = {"B": "A"}.get(stage)
    p = role_dir / f"stage_{prev}" / "ckpt.pt" if prev else None
    if p and p.is_file():
        backend.model.load_state_dict(load_ckpt(p)["model"])
        _log(role_dir, {"stage": stage, "event": "init_from", "path": str(p)})


def stage_b(args, role_dir: Path, size: ModelSize) -> dict:
    """Answers: next-token loss on the answer tokens of the role's prompts."""
    import torch

    base = build_base(role_dir, args.role, size, args.seed, args.family)
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
    opt = torch.optim.AdamW(
        [{"params": rest, "lr": args.lr}, {"params": vis, "lr": args.lr * args.vision_lr_mult}],
        weight_decay=0.01,
    )
    step, seconds = 0, 0.0
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    if args.resume and ck.is_file():
        s = load_ckpt(ck)
        model.load_state_dict(s["model"])
        opt.load_state_dict(s["opt"])
        step, seconds = s["step"], s.get("seconds", 0.0)
        _set_rng_state(s["rng"])
        _log(role_dir, {"stage": "B", "event": "resume", "step": step})
    else:
        _load_from_previous(backend, role_dir, "B")
    crops = args.role == "large"
    t0 = time.time()
    train = make_questions("train", args.seed, args.scenes, backend, crops)
    pairs = [p for r in train for p in examples_for(r, args.role, args.boxes)]
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
    order: list[int] = []
    while time.time() < deadline and (args.max_steps is None or step < args.max_steps):
        if len(order) < args.batch:
            order += random.sample(range(len(pairs)), len(pairs))
        idx, order = order[: args.batch], order[args.batch :]
        inputs = batch_inputs(backend, [pairs[i] for i in idx])
        loss = model(**inputs).loss
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
                    "seconds": round(time.time() - start, 1),
                },
            )
            losses = []
        if time.time() - last_save > args.save_every:
            save_ckpt(ck, backend, None, opt, step, {"seconds": time.time() - start})
            last_save = time.time()
    save_ckpt(ck, backend, None, opt, step, {"seconds": time.time() - start})
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
    p = pred.strip().strip(".").lower()
    return p == gold.lower() or (
        len(gold) == 1 and p[:1] == gold.lower() and (len(p) == 1 or not p[1].isalpha())
    )


def evaluate(folder: Path, role: str, scenes: int, seed: int = 0, batch: int = 16) -> dict:
    """Greedy accuracy through HFBackend.answer on held-out test-pool scenes, by target size."""
    from collections import Counter, defaultdict

    backend = load_backend(folder)
    rows = make_questions("test", seed, scenes, backend, crops=False)
    hits: dict[str, list[int]] = defaultdict(list)
    preds = Counter()
    for i in range(0, len(rows), batch):
        chunk = rows[i : i + batch]
        msgs = [prompts.small_messages(r["view"], r["question"], r["options"]) for r in chunk]
        for r, a in zip(chunk, backend.answer(msgs), strict=True):
            ok = int(_correct(a.text, r["answer"]))
            preds[a.text[:12]] += 1
            for key in ("all", r["target_size"], f"{r['target_size']}/{r['category']}"):
                hits[key].append(ok)
    # The prior: always answering each category's most common gold answer (on this set).
    prior: dict[str, list[int]] = defaultdict(list)
    by_cat: dict[str, Counter] = defaultdict(Counter)
    for r in rows:
        by_cat[r["category"]][r["answer"]] += 1
    for r in rows:
        ok = int(by_cat[r["category"]].most_common(1)[0][0] == r["answer"])
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
    res = evaluate(dest, args.role, args.val_scenes, seed=args.seed)
    rec = {
        "stage": "eval",
        "from": args.from_stage,
        "scenes": args.val_scenes,
        "seconds": round(time.time() - t, 1),
        **res,
    }
    _log(role_dir, rec)
    return rec


# -------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="speceyes miniworld train", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--role", choices=ROLES, default="small")
    p.add_argument("--stage", choices=("A", "B", "eval"), required=True)
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
    if args.lr > 3e-4 + 1e-12:
        print("warning: lr above 3e-4 diverged in earlier probes", file=sys.stderr)
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
