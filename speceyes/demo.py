"""``speceyes demo``: the whole funnel offline, on tiny checkpoints built on this machine.

The tiny models have random weights, so their answers are noise: the demo shows every phase,
route and timing working end to end through the same code path real checkpoints take. It does
not measure accuracy.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

from PIL import Image, ImageDraw

from speceyes.types import Query

COLORS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220)}
SHAPES = ("circle", "rectangle", "triangle")
CACHE_VERSION = "tiny-v2"


def default_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "speceyes" / CACHE_VERSION


def ensure_tiny_models(cache: Path) -> tuple[Path, Path]:
    """Build (once) a tiny Qwen3-VL small model and a tiny Qwen2.5-VL large model."""
    from speceyes.tiny import build_tiny_model

    small, large = cache / "small-qwen3-vl", cache / "large-qwen2.5-vl"
    if not (small / "model.safetensors").is_file():
        build_tiny_model(small, "qwen3_vl", seed=1, lm_head_scale=8.0)
    if not (large / "model.safetensors").is_file():
        build_tiny_model(large, "qwen2_5_vl", seed=2, lm_head_scale=20.0)
    return small, large


def draw_scene(rng: random.Random, size: tuple[int, int] = (640, 480)) -> tuple[Image.Image, str, str]:
    img = Image.new("RGB", size, (235, 230, 220))
    d = ImageDraw.Draw(img)
    color = rng.choice(list(COLORS))
    shape = rng.choice(SHAPES)
    s = rng.randint(24, 160)
    x, y = rng.randint(0, size[0] - s), rng.randint(0, size[1] - s)
    box = (x, y, x + s, y + s)
    if shape == "circle":
        d.ellipse(box, fill=COLORS[color])
    elif shape == "rectangle":
        d.rectangle(box, fill=COLORS[color])
    else:
        d.polygon([(x + s / 2, y), (x, y + s), (x + s, y + s)], fill=COLORS[color])
    return img, color, shape


def demo_queries(n: int, seed: int = 0) -> list[Query]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        img, color, shape = draw_scene(rng)
        opts = list(SHAPES)
        out.append(
            Query(
                id=f"demo-{i}",
                image=img,
                question=f"What shape is the {color} object?",
                options=opts,
                answer="ABC"[opts.index(shape)],
            )
        )
    return out


def run_demo(args: argparse.Namespace) -> int:
    from speceyes.agents.zoom import ZoomAgent
    from speceyes.backends.hf import HFBackend
    from speceyes.funnel import Funnel, FunnelConfig

    cache = Path(args.cache) if args.cache else default_cache()
    print(f"tiny models: {cache} (built here, random weights: answers are noise)")
    small_dir, large_dir = ensure_tiny_models(cache)
    small, large = HFBackend(small_dir), HFBackend(large_dir)
    agent = ZoomAgent(large, max_new_tokens=48)
    queries = demo_queries(args.n)
    # Random weights give every answer about the same confidence; a tau at their median lets
    # both gate outcomes appear. Real checkpoints use the calibrated defaults (0.98 / 0.95).
    probe = Funnel(small, None, None, FunnelConfig(mode="small", batch_size=4)).run(queries)
    confs = sorted(r.confidence for r in probe if r.confidence is not None)
    tau = confs[len(confs) // 2] if confs else 0.98
    print(f"tau = {tau:.4f} (median speculative confidence on the demo set)")
    rows = []
    for mode in ("agent", "small", "speceyes"):
        funnel = Funnel(small, large, agent, FunnelConfig(mode=mode, tau=tau, batch_size=4))
        t0 = time.perf_counter()
        results = funnel.run(queries)
        wall = time.perf_counter() - t0
        routes: dict[str, int] = {}
        for r in results:
            routes[r.route] = routes.get(r.route, 0) + 1
        rows.append((mode, wall / len(queries), funnel.stats, routes))
        if mode == "speceyes":
            for q, r in zip(queries, results, strict=True):
                conf = "-" if r.confidence is None else f"{r.confidence:.3f}"
                ptool = "-" if r.p_tool is None else f"{r.p_tool:.2f}"
                print(
                    f"  {q.id}: route={r.route:<18} P(tool)={ptool} conf={conf} "
                    f"tool_calls={r.tool_calls}+{r.invalid_tool_calls} invalid "
                    f"answer={r.answer[:30]!r}"
                )
    agent_time = rows[0][1]
    print()
    print("| mode | s/query | speedup vs agent | beta | alpha | routes |")
    print("|---|---|---|---|---|---|")
    for mode, per, stats, routes in rows:
        beta = "-" if stats.beta is None else f"{stats.beta:.2f}"
        alpha = "-" if stats.alpha is None else f"{stats.alpha:.2f}"
        r = ", ".join(f"{k}: {v}" for k, v in sorted(routes.items()))
        print(f"| {mode} | {per:.3f} | {agent_time / per:.2f}x | {beta} | {alpha} | {r} |")
    return 0
