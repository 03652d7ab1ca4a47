"""GPU smoke check: the transformers backend on CUDA gives the CPU run's answers.

Runs the bundled mini-world models (``speceyes/miniworld/models``) through ``HFBackend`` on 40
mini-world questions (``benchmarks/gpu_smoke/questions.jsonl``, images beside it) and compares,
question by question, with the CPU run committed in ``benchmarks/gpu_smoke/reference.json``:
the large model's judge P(tool) (one step over the whole vocabulary), the small model's answer
and its gate confidence, the large model's answer to the same prompt, and a 10-token greedy
turn of the large model (the decode-mode judge; it goes through ``chat``).

    bash benchmarks/gpu_smoke.sh                     # CUDA: bfloat16 and float32, sdpa
    bash benchmarks/gpu_smoke.sh --device cpu        # the same path on CPU (float32)
    python benchmarks/gpu_smoke.py --device cpu --write-reference    # remake reference.json
    python benchmarks/gpu_smoke.py --make-questions  # remake the questions (needs easy-vqa)

It needs the checkout, torch, transformers, numpy and pillow, and nothing from a package index.
float32 must match the reference (texts equal, numbers within ``--tol``): a mismatch exits 1.
bfloat16 rounds differently from float32, so its agreement is reported, not required.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout, with no install

from speceyes import gate, prompts  # noqa: E402
from speceyes.backends.hf import HFBackend  # noqa: E402
from speceyes.images import load_image  # noqa: E402
from speceyes.judging import tool_probability  # noqa: E402

DATA = Path(__file__).resolve().parent / "gpu_smoke"
MODELS = ROOT / "speceyes" / "miniworld" / "models"
BATCH = 8
ANSWER_TOKENS = 20  # the funnel's speculative answer budget
TURN_TOKENS = 10  # the decode-mode judge's
# The demo's test split (level 1, seed 0): the first five questions of each of eight scenes.
SCENES, PER_SCENE = 8, 5


def make_questions(dest: Path = DATA) -> None:
    """Write the 40 questions and their images (the mini-world generator; needs easy-vqa)."""
    import shutil
    import tempfile

    from speceyes.miniworld.splits import make_split

    with tempfile.TemporaryDirectory() as tmp:
        make_split(tmp, "test", SCENES, seed=0, canvas=(1024, 1024), level=1)
        rows = [json.loads(x) for x in (Path(tmp) / "questions.jsonl").read_text().splitlines()]
        picked = [r for r in rows if int(r["id"].rsplit("-q", 1)[1]) < PER_SCENE]
        (dest / "images").mkdir(parents=True, exist_ok=True)
        for r in picked:
            shutil.copy(Path(tmp) / r["image"], dest / r["image"])
    keep = ("id", "image", "question", "options", "answer", "category", "target_size")
    lines = [json.dumps({k: r[k] for k in keep}) for r in picked]
    (dest / "questions.jsonl").write_text("\n".join(lines) + "\n")


def run(device: str, dtype: str) -> list[dict[str, Any]]:
    """Every question's outputs on ``device`` in ``dtype``."""
    rows = [json.loads(x) for x in (DATA / "questions.jsonl").read_text().splitlines() if x]
    device_map = None if device == "cpu" else device
    load = {"dtype": dtype, "device_map": device_map, "attn_implementation": "sdpa"}
    small = HFBackend(MODELS / "small", **load)
    large = HFBackend(MODELS / "large", **load)
    out = []
    for i in range(0, len(rows), BATCH):
        batch = rows[i : i + BATCH]
        images = [load_image(DATA / r["image"]) for r in batch]
        judge = [prompts.judge_messages(im, r["question"], r["options"]) for im, r in zip(images, batch, strict=True)]
        ask = [prompts.small_messages(im, r["question"], r["options"]) for im, r in zip(images, batch, strict=True)]
        p_tool = tool_probability(large, judge)
        answers = small.answer(ask, max_new_tokens=ANSWER_TOKENS, top_k=gate.DEFAULT_TOP_K)
        conf = gate.batch_confidence([a.topk for a in answers])
        large_answers = large.answer(ask, max_new_tokens=ANSWER_TOKENS, top_k=gate.DEFAULT_TOP_K)
        turns = large.chat(judge, max_new_tokens=TURN_TOKENS)
        for j, r in enumerate(batch):
            out.append(
                {
                    "id": r["id"],
                    "p_tool": float(p_tool[j]),
                    "small_answer": answers[j].text,
                    "confidence": None if conf[j] != conf[j] else float(conf[j]),
                    "large_answer": large_answers[j].text,
                    "judge_turn": turns[j].text,
                }
            )
    return out


def compare(got: list[dict], want: list[dict], tol: float) -> dict[str, Any]:
    """How many outputs equal the reference's (texts exactly, numbers within ``tol``)."""
    want_by_id = {w["id"]: w for w in want}
    texts = ("small_answer", "large_answer", "judge_turn")
    equal = dict.fromkeys(texts, 0)
    worst = {"p_tool": 0.0, "confidence": 0.0}
    for g in got:
        w = want_by_id[g["id"]]
        for k in texts:
            equal[k] += g[k] == w[k]
        for k in worst:
            if g[k] is not None and w[k] is not None:
                worst[k] = max(worst[k], abs(g[k] - w[k]))
            elif g[k] != w[k]:
                worst[k] = float("inf")
    n = len(got)
    same = len(want_by_id) == n and all(v == n for v in equal.values())
    return {"n": n, "equal": equal, "max_abs_diff": worst,
            "same": same and all(v <= tol for v in worst.values())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    p.add_argument("--dtypes", default=None,
                   help="comma-separated (default: bfloat16,float32 on CUDA, float32 on CPU)")
    p.add_argument("--tol", type=float, default=1e-3, help="for P(tool) and confidence")
    p.add_argument("--write-reference", action="store_true", help="write reference.json")
    p.add_argument("--make-questions", action="store_true", help="remake the question set")
    p.add_argument("--out", default=None, help="also write every output to this JSON file")
    args = p.parse_args(argv)
    if args.make_questions:
        make_questions()
        return 0
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device here; pass --device cpu", file=sys.stderr)
        return 2
    dtypes = (args.dtypes or ("float32" if args.device == "cpu" else "bfloat16,float32")).split(",")
    reference = DATA / "reference.json"
    if args.write_reference:
        outputs = run("cpu", "float32")
        meta = {"device": "cpu", "dtype": "float32", "torch": torch.__version__}
        reference.write_text(json.dumps({"meta": meta, "outputs": outputs}, indent=1) + "\n")
        print(f"wrote {reference} ({len(outputs)} questions)")
        return 0
    want = json.loads(reference.read_text())["outputs"]
    failed, report = False, {}
    for dtype in dtypes:
        t0 = time.perf_counter()
        got = run(args.device, dtype)
        c = compare(got, want, args.tol)
        report[dtype] = {**c, "seconds": round(time.perf_counter() - t0, 1), "outputs": got}
        eq, d = c["equal"], c["max_abs_diff"]
        print(
            f"{dtype} on {args.device}: answers equal the CPU run's: {'yes' if c['same'] else 'NO'}"
            f" (small {eq['small_answer']}/{c['n']}, large {eq['large_answer']}/{c['n']}, "
            f"judge turns {eq['judge_turn']}/{c['n']}; max |dP(tool)| {d['p_tool']:.2g}, "
            f"max |dconfidence| {d['confidence']:.2g}; {report[dtype]['seconds']} s)"
        )
        failed |= dtype == "float32" and not c["same"]
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
