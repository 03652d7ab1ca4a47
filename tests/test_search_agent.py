"""The training-free search agent: real cropper, real backend inputs, real funnel.

The tiny random model's scores are meaningless but real (its own next-token probabilities); the
control test wraps the real backend in a double that supplies only the region scores, to check
that the agent zooms where the scores point.
"""

from __future__ import annotations

import numpy as np
import pytest

from speceyes.agents.search import SearchAgent, grid_boxes, score_question, target_phrase
from speceyes.funnel import Funnel, FunnelConfig
from speceyes.types import Query
from tests.conftest import make_scene


def q(
    i, size=(1000, 600), box=(600, 100, 700, 200), question="What is the color of the rectangle?"
):
    return Query(id=str(i), image=make_scene(size=size, box=box), question=question)


def test_target_phrases_of_the_miniworld_templates():
    assert target_phrase("Is there a red circle in the image?") == "red circle"
    assert target_phrase("What shape is the teal object?") == "teal object"
    assert target_phrase("What is the color of the triangle?") == "triangle"
    assert (
        target_phrase("Is the red triangle on the left or the right side of the black rectangle?")
        == "red triangle"
    )
    assert target_phrase("How many dogs are there?") is None
    assert (
        score_question("What is the color of the triangle?") == "Is there a triangle in the image?"
    )
    assert "How many dogs" in score_question("How many dogs are there?")


def test_grid_covers_the_box_with_overlap():
    cells = grid_boxes((0, 0, 100, 60), 2, 0.25)
    assert len(cells) == 4
    assert cells[0][:2] == (0, 0) and cells[-1][2:] == (100, 60)
    assert all(abs((c[2] - c[0]) - 62.5) < 1e-9 for c in cells)
    assert len(grid_boxes((0, 0, 90, 90), 3, 0.0)) == 9


def test_real_model_search_trace(q25):
    agent = SearchAgent(q25, depth=2, max_new_tokens=8)
    out = agent.run([q(0), q(1, size=(800, 800), box=(10, 10, 60, 60))])
    for o, (w, h) in zip(out, [(1000, 600), (800, 800)], strict=True):
        assert o.error is None
        zooms = [s for s in o.trace if s["type"] == "zoom"]
        assert zooms and o.tool_calls == len(zooms) <= 2
        for z in zooms:
            x1, y1, x2, y2 = z["crop_box"]
            assert 0 <= x1 < x2 <= w and 0 <= y1 < y2 <= h
            assert 0.0 <= z["score"] <= 1.0
            assert all(0.0 <= c["score"] <= 1.0 for c in z["candidates"])
            assert z["score"] == max(c["score"] for c in z["candidates"])
        # Each zoom is inside the previous one: the search narrows.
        for a, b in zip(zooms, zooms[1:], strict=False):
            assert a["crop_box"][0] <= b["crop_box"][0] and b["crop_box"][2] <= a["crop_box"][2]
        assert o.trace[-1]["type"] == "end" and o.turns == 1


class ScoreDouble:
    """The real backend for everything, except that region scores come from ``prefer``: P(yes) is
    high for crops whose centre pixel is the target colour (the cropper stays real)."""

    def __init__(self, real, color=(220, 30, 30)):
        self.real, self.color = real, color
        self.box_coords, self.factor = real.box_coords, real.factor
        self.min_pixels, self.max_pixels = real.min_pixels, real.max_pixels
        self.max_images, self.max_logprobs = real.max_images, real.max_logprobs
        self.calls: list[int] = []

    def view_of(self, image):
        return self.real.view_of(image)

    def next_token_probs(self, batch, words):
        self.real.next_token_probs(batch, words)  # the real model still reads every crop
        self.calls.append(len(batch))
        out = []
        for messages in batch:
            crop = messages[1]["content"][0]["image"]
            arr = np.asarray(crop)
            share = (np.abs(arr.astype(int) - self.color).sum(-1) < 30).mean()
            out.append([0.05 + 0.9 * min(1.0, 20 * share), 0.5])
        return np.array(out)

    def chat(self, batch, stop=(), max_new_tokens=1024):
        return self.real.chat(batch, stop=stop, max_new_tokens=max_new_tokens)

    def answer(self, batch, max_new_tokens=20, top_k=64):
        return self.real.answer(batch, max_new_tokens=max_new_tokens, top_k=top_k)


