"""Load test of ``speceyes serve`` on loopback: N requests at concurrency C, nothing may be lost.

Builds the tiny Qwen3-VL (small) and Qwen2.5-VL (large) checkpoints in a temp dir, serves them
in-process on 127.0.0.1 (a free port), and sends N chat completions with the async openai client
at concurrency C. Every request cycles through a few distinct scenes; each scene's answer is
first computed straight through ``Funnel.run_batch``, so a response that belongs to another
request is caught ("mismatched"). 429s are counted and retried with exponential backoff; lost
(no answer), failed (any other error) and malformed (not a chat.completion with the speceyes
field) responses must be zero. Prints p50/p95/p99 latency (client side, retries included),
throughput and the batch sizes the server formed.

Default: speceyes mode, tau 0.5 (the tiny small model's confidences sit around 0.8, so the gate
accepts nearly all and the run finishes in minutes on 2 CPU cores; use --tau 0.98 to send
everything through the agent).

``--schedules batched,pipelined`` runs the same load once per schedule, one after the other in
the same invocation, and prints the p50 latency of the gate-accepted answers of each (a mixed
load needs a tau between the confidences, e.g. --tau 0.83). ``--adversarial 0.1`` then runs
the last schedule again with 10% hostile requests mixed in (those of tests/tools/hostile.py:
lone surrogates, 11 options, a 20,000-character option, a 1 MB question, PNG headers of
9400x9400 and past PIL's bomb limit, deeply nested JSON; and a wrong API key): every valid
request must be answered correctly, every hostile one must get a 4xx, none lost; it prints the
valid requests' p95 against the clean run's.

    python benchmarks/bench_serve_load.py [--n 1000] [--concurrency 64] [--mode speceyes]
        [--tau 0.5] [--batch-size 32] [--max-wait-ms 10] [--max-queue 256]
        [--schedules pipelined] [--adversarial 0.1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np  # noqa: E402
from PIL import Image, ImageDraw  # noqa: E402

ROUTES = {"small", "agent_after_judge", "agent_after_gate", "agent_only", "small_only"}
API_KEY = "bench-key"


def scene(i: int) -> Image.Image:
    img = Image.new("RGB", (96 + 8 * (i % 5), 72), (240, 240, 235))
    color = [(220, 30, 30), (30, 160, 60), (40, 70, 220)][i % 3]
    ImageDraw.Draw(img).rectangle((4 + 3 * i, 6, 40 + 3 * i, 50), fill=color)
    return img


def build(args: argparse.Namespace, root: Path):
    from speceyes.agents.zoom import ZoomAgent
    from speceyes.backends.hf import HFBackend
    from speceyes.funnel import Funnel, FunnelConfig
    from speceyes.tiny import build_tiny_model

    small = HFBackend(build_tiny_model(root / "small", "qwen3_vl", seed=1, lm_head_scale=8.0))
    large = HFBackend(build_tiny_model(root / "large", "qwen2_5_vl", seed=2, lm_head_scale=20.0))
    agent = ZoomAgent(large, max_new_tokens=args.agent_max_tokens)

    def funnel(schedule: str):
        cfg = FunnelConfig(
            mode=args.mode, tau=args.tau, batch_size=args.batch_size, schedule=schedule
        )
        return Funnel(small, large, agent, cfg)

    return funnel


def hostile_requests(image_uri: str) -> list[tuple[str, bytes, dict[str, str]]]:
    """(name, body, headers) of the attacks the server must answer with a 4xx: the tests' set
    (tests/tools/hostile.py) with the right key, and a valid request with a wrong one."""
    from tests.tools.hostile import hostile_requests as attacks
    from tests.tools.hostile import image_part, text_part, user_request

    key = {"Authorization": f"Bearer {API_KEY}"}
    valid = json.dumps(user_request(image_part(image_uri), text_part("What color?"))).encode()
    wrong_key = ("wrong API key", valid, {"Authorization": "Bearer wrong"})
    return [(a.name, a.body, key) for a in attacks(image_uri)] + [wrong_key]


async def load(
    args: argparse.Namespace, url: str, reqs: list[dict], truth: list[str], adversarial: float
) -> dict:
    import aiohttp
    import openai

    client = openai.AsyncOpenAI(
        base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=args.client_timeout
    )
    raw = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.client_timeout))
    sem = asyncio.Semaphore(args.concurrency)
    lat: list[float] = []
    accepted_lat: list[float] = []
    out: Counter[str] = Counter()
    routes: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    hostile_status: Counter[str] = Counter()
    rng = random.Random(0)
    attacks = hostile_requests(reqs[0]["messages"][0]["content"][0]["image_url"]["url"])
    # Which requests are hostile: a fixed share, spread at random over the run.
    n_hostile = round(adversarial * args.n)
    hostile = set(random.Random(1).sample(range(args.n), n_hostile))

    def well_formed(r: Any) -> bool:
        extra = (r.model_extra or {}).get("speceyes")
        return (
            r.object == "chat.completion"
            and len(r.choices) == 1
            and isinstance(r.choices[0].message.content, str)
            and r.choices[0].finish_reason == "stop"
            and isinstance(extra, dict)
            and extra.get("route") in ROUTES
            and isinstance(extra.get("timings"), dict)
        )

    async def backoff(attempt: int) -> None:
        # Exponential backoff with jitter: retries must not arrive in lockstep.
        await asyncio.sleep(min(2.0, 0.05 * 2**attempt) * (0.5 + rng.random()))

    async def attack(i: int) -> None:
        name, data, headers = attacks[i % len(attacks)]
        async with sem:
            for attempt in range(args.max_attempts):
                try:
                    async with raw.post(
                        url + "/v1/chat/completions",
                        data=data,
                        headers={**headers, "Content-Type": "application/json"},
                    ) as resp:
                        status = resp.status
                        await resp.read()
                except Exception as e:
                    out["hostile_failed"] += 1
                    errors[f"hostile {name}: {type(e).__name__}"] += 1
                    return
                if status == 429:
                    out["429"] += 1
                    await backoff(attempt)
                    continue
                hostile_status[f"{name}: {status}"] += 1
                out["hostile_4xx" if 400 <= status < 500 else "hostile_not_4xx"] += 1
                return
            out["gave_up_after_429"] += 1

    async def one(i: int) -> None:
        if i in hostile:
            await attack(i)
            return
        k = i % len(reqs)
        async with sem:
            t0 = time.perf_counter()
            for attempt in range(args.max_attempts):
                try:
                    r = await client.chat.completions.create(model="speceyes", **reqs[k])
                except openai.RateLimitError:
                    out["429"] += 1
                    await backoff(attempt)
                    continue
                except Exception as e:  # any other status or transport error is a failure
                    out["failed"] += 1
                    errors[type(e).__name__] += 1
                    return
                if not well_formed(r):
                    out["malformed"] += 1
                elif r.choices[0].message.content != truth[k]:
                    out["mismatched"] += 1
                else:
                    out["ok"] += 1
                    lat.append(time.perf_counter() - t0)
                    route = r.model_extra["speceyes"]["route"]
                    routes[route] += 1
                    if route == "small":
                        accepted_lat.append(lat[-1])
                return
            out["gave_up_after_429"] += 1

    t0 = time.perf_counter()
    await asyncio.gather(*[one(i) for i in range(args.n)])
    wall = time.perf_counter() - t0
    await client.close()
    await raw.close()
    answered = sum(
        out[k]
        for k in ("ok", "failed", "malformed", "mismatched", "hostile_4xx", "hostile_not_4xx")
    )
    out["lost"] = args.n - answered - out["gave_up_after_429"] - out["hostile_failed"]
    return {
        "wall": wall,
        "lat": lat,
        "accepted_lat": accepted_lat,
        "out": out,
        "routes": routes,
        "errors": errors,
        "hostile_status": hostile_status,
        "valid": args.n - n_hostile,
    }


def metric_sum(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def report(label: str, res: dict, metrics: str) -> int:
    """Print one run; returns the number of requests that did not end as they must."""
    out, lat = res["out"], np.array(res["lat"])
    batches = metric_sum(metrics, "speceyes_batch_size_count")
    mean_batch = metric_sum(metrics, "speceyes_batch_size_sum") / max(1.0, batches)
    print(f"--- {label}")
    print(
        f"results: ok={out['ok']} of {res['valid']} valid, lost={out['lost']} "
        f"failed={out['failed']} malformed={out['malformed']} mismatched={out['mismatched']} "
        f"429s_retried={out['429']} gave_up={out['gave_up_after_429']}"
    )
    if res["hostile_status"]:
        print(
            f"hostile: {out['hostile_4xx']} got a 4xx, {out['hostile_not_4xx']} did not, "
            f"{out['hostile_failed']} transport errors; {dict(sorted(res['hostile_status'].items()))}"
        )
    if res["errors"]:
        print(f"errors: {dict(res['errors'])}")
    print(f"routes: {dict(res['routes'])}")
    if len(lat):
        p50, p95, p99 = np.percentile(lat, [50, 95, 99])
        print(
            f"latency (client, incl. queueing and retries): p50 {p50:.3f} s  p95 {p95:.3f} s  "
            f"p99 {p99:.3f} s  max {lat.max():.3f} s"
        )
    if res["accepted_lat"]:
        print(f"gate-accepted answers: p50 {np.percentile(res['accepted_lat'], 50):.3f} s")
    print(
        f"throughput: {out['ok'] / res['wall']:.2f} req/s  ({out['ok']} answers in "
        f"{res['wall']:.1f} s); {int(batches)} funnel batches, mean size {mean_batch:.1f}"
    )
    return res["valid"] - out["ok"] + out["lost"] + out["hostile_not_4xx"] + out["hostile_failed"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1000, help="requests")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--mode", default="speceyes", choices=["speceyes", "agent", "small", "both"])
    ap.add_argument("--tau", type=float, default=0.5)
    ap.add_argument("--batch-size", type=int, default=32, help="funnel and micro-batch size")
    ap.add_argument("--max-wait-ms", type=float, default=10.0)
    ap.add_argument("--max-queue", type=int, default=256)
    ap.add_argument("--agent-max-tokens", type=int, default=16)
    ap.add_argument("--scenes", type=int, default=16, help="distinct (image, question) pairs")
    ap.add_argument("--max-attempts", type=int, default=50, help="tries per request on 429")
    ap.add_argument("--client-timeout", type=float, default=600.0)
    ap.add_argument(
        "--schedules", default="pipelined", help="comma-separated: batched, pipelined (in order)"
    )
    ap.add_argument(
        "--adversarial",
        type=float,
        default=0.0,
        help="share of hostile requests in an extra run of the last schedule (e.g. 0.1)",
    )
    args = ap.parse_args()
    schedules = [x.strip() for x in args.schedules.split(",") if x.strip()]
    if not schedules or any(x not in ("batched", "pipelined") for x in schedules):
        ap.error("--schedules takes batched and/or pipelined")
    if not 0.0 <= args.adversarial < 1.0:
        ap.error("--adversarial must be in [0, 1)")

    import torch

    from speceyes.images import to_data_uri
    from speceyes.serve import create_app
    from speceyes.types import Query

    # The test tools' server thread: run from a checkout (repo root on the path).
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.tools.server_thread import ServerThread

    print(
        f"config: n={args.n} concurrency={args.concurrency} mode={args.mode} tau={args.tau} "
        f"batch_size={args.batch_size} max_wait_ms={args.max_wait_ms} max_queue={args.max_queue} "
        f"agent_max_tokens={args.agent_max_tokens} scenes={args.scenes} "
        f"schedules={schedules} adversarial={args.adversarial} "
        f"cpus={os.cpu_count()} torch_threads={torch.get_num_threads()}"
    )
    runs = [(x, 0.0) for x in schedules]
    if args.adversarial:
        runs.append((schedules[-1], args.adversarial))
    bad = 0
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        make_funnel = build(args, Path(tmp))
        print(f"built and loaded the tiny models in {time.perf_counter() - t0:.1f} s")
        reqs, queries = [], []
        for k in range(args.scenes):
            uri = to_data_uri(scene(k))
            text = f"What color is the box number {k}?"
            opts = ["red", "green", "blue"] if k % 2 else None
            msgs = [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": uri}},
                        {"type": "text", "text": text},
                    ],
                }
            ]
            reqs.append({"messages": msgs, **({"extra_body": {"options": opts}} if opts else {})})
            queries.append(Query(id=str(k), image=uri, question=text, options=opts))
        t0 = time.perf_counter()
        truth = [r.answer for r in make_funnel("batched").run_batch(queries)]
        dt = time.perf_counter() - t0
        print(f"ground truth for {args.scenes} scenes via Funnel.run_batch: {dt:.1f} s")

        for schedule, adversarial in runs:
            app = create_app(
                make_funnel(schedule),
                batch_size=args.batch_size,
                max_wait_ms=args.max_wait_ms,
                max_queue=args.max_queue,
                api_key=API_KEY,
            )
            with ServerThread(app) as srv:
                res = asyncio.run(load(args, srv.url, reqs, truth, adversarial))
                import urllib.request

                req = urllib.request.Request(
                    srv.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}
                )
                metrics = urllib.request.urlopen(req, timeout=30).read().decode()
            label = f"{schedule} schedule" + (
                f", {adversarial:.0%} hostile requests" if adversarial else ", clean"
            )
            bad += report(label, res, metrics)
            results.append((label, res))

    print("--- summary")
    for label, res in results:
        lat, acc = np.array(res["lat"]), res["accepted_lat"]
        p95 = f"{np.percentile(lat, 95):.3f} s" if len(lat) else "-"
        p50a = f"{np.percentile(acc, 50):.3f} s" if acc else "-"
        print(f"{label}: valid p95 {p95}, gate-accepted p50 {p50a}")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS: {rss:.0f} MiB")
    print("PASS" if bad == 0 else f"FAIL: {bad} requests did not end as they must")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
