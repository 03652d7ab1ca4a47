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
Stages A and B each supply one training step to the loop they share (:mod:`.loop`: deadline,
step count, logging, checkpoints); the flags become one :class:`.trainconfig.TrainConfig`.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from speceyes.agents.zoom import MIN_BOX
from speceyes.miniworld.bundle import stage_bundle
from speceyes.miniworld.evaluate import stage_eval
from speceyes.miniworld.loop import Checkpoint, optimizer_step, run_loop
from speceyes.miniworld.scenes import COLORS, SHAPES
from speceyes.miniworld.tinymodel import (
    ROLES,
    TINY,
    VISION_POS_INITS,
    Head,
    ModelSize,
    build_base,
    load_backend,
    load_ckpt,
    log_event,
    vision_tokens,
)
from speceyes.miniworld.trainconfig import TrainConfig
from speceyes.miniworld.traindata import (
    batch_inputs,
    examples_for,
    make_questions,
    pack_examples,
    render_object,
    sprites,
    token_labels,
)

# View pixels a trained <tool_call> box keeps above the DeepEyes tool's smallest box: a box the
# model writes is off by a few units of its digits (docs/miniworld-training.md)
BOX_MARGIN_PX = 4
# the smallest side, in view pixels, of the <tool_call> boxes --boxes trains
TRAINED_MIN_BOX_PX = MIN_BOX + BOX_MARGIN_PX

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


def stage_a(cfg: TrainConfig, role_dir: Path, size: ModelSize) -> dict:
    """Vision warm-start: vision tower + linear heads on shape and colour of one sprite."""
    import torch

    base = build_base(role_dir, cfg.role, size, cfg.seed, cfg.family, vision_pos=cfg.vision_pos)
    backend = load_backend(base)
    model = backend.model
    head = Head(size.text_hidden, cfg.seed)
    params = [*model.model.visual.parameters(), *head.parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.01)
    ckpt = Checkpoint(role_dir / "stage_A" / "ckpt.pt", backend, opt, {"head": head})
    step, seconds, _ = ckpt.seed_or_resume(cfg.seed, cfg.resume, role_dir, "A")
    train_sprites = sprites("train", cfg.sprite_limit)
    test_sprites = sprites("test", cfg.sprite_limit)
    vw = cfg.object_view
    trng = random.Random(12345)
    test = [
        (render_object(trng, sp, vw), SHAPES.index(sp.shape), COLORS.index(sp.color))
        for sp in trng.sample(test_sprites, min(cfg.val_n, len(test_sprites)))
    ]
    ce = torch.nn.functional.cross_entropy

    def train_step() -> dict[str, float | None]:
        chunk = [random.choice(train_sprites) for _ in range(cfg.batch)]
        imgs = [render_object(random, sp, vw, cfg.object_min, cfg.object_max) for sp in chunk]
        pix = backend.image_processor(images=imgs, return_tensors="pt")
        ls, lc = head(vision_tokens(backend, pix["pixel_values"], pix["image_grid_thw"]))
        ys = torch.tensor([SHAPES.index(sp.shape) for sp in chunk])
        yc = torch.tensor([COLORS.index(sp.color) for sp in chunk])
        loss = ce(ls, ys) + ce(lc, yc)
        optimizer_step(opt, loss, params)
        return {"loss": loss.item()}

    def evaluate_some(step: int) -> dict:
        # Held-out accuracy costs a pass over the test sprites: only on every eval_every-th line.
        if step % (cfg.log_every * cfg.eval_every) == 0:
            return _eval_head(backend, head, test)
        return {}

    return run_loop(
        cfg,
        role_dir,
        "A",
        ckpt,
        train_step,
        step=step,
        seconds=seconds,
        on_log=evaluate_some,
        on_end=lambda: _eval_head(backend, head, test),
    )


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


def _aux_loss(cfg: TrainConfig, aux, feats, yc, ys, model, word_ids):
    """Stage B's auxiliary loss on the merged vision tokens ``feats``: colour ``yc`` and shape
    ``ys`` of the object under each token (8 and 3 mean background), plus, with
    ``--word-align``, the alignment of object tokens to their words."""
    import torch

    ce = torch.nn.functional.cross_entropy
    # Background tokens dominate: weigh them down so objects are not ignored.
    wc = torch.tensor([1.0] * 8 + [0.1])
    ws = torch.tensor([1.0] * 3 + [0.1])
    la = ce(aux["color"](feats), yc, weight=wc) + ce(aux["shape"](feats), ys, weight=ws)
    if cfg.word_align > 0:
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
            la = la + cfg.word_align * wl
    return la