def test_scores_steer_the_zoom_to_the_target(q25):
    be = ScoreDouble(q25)
    # Target in the bottom-right corner of a 1600x1200 image.
    qs = [
        q(0, size=(1600, 1200), box=(1400, 1000, 1460, 1060)),
        q(1, size=(1600, 1200), box=(100, 80, 160, 140)),
    ]
    out = SearchAgent(be, depth=2, max_new_tokens=4).run(qs)
    # One scoring call per depth for both loops together (4 cells each).
    assert be.calls == [8, 8]
    for o, (tx, ty) in zip(out, [(1430, 1030), (130, 110)], strict=True):
        zooms = [s for s in o.trace if s["type"] == "zoom"]
        assert len(zooms) == 2
        for z in zooms:
            x1, y1, x2, y2 = z["crop_box"]
            assert x1 <= tx <= x2 and y1 <= ty <= y2
        last = zooms[-1]["crop_box"]
        assert (last[2] - last[0]) <= 1600 * 0.4  # two levels of a 2x2 grid with 25% overlap


def test_stay_stops_where_the_region_beats_its_cells(q25):
    be = ScoreDouble(q25)
    qs = [
        q(0, size=(1600, 1200), box=(1400, 1000, 1460, 1060)),  # small: every zoom gains
        q(1, size=(1600, 1200), box=(200, 150, 1400, 1050)),  # fills the image: cells cut it
    ]
    out = SearchAgent(be, depth=2, max_new_tokens=4, stay=True).run(qs)
    assert be.calls == [10, 5]  # the region itself + 4 cells per searching loop
    small, big = out
    zooms = [s for s in small.trace if s["type"] == "zoom"]
    assert len(zooms) == 2 and small.tool_calls == 2
    x1, y1, x2, y2 = zooms[-1]["crop_box"]
    assert x1 <= 1430 <= x2 and y1 <= 1030 <= y2
    assert big.tool_calls == 0 and not [s for s in big.trace if s["type"] == "zoom"]
    (stay,) = [s for s in big.trace if s["type"] == "stay"]
    assert stay["depth"] == 0 and stay["crop_box"] == [0, 0, 1600, 1200]
    assert stay["score"] >= stay["best_cell"]
    assert big.answer is not None and big.error is None


class DecoyDouble(ScoreDouble):
    """Scores a green decoy at a flat 0.4 and the red target by its share of the crop: the
    decoy's cell wins at depth 1, where the target is a few pixels, and loses at depth 2."""

    def next_token_probs(self, batch, words):
        self.real.next_token_probs(batch, words)
        self.calls.append(len(batch))
        out = []
        for messages in batch:
            arr = np.asarray(messages[1]["content"][0]["image"]).astype(int)
            red = (np.abs(arr - self.color).sum(-1) < 30).mean()
            green = (np.abs(arr - (30, 200, 30)).sum(-1) < 30).any()
            out.append([max(0.05 + 0.9 * min(1.0, 50 * red), 0.4 if green else 0.05), 0.5])
        return np.array(out)


def test_beam_recovers_a_target_ranked_second_at_depth_one(q25):
    from PIL import ImageDraw

    img = make_scene(size=(1600, 1200), box=(1400, 1000, 1460, 1060))
    ImageDraw.Draw(img).rectangle((100, 80, 300, 280), fill=(30, 200, 30))
    query = Query(id="0", image=img, question="What is the color of the rectangle?")
    ends = {}
    for beam in (1, 2):
        be = DecoyDouble(q25)
        (out,) = SearchAgent(be, depth=2, max_new_tokens=4, beam=beam).run([query])
        zooms = [s for s in out.trace if s["type"] == "zoom"]
        assert zooms[0]["crop_box"][0] == 0  # depth 1: the decoy's cell wins either way
        assert be.calls == [4, 4 * beam]  # depth 2 scores the cells of every kept region
        ends[beam] = zooms[-1]["crop_box"]
    x1, y1, x2, y2 = ends[2]
    assert x1 <= 1400 and y1 <= 1000 and x2 >= 1460 and y2 >= 1060  # beam 2 finds the target
    assert ends[1][2] <= 1000  # beam 1 stays in the decoy's quarter


