"""The speedup under two denominators: serial agent loops (the released code's, so Table 1's)
against batched ones, on the bundled mini-world models.

Four funnels share the loaded models: agent-only and SpecEyes, each with ``--schedule serial``
(one agent loop at a time, as the released SpecEyes scripts run every loop, the agent-only
baseline's too) and ``--schedule batched`` (a batch's loops share batched turns). They take
turns batch by batch in a rotating order, so the machine's load falls on all four alike, and
the script prints each one's seconds per query, accuracy, and SpecEyes' speedup over the
agent-only run of the same schedule: the number a reader of Table 1 compares with is the serial
one; a batched baseline is faster, so the same funnel's speedup over it is smaller.

    python benchmarks/bench_schedule_denominators.py [--scenes 6] [--batch-size 8]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from speceyes.bench.datasets import load_jsonl  # noqa: E402
from speceyes.bench.scoring import is_correct  # noqa: E402
from speceyes.factory import MANIFEST, Settings, assemble_funnel, load_backends  # noqa: E402
from speceyes.miniworld import demo  # noqa: E402
from speceyes.miniworld.splits import level_defaults, make_split  # noqa: E402

CONFIGS = (("agent", "serial"), ("speceyes", "serial"), ("agent", "batched"),
           ("speceyes", "batched"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenes", type=int, default=6, help="level-1 test scenes (8 questions each)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=8)
    args = ap.parse_args()
    base = Settings.from_manifest(demo.MODELS_DIR / MANIFEST)
    canvas, clutter = level_defaults(1)
    with tempfile.TemporaryDirectory() as tmp:
        make_split(tmp, "test", args.scenes, seed=args.seed, canvas=canvas, clutter=clutter,
                   level=1)
        queries = list(load_jsonl(Path(tmp) / "questions.jsonl"))
        resolved = base.resolved()
        small, large = load_backends(resolved)
        funnels = {}
        for mode, schedule in CONFIGS:
            s = base.with_funnel(mode=mode, schedule=schedule,
                                 batch_size=args.batch_size).resolved()
            funnels[mode, schedule] = assemble_funnel(s.funnel, small, large, s.agent)
        seconds = dict.fromkeys(CONFIGS, 0.0)
        cpu = dict.fromkeys(CONFIGS, 0.0)
        correct = dict.fromkeys(CONFIGS, 0)
        batches = [queries[i:i + args.batch_size]
                   for i in range(0, len(queries), args.batch_size)]
        for b, batch in enumerate(batches):
            order = CONFIGS[b % len(CONFIGS):] + CONFIGS[:b % len(CONFIGS)]  # rotating
            for key in order:
                t0, c0 = time.perf_counter(), time.process_time()
                results = funnels[key].run(batch)
                seconds[key] += time.perf_counter() - t0
                cpu[key] += time.process_time() - c0
                correct[key] += sum(is_correct(q, r.answer) for q, r in zip(batch, results,
                                                                           strict=True))
            print(f"batch {b + 1}/{len(batches)} done", file=sys.stderr, flush=True)
    n = len(queries)
    print(f"{n} level-1 test questions (seed {args.seed}), batch size {args.batch_size}, "
          "modes taking turns batch by batch\n")
    print("| schedule | mode | s/query | CPU s/query | accuracy | SpecEyes speedup (wall / CPU) |")
    print("|---|---|---|---|---|---|")
    for schedule in ("serial", "batched"):
        a, s = ("agent", schedule), ("speceyes", schedule)
        for key in (a, s):
            speed = ""
            if key == s:
                speed = f"{seconds[a] / seconds[s]:.2f}x / {cpu[a] / cpu[s]:.2f}x"
            print(f"| {schedule} | {key[0]} | {seconds[key] / n:.2f} | {cpu[key] / n:.2f} | "
                  f"{correct[key] / n:.3f} | {speed} |")
    print(f"\nagent-only serial / batched: {seconds[CONFIGS[0]] / seconds[CONFIGS[2]]:.2f}x "
          "the time (what batching the baseline's loops saves)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
