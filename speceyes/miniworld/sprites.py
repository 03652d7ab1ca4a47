"""Easy-VQA sprites for the mini world: the colour and shape vocabulary, the sprite pool with
labels read from the package's own data and cross-checked by pixel analysis, and the alpha masks
that scale a sprite to any side."""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Any

import numpy as np
from PIL import Image

COLORS = ("red", "green", "blue", "yellow", "black", "gray", "teal", "brown")
SHAPES = ("circle", "rectangle", "triangle")
# easy-VQA draws with these exact CSS colours (checked on the package's pixels).
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (255, 0, 0),
    "green": (0, 255, 0),
    "blue": (0, 0, 255),
    "yellow": (255, 255, 0),
    "black": (0, 0, 0),
    "gray": (128, 128, 128),
    "teal": (0, 128, 128),
    "brown": (165, 42, 42),
}

SOURCE_SPLIT = {"train": "train", "val": "train", "test": "test"}
ALL_PAIRS: tuple[tuple[str, str], ...] = tuple((c, s) for c in COLORS for s in SHAPES)
_QUESTION_WORDS = re.compile(r"[a-z]+")
_HARD_THRESHOLD = 60  # max-channel distance from the background that counts as shape
_MIN_SPRITE_SIDE = 16  # smaller source shapes are polygons that turn into blobs when scaled
_MAX_SPRITE_ASPECT = 3.0
_UPSCALE_SIGMA = 1.0  # source pixels of smoothing before an upscale
_UPSCALE_RAMP = 2.5  # edge ramp width (source px) after that smoothing


@dataclass(frozen=True, eq=False)
class Sprite:
    """One easy-VQA shape: its labels and a soft alpha mask cropped tight to the shape."""

    color: str
    shape: str
    source: str  # "train/123": easy-VQA split and image id
    alpha: np.ndarray  # float32 in [0, 1], shape (h, w)

    @property
    def side(self) -> int:
        return int(max(self.alpha.shape))


@dataclass(frozen=True, eq=False)
class SpritePool:
    """The images of one easy-VQA split with question/answer-derived labels, by (colour, shape).

    Sprites are extracted lazily (a scene touches a handful of images, a full pass over 4,000
    PNGs takes seconds) and each one is pixel-verified when loaded: :meth:`sprite` returns None
    for an image whose pixels disagree with its labels or that is unusable as a sprite.
    """

    split: str
    paths: dict[int, str]
    labels: dict[int, tuple[str, str]]  # image id -> (colour, shape)
    by_pair: dict[tuple[str, str], tuple[int, ...]]  # sorted image ids
    stats: dict[str, int]

    def sprite(self, image_id: int) -> Sprite | None:
        color, shape = self.labels[image_id]
        sprite, _ = _load_sprite(self.split, image_id, self.paths[image_id], color, shape)
        return sprite


def _qa_labels(
    texts: Sequence[str], answers: Sequence[str], image_ids: Sequence[int]
) -> dict[int, tuple[str | None, str | None]]:
    """(colour, shape) per image id from easy-VQA's questions; None where unknown or conflicting.

    Open questions name the attribute in the answer and presuppose any attribute they mention
    ("what color is the triangle?" -> triangle); yes/no questions assert or exclude the one they
    mention ("is there not a red shape?" + "no" -> red).
    """
    pos: dict[int, dict[str, set[str]]] = defaultdict(lambda: {"c": set(), "s": set()})
    neg: dict[int, dict[str, set[str]]] = defaultdict(lambda: {"c": set(), "s": set()})
    color_set, shape_set = set(COLORS), set(SHAPES)
    for text, ans, iid in zip(texts, answers, image_ids, strict=True):
        words = set(_QUESTION_WORDS.findall(text.lower()))
        ans = ans.strip().lower()
        if ans in color_set or ans in shape_set:
            target = pos
            words.add(ans)
        elif ans in ("yes", "no"):
            target = pos if (ans == "yes") != bool(words & {"not", "no"}) else neg
        else:
            continue
        target[iid]["c"] |= words & color_set
        target[iid]["s"] |= words & shape_set
    out: dict[int, tuple[str | None, str | None]] = {}
    for iid in set(pos) | set(neg):
        got: list[str | None] = []
        for key, universe in (("c", COLORS), ("s", SHAPES)):
            p, n = pos[iid][key], neg[iid][key]
            left = [v for v in universe if v not in n]
            if len(p) == 1 and not (p & n):
                got.append(next(iter(p)))
            elif not p and len(left) == 1:  # every other value excluded
                got.append(left[0])
            else:
                got.append(None)
        out[iid] = (got[0], got[1])
    return out


