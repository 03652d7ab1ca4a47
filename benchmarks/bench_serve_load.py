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
the last schedule again with 10% hostile requests mixed in: those of tests/tools/hostile.py
(lone surrogates, 11 options, a 20,000-character option, a 1 MB question, 4096 emoji (past the
token limit), chat-template control tokens, PNG headers of 9400x9400 and past PIL's bomb limit,
a 1x30000 image, deeply nested JSON, a million JSON values, a gzip bomb, a brotli body), and
the attacks an HTTP client library would not send: a wrong API key, non-UTF-8 bytes in the key,
a 30 MB body of ten million JSON values, a 1 GiB gzip bomb, a 32-bit float 6300x6300 TIFF (under
the pixel limit as width x height, over it as decoded bytes), clients that disconnect mid-body.
Beside them for the whole run, ``--slow-clients`` connections (default: more than
``--max-queue``) send their bodies one byte every 2 s, and a probe reads ``/health`` every
0.1 s. It checks: every valid request answered correctly (its p95 within 2x the clean run's),
every hostile one a JSON 4xx with the expected code (slow bodies: 408 after ``--body-timeout``),
no request lost, ``/health`` always under 1 s, the server's log free of warnings and
tracebacks, and the process's peak RSS (sampled every 0.2 s) within the server's memory
budgets above the clean run's.

    python benchmarks/bench_serve_load.py [--n 1000] [--concurrency 64] [--mode speceyes]
        [--tau 0.5] [--batch-size 32] [--max-wait-ms 10] [--max-queue 256]
        [--schedules pipelined] [--adversarial 0.1] [--slow-clients N] [--body-timeout 5]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import logging
import os
import random
import resource
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple

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


class Attack(NamedTuple):
    name: str
    body: bytes
    headers: dict[str, str]
    status: int  # what the server must answer, as JSON
    code: str
    raw: bytes | None = None  # sent as these bytes on a socket of its own (headers and body)


def _raw_post(headers: bytes, body: bytes) -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + headers
        + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )


def hostile_requests(image_uri: str) -> list[Attack]:
    """The attacks the server must answer with a JSON 4xx: the tests' set
    (tests/tools/hostile.py) with the right key, and the ones only a benchmark sends."""
    from tests.tools.hostile import gzip_bomb, image_part, text_part, user_request
    from tests.tools.hostile import hostile_requests as attacks

    key = {"Authorization": f"Bearer {API_KEY}"}
    valid = json.dumps(user_request(image_part(image_uri), text_part("What color?"))).encode()
    heavy = user_request(image_part(float_tiff(6300, 6300)), text_part("What?"))
    return [Attack(a.name, a.body, {**key, **a.headers}, a.status, a.code) for a in attacks(image_uri)] + [
        Attack("wrong API key", valid, {"Authorization": "Bearer wrong"}, 401, "invalid_api_key"),
        Attack("non-UTF-8 API key", valid, {}, 401, "invalid_api_key",
               _raw_post(b"Authorization: Bearer \xff\xfe" + API_KEY.encode() + b"\r\n", valid)),
        Attack("30 MB of values", b"[" + b"[]," * (10 << 20) + b"[]]", key, 413,
               "request_too_complex"),
        Attack("1 GiB gzip bomb", gzip_bomb(1024), {**key, "Content-Encoding": "gzip"}, 413,
               "request_too_large"),
        Attack("float 6300x6300", json.dumps(heavy).encode(), key, 413, "image_too_large"),
    ]  # fmt: skip


def float_tiff(width: int, height: int) -> str:
    """A 32-bit float TIFF, deflated: under the pixel limit as width x height, over it as the
    bytes its decoding holds."""
    buf = io.BytesIO()
    img = Image.fromarray(np.zeros((height, width), np.float32), "F")
    img.save(buf, "TIFF", compression="tiff_deflate")
    return "data:image/tiff;base64," + base64.b64encode(buf.getvalue()).decode()


DISCONNECT = "disconnect mid-body"  # an attack with no answer: the client is gone


