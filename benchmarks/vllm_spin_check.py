"""Does a small-model request slow down the agent loop that follows it? (vLLM CPU build)

Starts the small and large mini-world servers as ``bench_load_vllm.py`` does (``--placement``,
``--executor``) and one agent-only ``speceyes serve`` app. For each of the 16 test questions,
``--reps`` times, it sends in turn: an agent-only request (``plain``), a one-token request
straight to the small server, the same agent-only request at once (``after small``), and after
``--quiet`` seconds the same again (``after quiet``). It prints the median of serve's own
``agent`` timing for each, and the ratios. The CPU worker of vLLM's default ``mp`` executor
busy-polls for a second after each step, so ``after small`` shows what that costs the processes
around it; ``uni`` keeps the worker in the engine process, which does not poll.

    python benchmarks/vllm_spin_check.py [--executor uni|mp] [--placement split|shared]
        [--reps 3] [--quiet 1.5] [--out runs/vllm-spin-check]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_load_vllm as blv  # noqa: E402

SEQUENCE = ("plain", "after small", "after quiet")


async def measure(
    small_url: str, app_url: str, bodies: list[dict[str, Any]], reps: int, quiet: float
) -> dict[str, list[float]]:
    """Serve's ``agent`` seconds per step of :data:`SEQUENCE`, over ``reps`` x the questions."""
    import aiohttp

    got: dict[str, list[float]] = {k: [] for k in SEQUENCE}
    async with aiohttp.ClientSession() as s:
        async with s.get(small_url + "/models") as r:
            small_id = (await r.json())["data"][0]["id"]

        async def agent(body: dict[str, Any]) -> float:
            async with s.post(app_url + "/v1/chat/completions", json=body) as r:
                r.raise_for_status()
                return float((await r.json())["speceyes"]["timings"]["agent"])

        async def small(body: dict[str, Any]) -> None:
            direct = {k: v for k, v in body.items() if k != "options"}
            async with s.post(small_url + "/chat/completions",
                              json={**direct, "model": small_id, "max_tokens": 1}) as r:
                r.raise_for_status()
                await r.read()

        for body in bodies:  # warm-up: every question once (prefix cache, first-call costs)
            await agent(body)
        for _ in range(reps):
            for body in bodies:
                got["plain"].append(await agent(body))
                await small(body)
                got["after small"].append(await agent(body))
                await asyncio.sleep(quiet)
                got["after quiet"].append(await agent(body))
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--executor", choices=blv.EXECUTORS, default=blv.NON_SPINNING_EXECUTOR)
    ap.add_argument("--placement", choices=blv.PLACEMENTS, default=blv.SPLIT_PLACEMENT)
    ap.add_argument("--reps", type=int, default=3, help="passes over the 16 questions")
    ap.add_argument("--quiet", type=float, default=1.5,
                    help="seconds of quiet before the third request (vLLM's poll lasts 1 s)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "vllm-spin-check")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    args = ap.parse_args()

    from speceyes.factory import build_funnel
    from speceyes.images import load_image, to_data_uri
    from speceyes.serve import create_app
    from tests.tools.server_thread import ServerThread

    blv._signals_as_interrupt()
    args.out.mkdir(parents=True, exist_ok=True)
    servers: list[Any] = []
    app = None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            queries = blv.question_set(Path(tmp) / "mw", 2, 0)
            uris = {q.image: to_data_uri(load_image(q.image)) for q in queries}
            bodies = [blv.request_body(q, uris[q.image]) for q in queries]
        t0 = time.perf_counter()
        servers = blv.start_servers(args.out, args.start_timeout, args.placement,
                                    executor=args.executor)
        print(f"servers up in {time.perf_counter() - t0:.0f} s "
              f"(executor {args.executor}, placement {args.placement})", flush=True)
        mode = blv.Mode("agent-only", "agent")
        funnel = build_funnel(blv.settings_for(mode, servers[0].url, servers[1].url))
        app = ServerThread(create_app(funnel, max_queue=64, request_timeout=None)).start()
        got = asyncio.run(measure(servers[0].url, app.url, bodies, args.reps, args.quiet))
    finally:
        if app is not None:
            app.stop()
        for s in servers:
            s.stop()
    med = {k: statistics.median(v) for k, v in got.items()}
    for k in SEQUENCE:
        print(f"{k:12s} agent loop median {med[k]:.3f} s  ({med[k] / med['plain']:.2f}x plain, "
              f"n={len(got[k])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