def _fill_shape(fill: float) -> str:
    # Fill ratio of the mask in its bounding box: triangle ~0.5, circle ~0.8, rectangle ~1.0.
    if fill < 0.71:
        return "triangle"
    return "circle" if fill < 0.94 else "rectangle"


def pixel_labels(arr: np.ndarray) -> dict[str, Any]:
    """Pixel analysis of one 64x64 easy-VQA image (uint8 RGB).

    Returns ``color`` (the palette colour with the most pixels in the shape mask), ``shape``
    (from the mask's fill ratio), ``bg`` (the flat background colour), ``box`` (mask bbox
    x1, y1, x2, y2) and ``border`` (the shape touches the image edge, so it may be cut off).
    """
    a16 = arr.astype(np.int16)
    corners = np.stack([a16[0, 0], a16[0, -1], a16[-1, 0], a16[-1, -1]])
    bg = np.median(corners, axis=0).astype(np.int16)  # backgrounds are flat light colours
    mask = np.abs(a16 - bg).max(-1) > _HARD_THRESHOLD
    if not mask.any():
        return {"color": None, "shape": None, "bg": bg, "box": None, "border": False}
    fg = a16[mask]
    counts = [int((fg == np.asarray(rgb, np.int16)).all(1).sum()) for rgb in PALETTE.values()]
    ys, xs = np.nonzero(mask)
    box = (int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1)
    fill = mask.sum() / ((box[2] - box[0]) * (box[3] - box[1]))
    border = bool(mask[0].any() or mask[-1].any() or mask[:, 0].any() or mask[:, -1].any())
    return {
        "color": COLORS[int(np.argmax(counts))] if max(counts) else None,
        "shape": _fill_shape(float(fill)),
        "bg": bg,
        "box": box,
        "border": border,
    }


def _soft_alpha(arr: np.ndarray, bg: np.ndarray, color: str, box: Sequence[int]) -> np.ndarray:
    """Coverage of the shape colour per pixel: projection of (pixel - bg) onto (colour - bg)."""
    x1, y1, x2, y2 = (int(v) for v in box)
    # One pixel of context keeps anti-aliased edge pixels that the hard mask missed.
    y1, x1 = max(y1 - 1, 0), max(x1 - 1, 0)
    y2, x2 = min(y2 + 1, arr.shape[0]), min(x2 + 1, arr.shape[1])
    patch = arr[y1:y2, x1:x2].astype(np.float32) - bg.astype(np.float32)
    direction = np.asarray(PALETTE[color], np.float32) - bg.astype(np.float32)
    alpha = np.clip(patch @ direction / float(direction @ direction), 0.0, 1.0)
    alpha[alpha < 0.05] = 0.0
    ys, xs = np.nonzero(alpha > 0)
    return np.ascontiguousarray(alpha[ys.min() : ys.max() + 1, xs.min() : xs.max() + 1])


def _read_rgb(path: str) -> np.ndarray:
    with Image.open(path) as im:
        arr = np.asarray(im.convert("RGB"))
    if arr.shape != (64, 64, 3):
        raise ValueError(f"easy-VQA image {path} is {arr.shape[1]}x{arr.shape[0]}, expected 64x64")
    return arr


@cache
def _load_sprite(
    split: str, image_id: int, path: str, color: str, shape: str
) -> tuple[Sprite | None, str]:
    """The sprite of one image and "ok", or None and why it is unusable."""
    px = pixel_labels(_read_rgb(path))
    if px["color"] != color or px["shape"] != shape:
        return None, "label_mismatch"
    if px["border"]:
        return None, "border"
    alpha = _soft_alpha(_read_rgb(path), px["bg"], color, px["box"])
    h, w = alpha.shape
    if max(h, w) < _MIN_SPRITE_SIDE or max(h, w) / max(min(h, w), 1) > _MAX_SPRITE_ASPECT:
        return None, "size"
    return Sprite(color, shape, f"{split}/{image_id}", alpha), "ok"


