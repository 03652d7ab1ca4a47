"""Held-out accuracy of a trained role: its exported folder loaded back through ``HFBackend``
(the path real checkpoints take), greedy answers on val scenes by target size and category."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from speceyes import prompts
from speceyes.miniworld.bundle import export
from speceyes.miniworld.tinymodel import load_backend, log_event
from speceyes.miniworld.traindata import make_questions

if TYPE_CHECKING:
    from speceyes.miniworld.trainconfig import TrainConfig


def _correct(pred: str, gold: str) -> bool:
    return pred.strip().strip(".").lower() == gold.lower()


def evaluate(
    folder: Path, role: str, scenes: int, seed: int = 0, batch: int = 16, level: int = 1
) -> dict:
    """Greedy accuracy through HFBackend.answer on held-out test-pool scenes: on the full view
    by target size and category, and on the zoom crops of the small-target questions."""
    from collections import Counter, defaultdict

    backend = load_backend(folder)
    rows = make_questions("val", seed, scenes, backend, crops=True, level=level)
    items = [("zoom" if r["category"] == "zoom" else "view", r, r["view"]) for r in rows]
    rows = [r for r in rows if r["category"] != "zoom"]
    items += [("crop", r, r["crop"]) for r in rows if r.get("crop") is not None]
    hits: dict[str, list[int]] = defaultdict(list)
    preds = Counter()
    for i in range(0, len(items), batch):
        chunk = items[i : i + batch]
        msgs = [prompts.small_messages(im, r["question"], r["options"]) for _, r, im in chunk]
        for (where, r, _), a in zip(chunk, backend.answer(msgs), strict=True):
            ok = int(_correct(a.text, r["answer_text"]))
            preds[a.text[:12]] += 1
            size = r["target_size"]
            for key in (f"{where}", f"{where}/{size}", f"{where}/{size}/{r['category']}"):
                hits[key].append(ok)
    # The prior: always answering each category's most common gold answer (on this set).
    prior: dict[str, list[int]] = defaultdict(list)
    by_cat: dict[str, Counter] = defaultdict(Counter)
    for r in rows:
        by_cat[r["category"]][r["answer_text"]] += 1
    for r in rows:
        ok = int(by_cat[r["category"]].most_common(1)[0][0] == r["answer_text"])
        for key in ("all", r["target_size"]):
            prior[key].append(ok)
    out = {
        k: {"acc": round(sum(v) / len(v), 4), "correct": sum(v), "n": len(v)}
        for k, v in sorted(hits.items())
    }
    out["prior"] = {k: round(sum(v) / len(v), 4) for k, v in prior.items()}
    out["predictions"] = dict(preds.most_common(8))
    return out


def stage_eval(cfg: TrainConfig, role_dir: Path) -> dict:
    dest = role_dir / "export"
    export(role_dir, cfg.from_stage, dest)
    t = time.time()
    res = evaluate(dest, cfg.role, cfg.val_scenes, seed=cfg.seed, level=cfg.level)
    rec = {
        "stage": "eval",
        "from": cfg.from_stage,
        "scenes": cfg.val_scenes,
        "seconds": round(time.time() - t, 1),
        **res,
    }
    log_event(role_dir, rec)
    return rec
