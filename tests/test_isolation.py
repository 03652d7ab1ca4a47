"""Per-query isolation: a query that breaks a tokenizer or a prompt ends as its own error result
and its batch-mates are answered, on the tiny real models, in the funnel and in ``eval``.

The poison is a lone surrogate in the question (valid JSON, ``"\\ud800"``), which the real
tokenizers refuse with a TypeError, and more options than the prompts have letters.
"""

from __future__ import annotations

import json

import pytest

from speceyes.agents.zoom import ZoomAgent
from speceyes.cli import main
from speceyes.funnel import Funnel, FunnelConfig
from speceyes.limits import MAX_OPTIONS
from speceyes.rundir import RunDir
from speceyes.types import Query
from tests.conftest import make_scene

POISON = "What \ud800 color is the box?"


def _queries() -> list[Query]:
    img = make_scene(size=(96, 64), box=(4, 4, 40, 40))
    return [
        Query(id="a", image=img, question="What color is the box?", options=["red", "blue"]),
        Query(id="bad", image=img, question=POISON),
        Query(id="b", image=img, question="Is there a box?"),
        Query(id="many", image=img, question="Which?", options=[f"o{k}" for k in range(11)]),
    ]


@pytest.mark.parametrize(
    ("mode", "schedule"),
    [("speceyes", "batched"), ("speceyes", "pipelined"), ("agent", "batched"), ("small", "batched")],
)
def test_a_poisoned_query_fails_alone(q3, q25, mode, schedule):
    assert MAX_OPTIONS == 10

    def funnel() -> Funnel:
        cfg = FunnelConfig(mode=mode, tau=0.5, batch_size=4, schedule=schedule)
        return Funnel(q3, q25, ZoomAgent(q25, max_new_tokens=8), cfg)

    f = funnel()
    got = {r.id: r for r in f.run(_queries())}
    assert set(got) == {"a", "bad", "b", "many"}
    for bad in ("bad", "many"):
        # Failed before phase IV: route "error"; in the agent's loop: the agent's route, no answer.
        r = got[bad]
        assert r.error and not r.answer and (r.route == "error" or mode == "agent"), r
    assert f.stats.errors == (0 if mode == "agent" else 2)  # counts failures before phase IV
    # The batch-mates get the answers they get without the poisoned queries beside them.
    clean = {r.id: r for r in funnel().run([q for q in _queries() if q.id in ("a", "b")])}
    for qid in ("a", "b"):
        assert got[qid].route != "error" and got[qid].error is None
        assert (got[qid].route, got[qid].answer) == (clean[qid].route, clean[qid].answer)


def test_eval_answers_the_batch_mates_of_a_poisoned_sample(tiny_dirs, tmp_path):
    make_scene(box=(30, 40, 120, 130)).save(tmp_path / "img.png")
    lines = [
        {"id": f"q{i}", "image": "img.png", "question": q, "options": ["red", "blue"], "answer": "A"}
        for i, q in enumerate(["What color is the box?", POISON, "Which color?"])
    ]
    # json.dumps escapes the lone surrogate as \ud800: a valid line that the loader accepts.
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "run"
    args = ["eval", "--bench", "jsonl", "--data", str(tmp_path / "data.jsonl"), "--output", str(out)]
    args += ["--small", str(tiny_dirs["qwen3_vl"]), "--large", str(tiny_dirs["qwen2_5_vl"])]
    args += ["--tau", "0.5", "--batch-size", "3", "--agent-max-tokens", "8", "--no-progress"]
    assert main(args) == 0
    records = {r["id"]: r for r in RunDir(out).records()}
    assert set(records) == {"q0", "q1", "q2"}
    assert records["q1"]["route"] == "error" and records["q1"]["error"]
    assert records["q1"]["correct"] is False  # errors stay in the denominator as wrong
    assert records["q0"]["route"] != "error" and records["q2"]["route"] != "error"
    results = json.loads((out / "results.json").read_text())
    assert results["n"] == 3
