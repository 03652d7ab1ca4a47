"""Measure the vLLM CPU engine's constants for the simulator: a costs file for ``--costs``.

Starts the two vLLM OpenAI servers of ``benchmarks/bench_load_vllm.py`` (the bundled mini-world
models, the settings of ``tests/vllm_support.py``) and times direct OpenAI-API requests against
each, one server at a time, with the same client library the funnel uses (``openai``'s
AsyncOpenAI), images sent at the checkpoints' 224x224 view as PNG data URIs:

- token counts: one request of every kind the load benchmark sends (the judge, the prefix
  judge, the small model's answer, the search agent's cell score and its answer), each twice
  with the same image: the usage's prompt and cached tokens give the image tokens, the text
  tokens and what a repeated prompt still prefills;
- the fixed cost per request: n concurrent cell-score requests (1 token, 64 top logprobs),
  n = 1..32, repeated (warm: the prefix and multimodal caches hold them, as in the benchmark,
  where a few questions repeat after a warm-up) and new (cold: every crop unseen). The wall time
  is fitted as ``a + b n``: ``b`` is the work that does not batch (per request), ``a - t(1)``
  what runs beside it;
- the decode step against batch size: n concurrent requests decoding 2 and 34 tokens
  (``ignore_eos``); the difference over 32 tokens is one step at batch n;
- prefill per text token: one request at a time with 16 to 2048 new tokens (a fresh prefix, so
  the prefix cache cannot serve it); per image token: cold image requests against text ones;
- the client's CPU to cut and encode one round's 9 crops (the search agent's tool time);
- the serving app's time per query outside the funnel (``app_intake_s``): the benchmark's app
  (``speceyes serve``'s, in a process of its own, judge ``none``) answers its requests from one
  client; each answer's ``intake`` (body read, image decoded) plus its time outside the app
  (the client's send and the reply), averaged.

Writes OUT/costs.json (CostModel fields, for ``speceyes simulate --costs`` and
``benchmarks/sim_vs_real.py``) and OUT/measurements.json (every raw timing), and prints the
measured table. The servers are always stopped (their process groups), also on Ctrl-C, SIGTERM
or SIGHUP. About 5-7 minutes on 2 CPU cores, start-up included.

    python benchmarks/measure_vllm_costs.py [--out runs/vllm-costs] [--reps 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "benchmarks"):  # tests/ and bench_load_vllm hold the server helpers
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from tests.vllm_support import (  # noqa: E402
    EXECUTORS,
    NON_SPINNING_EXECUTOR,
    PLACEMENTS,
    SPLIT_PLACEMENT,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

TOP_LOGPROBS = 64  # what every funnel request asks for (the servers' --max-logprobs)
CONCURRENCY = (1, 2, 4, 8, 16, 32)
DECODE_BATCH = (1, 4, 16, 64)
DECODE_TOKENS = (2, 34)
PREFILL_WORDS = (8, 128, 512, 1024)  # words of fresh text; the token counts come from usage
SCORER = "Is there a red circle in the image?"  # a cell-score question (search.score_question)


# --- requests ------------------------------------------------------------------------------


def openai_messages(messages: list[dict], uri_of: Any) -> list[dict]:
    """speceyes messages (PIL image parts) -> OpenAI parts with the images as data URIs."""
    from speceyes.backends.base import map_images

    return map_images(messages, lambda src: {"type": "image_url", "image_url": {"url": uri_of(src)}})


class Client:
    """One server's AsyncOpenAI client and the bodies of each request kind."""

    def __init__(self, url: str, model: str) -> None:
        import openai

        self.model = model
        self.client = openai.AsyncOpenAI(
            base_url=url, api_key="none", max_retries=0, timeout=600.0,
            http_client=openai.DefaultAsyncHttpxClient(trust_env=False),
        )  # fmt: skip

    def body(self, messages: list[dict], max_tokens: int = 1, logprobs: bool = True,
             ignore_eos: bool = False) -> dict[str, Any]:
        b: dict[str, Any] = {
            "model": self.model, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0.0,
        }  # fmt: skip
        if logprobs:
            b.update(logprobs=True, top_logprobs=TOP_LOGPROBS)
        if ignore_eos:
            b["extra_body"] = {"ignore_eos": True}
        return b

    async def one(self, body: dict[str, Any]) -> Any:
        return await self.client.chat.completions.create(**body)

    async def batch(self, bodies: list[dict[str, Any]]) -> tuple[float, list[Any]]:
        """All of ``bodies`` in flight at once; the wall time until the last is answered."""
        t0 = time.perf_counter()
        out = await asyncio.gather(*(self.one(b) for b in bodies))
        return time.perf_counter() - t0, list(out)