def test_search_agent_in_the_funnel(q25, silent):
    queries = [q(i) for i in range(3)]
    f = Funnel(silent, q25, SearchAgent(q25, max_new_tokens=8), FunnelConfig(tau=0.0, batch_size=2))
    res = f.run(queries)
    assert [r.id for r in res] == ["0", "1", "2"]
    for r in res:
        assert r.route.startswith("agent") and r.agent_answer is not None
        assert any(s["type"] == "zoom" for s in r.trace)


def test_corrupt_image_is_an_error_outcome(q25, tmp_path):
    bad = tmp_path / "corrupt.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    out = SearchAgent(q25, max_new_tokens=4).run(
        [Query(id="b", image=str(bad), question="?"), q(1)]
    )
    assert out[0].error and "corrupt.png" in out[0].error
    assert out[1].error is None


def test_small_image_answers_without_zooming(q25):
    o = SearchAgent(q25, max_new_tokens=4).run([q(0, size=(200, 150), box=(50, 50, 90, 90))])[0]
    assert o.tool_calls == 0 and o.turns == 1 and o.error is None


def test_bad_arguments():
    with pytest.raises(ValueError):
        SearchAgent(object(), answer_prompt="nope")


def test_ask_with_the_search_agent(tiny_dirs, tmp_path, capsys):
    import json

    from speceyes.cli import main
    from tests.conftest import make_scene

    img = tmp_path / "scene.png"
    make_scene(size=(600, 400)).save(img)
    rc = main(
        [
            "ask",
            str(img),
            "Is there a red square in the image?",
            "--json",
            "--agent",
            "search",
            "--mode",
            "agent",
            "--agent-max-tokens",
            "8",
            "--small",
            str(tiny_dirs["qwen3_vl"]),
            "--large",
            str(tiny_dirs["qwen2_5_vl"]),
        ]
    )
    data = json.loads(capsys.readouterr().out)
    assert rc == 0 and data["route"] == "agent_only"
    assert any(step["type"] == "zoom" for step in data["trace"])


def test_fill_view_and_min_box_reach_a_third_depth(tiny_dirs):
    from speceyes.backends.hf import HFBackend

    # A 224-px view of a 1024-px image: 28 view px are 128 original px, so with the DeepEyes
    # minimum the third depth's cells (about 66 px) are refused.
    be = ScoreDouble(HFBackend(tiny_dirs["qwen2_5_vl"], max_pixels=224 * 224))
    query = q(0, size=(1024, 1024), box=(700, 700, 720, 720))
    runs = {}
    for fill, min_box in ((False, 28), (True, 10)):
        agent = SearchAgent(
            be, depth=3, grid=3, min_region=64, max_new_tokens=4, fill_view=fill, min_box=min_box
        )
        (out,) = agent.run([query])
        runs[fill] = [s for s in out.trace if s["type"] == "zoom"], out
    zooms, out = runs[False]
    assert len(zooms) == 2 and out.invalid_tool_calls == 9  # every depth-3 cell is too small
    assert min(zooms[-1]["crop_size"]) < 224  # a 164-px crop at its native size
    zooms, out = runs[True]
    assert len(zooms) == 3 and out.invalid_tool_calls == 0
    assert all(z["crop_size"] == [224, 224] for z in zooms)  # every crop fills the view
    x1, y1, x2, y2 = zooms[-1]["crop_box"]
    assert x2 - x1 < 128 and x1 <= 710 <= x2 and y1 <= 710 <= y2


def test_fill_view_never_exceeds_the_full_view(q25):
    # A real model's budget (16384 * 28 * 28 pixels) is far above this image: crops are
    # upscaled to the full image's view, not to the budget.
    query = q(0, size=(700, 420), box=(600, 300, 640, 340))
    (out,) = SearchAgent(q25, depth=1, max_new_tokens=4, fill_view=True).run([query])
    view = q25.view_of(query.image)
    (zoom,) = [s for s in out.trace if s["type"] == "zoom"]
    w, h = zoom["crop_size"]
    assert 0.8 * view.view_w * view.view_h <= w * h <= view.view_w * view.view_h
