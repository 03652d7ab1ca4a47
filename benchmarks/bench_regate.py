"""Time offline re-gating: load a 10,000-query log (K=64, ~5 tokens each) and sweep 100 taus.

Budget: load + regate under 2 s. Prints the phases, the total wall time and its ratio to the
budget (best of --repeats; each repeat loads the log afresh, so confidences are recomputed), and
the process CPU time (all threads), which tells a busy machine from a slow path.

    python benchmarks/bench_regate.py [--n 10000] [--k 64] [--taus 100] [--repeats 3]

``--real N`` checks the speedup estimate instead: tiny local models run ``eval --mode both`` on
N generated V*-layout questions, regate predicts the agent phase's wall time at a tau that
accepts about half of the tool-free answers (batch-occupancy model, and the per-query sum for
comparison), then ``eval --mode speceyes`` at that tau measures it. Prints predicted / measured.
Random tiny models answer in one turn, so every batched step holds a full batch and the fit cannot
tell fixed from per-loop cost: the estimate then falls back to GPU time, an upper bound.

``--real N --models DIR --data FILE`` runs the same check on trained models (the bundled mini
world: ``--models speceyes/miniworld/models --data runs/demo/data/questions.jsonl``, written by
``speceyes demo``) with the manifest's search agent and ``stay=1``, whose loops take 1-4 turns;
it adds an agent-only run and compares the estimated speedup with the measured one (agent-only
wall / speceyes wall).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from speceyes.bench import regate as rg
from speceyes.bench.runlog import load_run
from speceyes.rundir import RunDir

# Its synthetic runs come from the test tools: run from a checkout (repo root on the path).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.tools.synthetic_run import write_synthetic_run  # noqa: E402

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


def real_check(n: int, batch: int, workdir: Path) -> None:
    """Predict a speceyes run's agent wall time from a both run, then run it and compare."""
    from PIL import Image

    from speceyes.cli import main as cli
    from speceyes.tiny import build_tiny_model

    small = build_tiny_model(workdir / "small", "qwen3_vl", seed=1, lm_head_scale=8.0)
    large = build_tiny_model(workdir / "large", "qwen2_5_vl", seed=2, lm_head_scale=20.0)
    rng = np.random.default_rng(0)
    data = workdir / "vstar"
    for cat in ("direct_attributes", "relative_position"):
        (data / cat).mkdir(parents=True)
        for i in range(n // 2):
            img = np.full((224, 224, 3), 240, np.uint8)
            x, y = rng.integers(10, 130, 2)
            img[y : y + 80, x : x + 80] = rng.integers(0, 255, 3)
            Image.fromarray(img).save(data / cat / f"q{i}.jpg")
            meta = {"question": "What color is the square?", "options": ["red", "blue"]}
            (data / cat / f"q{i}.json").write_text(json.dumps(meta))
    common = ["eval", "--bench", "vstar", "--data", str(data), "--small", str(small)]
    common += ["--large", str(large), "--batch-size", str(batch), "--no-progress"]
    common += ["--agent-max-tokens", "24", "--max-tool-calls", "2", "--top-k", "16"]
    compare(cli, common, workdir, with_agent=False)


def miniworld_check(n: int, models: Path, data: Path, workdir: Path) -> None:
    """The same check on trained mini-world models with the manifest's search agent."""
    from speceyes.cli import main as cli
    from speceyes.factory import Settings

    s = Settings.from_manifest(models / "manifest.json").resolved()
    rows = [json.loads(ln) for ln in data.read_text(encoding="utf-8").splitlines() if ln.strip()]
    # Evenly spaced rows: both target sizes, so the judge sends some loops to the agent. Image
    # paths become absolute (the loader takes them relative to the file's own folder).
    rows = rows[:: max(1, len(rows) // n)][:n]
    for r in rows:
        r["image"] = str((data.parent / r["image"]).resolve())
    subset = workdir / "questions.jsonl"
    subset.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    # stay=1: loops stop at different depths (1-4 turns), so batch occupancy varies from step to
    # step, which is what the occupancy model has to get right.
    options = {**s.agent.options, "stay": True}
    search = ",".join(
        f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in options.items() if v is not None
    )
    f = s.funnel
    common = ["eval", "--bench", "jsonl", "--data", str(subset), "--no-progress"]
    common += ["--small", str(models / "small"), "--large", str(models / "large")]
    common += ["--agent", "search", "--search", search, "--batch-size", str(f.batch_size)]
    common += ["--agent-max-tokens", str(s.agent.max_new_tokens)]
    common += ["--top-k", str(f.top_k), "--agg", f.agg]
    compare(cli, common, workdir, with_agent=True)


def compare(cli, common: list[str], workdir: Path, with_agent: bool) -> None:
    """both run -> tau at the median tool-free confidence -> predicted vs measured speceyes run."""
    from speceyes.bench import occupancy

    both = workdir / "both"
    assert cli([*common, "--mode", "both", "--tau", "0.5", "--output", str(both)]) == 0
    run = load_run(both)
    conf = rg.confidences(run)[run.judge_tool == 0]
    tau = float(np.median(conf))
    rep = rg.replay(run, tau)
    keep = ~rep.accepted
    cost = occupancy.step_cost(run)
    predicted = occupancy.agent_wall(run, keep, cost)
    gpu_sum = float(np.nansum(run.timings["agent"][keep]))
    row = rg.regate(run, [tau])[0]
    spec = workdir / "speceyes"
    assert cli([*common, "--mode", "speceyes", "--tau", f"{tau!r}", "--output", str(spec)]) == 0
    measured_run = load_run(spec)
    measured = occupancy.measured_agent_wall(measured_run)
    print(f"tau {tau:.6f}: {int(rep.accepted.sum())} of {run.n} accepted; {cost.describe()}")
    print(f"agent wall, measured in the speceyes run: {measured:.2f} s")
    print(f"predicted by occupancy model: {predicted:.2f} s (ratio {predicted / measured:.3f})")
    print(f"per-query sum of both-run shares: {gpu_sum:.2f} s (ratio {gpu_sum / measured:.3f})")
    t_both, t_spec = occupancy.turns(run), occupancy.turns(measured_run)
    print(
        f"both run: agent wall {occupancy.measured_agent_wall(run):.2f} s for {run.n} loops, "
        f"{t_both.sum():.0f} turns; speceyes run: {t_spec.sum():.0f} turns "
        f"(both run, kept loops: {t_both[keep].sum():.0f})"
    )
    if with_agent:
        agent_dir = workdir / "agent"
        assert cli([*common, "--mode", "agent", "--output", str(agent_dir)]) == 0
        wall_agent = run_wall(agent_dir)
        wall_spec = run_wall(spec)
        real = wall_agent / wall_spec
        print(
            f"speedup estimated by regate: {row.speedup:.2f}x; measured (agent-only "
            f"{wall_agent:.1f} s / speceyes {wall_spec:.1f} s): {real:.2f}x "
            f"(ratio {row.speedup / real:.3f})"
        )


def run_wall(run_dir: Path) -> float:
    """Seconds the run's queries took, as its results.json records them."""
    return float(RunDir(run_dir).read_results()["wall_time"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--taus", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--real", type=int, default=0, help="check the speedup model on N queries")
    ap.add_argument("--batch", type=int, default=8, help="--real: eval batch size")
    ap.add_argument("--models", type=Path, help="--real: trained mini-world models folder")
    ap.add_argument("--data", type=Path, help="--real with --models: mini-world questions.jsonl")
    args = ap.parse_args()
    if args.real:
        with tempfile.TemporaryDirectory() as tmp:
            if args.models:
                if not args.data:
                    ap.error("--models needs --data (run `speceyes demo` to write the questions)")
                miniworld_check(args.real, args.models, args.data, Path(tmp))
            else:
                real_check(args.real, args.batch, Path(tmp))
        return
    taus = np.linspace(0.5, 0.9999, args.taus)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        # 1-9 tokens per answer: about 5 on average.
        write_synthetic_run(run_dir, args.n, k_logged=args.k, tokens=(1, 10), seed=0)
        size_mb = RunDir(run_dir).samples_file.stat().st_size / 1e6
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
