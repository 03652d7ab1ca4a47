"""Funnel overhead per query, isolated from model time, on real tiny checkpoints.

Every backend call is timed by a transparent wrapper around the real backend; the funnel's own
cost is the run's wall time minus the time spent inside model calls, per query. Both schedules
run side by side in one process on the same inputs.

    python benchmarks/bench_funnel_overhead.py [--queries 64] [--batch-size 8]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from PIL import Image, ImageDraw

from speceyes.agents.zoom import ZoomAgent
from speceyes.backends.hf import HFBackend
from speceyes.funnel import Funnel, FunnelConfig
from speceyes.tiny import build_tiny_model
from speceyes.types import Query

COLORS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220)}


def make_queries(n: int, seed: int = 0) -> list[Query]:
    """One coloured square per 640x480 image, asked about in three-way multiple choice."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        img = Image.new("RGB", (640, 480), (235, 230, 220))
        color, s = rng.choice(list(COLORS)), rng.randint(24, 160)
        x, y = rng.randint(0, 640 - s), rng.randint(0, 480 - s)
        ImageDraw.Draw(img).rectangle((x, y, x + s, y + s), fill=COLORS[color])
        opts = list(COLORS)
        q = Query(id=f"q{i}", image=img, question="What color is the square?", options=opts,
                  answer="ABC"[opts.index(color)])
        out.append(q)
    return out


class Timed:
    """Delegates to a backend and adds up the seconds spent inside its model calls."""

    def __init__(self, inner):
        self.inner = inner
        self.seconds = 0.0

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name not in ("judge", "answer", "chat", "next_token_probs"):
            return attr

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return attr(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--queries", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        small_dir = build_tiny_model(Path(d) / "s", "qwen3_vl", seed=1, lm_head_scale=8.0)
        large_dir = build_tiny_model(Path(d) / "l", "qwen2_5_vl", seed=2, lm_head_scale=20.0)
        small, large = Timed(HFBackend(small_dir)), Timed(HFBackend(large_dir))
        queries = make_queries(args.queries)  # images in memory: no decoding in the figure
        print(f"{args.queries} queries, batch {args.batch_size}, tiny Qwen3-VL small / Qwen2.5-VL large")
        print("| schedule | wall s | model s | overhead ms/query |")
        print("|---|---|---|---|")
        rows = {}
        for schedule in ("batched", "pipelined"):
            small.seconds = large.seconds = 0.0
            agent = ZoomAgent(large, max_new_tokens=16)
            cfg = FunnelConfig(tau=0.84, batch_size=args.batch_size, schedule=schedule)
            funnel = Funnel(small, large, agent, cfg)
            t0 = time.perf_counter()
            results = funnel.run(queries)
            wall = time.perf_counter() - t0
            model = small.seconds + large.seconds
            # Pipelined runs model calls on two threads at once: overlap can exceed wall time.
            over = max(wall - model, 0.0) / len(results) * 1000
            rows[schedule] = over
            print(f"| {schedule} | {wall:.3f} | {model:.3f} | {over:.3f} |")
        print(f"overhead batched / 2 ms target = {rows['batched'] / 2.0:.2f}")


if __name__ == "__main__":
    main()
