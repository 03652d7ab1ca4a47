"""Time offline re-gating: load a 10,000-query log (K=64, ~5 tokens each) and sweep 100 taus.

Budget: load + regate under 2 s. Prints the phases, the total wall time and its ratio to the
budget (best of --repeats; each repeat loads the log afresh, so confidences are recomputed), and
the process CPU time (all threads), which tells a busy machine from a slow path.

    python benchmarks/bench_regate.py [--n 10000] [--k 64] [--taus 100] [--repeats 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from speceyes.bench import regate as rg
from speceyes.bench.runlog import SAMPLES_FILE, load_run, write_synthetic_run

BUDGET_S = 2.0


def one_pass(run_dir: Path, taus: np.ndarray, top_k: int) -> dict[str, float]:
    c0 = time.process_time()  # CPU of all threads: shows how much of the wall is contention
    t0 = time.perf_counter()
    run = load_run(run_dir)
    t1 = time.perf_counter()
    rg.confidences(run, top_k=top_k)
    t2 = time.perf_counter()
    rows = rg.regate(run, taus, top_k=top_k)  # confidences now cached: this is the sweep
    t3 = time.perf_counter()
    assert len(rows) == len(taus)
    cpu = time.process_time() - c0
    return {"load": t1 - t0, "confidence": t2 - t1, "sweep": t3 - t2, "total": t3 - t0, "cpu": cpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--taus", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    taus = np.linspace(0.5, 0.9999, args.taus)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        # 1-9 tokens per answer: about 5 on average.
        write_synthetic_run(run_dir, args.n, k_logged=args.k, tokens=(1, 10), seed=0)
        size_mb = (run_dir / SAMPLES_FILE).stat().st_size / 1e6
        print(f"log: {args.n} queries, K={args.k}, {size_mb:.1f} MB samples.jsonl")
        passes = [one_pass(run_dir, taus, args.k) for _ in range(args.repeats)]
    for i, p in enumerate(passes):
        print(f"pass {i}: " + "  ".join(f"{k} {v:.3f}s" for k, v in p.items()))
    best = min(passes, key=lambda p: p["total"])
    print(
        f"load + regate ({args.taus} taus): {best['total']:.3f} s "
        f"(best of {args.repeats}); ratio to the {BUDGET_S:.0f} s budget: "
        f"{best['total'] / BUDGET_S:.2f}"
    )


if __name__ == "__main__":
    main()