def stage_b(cfg: TrainConfig, role_dir: Path, size: ModelSize) -> dict:
    """Answers: next-token loss on the answer tokens of the role's prompts."""
    import torch

    folder = cfg.init_from if cfg.init_from is not None and cfg.init_from.is_dir() else None
    base = build_base(role_dir, cfg.role, size, cfg.seed, cfg.family, from_folder=folder,
                      vision_pos=cfg.vision_pos)
    backend = load_backend(base)
    model = backend.model
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
            {"params": rest, "lr": cfg.lr},
            {"params": vis, "lr": cfg.lr * cfg.vision_lr_mult},
            {"params": list(aux.parameters()), "lr": cfg.lr},
        ],
        weight_decay=0.01,
    )
    ckpt = Checkpoint(role_dir / "stage_B" / "ckpt.pt", backend, opt, {"aux": aux})
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
    step, seconds, resumed = ckpt.seed_or_resume(cfg.seed, cfg.resume, role_dir, "B")
    if not resumed and folder is None:  # a model folder's weights are already the base's
        _load_from_previous(backend, role_dir, "B", cfg.init_from, {"aux": aux})
    t0 = time.time()
    train = make_questions(
        "train",
        cfg.seed,
        cfg.scenes,
        backend,
        True,
        cfg.zoom_max,
        cfg.zoom_crops,
        cfg.search_cells,
        cfg.cell_near_misses,
        cfg.cell_elsewhere,
        cfg.level,
        cfg.search_depth,
        # a box the model learns to write must be one zoom.py runs, with room for a few units
        # of error in its digits (trained at the minimum, a third of its boxes fell just under)
        TRAINED_MIN_BOX_PX if cfg.boxes else 0,
    )
    pairs = [
        p for r in train
        for p in examples_for(r, cfg.role, cfg.boxes, cfg.deepeyes, cfg.direct_turns)
    ]
    if cfg.pack > 1:
        pairs = pack_examples(pairs, cfg.pack, random.Random(cfg.seed))
    log_event(
        role_dir,
        {
            "stage": "B",
            "event": "data",
            "scenes": cfg.scenes,
            "questions": len(train),
            "examples": len(pairs),
            "seconds": round(time.time() - t0, 1),
        },
    )
    order: list[int] = []  # the rest of the current shuffled pass over the examples

    def train_step() -> dict[str, float | None]:
        nonlocal order
        if len(order) < cfg.batch:
            order += random.sample(range(len(pairs)), len(pairs))
        idx, order = order[: cfg.batch], order[cfg.batch :]
        chunk = [pairs[i] for i in idx]
        inputs = batch_inputs(backend, chunk)
        loss = model(**inputs).loss
        lm = loss.item()
        aux_value = None
        if cfg.aux_weight > 0:
            feats = captured["v"].pooler_output
            feats = torch.cat(list(feats)) if isinstance(feats, (list, tuple)) else feats
            yc, ys = token_labels(
                [lay for p in chunk for lay in p[2]], inputs["image_grid_thw"], cell
            )
            la = _aux_loss(cfg, aux, feats, yc, ys, model, word_ids)
            aux_value = la.item()
            loss = loss + cfg.aux_weight * la
        optimizer_step(opt, loss, model.parameters())
        return {"loss": loss.item(), "lm": lm, "aux": aux_value}

    return run_loop(cfg, role_dir, "B", ckpt, train_step, step=step, seconds=seconds)


