"""The cascade on the mini world: every stage for every query (``both``), per target size.

Builds the demo's split (``speceyes demo``'s machinery: level 1 by default, ``--split val`` or
``test``, ``--seed``, ``--scenes``), loads the bundled models (or ``--models DIR``) once, and runs the demo's funnel
(its manifest's agent and gate) in mode ``both`` with ``--speculate-depth`` and
``--middle-tier`` through ``speceyes eval``'s runner into ``OUT/{small,large}-targets/``:
ordinary run folders whose ``samples.jsonl`` log every stage (for offline replay of any
per-stage thresholds). With ``--pooled`` every question goes into one folder,
``OUT/all-targets/``, the single run ``speceyes calibrate --cascade`` and ``regate --cascade``
take. Prints each stage's accuracy, acceptance at its tau and seconds per
query, as ``results.json`` reports them (``stages``).

    nice -n 10 python benchmarks/cascade_miniworld.py --split val --out runs/cascade-val
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from speceyes.bench.datasets import load_jsonl
from speceyes.bench.runner import EvalSpec, run_eval
from speceyes.factory import MANIFEST, Settings, build_funnel, make_agent, make_backend
from speceyes.miniworld import demo
from speceyes.miniworld.summary import SPLITS
from speceyes.types import DIRECT_PROMPTS

POOLED = "all-targets"  # --pooled: the run folder of every question


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--split", choices=("val", "test"), default="val")
    p.add_argument("--seed", type=int, default=demo.TestSplit.seed)
    p.add_argument("--scenes", type=int, default=10, help="8 questions each (default 10)")
    p.add_argument("--level", type=int, choices=demo.LEVELS, default=1)
    p.add_argument("--speculate-depth", type=int, default=1)
    p.add_argument("--no-middle-tier", action="store_true")
    p.add_argument(
        "--direct-prompt", default=DIRECT_PROMPTS[0], choices=DIRECT_PROMPTS,
        help="the middle tier's prompt (as eval's --direct-prompt): its confidences, and so its "
        "thresholds, belong to the prompt they were logged with",
    )
    p.add_argument("--resume", action="store_true")
    p.add_argument(
        "--pooled",
        action="store_true",
        help="one run folder of every question (OUT/all-targets), for calibrate --cascade",
    )
    p.add_argument(
        "--models",
        type=Path,
        default=None,
        help="folder with small/, large/ and manifest.json, as speceyes demo --models takes "
        "(default: the level's bundled models)",
    )
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    models_dir = args.models or demo.LEVEL_MODELS[args.level]
    models = demo.find_models(models_dir)
    settings = Settings.from_manifest(models_dir / MANIFEST).with_funnel(
        mode="both", speculate_depth=args.speculate_depth, middle_tier=not args.no_middle_tier,
        direct_prompt=args.direct_prompt,
    )
    split = demo.TestSplit.from_settings(settings)
    split.level, split.seed, split.scenes = args.level, args.seed, args.scenes
    out = Path(args.out).resolve()
    data = out / demo.DATA_DIR
    key = demo.split_key(split, args.split)
    man, _ = demo.ensure_split(data, key)
    print(f"split {args.split} seed {args.seed}: {man['n_questions']} questions in {data}")

    backends = {r: make_backend(str(models[r]), settings=settings.backend) for r in demo.ROLES}
    agent = make_agent(settings.resolved().agent, backends["large"])
    demo.warm_up(backends, data)
    funnel = build_funnel(settings, (backends["small"], backends["large"]), agent)
    parts = [(POOLED, None)] if args.pooled else SPLITS
    for label, size in parts:
        subset = data / "questions.jsonl" if size is None else demo.subset_path(data, size)
        queries = list(load_jsonl(subset))
        spec = EvalSpec(
            bench="jsonl",
            data=str(subset),
            output=out / label,
            resume=args.resume,
            models={r: str(models[r]) for r in demo.ROLES},
            loader_kw={"target_size": size or "all", "split": key},
        )
        res = run_eval(spec, funnel, queries, total=len(queries), progress=False, plots=False)
        print(f"\n[{label}] n={res['n']} accuracy={res['accuracy']:.3f} routes={res['routes']}")
        print(f"  {'stage':<13} {'acc':>6} {'accept':>7} {'acc|acc':>8} {'answered':>9} {'s/q':>7}")
        for stage, row in res["stages"].items():
            ap = "-" if row["accuracy_passed"] is None else f"{row['accuracy_passed']:.3f}"
            print(
                f"  {stage:<13} {row['accuracy']:6.3f} {row['acceptance']:7.3f} {ap:>8} "
                f"{row['answered']:9d} {row['seconds_per_query']:7.3f}"
            )
        agent_s = res["time_by_phase"]["agent"] / max(res["n"], 1)
        print(f"  agent loop: {agent_s:.3f} s/query")


if __name__ == "__main__":
    main()
