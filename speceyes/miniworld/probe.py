"""How a model answers the search agent's existence question on the search's own cells.

The search agent ranks grid cells by P(yes) to "Is there a {target} in the image?" and answers on
the winner, so an existence answer is only as good as the gap between the P(yes) of a cell that
shows the target and that of a cell showing something else. This probe measures P(yes) on the
3x3 cells (25% overlap) of small-regime validation scenes at depth 1 (the canvas grid) and depth
2 (the grid inside a cell that holds a small object), by kind of question:

- ``yes``: a colour-shape pair the cell shows;
- ``no-elsewhere``: a pair of the scene that lies outside the cell;
- ``no-near``: a pair one attribute away from an object the cell shows (POPE adversarial);
- ``no-absent``: a pair absent from the scene and sharing no attribute with what the cell
  shows (POPE random, mostly).

Usage: ``speceyes miniworld probe MODEL_DIR [--scenes 20]``.
"""

from __future__ import annotations

import argparse
import random
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

KINDS = ("yes", "no-elsewhere", "no-near", "no-absent")


def cell_existence(backend, scenes: int = 20, seed: int = 0) -> dict[str, dict]:
    """``{"depth D/kind": {"n", "mean_p_yes", "share_yes"}}`` over ``scenes`` small-regime
    validation scenes (``share_yes``: P(yes) > 0.5, what a greedy answer says)."""
    from speceyes import prompts
    from speceyes.agents.search import grid_boxes
    from speceyes.miniworld import traindata as T
    from speceyes.miniworld.scenes import COLORS, SHAPES, generate_scene, load_pool, scene_rng

    pool = load_pool("train")
    got: dict[str, list[float]] = defaultdict(list)
    for i in range(1, 2 * scenes, 2):  # odd scene indices are the small regime
        scene = generate_scene(scene_rng("val", seed, i), pool, canvas=T.CANVAS, regime="small")
        rng = random.Random(f"probe-{seed}-{i}")
        in_scene = {(o.color, o.shape) for o in scene.objects}
        absent = [(c, s) for c in COLORS for s in SHAPES if (c, s) not in in_scene]
        small = [o for o in scene.objects if o.size == "small"] or list(scene.objects)
        anchor = rng.choice(small)
        region: Sequence[float] = (0.0, 0.0, *map(float, scene.image.size))
        for depth in (1, 2):
            level = [tuple(round(v) for v in c) for c in grid_boxes(region, 3, 0.25)]
            msgs, keys = [], []
            for box in level:
                crop = T.crop_at_view(scene.image, box, backend)
                shown, partial = T.objects_in_crop(scene.objects, box)
                pairs = {(o.color, o.shape) for o in shown}
                cut = {(o.color, o.shape) for o in partial}
                asked = [(p, "yes") for p in sorted(pairs)]
                asked += [(p, "no-elsewhere") for p in sorted(in_scene - pairs - cut)]
                asked += [
                    (p, "no-near")
                    for p in T.near_miss_pairs(shown, partial, rng, 2)
                    if p not in in_scene
                ]
                far = [p for p in absent if all(p[0] != c and p[1] != s for c, s in pairs)]
                asked += [(p, "no-absent") for p in rng.sample(far, min(2, len(far)))]
                for (c, s), kind in asked:
                    msgs.append(prompts.small_messages(crop, f"Is there a {c} {s} in the image?"))
                    keys.append(f"depth {depth}/{kind}")
            p = np.asarray(backend.next_token_probs(msgs, ["yes", "no"]), dtype=np.float64)
            for key, v in zip(keys, p[:, 0] / np.maximum(p.sum(1), 1e-30), strict=True):
                got[key].append(float(v))
            home = [c for c in level if T.inside_crop(anchor, c, 1.0)]
            if not home:
                break
            region = home[0]
    return {
        k: {
            "n": len(v),
            "mean_p_yes": round(float(np.mean(v)), 3),
            "share_yes": round(float(np.mean(np.asarray(v) > 0.5)), 3),
        }
        for k, v in sorted(got.items())
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="speceyes miniworld probe",
        description="P(yes) of a model's existence answers on the search agent's cells, by kind "
        "of question (val split, small-regime scenes).",
    )
    ap.add_argument(
        "model", type=Path, help="a checkpoint folder (e.g. speceyes/miniworld/models/large)"
    )
    ap.add_argument("--scenes", type=int, default=20, help="small-regime val scenes (default 20)")
    ap.add_argument("--seed", type=int, default=0, help="val split seed (default 0)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = ap.parse_args(argv)
    import torch

    from speceyes.miniworld.tinymodel import load_backend

    torch.set_num_threads(args.threads)
    table = cell_existence(load_backend(args.model), args.scenes, args.seed)
    print("| depth / question | n | mean P(yes) | share answered yes |")
    print("|---|---|---|---|")
    for k, v in table.items():
        print(f"| {k} | {v['n']} | {v['mean_p_yes']:.2f} | {v['share_yes']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