def usage_of(resp: Any) -> tuple[int, int]:
    """(prompt tokens, of them served by the prefix cache)."""
    u = resp.usage
    details = getattr(u, "prompt_tokens_details", None)
    return int(u.prompt_tokens), int(getattr(details, "cached_tokens", 0) or 0)


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares ``y = a + b x``."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return my - b * mx, b


class Images:
    """Views and crops of mini-world scenes at the checkpoints' view (as the clients send)."""

    def __init__(self, paths: list[str], seed: int = 0) -> None:
        from speceyes.backends.base import checkpoint_geometry
        from speceyes.images import load_image
        from speceyes.miniworld.demo import MODELS_DIR

        g = checkpoint_geometry("qwen2_5_vl", MODELS_DIR / "large")
        self.factor, self.lo, self.hi = 28, g.min_pixels, g.max_pixels
        self.scenes = [load_image(p) for p in paths]
        self.rng = random.Random(seed)

    def view(self, img: Any) -> Any:
        from speceyes.images import resize_for_model

        return resize_for_model(img, self.factor, self.lo, self.hi)[0]

    def crop(self) -> Any:
        """A new square crop of a scene (side 74-427 px, as the search's depths cut), shown
        with the full view's pixels (the manifest's fill_view)."""
        img = self.rng.choice(self.scenes)
        side = self.rng.choice((74, 178, 427)) + self.rng.randrange(0, 8)
        x, y = self.rng.randrange(0, img.width - side), self.rng.randrange(0, img.height - side)
        return self.view(img.crop((x, y, x + side, y + side)).resize((224, 224)))


def uri(img: Any) -> str:
    from speceyes.images import to_data_uri

    return to_data_uri(img, "PNG")


# --- measurements --------------------------------------------------------------------------


async def token_counts(
    cl: Client, primer: dict[str, list[dict]], kinds: dict[str, list[dict]]
) -> dict[str, dict[str, float]]:
    """Per kind: its prompt tokens, what a first send with an unseen image prefills (after
    ``primer``, the same kind on another image, has cached the shared text), what a repeat of
    it still prefills, and the repeat's latency alone (warm, median of 3)."""
    out = {}
    for name, msgs in kinds.items():
        await cl.one(cl.body(primer[name]))
        first = usage_of(await cl.one(cl.body(msgs)))
        again = usage_of(await cl.one(cl.body(msgs)))
        walls = [(await cl.batch([cl.body(msgs)]))[0] for _ in range(3)]
        out[name] = {"prompt": first[0], "cached_first": first[1],
                     "uncached_repeat": again[0] - again[1],
                     "warm_latency_s": statistics.median(walls)}
    return out


async def fixed_cost(
    cl: Client, make: Any, reps: int, warm: bool
) -> dict[str, Any]:
    """Wall time of n concurrent requests from ``make()`` (each new, or one repeated)."""
    times: dict[int, list[float]] = {}
    cpu, sent = 0.0, 0  # this client's own CPU per request (the openai library, JSON)
    for n in CONCURRENCY:
        times[n] = []
        for _ in range(reps + (4 if n == 1 else 0)):
            if warm:
                msgs = make()
                await cl.one(cl.body(msgs))  # cache it, untimed
                bodies = [cl.body(msgs)] * n
            else:
                bodies = [cl.body(make()) for _ in range(n)]
            c0 = time.process_time()
            wall, _ = await cl.batch(bodies)
            cpu += time.process_time() - c0
            sent += n
            times[n].append(wall)
    med = {n: statistics.median(v) for n, v in times.items()}
    a, b = fit_line([float(n) for n in med], list(med.values()))
    return {"median_s": med, "a": a, "b": b, "raw": times, "client_cpu_s": cpu / sent}


