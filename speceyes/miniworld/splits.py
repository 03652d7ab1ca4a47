"""Write a mini-world split to disk: PNG images, ``questions.jsonl`` (the generic JSONL format of
:func:`speceyes.bench.datasets.load_jsonl`) and ``manifest.json``, in parallel and resumably;
``python -m speceyes.miniworld.splits --help``."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from speceyes.miniworld.level1 import (
    LEVEL1_CANVAS,
    LEVEL1_CLUTTER,
    LEVEL1_SIDE,
    LEVEL1_VERSION,
    generate_level1_scene,
    level1_rng,
    level1_sides,
)
from speceyes.miniworld.scenes import (
    CATEGORIES,
    DEFAULT_CANVAS,
    GENERATOR_VERSION,
    LOW_RES_MAX_PIXELS,
    POPULAR_PAIRS,
    SIZE_CLASSES,
    SPLITS,
    SizeClass,
    generate_scene,
    low_res_scale,
    scene_rng,
    size_ranges,
)
from speceyes.miniworld.sprites import SOURCE_SPLIT, load_pool


def _scene_job(job: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Generate, save and serialise one scene (a top-level function so processes can run it)."""
    split, index, scene_id = job["split"], job["index"], job["scene_id"]
    pool = load_pool(SOURCE_SPLIT[split])
    if job.get("level", 2) == 1:
        rng = level1_rng(split, job["seed"], index)
        scene = generate_level1_scene(
            rng, pool, tuple(job["canvas"]), job["regime"], clutter=job["clutter"]
        )
    else:
        rng = scene_rng(split, job["seed"], index)
        scene = generate_scene(
            rng, pool, tuple(job["canvas"]), job["regime"], clutter=job["clutter"]
        )
    rel = f"images/{scene_id}.{job['ext']}"
    path = Path(job["out_dir"]) / rel
    if job["ext"] == "png":
        scene.image.save(path, format="PNG", compress_level=6)
    else:
        scene.image.save(path, format="JPEG", quality=95, subsampling=0)
    objects = [o.to_json() for o in scene.objects]
    rows = []
    for k, q in enumerate(scene.questions):
        row: dict[str, Any] = {
            "id": f"{scene_id}-q{k}",
            "image": rel,
            "question": q.question,
            "options": q.options,
            "answer": q.answer,
            "category": q.category,
            "target_size": q.target_size,
            "target_bbox": None if q.target_bbox is None else list(q.target_bbox),
            "scene": scene_id,
            "regime": scene.regime,
            "canvas": list(scene.image.size),
        }
        row.update({k2: v for k2, v in q.meta.items() if k2 != "kind"})
        row["question_kind"] = q.meta.get("kind")
        row["objects"] = objects
        rows.append(row)
    return rows, objects


def make_split(
    out_dir: str | Path,
    split: str = "test",
    n_scenes: int = 100,
    seed: int = 0,
    canvas: tuple[int, int] = DEFAULT_CANVAS,
    small_fraction: float = 0.5,
    clutter: int = 0,
    image_format: str = "png",
    workers: int = 1,
    level: int = 2,
) -> dict[str, Any]:
    """Write ``images/``, ``questions.jsonl`` and ``manifest.json`` for one split; return the
    manifest.

    Exactly ``round(n_scenes * small_fraction)`` scenes are small-regime (order shuffled by the
    seed), so every question category has that share of small targets. Output is a function of
    (generator version, split, seed, n_scenes, canvas, small_fraction, clutter): same arguments,
    byte-identical JSONL and identical images. ``val`` draws from easy-VQA train sprites like
    ``train`` but from its own seed stream, so its scenes differ from train's.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if n_scenes < 1:
        raise ValueError("n_scenes must be >= 1")
    if not 0.0 <= small_fraction <= 1.0:
        raise ValueError("small_fraction must be in [0, 1]")
    ext = {"png": "png", "jpg": "jpg", "jpeg": "jpg"}.get(image_format.lower())
    if ext is None:
        raise ValueError(f"image_format must be png or jpg, got {image_format!r}")
    if level not in (1, 2):
        raise ValueError(f"level must be 1 or 2, got {level}")
    canvas = (int(canvas[0]), int(canvas[1]))
    if level == 1:
        ranges = level1_sides(canvas)
    else:
        ranges = size_ranges(canvas)  # fail early on an unusable canvas
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)

    n_small = round(n_scenes * small_fraction)
    regimes: list[SizeClass] = ["small"] * n_small + ["large"] * (n_scenes - n_small)
    scene_rng(split, seed, -1).shuffle(regimes)
    jobs = [
        {
            "split": split,
            "index": i,
            "scene_id": f"{split}-{i:05d}",
            "seed": seed,
            "canvas": canvas,
            "regime": regimes[i],
            "clutter": clutter,
            "ext": ext,
            "out_dir": str(out),
            "level": level,
        }
        for i in range(n_scenes)
    ]
    if workers > 1:
        with ProcessPoolExecutor(max_workers=workers) as ex:
            results = list(ex.map(_scene_job, jobs, chunksize=4))
    else:
        results = [_scene_job(j) for j in jobs]

    counts: dict[str, Counter[str]] = {c: Counter() for c in CATEGORIES}
    answers: dict[str, Counter[str]] = {c: Counter() for c in CATEGORIES}
    pair_counts: Counter[str] = Counter()
    sources: set[str] = set()
    n_questions = 0
    with (out / "questions.jsonl").open("w", encoding="utf-8", newline="\n") as f:
        for rows, objects in results:
            pair_counts.update(f"{o['color']} {o['shape']}" for o in objects)
            sources.update(o["source"] for o in objects)
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                counts[row["category"]][row["target_size"]] += 1
                answers[row["category"]][row["answer"]] += 1
                n_questions += 1
    pool = load_pool(SOURCE_SPLIT[split])
    manifest = {
        "generator": LEVEL1_VERSION if level == 1 else GENERATOR_VERSION,
        "level": level,
        "split": split,
        "seed": seed,
        "n_scenes": n_scenes,
        "n_questions": n_questions,
        "canvas": list(canvas),
        "small_fraction": small_fraction,
        "small_scenes": n_small,
        "large_scenes": n_scenes - n_small,
        "clutter": clutter,
        "image_format": ext,
        "low_res_view": {
            "max_pixels": LOW_RES_MAX_PIXELS,
            "scale": round(low_res_scale(canvas), 6),
        },
        "size_ranges_px": {k: list(v) for k, v in ranges.items()},
        "source": {
            "package": "easy-vqa",
            "version": _package_version("easy-vqa"),
            "easy_vqa_split": SOURCE_SPLIT[split],
            "label_method": (
                "colour and shape from easy-VQA's own question/answer data; every sprite is "
                "checked against pixel analysis (palette colour, mask fill ratio) when loaded"
            ),
            "labelled_images": pool.stats["qa_labelled"],
            "images": pool.stats["images"],
            "distinct_sprites_used": len(sources),
        },
        "counts": {c: {s: counts[c][s] for s in SIZE_CLASSES} for c in CATEGORIES},
        "answers": {c: dict(sorted(answers[c].items())) for c in CATEGORIES},
        "popular_pairs": [f"{c} {s}" for c, s in POPULAR_PAIRS],
        "object_pair_counts": dict(sorted(pair_counts.items(), key=lambda kv: (-kv[1], kv[0]))),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def _package_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


# ----------------------------------------------------------------------------------------- CLI


def _parse_canvas(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*[xX,]\s*(\d+)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"canvas must look like 2048x1536, got {text!r}")
    return int(m.group(1)), int(m.group(2))


def level_defaults(level: int) -> tuple[tuple[int, int], int]:
    """(canvas, clutter) of a level's scenes unless told otherwise."""
    return (LEVEL1_CANVAS, LEVEL1_CLUTTER) if level == 1 else (DEFAULT_CANVAS, 0)


