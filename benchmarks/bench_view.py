"""Time `speceyes view` on a synthetic run of 10,000 queries (K=32 top-K logits logged).

Prints the first build (thumbnails made), a rebuild (thumbnails reused), the page's size and the
cost per distinct image. Every query has one zoom box; --images distinct 640x480 pictures are
shared among the queries.

    python benchmarks/bench_view.py [--n 10000] [--images 200]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from PIL import Image, ImageDraw

from speceyes.rundir import SAMPLES_FILE
from speceyes.view import build_view

# Its synthetic run comes from the test tools: run from a checkout (repo root on the path).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.tools.synthetic_run import write_synthetic_run  # noqa: E402


def make_run(root: Path, n: int, images: int) -> Path:
    run = write_synthetic_run(root / "run", n=n, seed=1, mode="speceyes", tau=0.9)
    pics = []
    for i in range(images):
        img = Image.new("RGB", (640, 480), (240, 240, 235))
        ImageDraw.Draw(img).rectangle((i % 500, 30, i % 500 + 80, 110), fill=(220, 30, 30))
        pics.append(root / f"pic{i}.png")
        img.save(pics[-1])
    path = run / SAMPLES_FILE
    lines = []
    for i, line in enumerate(path.read_text().splitlines()):
        s = json.loads(line)
        s["image"] = str(pics[i % images])
        s["trace"] = [{"type": "zoom", "crop_box": [10, 10, 200 + i % 50, 150]}]
        lines.append(json.dumps(s) + "\n")
    path.write_text("".join(lines))
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--images", type=int, default=200)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = make_run(Path(tmp), args.n, args.images)
        mb = (run / SAMPLES_FILE).stat().st_size / 1e6
        t0 = time.perf_counter()
        res = build_view([run], Path(tmp) / "view")
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        again = build_view([run], Path(tmp) / "view")
        rebuild = time.perf_counter() - t0
        page = res.index.stat().st_size / 1e6
    assert res.images_made == args.images and again.images_reused == args.images
    print(f"{args.n} queries ({mb:.1f} MB samples.jsonl), {args.images} distinct images")
    print(f"first build {first:.2f} s (images made), rebuild {rebuild:.2f} s (images reused)")
    print(f"images: {(first - rebuild) / args.images * 1000:.1f} ms each; page {page:.1f} MB")


if __name__ == "__main__":
    main()