async def decode_steps(cl: Client, reps: int) -> dict[int, float]:
    """Seconds of one decode step at batch n (34 - 2 tokens, ignore_eos)."""
    out = {}
    for n in DECODE_BATCH:
        walls = {}
        for k in DECODE_TOKENS:
            got = []
            for r in range(max(1, reps - 1)):
                msgs = [{"role": "user", "content": f"{r} {n} {k} hello"}]
                bodies = [cl.body(msgs, max_tokens=k, ignore_eos=True)] * n
                await cl.one(bodies[0])  # cached: the sweep times decode, not prefill
                got.append((await cl.batch(bodies))[0])
            walls[k] = statistics.median(got)
        out[n] = (walls[DECODE_TOKENS[1]] - walls[DECODE_TOKENS[0]]) / (
            DECODE_TOKENS[1] - DECODE_TOKENS[0]
        )
    return out


async def prefill_sweep(cl: Client, reps: int) -> list[tuple[int, float]]:
    """(new prompt tokens, seconds) at batch 1, 1 decoded token, fresh text every time."""
    rng = random.Random(1)
    words = ["red", "blue", "circle", "square", "left", "right", "image", "shape", "small"]
    pts = []
    for w in PREFILL_WORDS:
        for _ in range(reps):
            text = f"{rng.random()} " + " ".join(rng.choice(words) for _ in range(w))
            body = cl.body([{"role": "user", "content": text}])
            t0 = time.perf_counter()
            resp = await cl.one(body)
            dt = time.perf_counter() - t0
            prompt, cached = usage_of(resp)
            pts.append((prompt - cached, dt))
    return pts


def view_cpu_s(images: Images, n: int = 10) -> float:
    """The client's seconds to resize a scene to the view and PNG-encode it: what the funnel
    pays per backend for each query whose whole image it sends (judge, small answer)."""
    t0 = time.perf_counter()
    for i in range(n):
        uri(images.view(images.scenes[i % len(images.scenes)].copy()))
    return (time.perf_counter() - t0) / n


def crop_cpu_s(images: Images, n: int = 27) -> float:
    """The client's seconds to cut and PNG-encode one search round's 9 crops."""
    t0 = time.perf_counter()
    for _ in range(n):
        uri(images.crop())
    return (time.perf_counter() - t0) / n * 9


def app_intake_s(small_url: str, large_url: str, queries: list[Any], work: Path,
                 n: int = 48) -> dict[str, float]:
    """The benchmark's app (judge ``none``, its own process) in front of the servers, one
    client sending its requests one after another (after one untimed pass): the mean intake,
    the mean time outside the app, and their sum (``app_intake_s``)."""
    import bench_load_vllm as blv

    (mode,) = [m for m in blv.modes_of(["none"]) if m.judge == "none"]
    bodies = blv.request_bodies(queries)
    url_file = work / "app.url"
    app = blv.AppProcess(blv.app_spec(mode, small_url, large_url, None, None, url_file),
                         url_file, work / "app.log")
    try:
        url = app.wait_ready(blv.APP_START_S)
        asyncio.run(blv.closed_loop(url, bodies, queries, 0, len(queries), 1, 0))
        run = asyncio.run(blv.closed_loop(url, bodies, queries, 0, n, 1, 0))
    finally:
        app.stop()
    got = [x for x in run.samples if "intake" in x.timings and "total" in x.timings]
    if not got:
        raise RuntimeError(f"the app answered no request with its timings; see {work}/app.log")
    intake = statistics.fmean(x.timings["intake"] for x in got)
    outside = statistics.fmean(x.latency_s - x.timings["total"] for x in got)
    return {"intake_s": intake, "outside_s": outside, "app_intake_s": intake + outside}