def _wxh(canvas: tuple[int, int]) -> str:
    return f"{canvas[0]}x{canvas[1]}"


def _build_parser() -> argparse.ArgumentParser:
    small, large = LEVEL1_SIDE["small"], LEVEL1_SIDE["large"]
    p = argparse.ArgumentParser(
        prog="python -m speceyes.miniworld.splits",
        description=(
            "Generate a mini-world split. Level 1 (default, the demo's world): one easy-VQA "
            f"shape per {_wxh(LEVEL1_CANVAS)} scene among pastel clutter, 8 questions about it "
            "(colour, shape, POPE random/popular/adversarial yes and no); small targets are "
            f"{small[0]}-{small[1]} px (unreadable in the small model's view, readable after a "
            f"zoom crop), large ones {large[0]}-{large[1]} px. Level 2: several shapes on a "
            f"{_wxh(DEFAULT_CANVAS)} canvas, with attribute, relative-position and POPE "
            "questions. Writes DIR/images/, DIR/questions.jsonl "
            "(generic JSONL: evaluate with the 'jsonl' benchmark) and DIR/manifest.json. Same "
            "arguments give the same files."
        ),
    )
    p.add_argument("--out", required=True, type=Path, help="output folder (created)")
    p.add_argument(
        "--split",
        choices=SPLITS,
        default="test",
        help="train/val draw easy-VQA train images, test draws easy-VQA test images",
    )
    p.add_argument("--scenes", type=int, default=100, help="number of scenes (8 questions each)")
    p.add_argument("--seed", type=int, default=0, help="seed; change it for a fresh split")
    p.add_argument(
        "--canvas",
        type=_parse_canvas,
        default=None,
        help=f"canvas WxH in pixels (default: {_wxh(LEVEL1_CANVAS)} at level 1, "
        f"{_wxh(DEFAULT_CANVAS)} at level 2)",
    )
    p.add_argument(
        "--small-fraction",
        type=float,
        default=0.5,
        help="share of scenes whose questioned objects are small (default 0.5)",
    )
    p.add_argument(
        "--clutter",
        type=int,
        default=None,
        choices=range(4),
        help=f"pastel blob clutter, 0-3 (default: {LEVEL1_CLUTTER} at level 1, 0 at level 2)",
    )
    p.add_argument("--format", choices=("png", "jpg"), default="png", help="image format")
    p.add_argument("--workers", type=int, default=1, help="processes for rendering")
    p.add_argument(
        "--level",
        type=int,
        choices=(1, 2),
        default=1,
        help="1: one target shape per scene among pastel clutter (default, the demo's "
        "world); 2: the multi-object world",
    )
    return p


def main(argv: Iterable[str] | None = None) -> int:
    args = _build_parser().parse_args(None if argv is None else list(argv))
    canvas, clutter = level_defaults(args.level)
    if args.canvas is None:
        args.canvas = canvas
    if args.clutter is None:
        args.clutter = clutter
    manifest = make_split(
        args.out,
        split=args.split,
        n_scenes=args.scenes,
        seed=args.seed,
        canvas=args.canvas,
        small_fraction=args.small_fraction,
        clutter=args.clutter,
        image_format=args.format,
        workers=args.workers,
        level=args.level,
    )
    print(
        f"wrote {manifest['n_scenes']} scenes, {manifest['n_questions']} questions to "
        f"{args.out} ({manifest['split']}, seed {manifest['seed']})"
    )
    for cat, by_size in manifest["counts"].items():
        print(f"  {cat:18s} small={by_size['small']:5d} large={by_size['large']:5d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