async def _read_answer(reader: asyncio.StreamReader) -> tuple[int, str, bytes]:
    """Status, Content-Type and body of one HTTP/1.1 answer."""
    status = int((await reader.readline()).split()[1])
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode("latin-1").partition(":")
        headers[k.strip().lower()] = v.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return status, headers.get("content-type", ""), body


async def raw_exchange(port: int, data: bytes) -> tuple[int, str, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await _read_answer(reader)
    finally:
        writer.close()


async def disconnect_mid_body(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    auth = f"Authorization: Bearer {API_KEY}\r\n".encode()
    writer.write(_raw_post(auth, b" " * 100_000)[:-90_000])  # headers and 10 KB of 100 KB
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.close()


async def slow_client(port: int, stop: asyncio.Event, seen: Counter[str]) -> None:
    """Bodies sent one byte every 2 s, again and again until ``stop``: each must end in 408."""
    while not stop.is_set():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        auth = f"Authorization: Bearer {API_KEY}\r\n".encode()
        head = _raw_post(auth, b"{" + b" " * 199_999)
        writer.write(head[: len(head) - 199_999])  # the headers and "{"
        answer = asyncio.ensure_future(_read_answer(reader))
        try:
            while not stop.is_set():
                done, _ = await asyncio.wait([answer], timeout=2.0)
                if done:
                    status, ctype, body = answer.result()
                    code = json.loads(body)["error"]["code"] if "json" in ctype else ctype
                    seen[f"{status} {code}"] += 1
                    break
                writer.write(b" ")
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError) as e:
            seen[type(e).__name__] += 1
        finally:
            answer.cancel()
            writer.close()


class Watch:
    """What runs beside a load: /health probes, RSS samples, and the server's log records at
    warning level or above (or with a traceback)."""

    def __init__(self) -> None:
        self.health: list[float] = []
        self.health_failed = 0
        self.rss_peak = 0
        self.records: list[str] = []
        self._stop = threading.Event()
        handler = logging.Handler(logging.WARNING)
        handler.emit = lambda r: self.records.append(f"{r.name}: {r.getMessage()[:200]}")
        self._handler = handler

    def __enter__(self) -> Watch:
        for name in ("speceyes.serve", "aiohttp", "asyncio"):
            logging.getLogger(name).addHandler(self._handler)
        self._thread = threading.Thread(target=self._sample_rss, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        for name in ("speceyes.serve", "aiohttp", "asyncio"):
            logging.getLogger(name).removeHandler(self._handler)

    def _sample_rss(self) -> None:
        while not self._stop.wait(0.2):
            self.rss_peak = max(self.rss_peak, rss_bytes())

    async def probe(self, session: Any, url: str, stop: asyncio.Event) -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                async with session.get(url + "/health") as resp:
                    await resp.read()
                    ok = resp.status == 200
            except Exception:
                ok = False
            self.health.append(time.perf_counter() - t0)
            self.health_failed += not ok
            try:
                await asyncio.wait_for(stop.wait(), 0.1)
            except TimeoutError:
                pass


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def load(
    args: argparse.Namespace,
    url: str,
    reqs: list[dict],
    truth: list[str],
    adversarial: float,
    attacks: list[Attack],
    watch: Watch,
) -> dict:
    import aiohttp
    import openai

    port = int(url.rsplit(":", 1)[1])
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
    slow: Counter[str] = Counter()
    kinds = [*attacks, None]  # None: a client that disconnects mid-body
    # Which requests are hostile: a fixed share, spread at random over the run.
    n_hostile = round(adversarial * args.n)
    hostile = set(random.Random(1).sample(range(args.n), n_hostile))
    # The j-th hostile request is attack j (cycling): each kind is sent as evenly as it can be.
    kind_of = {i: kinds[j % len(kinds)] for j, i in enumerate(sorted(hostile))}
    if hostile and n_hostile < len(kinds):
        print(f"note: {n_hostile} hostile requests do not cover all {len(kinds)} attacks")

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
        a = kind_of[i]
        async with sem:
            if a is None:
                await disconnect_mid_body(port)
                out["disconnected"] += 1
                hostile_status[DISCONNECT] += 1
                return
            for attempt in range(args.max_attempts):
                try:
                    if a.raw is not None:
                        status, ctype, body = await raw_exchange(port, a.raw)
                    else:
                        async with raw.post(
                            url + "/v1/chat/completions",
                            data=a.body,
                            headers={**a.headers, "Content-Type": "application/json"},
                        ) as resp:
                            status, ctype = resp.status, resp.headers.get("Content-Type", "")
                            body = await resp.read()
                except Exception as e:
                    out["hostile_failed"] += 1
                    errors[f"hostile {a.name}: {type(e).__name__}"] += 1
                    return
                if status == 429:
                    out["429"] += 1
                    await backoff(attempt)
                    continue
                code = json.loads(body)["error"]["code"] if "json" in ctype else f"({ctype})"
                hostile_status[f"{a.name}: {status} {code}"] += 1
                expected = (status, code) == (a.status, a.code)
                out["hostile_4xx" if expected else "hostile_not_4xx"] += 1
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

    stop = asyncio.Event()
    beside = [asyncio.ensure_future(watch.probe(raw, url, stop))]
    if adversarial:
        beside += [
            asyncio.ensure_future(slow_client(port, stop, slow)) for _ in range(args.slow_clients)
        ]
    t0 = time.perf_counter()
    await asyncio.gather(*[one(i) for i in range(args.n)])
    wall = time.perf_counter() - t0
    stop.set()
    await asyncio.gather(*beside)
    await client.close()
    await raw.close()
    answered = sum(
        out[k]
        for k in (
            "ok", "failed", "malformed", "mismatched", "hostile_4xx", "hostile_not_4xx",
            "disconnected",
        )
    )  # fmt: skip
    out["lost"] = args.n - answered - out["gave_up_after_429"] - out["hostile_failed"]
    return {
        "slow": slow,
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


def report(label: str, res: dict, metrics: str, watch: Watch) -> int:
    """Print one run; returns the number of requests (and probes) that did not end as they
    must."""
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
            f"hostile: {out['hostile_4xx']} got the expected JSON 4xx, "
            f"{out['hostile_not_4xx']} did not, {out['hostile_failed']} transport errors, "
            f"{out['disconnected']} disconnected mid-body on purpose"
        )
        for name, count in sorted(res["hostile_status"].items()):
            print(f"  {count:4d} x {name}")
    slow_ok = res["slow"].get("408 body_timeout", 0)
    slow_bad = sum(res["slow"].values()) - slow_ok
    if res["slow"]:
        print(f"slow clients: {dict(res['slow'])}")
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
    health = np.array(watch.health)
    slow_health = int((health >= 1.0).sum())
    print(
        f"/health: {len(health)} probes, max {health.max():.3f} s, p99 "
        f"{np.percentile(health, 99):.3f} s, {slow_health} at 1 s or more, "
        f"{watch.health_failed} failed; peak RSS {watch.rss_peak / 2**20:.0f} MiB; "
        f"server log warnings/tracebacks: {len(watch.records)}"
    )
    for line in watch.records[:5]:
        print(f"  log: {line}")
    return (
        res["valid"] - out["ok"] + out["lost"] + out["hostile_not_4xx"] + out["hostile_failed"]
        + slow_bad + slow_health + watch.health_failed + len(watch.records)
    )  # fmt: skip


def check_adversarial(clean: tuple, hostile: tuple, state: Any) -> int:
    """Valid requests within 2x the clean p95, and RSS within the server's memory budgets above
    the clean run's peak; returns the number of checks that failed."""
    (_, res_c, watch_c), (_, res_h, watch_h) = clean, hostile
    p95_clean = float(np.percentile(res_c["lat"], 95))
    lat = np.array(res_h["lat"])
    over = int((lat > 2 * p95_clean).sum())
    p95 = float(np.percentile(lat, 95))
    # What the server may hold for requests beyond the clean run: the bodies being read and
    # parsed, and the decoded images of admitted requests (12 bytes a charged pixel at most).
    budget = state.body_budget.limit + 12 * state.max_pixels_in_flight
    grown = watch_h.rss_peak - watch_c.rss_peak
    print(
        f"valid requests under hostile load: p95 {p95:.3f} s against the clean p95 "
        f"{p95_clean:.3f} s ({p95 / p95_clean:.2f}x); {over} of {len(lat)} took more than 2x "
        f"the clean p95 (max {lat.max():.3f} s)"
    )
    print(
        f"peak RSS: clean {watch_c.rss_peak / 2**20:.0f} MiB, hostile "
        f"{watch_h.rss_peak / 2**20:.0f} MiB ({grown / 2**20:+.0f} MiB; the server's budgets "
        f"allow {budget / 2**20:.0f} MiB)"
    )
    return int(p95 > 2 * p95_clean) + int(grown > budget)


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
    ap.add_argument(
        "--slow-clients",
        type=int,
        default=None,
        help="connections sending bodies a byte every 2 s in the hostile run (default: "
        "max-queue + 8)",
    )
    ap.add_argument(
        "--body-timeout", type=float, default=5.0, help="the server's --body-timeout (408)"
    )
    args = ap.parse_args()
    if args.slow_clients is None:
        args.slow_clients = args.max_queue + 8
    schedules = [x.strip() for x in args.schedules.split(",") if x.strip()]
    if not schedules or any(x not in ("batched", "pipelined") for x in schedules):
        ap.error("--schedules takes batched and/or pipelined")
    if not 0.0 <= args.adversarial < 1.0:
        ap.error("--adversarial must be in [0, 1)")

    import torch

    from speceyes.images import to_data_uri
    from speceyes.serve import STATE_KEY, create_app
    from speceyes.types import Query

    # The test tools' server thread: run from a checkout (repo root on the path).
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.tools.server_thread import ServerThread

    print(
        f"config: n={args.n} concurrency={args.concurrency} mode={args.mode} tau={args.tau} "
        f"batch_size={args.batch_size} max_wait_ms={args.max_wait_ms} max_queue={args.max_queue} "
        f"agent_max_tokens={args.agent_max_tokens} scenes={args.scenes} "
        f"schedules={schedules} adversarial={args.adversarial} slow_clients={args.slow_clients} "
        f"body_timeout={args.body_timeout} "
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
        attacks = hostile_requests(reqs[0]["messages"][0]["content"][0]["image_url"]["url"])
        settings = None

        for schedule, adversarial in runs:
            app = create_app(
                make_funnel(schedule),
                batch_size=args.batch_size,
                max_wait_ms=args.max_wait_ms,
                max_queue=args.max_queue,
                api_key=API_KEY,
                body_timeout=args.body_timeout,
            )
            settings = app[STATE_KEY]
            with ServerThread(app) as srv, Watch() as watch:
                res = asyncio.run(load(args, srv.url, reqs, truth, adversarial, attacks, watch))
                import urllib.request

                req = urllib.request.Request(
                    srv.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}
                )
                metrics = urllib.request.urlopen(req, timeout=30).read().decode()
            label = f"{schedule} schedule" + (
                f", {adversarial:.0%} hostile requests" if adversarial else ", clean"
            )
            bad += report(label, res, metrics, watch)
            results.append((label, res, watch))

    print("--- summary")
    for label, res, watch in results:
        lat, acc = np.array(res["lat"]), res["accepted_lat"]
        p95 = f"{np.percentile(lat, 95):.3f} s" if len(lat) else "-"
        p50a = f"{np.percentile(acc, 50):.3f} s" if acc else "-"
        print(
            f"{label}: valid p95 {p95}, gate-accepted p50 {p50a}, /health max "
            f"{max(watch.health):.3f} s, peak RSS {watch.rss_peak / 2**20:.0f} MiB"
        )
    if args.adversarial:
        bad += check_adversarial(results[-2], results[-1], settings)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS: {rss:.0f} MiB")
    print("PASS" if bad == 0 else f"FAIL: {bad} requests did not end as they must")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