async def measure_server(url: str, model: str, images: Images, queries: list[Any], role: str,
                         reps: int) -> dict[str, Any]:
    cl = Client(url, model)
    primer, kinds = request_kinds(images, queries, role, 0), request_kinds(images, queries, role, 1)
    for _ in range(3):  # first calls: the server's lazy set-up is not a cost per request
        await cl.one(cl.body(primer["text"]))
    res: dict[str, Any] = {"tokens": await token_counts(cl, primer, kinds)}

    def cell() -> list[dict]:
        from speceyes import prompts

        return openai_messages(prompts.small_messages(images.crop(), SCORER), uri)

    def text() -> list[dict]:
        return [{"role": "user", "content": f"{random.random()} hi"}]

    res["warm"] = await fixed_cost(cl, cell, reps, warm=True)
    res["cold"] = await fixed_cost(cl, cell, reps, warm=False)
    res["text"] = await fixed_cost(cl, text, reps, warm=False)
    res["decode"] = await decode_steps(cl, reps)
    res["prefill"] = await prefill_sweep(cl, reps)
    await cl.client.close()
    return res


# --- the costs file ------------------------------------------------------------------------


def derive(
    large: dict[str, Any], small: dict[str, Any], crop_s: float, view_s: float,
    placement: str = "shared", app_s: float = 0.0,
) -> dict[str, Any]:
    """CostModel fields from both servers' measurements (see the module docstring);
    ``placement``: the servers' cores (``split``: a device per model); ``app_s``: the serving
    app's time per query outside the funnel (:func:`app_intake_s`)."""
    from speceyes.miniworld.demo import MODELS_DIR

    out: dict[str, Any] = {}
    for role, m in (("large", large), ("small", small)):
        dec = {int(k): v for k, v in m["decode"].items()}
        t1 = max(dec[1], 1e-5)
        pre_x = [float(x) for x, _ in m["prefill"]]
        pre_a, per_token = fit_line(pre_x, [y for _, y in m["prefill"]])
        per_token = max(per_token, 0.0)
        img_tokens = m["tokens"]["image"]["prompt"] - m["tokens"]["text"]["prompt"]
        tok = m["tokens"]
        own = "cell" if role == "large" else "small"  # the server's typical request
        cell_new = tok[own]["prompt"] - tok[own]["cached_first"]
        text_new = tok["text"]["prompt"] - tok["text"]["cached_first"]
        # the serial part of a cold image beyond its tokens' prefill: the vision encoder and
        # the multimodal processor, per image token
        vit = (m["cold"]["b"] - m["text"]["b"] - per_token * (cell_new - text_new)) / img_tokens
        tail = tok[own]["uncached_repeat"]
        curve = [[b, dec[b] / t1] for b in sorted(dec)]
        # what one more sequence adds to a decode step, over the warm sweep's batch sizes
        top = max(CONCURRENCY)
        grow = (_interp(dec, top) - t1) / (top - 1)
        # warm requests (the benchmark's): what does not batch, less the tail's prefill and
        # the step's growth for its one token, which the simulator's step charges already
        request_s = max(m["warm"]["b"] - per_token * tail - grow, 0.0)
        # plus the client's own CPU per request: on these cores it is serial work too
        request_s += m["warm"].get("client_cpu_s", 0.0)
        latency = max(m["warm"]["a"] - t1, 0.0)
        # never flat or falling: the simulator's curve must grow with the batch
        for i in range(1, len(curve)):
            curve[i][1] = max(curve[i][1], curve[i - 1][1] + 1e-3)
        cfg = json.loads((MODELS_DIR / role / "config.json").read_text())
        t = cfg.get("text_config", cfg)
        head = t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"]
        kv_bytes = t["num_hidden_layers"] * t["num_key_value_heads"] * head * 2 * 4  # float32
        out.update({
            f"{role}_decode_s": t1,
            f"{role}_batch_curve": curve,
            f"{role}_prefill_s_per_token": per_token,
            f"{role}_vit_s_per_token": max(vit, 0.0),
            f"{role}_kv_read_s_per_token": 0.0,  # inside the measured step (tiny contexts)
            f"{role}_request_s": request_s,
            f"{role}_request_latency_s": latency,
            f"{role}_kv_bytes_per_token": kv_bytes,
            f"{role}_kv_tokens": int(2**30 // kv_bytes),  # VLLM_CPU_KVCACHE_SPACE=1 GiB
        })  # fmt: skip
        out[f"_{role}_prefill_intercept_s"] = pre_a
    tl, ts = large["tokens"], small["tokens"]
    # a repeated prompt keeps its full blocks: the block size divides every cached length
    block = 0
    for k in [*tl.values(), *ts.values()]:
        block = math.gcd(block, int(k["prompt"] - k["uncached_repeat"]))
    img = tl["image"]["prompt"] - tl["text"]["prompt"]
    simg = ts["image"]["prompt"] - ts["text"]["prompt"]

    def new(kind: dict[str, int]) -> int:  # text a first send prefills (the system prompt hits)
        return kind["prompt"] - kind["cached_first"]

    out.update({
        # shared: both engines on the same cores; split: each on cores of its own
        "shared_gpu": placement == "shared",
        "prefix_caching": True,
        "warm_cache": True,  # the benchmark cycles through 16 questions after a warm-up
        "phase_overlap": False,  # the funnel's default: the judge, then the small answer
        # the serve app's pipelined funnel: front batches of the manifest's batch_size, its
        # max_wait_ms, and the funnel's max_agent_loops
        "funnel_pipeline": True, "front_batch": 16, "front_wait_s": 0.01, "max_agent_loops": 32,
        "cache_block_tokens": block if block >= 16 else 16,
        "image_tokens": img, "small_image_tokens": simg, "crop_tokens": img,
        "image_wh": [1024, 1024],
        "judge_text_tokens": max(new(tl["judge"]) - img, 0),
        "small_text_tokens": max(new(ts["small"]) - simg, 0),
        "agent_text_tokens": max(new(tl["deepeyes"]) - img, 0),
        "prefix_judge_tokens": max(tl["prefix"]["prompt"] - tl["deepeyes"]["prompt"], 0),
        "judge_decode_tokens": 1,
        "small_decode_tokens": 2,  # a one-token answer and its end-of-sequence token
        "agent_workload": "search",
        "search_depth": 3, "search_grid": 3,  # the manifest's search agent
        "search_cell_text_tokens": max(new(tl["cell"]) - img, 0),
        "search_cell_decode_tokens": 1,
        "search_answer_text_tokens": max(new(tl["answer"]) - img, 0),
        "search_answer_decode_tokens": 2,
        "tool_s": crop_s,
        "image_preprocess_s": view_s,  # the client's view of the whole image, per backend
        "app_intake_s": app_s,  # the benchmark's clients reach the funnel through an app
        "client_cpu_on_engine": True,  # the clients run on the servers' cores
        # unpinned, the client's threads take whichever server's core is idle
        "client_cpu_free_core": placement == SPLIT_PLACEMENT,
    })  # fmt: skip
    return out


def _interp(points: dict[int, float], x: float) -> float:
    xs = sorted(points)
    for lo, hi in zip(xs, xs[1:], strict=False):
        if lo <= x <= hi:
            return points[lo] + (points[hi] - points[lo]) * (x - lo) / (hi - lo)
    return points[xs[-1]]


def table(costs: dict[str, Any], large: dict[str, Any], small: dict[str, Any]) -> str:
    rows = ["| constant | large server | small server |", "|---|---|---|"]

    def both(name: str, key: str, fmt: str, scale: float = 1.0) -> None:
        a, b = costs[f"large_{key}"], costs[f"small_{key}"]
        rows.append(f"| {name} | {format(a * scale, fmt)} | {format(b * scale, fmt)} |")

    both("decode step at batch 1 (ms)", "decode_s", ".2f", 1e3)
    rows.append(
        "| decode step t(b)/t(1), b = " + ", ".join(str(int(b)) for b, _ in
                                                   costs["large_batch_curve"]) + " | "
        + ", ".join(f"{f:.2f}" for _, f in costs["large_batch_curve"]) + " | "
        + ", ".join(f"{f:.2f}" for _, f in costs["small_batch_curve"]) + " |"
    )
    both("prefill per text token (us)", "prefill_s_per_token", ".1f", 1e6)
    both("extra per image token, cold (us)", "vit_s_per_token", ".1f", 1e6)
    both("per request, serial (ms)", "request_s", ".2f", 1e3)
    both("per request, beside the engine (ms)", "request_latency_s", ".2f", 1e3)
    for name, key in (("warm", "warm"), ("cold", "cold"), ("text only", "text")):
        la, sm = large[key], small[key]
        rows.append(
            f"| n concurrent {name} requests: a + b n (ms) | {la['a'] * 1e3:.1f} + "
            f"{la['b'] * 1e3:.2f} n | {sm['a'] * 1e3:.1f} + {sm['b'] * 1e3:.2f} n |"
        )
    rows.append(f"| client CPU per warm request (ms) | {large['warm']['client_cpu_s'] * 1e3:.2f} "
                f"| {small['warm']['client_cpu_s'] * 1e3:.2f} |")
    rows.append(f"| the app's intake and reply per query (ms) | {costs['app_intake_s'] * 1e3:.1f} "
                "| same |")
    rows.append(f"| image tokens (224x224 view) | {costs['image_tokens']} | "
                f"{costs['small_image_tokens']} |")
    rows.append(f"| crop cutting per search round (ms) | {costs['tool_s'] * 1e3:.1f} | - |")
    rows.append(f"| whole image to its view, per backend (ms) | "
                f"{costs['image_preprocess_s'] * 1e3:.1f} | same |")
    rows.append(f"| prefix-cache block (tokens) | {costs['cache_block_tokens']} | same |")
    tok = ["judge", "prefix", "deepeyes", "cell", "answer", "small"]
    for k in tok:
        src = large if k != "small" else small
        t = src["tokens"][k]
        cells = (f"{t['prompt']} / {t['prompt'] - t['cached_first']} / {t['uncached_repeat']}"
                 f" / {t['warm_latency_s'] * 1e3:.1f} ms")
        rows.append(f"| {k}: prompt tokens / new (unseen image) / new on a repeat / repeat's "
                    f"latency alone | " + (f"{cells} | - |" if k != "small" else f"- | {cells} |"))
    return "\n".join(rows)


def request_kinds(
    images: Images, queries: list[Any], role: str, which: int
) -> dict[str, list[dict]]:
    """One request of each kind the load benchmark sends to this server, on a real
    multiple-choice question (``which``: the first of them on one scene, or on another)."""
    from speceyes import prompts
    from speceyes.funnel import PREFIX_JUDGE_TEXT
    from speceyes.images import load_image

    mc = [x for x in queries if x.options] or queries
    scenes = sorted({x.image for x in mc})
    q = next(x for x in mc if x.image == scenes[which % len(scenes)])
    view = images.view(load_image(q.image))
    crop = images.crop()
    judge_turn = {"role": "user", "content": [prompts.text_part(PREFIX_JUDGE_TEXT)]}
    kinds = {
        "text": [{"role": "user", "content": [prompts.text_part("hi")]}],
        "image": [{"role": "user", "content": [prompts.image_part(crop),
                                               prompts.text_part("hi")]}],
    }
    if role == "large":
        kinds.update({
            "judge": prompts.judge_messages(view, q.question, q.options),
            "deepeyes": prompts.deepeyes_messages(view, q.question, q.options),
            "prefix": [*prompts.deepeyes_messages(view, q.question, q.options), judge_turn],
            "cell": prompts.small_messages(crop, SCORER),
            "answer": prompts.small_messages(crop, q.question, q.options),
        })  # fmt: skip
    else:
        kinds["small"] = prompts.small_messages(view, q.question, q.options)
    return {k: openai_messages(v, uri) for k, v in kinds.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "vllm-costs")
    ap.add_argument("--reps", type=int, default=3, help="repetitions per timed point")
    ap.add_argument("--placement", choices=PLACEMENTS, default=SPLIT_PLACEMENT,
                    help="the servers' cores, as bench_load_vllm.py --placement places them")
    ap.add_argument("--executor", choices=EXECUTORS, default=NON_SPINNING_EXECUTOR,
                    help="the engines' executor, as bench_load_vllm.py --executor")
    ap.add_argument("--start-timeout", type=float, default=600.0, help="seconds per server")
    ap.add_argument("--vllm-python", type=Path, default=None,
                    help="the vLLM environment's python (default: .venv-vllm/bin/python)")
    ap.add_argument("--from", dest="source", type=Path, default=None,
                    help="derive the costs again from a measurements.json, no servers")
    args = ap.parse_args()
    if args.source is not None:
        saved = json.loads(args.source.read_text())
        for role in ("large", "small"):  # JSON made the batch sizes strings
            saved[role]["decode"] = {int(k): v for k, v in saved[role]["decode"].items()}
        args.out.mkdir(parents=True, exist_ok=True)
        if "view_s" not in saved:  # a client-side timing: no server needed to take it
            with tempfile.TemporaryDirectory() as tmp:
                blv = __import__("bench_load_vllm")
                queries = blv.question_set(Path(tmp) / "mw", 2, 0)
                saved["view_s"] = view_cpu_s(Images(sorted({q.image for q in queries})))
            args.source.write_text(json.dumps(saved, indent=2, default=str))
        if "app" not in saved:  # measurements from before the app's intake was timed
            print("note: no app intake in these measurements; app_intake_s is 0")
        # measurements from before --placement existed were taken on shared cores
        return write_costs(args.out, saved["large"], saved["small"], saved["crop_round_s"],
                           saved["view_s"], saved.get("placement", "shared"),
                           (saved.get("app") or {}).get("app_intake_s", 0.0))

    import bench_load_vllm as blv

    from speceyes.miniworld.demo import MODELS_DIR
    from tests import vllm_support

    if args.vllm_python is not None:
        vllm_support.VLLM_PYTHON = args.vllm_python
    if not vllm_support.VLLM_PYTHON.is_file():
        print(f"no vLLM environment at {vllm_support.VLLM_PYTHON}: {vllm_support.SETUP_HINT}")
        return 2
    blv._signals_as_interrupt()  # SIGTERM / SIGHUP end the run through the clean-up below
    args.out.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    servers: list[Any] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            queries = blv.question_set(Path(tmp) / "mw", 2, 0)
            images = Images(sorted({q.image for q in queries}))
            crop_s, view_s = crop_cpu_s(images), view_cpu_s(images)
            t0 = time.perf_counter()
            servers = blv.start_servers(args.out, args.start_timeout, args.placement,
                                        executor=args.executor)
            print(f"vLLM servers up in {time.perf_counter() - t0:.0f} s", flush=True)
            got = {}
            for role, srv in zip(("small", "large"), servers, strict=True):
                t1 = time.perf_counter()
                got[role] = asyncio.run(measure_server(
                    srv.url, str(MODELS_DIR / role), images, queries, role, args.reps))
                print(f"{role} server measured in {time.perf_counter() - t1:.0f} s", flush=True)
            t1 = time.perf_counter()
            app = app_intake_s(servers[0].url, servers[1].url, queries, args.out)
            print(f"the app's intake measured in {time.perf_counter() - t1:.0f} s", flush=True)
    finally:
        for s in servers:
            s.stop()
    meta = {"command": " ".join([Path(sys.executable).name, *sys.argv]),
            "total_s": round(time.perf_counter() - t_all, 1), "load_avg": os.getloadavg(),
            "cpus": os.cpu_count(), "placement": args.placement, "executor": args.executor}
    # the raw timings first: a costs file can always be derived again from them (--from)
    (args.out / "measurements.json").write_text(
        json.dumps({**meta, "crop_round_s": crop_s, "view_s": view_s, "app": app, **got},
                   indent=2, default=str))
    print(f"measured in {meta['total_s']:.0f} s; wrote {args.out}/measurements.json")
    return write_costs(args.out, got["large"], got["small"], crop_s, view_s, args.placement,
                       app["app_intake_s"])


def write_costs(
    out: Path, large: dict[str, Any], small: dict[str, Any], crop_s: float, view_s: float,
    placement: str = "shared", app_s: float = 0.0,
) -> int:
    costs = derive(large, small, crop_s, view_s, placement, app_s)
    md = table(costs, large, small)
    print(md)
    fields = {k: v for k, v in costs.items() if not k.startswith("_")}
    (out / "costs.json").write_text(json.dumps(fields, indent=2))
    (out / "table.md").write_text(md + "\n")
    print(f"wrote {out}/costs.json, table.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