# -------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="speceyes miniworld train", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--out", type=Path, help="run folder (stages A, B, eval)")
    p.add_argument("--role", choices=ROLES)
    p.add_argument("--stage", choices=("A", "B", "eval", "bundle"), required=True)
    p.add_argument("--minutes", type=float)
    p.add_argument("--max-steps", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--lr", type=float)
    p.add_argument("--vision-lr-mult", type=float)
    p.add_argument("--batch", type=int)
    p.add_argument("--scenes", type=int, help="training scenes for stage B")
    p.add_argument("--val-scenes", type=int, help="held-out scenes for eval")
    p.add_argument("--val-n", type=int, help="held-out sprites for stage A")
    p.add_argument("--object-view", type=int, help="stage A image side (px)")
    p.add_argument("--object-min", type=int, help="stage A: smallest object side (px)")
    p.add_argument("--object-max", type=int, help="stage A: largest object side (px)")
    p.add_argument("--sprite-limit", type=int)
    p.add_argument(
        "--init-from",
        type=Path,
        help="stage B: start from this ckpt.pt, or from a model folder (e.g. the bundled "
        "speceyes/miniworld/models/large), whose files then become the run's base",
    )
    p.add_argument(
        "--level",
        type=int,
        choices=(1, 2),
        help="mini-world level of the training and eval scenes: 1 one target among clutter "
        "(the demo's default), 2 the multi-object world",
    )
    p.add_argument("--small-dir", type=Path, help="bundle: the small role's folder")
    p.add_argument("--large-dir", type=Path, help="bundle: the large role's folder")
    p.add_argument("--dest", type=Path, help="bundle: where to write")
    p.add_argument("--settings", type=Path, help="bundle: JSON of demo settings (tau, agent)")
    p.add_argument("--aux-weight", type=float, help="stage B: per-token aux loss")
    p.add_argument("--word-align", type=float, help="stage B: align object tokens to words")
    p.add_argument("--zoom-max", type=float, help="stage B: widest random zoom (x object side)")
    p.add_argument("--zoom-crops", type=int, help="stage B: random zooms per scene")
    p.add_argument(
        "--search-cells",
        type=int,
        help="stage B: search-grid cells per depth with existence questions (small scenes)",
    )
    p.add_argument(
        "--cell-near-misses",
        type=int,
        help="stage B: extra no-questions per search cell about near misses of what it shows",
    )
    p.add_argument(
        "--cell-elsewhere",
        type=int,
        help="stage B: at most this many no-questions per search cell about scene objects "
        "outside it (default 4)",
    )
    p.add_argument(
        "--search-depth",
        type=int,
        help="stage B: search depths that get search-cell questions (the agent's depth)",
    )
    p.add_argument("--pack", type=int, help="stage B: questions per conversation")
    p.add_argument("--deepeyes", action="store_true", help="large role: train DeepEyes turns too")
    p.add_argument("--boxes", action="store_true", help="large role: train the <tool_call> box too")
    p.add_argument(
        "--direct-turns", action="store_true",
        help="large role: train the middle tier's direct answer with --direct-prompt "
        "agent-prefix (the DeepEyes first turn on the view, then the direct question)",
    )
    p.add_argument("--from-stage", help="eval: which stage's checkpoint")
    p.add_argument("--log-every", type=int)
    p.add_argument("--eval-every", type=int, help="stage A: evaluate every N logs")
    p.add_argument("--save-every", type=float, help="seconds between checkpoints")
    p.add_argument(
        "--family",
        choices=("qwen2_5_vl", "qwen3_vl"),
        help="override the role's architecture (only when its base is first built)",
    )
    p.add_argument(
        "--vision-pos", choices=VISION_POS_INITS,
        help="a Qwen3-VL base built from scratch: its vision position grid at initialisation, "
        "random or a 2D sine-cosine grid (which a box-writing large model needs to tell left "
        "from right; docs/miniworld-training.md)",
    )  # fmt: skip
    p.add_argument("--tiny", action="store_true", help="a very small model (smoke tests)")
    p.add_argument("--threads", type=int)
    # The defaults are TrainConfig's, so a config built in code matches the command line's.
    p.set_defaults(**TrainConfig.defaults())
    return p


def main(argv: Sequence[str] | None = None) -> int:
    cfg = TrainConfig.from_args(build_parser().parse_args(argv))
    import torch

    torch.set_num_threads(cfg.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if cfg.stage == "bundle":
        if not (cfg.small_dir and cfg.large_dir):
            print("error: --stage bundle needs --small-dir and --large-dir", file=sys.stderr)
            return 2
        stage_bundle(cfg)
        return 0
    if cfg.out is None:
        print("error: --out is required for stages A, B and eval", file=sys.stderr)
        return 2
    role_dir = cfg.out / cfg.role
    role_dir.mkdir(parents=True, exist_ok=True)
    size = TINY if cfg.tiny else ModelSize()
    if cfg.stage == "A":
        stage_a(cfg, role_dir, size)
    elif cfg.stage == "B":
        stage_b(cfg, role_dir, size)
    else:
        stage_eval(cfg, role_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