@lru_cache(maxsize=2)
def load_pool(split: str) -> SpritePool:
    """Labelled images of one easy-VQA split ("train" or "test"); cached per process.

    Labels come from the package's question/answer data only; images whose questions do not
    pin down both colour and shape are left out.
    """
    if split not in ("train", "test"):
        raise ValueError(f"easy-VQA split must be 'train' or 'test', got {split!r}")
    try:
        import easy_vqa
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the mini-world needs the easy-vqa package: pip install easy-vqa") from e
    if split == "train":
        paths = easy_vqa.get_train_image_paths()
        texts, answers, ids = easy_vqa.get_train_questions()
    else:
        paths = easy_vqa.get_test_image_paths()
        texts, answers, ids = easy_vqa.get_test_questions()
    qa = _qa_labels(texts, answers, ids)
    labels = {
        iid: (c, s)
        for iid, (c, s) in sorted(qa.items())
        if iid in paths and c is not None and s is not None
    }
    by_pair: dict[tuple[str, str], list[int]] = defaultdict(list)
    for iid, pair in labels.items():
        by_pair[pair].append(iid)
    missing = [p for p in ALL_PAIRS if not by_pair.get(p)]
    if missing:
        raise RuntimeError(f"easy-VQA {split} has no labelled image for {missing}")
    return SpritePool(
        split=split,
        paths={iid: str(paths[iid]) for iid in labels},
        labels=labels,
        by_pair={p: tuple(by_pair[p]) for p in ALL_PAIRS},
        stats={"images": len(paths), "qa_labelled": len(labels)},
    )


def verify_labels(split: str, limit: int | None = None) -> dict[str, int]:
    """Compare question/answer labels with pixel labels over a split (or its first ``limit``
    images by id). Also counts images whose questions leave colour or shape open."""
    import easy_vqa

    if split == "train":
        paths = easy_vqa.get_train_image_paths()
        qa = _qa_labels(*easy_vqa.get_train_questions())
    elif split == "test":
        paths = easy_vqa.get_test_image_paths()
        qa = _qa_labels(*easy_vqa.get_test_questions())
    else:
        raise ValueError(f"easy-VQA split must be 'train' or 'test', got {split!r}")
    stats: Counter[str] = Counter()
    for iid in sorted(paths)[:limit]:
        stats["images"] += 1
        px = pixel_labels(_read_rgb(str(paths[iid])))
        qc, qs = qa.get(iid, (None, None))
        for key, q, p in (("color", qc, px["color"]), ("shape", qs, px["shape"])):
            if q is None:
                stats[f"{key}_open"] += 1
            else:
                stats[f"{key}_checked"] += 1
                stats[f"{key}_agree"] += q == p
        if qc is not None and qs is not None:
            _, why = _load_sprite(split, iid, str(paths[iid]), qc, qs)
            stats[f"sprite_{why}"] += 1
    return dict(sorted(stats.items()))


def _gaussian_blur(a: np.ndarray, sigma: float) -> np.ndarray:
    """Separable Gaussian blur of a small float array (zero outside); output is larger by 2r."""
    r = max(1, round(3 * sigma))
    x = np.arange(-r, r + 1, dtype=np.float32)
    k = np.exp(-(x**2) / (2 * sigma**2))
    k /= k.sum()
    a = np.pad(a, r)
    h, w = a.shape
    rows = sum(k[i] * a[i : h - 2 * r + i] for i in range(2 * r + 1))
    return sum(k[i] * rows[:, i : w - 2 * r + i] for i in range(2 * r + 1))


def _resample(alpha: np.ndarray, scale: float) -> np.ndarray:
    a = np.pad(alpha, 3)  # zero border so the resampling kernel sees the edges
    if scale > 1.5:
        # Upsampling magnifies the source's pixel staircase into wavy edges: smooth it at the
        # source scale, then steepen the stretched edge ramp back to ~1.5 px. Crisp, smooth
        # contours; corners round off by about a source pixel.
        a = _gaussian_blur(a, _UPSCALE_SIGMA)
        method = Image.Resampling.BICUBIC
    else:
        method = Image.Resampling.LANCZOS
    h, w = a.shape
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    out = np.asarray(Image.fromarray(a.astype(np.float32)).resize(size, method))
    if scale > 1.5:
        out = (out - 0.5) * max(1.0, scale * _UPSCALE_RAMP / 1.5) + 0.5
    out = np.clip(out, 0.0, 1.0)
    out[out < 0.04] = 0.0
    ys, xs = np.nonzero(out)
    return np.ascontiguousarray(out[ys.min() : ys.max() + 1, xs.min() : xs.max() + 1])


def _visible_side(alpha: np.ndarray) -> int:
    ys, xs = np.nonzero(alpha >= 0.5)
    return int(max(np.ptp(ys), np.ptp(xs))) + 1 if len(ys) else 0


def scaled_alpha(sprite: Sprite, side: int) -> np.ndarray:
    """The sprite's alpha with its longer *visible* side (alpha >= 0.5) scaled to ``side`` px,
    cropped tight to its soft fringe."""
    scale = side / sprite.side
    out = _resample(sprite.alpha, scale)
    # The source crop includes faint anti-aliasing fringe that vanishes once upscaled and
    # sharpened (up to ~2 source px times the scale): correct the scale once by measuring.
    got = _visible_side(out)
    if got and got != side:
        out = _resample(sprite.alpha, scale * side / got)
    return out
