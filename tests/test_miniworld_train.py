"""Smoke test of the mini-world training stages: a few steps each on a very small config.

Never the real training: it checks that every stage runs, its loss is finite, a checkpoint is
saved and resumed (the step count goes on), and the export loads through HFBackend.
"""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("easy_vqa")

from speceyes.miniworld import bundle as B  # noqa: E402
from speceyes.miniworld import tinymodel as M  # noqa: E402
from speceyes.miniworld import train as T  # noqa: E402
from speceyes.miniworld import traindata as D  # noqa: E402


def _log(role_dir):
    return [json.loads(line) for line in (role_dir / "log.jsonl").read_text().splitlines()]


def _run(out, *extra):
    common = [
        "--out",
        str(out),
        "--tiny",
        "--batch",
        "2",
        "--log-every",
        "1",
        "--eval-every",
        "1",
        "--seed",
        "0",
        "--threads",
        "1",
    ]
    assert T.main([*common, *extra]) == 0


def test_stages_run_save_and_resume(tmp_path):
    small = tmp_path / "small"
    a = ["--stage", "A", "--object-view", "64", "--val-n", "4", "--sprite-limit", "24"]
    _run(tmp_path, *a, "--max-steps", "2")
    assert M.load_ckpt(small / "stage_A" / "ckpt.pt")["step"] == 2
    _run(tmp_path, *a, "--max-steps", "3", "--resume")
    log = _log(small)
    steps = [r for r in log if r.get("stage") == "A" and "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in steps)
    assert any(r.get("event") == "resume" and r["step"] == 2 for r in log)
    assert 0.0 <= steps[-1]["val_shape"] <= 1.0

    _run(tmp_path, "--stage", "B", "--scenes", "1", "--max-steps", "2")
    log = _log(small)
    assert any(r.get("event") == "init_from" for r in log)  # B starts from A's weights
    b = [r for r in log if r.get("stage") == "B" and "loss" in r]
    assert len(b) == 2 and all(math.isfinite(r["loss"]) for r in b)
    assert M.load_ckpt(small / "stage_B" / "ckpt.pt")["step"] == 2

    # The export is a real checkpoint folder: HFBackend loads it and answers.
    dest = B.export(small, "B", tmp_path / "export")
    be = M.load_backend(dest)
    assert be.family == "qwen3_vl" and be.max_pixels == M.VIEW_PIXELS["small"]

    # The bundle: both roles in bfloat16 plus the demo's manifest, loadable by the demo.
    from speceyes.factory import Settings
    from speceyes.miniworld.demo import TestSplit, find_models

    settings = tmp_path / "settings.json"
    settings.write_text(json.dumps({"tau": 0.8, "agent": {"kind": "search", "depth": 2}}))
    rc = T.main(
        [
            *("--stage", "bundle", "--small-dir", str(small), "--large-dir", str(small)),
            *("--dest", str(tmp_path / "models"), "--settings", str(settings)),
        ]
    )
    assert rc == 0
    found = find_models(tmp_path / "models")
    cfg = json.loads((found["large"] / "config.json").read_text())
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"
    man = Settings.from_manifest(tmp_path / "models" / "manifest.json")
    canvas = TestSplit.from_settings(man).canvas
    assert man.funnel.tau == 0.8 and man.agent.options["depth"] == 2
    assert list(canvas) == list(D.CANVAS)
    assert man.extra["trained_steps"] == {"small": 2, "large": 2}
    # The bundled small model is the trained one in bfloat16 and answers through HFBackend.
    import torch

    from speceyes import prompts
    from tests.conftest import make_scene

    bundled = M.load_backend(found["small"])
    for (name, got), (_, want) in zip(
        bundled.model.state_dict().items(), be.model.state_dict().items(), strict=True
    ):
        assert torch.equal(got, want.to(torch.bfloat16).float()), name
    msgs = prompts.small_messages(make_scene(), "What color is the square?")
    (ans,) = bundled.answer([msgs], max_new_tokens=3, top_k=5)
    assert (
        ans.topk.shape == (len(ans.token_ids), 5) and torch.isfinite(torch.tensor(ans.topk)).all()
    )


def test_large_role_trains_judge_and_zoom_turns(tmp_path):
    _run(
        tmp_path,
        *("--role", "large", "--stage", "B", "--scenes", "2", "--max-steps", "1"),
        *("--deepeyes", "--boxes"),
    )
    log = _log(tmp_path / "large")
    data = next(r for r in log if r.get("event") == "data")
    rec = next(r for r in log if r.get("stage") == "B" and "loss" in r)
    assert math.isfinite(rec["loss"]) and math.isfinite(rec["aux"])
    # Per scene question: the small prompt on the view, the judge, a DeepEyes answer; zoom
    # crops add the small prompt on the crop and the tool call, and the answer moves after it.
    be = M.load_backend(tmp_path / "large" / "base")
    rows = D.make_questions("train", 0, 2, be, crops=True)
    scene_q = [r for r in rows if r["category"] != "zoom"]
    with_crop = [r for r in scene_q if r.get("crop") is not None]
    zoom = len(rows) - len(scene_q)
    assert with_crop and zoom
    assert data["examples"] == 3 * len(scene_q) + 2 * len(with_crop) + zoom
    judge = [
        e
        for r in scene_q
        for e in D.examples_for(r, "large", False)
        if "tools" in e[0][0]["content"] and "reliab" in e[0][0]["content"]
    ]
    assert [e[1] for e in judge] == [
        "yes" if r["target_size"] == "small" else "no" for r in scene_q
    ]


def test_answer_labels_cover_only_the_answer(tmp_path):
    base = M.build_base(tmp_path, "small", M.TINY, 0)
    be = M.load_backend(base)
    rows = D.make_questions("train", 0, 1, be, crops=False)
    pairs = [p for r in rows[:2] for p in D.examples_for(r, "small", False)]
    inputs = D.batch_inputs(be, pairs)
    for b, (_, ans, _) in enumerate(pairs):
        lab = [t for t in inputs["labels"][b].tolist() if t != -100]
        assert be.tokenizer.decode(lab) == ans + "<|im_end|>"
    # Answers are words (the option's text), never a letter; each one a single token.
    assert {p[1] for p in pairs} <= {*D.COLORS_AND_SHAPES, "left", "right", "yes", "no"}
    for word in (*D.COLORS_AND_SHAPES, "yes", "no", "left", "right"):
        assert len(be.tokenizer(word, add_special_tokens=False)["input_ids"]) == 1


def test_token_labels_mark_the_cells_under_each_object():
    import torch

    grid = torch.tensor([[1, 8, 8]])  # 4 x 4 merged tokens of 28 px
    # A red (0) circle (0) over cells (0..1, 0..1); a tiny blue (2) triangle (2) in cell (3, 3).
    lay = [(0, 0, 56, 56, 0, 0), (90, 90, 100, 100, 2, 2)]
    yc, ys = D.token_labels([lay], grid, 28)
    yc, ys = yc.view(4, 4), ys.view(4, 4)
    assert yc[:2, :2].eq(0).all() and ys[:2, :2].eq(0).all()
    assert yc[3, 3] == 2 and ys[3, 3] == 2  # half of a small object counts
    assert yc.eq(8).sum() == 16 - 5 and ys.eq(3).sum() == 16 - 5


def test_zoom_questions_answer_from_what_the_crop_shows(tmp_path):
    import random

    from speceyes.miniworld.scenes import generate_scene, load_pool, scene_rng

    be = M.load_backend(M.build_base(tmp_path, "small", M.TINY, 0))
    pool = load_pool("train")
    n = 0
    for i in range(4):
        scene = generate_scene(scene_rng("train", 0, i), pool, canvas=D.CANVAS, regime="small")
        for r in D.zoom_questions(scene, random.Random(i), be, n_crops=3):
            assert r["view"].size == (224, 224)
            shown = [
                o for o in r["objs"] if o[0] >= -1 and o[1] >= -1 and o[2] <= 225 and o[3] <= 225
            ]
            q, a = r["question"], r["answer_text"]
            if q.startswith("Is there a ") and a == "yes":
                words = q[len("Is there a ") : -len(" in the image?")].split()
                ok = [
                    o
                    for o in r["objs"]
                    if all(w in ("object", D.name_of(o)[0], D.name_of(o)[1]) for w in words)
                ]
                assert ok, q  # the object asked about is in the crop's layout
            if q.startswith("What shape is the "):
                color = q.split()[4]
                assert [D.name_of(o)[1] for o in shown if D.name_of(o)[0] == color] == [a]
            n += 1
    assert n > 20


def test_search_cell_questions_answer_what_each_cell_shows(tmp_path):
    import random

    from speceyes.agents.search import grid_boxes
    from speceyes.miniworld.scenes import generate_scene, load_pool, scene_rng

    be = M.load_backend(M.build_base(tmp_path, "small", M.TINY, 0))
    pool = load_pool("train")
    answers, near = [], 0
    for i in range(3):
        scene = generate_scene(scene_rng("train", 0, i), pool, canvas=D.CANVAS, regime="small")
        rows = D.search_cell_questions(scene, random.Random(i), be, cells=3, near_misses=2)
        level1 = [tuple(round(v) for v in c) for c in grid_boxes((0, 0, *D.CANVAS), 3, 0.25)]
        for r in rows:
            w, h = r["view"].size
            assert r["options"] is None
            words = r["question"][len("Is there a ") : -len(" in the image?")].split()
            named = [o for o in r["objs"] if all(x in ("object", *D.name_of(o)) for x in words)]
            # Crop pixels: shown means the centre is in the crop; touching means any overlap.
            centred = [
                o for o in named if 0 <= (o[0] + o[2]) / 2 < w and 0 <= (o[1] + o[3]) / 2 < h
            ]
            touching = [o for o in named if o[2] > 0 and o[0] < w and o[3] > 0 and o[1] < h]
            if r["answer_text"] == "yes":
                assert centred, r["question"]
            else:
                assert r["answer_text"] == "no" and not touching, r["question"]
                shown = [
                    D.name_of(o)
                    for o in r["objs"]
                    if 0 <= (o[0] + o[2]) / 2 < w and 0 <= (o[1] + o[3]) / 2 < h
                ]
                if len(words) == 2 and words[1] != "object":
                    near += any(c == words[0] or sh == words[1] for c, sh in shown)
            answers.append(r["answer_text"])
        # Both depths: depth-1 cells are grid cells of the canvas, depth-2 ones are smaller.
        zooms = sorted({r["zoom"] for r in rows})
        assert zooms[0] == round(D.CANVAS[0] / (level1[0][2] - level1[0][0]), 2)
        assert len(zooms) >= 2
    assert "yes" in answers and "no" in answers
    # Near misses (pairs one attribute away from an object the cell shows) come on top of the
    # plain questions: the same scenes and seeds without them give 6+ fewer.
    plain = 0
    for i in range(3):
        scene = generate_scene(scene_rng("train", 0, i), pool, canvas=D.CANVAS, regime="small")
        for r in D.search_cell_questions(scene, random.Random(i), be, cells=3):
            words = r["question"][len("Is there a ") : -len(" in the image?")].split()
            w, h = r["view"].size
            shown = [
                D.name_of(o)
                for o in r["objs"]
                if 0 <= (o[0] + o[2]) / 2 < w and 0 <= (o[1] + o[3]) / 2 < h
            ]
            if r["answer_text"] == "no" and len(words) == 2 and words[1] != "object":
                plain += any(c == words[0] or sh == words[1] for c, sh in shown)
    assert near >= plain + 6


def test_packed_conversations_label_every_answer(tmp_path):
    import random

    be = M.load_backend(M.build_base(tmp_path, "small", M.TINY, 0))
    rows = D.make_questions("train", 0, 1, be, crops=True)
    examples = [e for r in rows for e in D.examples_for(r, "small", False)]
    packed = D.pack_examples(examples, 4, random.Random(0))
    # Every question is kept exactly once, at most 4 per conversation, one image each.
    assert sum(1 + sum(m["role"] == "assistant" for m in p[0]) for p in packed) == len(examples)
    inputs = D.batch_inputs(be, packed)
    for b, p in enumerate(packed):
        answers = [m["content"] for m in p[0] if m["role"] == "assistant"] + [p[1]]
        assert len(answers) <= 4
        images = [c for m in p[0] if isinstance(m["content"], list) for c in m["content"]]
        assert sum(c["type"] == "image" for c in images) == 1
        lab = [t for t in inputs["labels"][b].tolist() if t != -100]
        assert be.tokenizer.decode(lab) == "".join(a + "<|im_end|>" for a in answers)


def test_search_cell_elsewhere_caps_the_plain_negatives(tmp_path):
    import random
    from collections import Counter

    from speceyes.miniworld.scenes import generate_scene, load_pool, scene_rng

    be = M.load_backend(M.build_base(tmp_path, "small", M.TINY, 0))
    scene = generate_scene(scene_rng("train", 0, 1), load_pool("train"), D.CANVAS, "small")

    def per_cell(**kw):
        rows = D.search_cell_questions(scene, random.Random(1), be, cells=3, **kw)
        return Counter((id(r["view"]), r["answer_text"]) for r in rows)

    default, none, one = per_cell(), per_cell(elsewhere=0), per_cell(elsewhere=1)
    assert max(n for (_, a), n in default.items() if a == "no") > 1
    assert not [k for k in none if k[1] == "no"]  # only the yes questions are left
    assert max(n for (_, a), n in one.items() if a == "no") == 1
    assert sum(n for (_, a), n in one.items() if a == "yes") == sum(
        n for (_, a), n in default.items() if a == "yes"
    )


def test_init_from_carries_the_auxiliary_heads(tmp_path):
    import torch

    _run(tmp_path / "a", "--stage", "B", "--scenes", "1", "--max-steps", "1")
    src_path = tmp_path / "a" / "small" / "stage_B" / "ckpt.pt"
    src = M.load_ckpt(src_path)
    _run(
        tmp_path / "b",
        *("--stage", "B", "--scenes", "1", "--max-steps", "0", "--init-from", str(src_path)),
    )
    (init,) = [r for r in _log(tmp_path / "b" / "small") if r.get("event") == "init_from"]
    assert init["heads"] == ["aux"] and init["tensors"] == len(src["model"])
    got = M.load_ckpt(tmp_path / "b" / "small" / "stage_B" / "ckpt.pt")
    assert got["aux"].keys() == src["aux"].keys()
    for k, v in src["aux"].items():
        assert torch.equal(got["aux"][k], v)
    diff = [k for k, v in src["model"].items() if not torch.equal(got["model"][k], v)]
    assert not diff, diff


def test_stage_b_stopped_by_max_steps_resumes_from_its_step(tmp_path):
    import torch

    b = ["--stage", "B", "--scenes", "1", "--pack", "2"]
    ck = tmp_path / "small" / "stage_B" / "ckpt.pt"
    _run(tmp_path, *b, "--max-steps", "2")
    first = M.load_ckpt(ck)
    assert first["step"] == 2
    # A resume with no steps left restores the saved weights and heads and writes them back.
    _run(tmp_path, *b, "--max-steps", "2", "--resume")
    same = M.load_ckpt(ck)
    assert same["step"] == 2
    for key in ("model", "aux"):
        assert all(torch.equal(same[key][k], v) for k, v in first[key].items()), key
    _run(tmp_path, *b, "--max-steps", "4", "--resume")
    assert M.load_ckpt(ck)["step"] == 4
    log = _log(tmp_path / "small")
    assert [r["step"] for r in log if r.get("stage") == "B" and "loss" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in log if r.get("event") == "resume"] == [2, 2]
    assert [r["step"] for r in log if r.get("event") == "end"] == [2, 2, 4]
    assert all(math.isfinite(r["lm"]) and math.isfinite(r["aux"]) for r in log if "lm" in r)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_trained_tool_call_box_reads_back_to_the_crop_it_returns(tmp_path, family):
    """The <tool_call> box a large model is trained to write is in its family's convention
    (view pixels for Qwen2.5-VL, 0..1000 of the view for Qwen3-VL): read back the way the
    DeepEyes loop reads a box, it is the zoom square the training crop shows, which holds the
    target; and at least the tool's smallest box, so the loop runs it (trained on the target's
    own box, a model wrote boxes of a small target's size, and the tool refused every one)."""
    from speceyes import images
    from speceyes.agents.zoom import MIN_BOX

    be = M.load_backend(M.build_base(tmp_path, "large", M.TINY, 0, family))
    px = T.TRAINED_MIN_BOX_PX  # what --boxes trains
    rows = D.make_questions("train", 0, 2, be, crops=True, min_zoom_view_px=px)
    # rows whose crop is around the question's own target (the others zoom on a random object)
    rows = [r for r in rows if r.get("view_box") and r["target_bbox"] is not None]
    assert rows
    for r in rows:
        call = next(
            e[1] for e in D.examples_for(r, "large", True, deepeyes=True) if "<tool_call>" in e[1]
        )
        box = json.loads(call.split("\n")[1])["arguments"]["bbox_2d"]
        view = images.View(*D.CANVAS, r["view"].width, r["view"].height)
        got = images.box_to_original(box, view, be.box_coords)
        square = D.zoom_box(D.CANVAS, r["target_bbox"], D.min_zoom_side(r["view"], px))
        # rounding to whole view pixels (or thousandths) moves an edge by at most one unit
        unit = max(view.scale_x, view.scale_y) if be.box_coords == "absolute" else 1024 / 1000
        assert all(abs(a - b) <= unit for a, b in zip(got, square, strict=True)), (got, square)
        t = r["target_bbox"]
        assert square[0] <= t[0] and square[1] <= t[1] and square[2] >= t[2] and square[3] >= t[3]
        images.checked_crop_box(box, view, be.box_coords, MIN_BOX)  # the tool runs it
        # and still runs it with each coordinate a few units off (the model's digits are)
        off = [v + d for v, d in zip(box, (2, 2, -2, -2), strict=True)]
        images.checked_crop_box(off, view, be.box_coords, MIN_BOX)


def test_direct_turns_train_the_middle_tiers_agent_prefix_prompt(tmp_path):
    """--direct-turns adds, per scene question, the large model's direct answer after the
    agent's first turn: the messages the funnel sends with --direct-prompt agent-prefix (for the
    search agent, the DeepEyes first turn), labelled with the answer word."""
    from speceyes.agents.search import SearchAgent
    from speceyes.funnel import Funnel

    be = M.load_backend(M.build_base(tmp_path, "large", M.TINY, 0))
    rows = [r for r in D.make_questions("train", 0, 1, be, crops=False) if r["category"] != "zoom"]
    assert rows
    for r in rows:
        plain = D.examples_for(r, "large", False)
        direct = D.examples_for(r, "large", False, direct=True)
        assert len(direct) == len(plain) + 1
        msgs, answer, layouts = next(e for e in direct if e not in plain)
        assert answer == D.answer_text(r) and layouts == [r["objs"]]
        funnel = Funnel.__new__(Funnel)  # only the message builder: no models behind it
        funnel.agent = SearchAgent(be)
        sent = funnel._agent_prefix_direct_messages(r["view"], r["question"], r["options"])
        assert _texts(msgs) == _texts(sent)
        assert D.examples_for(r, "small", False, direct=True) == D.examples_for(r, "small", False)


def _texts(messages):
    """The conversation with images as their sizes (PIL images compare by identity)."""
    out = []
    for m in messages:
        content = m["content"]
        parts = content if isinstance(content, list) else [{"type": "text", "text": content}]
        out.append((m["role"], [p.get("text") or getattr(p.get("image"), "size", None)
                                for p in parts]))
    return out
