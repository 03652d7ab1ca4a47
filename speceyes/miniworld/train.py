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
import math
import os
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from speceyes.miniworld.bundle import stage_bundle
from speceyes.miniworld.demo import MODELS_DIR
from speceyes.miniworld.evaluate import stage_eval
from speceyes.miniworld.scenes import COLORS, SHAPES
from speceyes.miniworld.tinymodel import (
    ROLES,
    TINY,
    Head,
    ModelSize,
    build_base,
    load_backend,
    load_ckpt,
    log_event,
    save_ckpt,
    set_rng_state,
    vision_tokens,
)
from speceyes.miniworld.traindata import (
    batch_inputs,
    examples_for,
    make_questions,
    pack_examples,
    render_object,
    sprites,
    token_labels,
)

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
            log_event(
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
    log_event(role_dir, rec)
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
    set_rng_state(s["rng"])
    log_event(role_dir, {"stage": stage, "event": "resume", "step": s["step"]})
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
        log_event(
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
    log_event(
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
            log_event(
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
    log_event(role_dir, rec)
    return rec


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
