"""docs/extending.md, "Adding a benchmark", done from a test: a loader, a metrics function and
one register() call make a benchmark that `speceyes eval`, `report` and `view` all run on."""

from __future__ import annotations

import csv
import json
import logging
import random
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from speceyes.bench import benchmarks
from speceyes.bench.benchmarks import Benchmark, get, register
from speceyes.bench.scoring import accuracy_metrics, record_correct
from speceyes.rundir import RunDir
from speceyes.types import Query
from tests.conftest import make_scene
from tests.extending import direct_agent, logged_backend
from tests.extending.direct_agent import DirectAgent

COLORS = {"red": (220, 30, 30), "blue": (30, 30, 220)}


# --- the three pieces, as docs/extending.md writes them ----------------------------------------


def load_squares(path: str | Path, seed: int = 0) -> Iterator[Query]:
    """A CSV of ``id,image,color`` rows: "What colour is the square?", options shuffled."""
    path = Path(path)
    with path.open(newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            options = list(COLORS)
            random.Random(f"{seed}/{row['id']}").shuffle(options)
            yield Query(
                id=row["id"],
                image=str(path.parent / row["image"]),
                question="What colour is the square?",
                options=options,
                answer="AB"[options.index(row["color"])],
                category=row["color"],
            )


def squares_metrics(records: Iterable[Any]) -> dict[str, Any]:
    """Accuracy per colour, plus how often the gold answer is the first option."""
    recs = list(records)
    out = accuracy_metrics(recs)
    out["gold_first"] = sum(r["answer"] == "A" for r in recs) / len(recs) if recs else 0.0
    out["wrong_ids"] = sorted(r["id"] for r in recs if not record_correct(r))
    return out


@pytest.fixture
def squares():
    bench = register(
        Benchmark(
            name="squares",
            aliases=("colour-squares",),
            load=load_squares,
            loader_kw_from_args=lambda args: {"seed": args.seed},
            metrics=squares_metrics,
        )
    )
    yield bench
    del benchmarks.BENCHMARKS[bench.name]


@pytest.fixture
def squares_csv(tmp_path):
    root = tmp_path / "squares"
    root.mkdir()
    rows = []
    for i in range(4):
        color = list(COLORS)[i % 2]
        make_scene(box=(40 + 30 * i, 40, 140 + 30 * i, 140), color=COLORS[color]).save(
            root / f"sq{i}.png"
        )
        rows.append({"id": f"sq{i}", "image": f"sq{i}.png", "color": color})
    with (root / "squares.csv").open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=["id", "image", "color"])
        writer.writeheader()
        writer.writerows(rows)
    return root / "squares.csv"


# --- the tests ---------------------------------------------------------------------------------


def test_registered_benchmark_loads_and_scores(squares, squares_csv):
    assert get(" Colour-Squares ") is squares
    queries = list(get("squares").load(squares_csv, seed=1))
    assert [q.id for q in queries] == ["sq0", "sq1", "sq2", "sq3"]
    assert all(q.options[ord(q.answer) - 65] == q.category for q in queries)
    records = [
        {"id": q.id, "category": q.category, "answer": q.answer, "correct": q.id != "sq1"}
        for q in queries
    ]
    m = squares.metrics(records)
    assert m["n"] == 4 and m["accuracy"] == 0.75 and m["wrong_ids"] == ["sq1"]
    assert m["per_category"]["blue"]["accuracy"] == 0.5
    assert m["gold_first"] == sum(q.answer == "A" for q in queries) / 4
    # A logged run's loader settings may carry more than the loader takes.
    again = squares.load_logged(squares_csv, {"seed": 1, "split": "x"})
    assert [q.options for q in again] == [q.options for q in queries]


def test_names_are_checked(squares):
    with pytest.raises(ValueError, match="'squares' is taken by 'squares'"):
        register(Benchmark(name="squares", load=load_squares, metrics=squares_metrics))
    with pytest.raises(ValueError, match="'v\\*' is taken by 'vstar'"):
        register(Benchmark(name="vee", aliases=("v*",), load=load_squares, metrics=squares_metrics))
    with pytest.raises(ValueError, match="lowercase"):
        register(Benchmark(name="Squares2", load=load_squares, metrics=squares_metrics))
    with pytest.raises(ValueError, match="expected vstar, hrbench, pope, jsonl or squares"):
        get("mmbench")
    with pytest.raises(ValueError, match="cover vstar, hrbench and pope, not 'squares'"):
        squares.score_published([])


def test_speceyes_eval_runs_a_registered_benchmark(squares, squares_csv, tiny_dirs, tmp_path):
    from speceyes.cli import main

    out = tmp_path / "run"
    args = [
        "eval", "--bench", "colour-squares", "--data", str(squares_csv), "--output", str(out),
        "--small", str(tiny_dirs["qwen3_vl"]), "--large", str(tiny_dirs["qwen2_5_vl"]),
        "--mode", "both", "--tau", "0.5", "--batch-size", "2", "--agent-max-tokens", "8",
        "--seed", "3", "--no-progress",
    ]  # fmt: skip
    assert main(args) == 0
    run = RunDir(out)
    records = run.records()
    assert [r["id"] for r in records] == ["sq0", "sq1", "sq2", "sq3"]
    results = run.read_results()
    config = results["config"]
    assert config["bench"] == "squares" and config["loader"] == {"seed": 3}
    # The metrics are the benchmark's own, over the logged records.
    assert results["metrics"] == json.loads(json.dumps(squares_metrics(records)))
    # The queries were the loader's with the flag's seed: same option order as logged.
    loaded = {q.id: q for q in load_squares(squares_csv, seed=3)}
    assert all(r["options"] == loaded[r["id"]].options for r in records)
    # The viewer finds the images through the same registry entry.
    from speceyes.view import build_view

    view = build_view([out], tmp_path / "view")
    assert view.notes == [] and view.images_made == 4


# --- an agent and a backend, as docs/extending.md shows them ------------------------------------

DOC = Path(__file__).resolve().parents[1] / "docs" / "extending.md"


def test_the_doc_shows_the_code_these_tests_run():
    doc = DOC.read_text(encoding="utf-8")
    for module in (direct_agent, logged_backend):
        source = Path(module.__file__).read_text(encoding="utf-8")
        assert f"```python\n{source}```" in doc, module.__name__


@pytest.fixture
def direct(monkeypatch):
    """The agent registered as its one line in agents/registry.py registers it."""
    from speceyes.agents import registry

    monkeypatch.setitem(registry.AGENTS, DirectAgent.name, DirectAgent)
    return DirectAgent


def _ask(tiny_dirs, image, *extra):
    return [
        "ask", str(image), "What colour is the square?", "--option", "red", "--option", "blue",
        "--small", str(tiny_dirs["qwen3_vl"]), "--large", str(tiny_dirs["qwen2_5_vl"]),
        "--agent-max-tokens", "8", "--json", *extra,
    ]  # fmt: skip


def test_ask_and_eval_run_a_registered_agent(
    direct, squares, squares_csv, tiny_dirs, q25, tmp_path, capsys
):
    from speceyes import prompts
    from speceyes.agents.base import fallback_answer
    from speceyes.cli import main
    from speceyes.factory import Settings
    from speceyes.images import load_image

    image = squares_csv.parent / "sq0.png"
    capsys.readouterr()
    assert main(_ask(tiny_dirs, image, "--agent", "direct", "--mode", "agent")) == 0
    r = json.loads(capsys.readouterr().out)
    # The large model's own one-turn answer to the small model's prompt, no tool calls.
    question = "What colour is the square?"
    messages = prompts.small_messages(load_image(image), question, list(COLORS))
    said = q25.chat([messages], max_new_tokens=8)[0].text
    assert (r["route"], r["agent_answer"], r["tool_calls"]) == (
        "agent_only", fallback_answer(said), 0
    )  # fmt: skip
    assert [s["text"] for s in r["trace"] if s["type"] == "assistant"] == [said]

    out = tmp_path / "run"
    args = [
        "eval", "--bench", "squares", "--data", str(squares_csv), "--output", str(out),
        "--small", str(tiny_dirs["qwen3_vl"]), "--large", str(tiny_dirs["qwen2_5_vl"]),
        "--agent", "direct", "--mode", "agent", "--batch-size", "2", "--agent-max-tokens", "8",
        "--no-progress",
    ]  # fmt: skip
    assert main(args) == 0
    records = RunDir(out).records()
    assert len(records) == 4 and {r["route"] for r in records} == {"agent_only"}
    for rec in records:
        steps = [s for s in rec["trace"] if s["type"] == "assistant"]
        assert len(steps) == 1 and rec["agent_answer"] == fallback_answer(steps[0]["text"])
    config = RunDir(out).read_results()["config"]
    assert config["agent"] == "direct"
    # run.json records the resolved settings whole, readable back as Settings.
    settings = Settings.from_dict(RunDir(out).read_state()["config"]["settings"])
    assert (settings.agent.kind, settings.agent.max_new_tokens) == ("direct", 8)
    assert (settings.bench, settings.funnel.mode, settings.funnel.tau) == ("squares", "agent", 0.9)


def _untimed(value):
    """A result without its times (timings, and the seconds of trace steps)."""
    if isinstance(value, dict):
        return {k: _untimed(v) for k, v in value.items() if k not in ("timings", "seconds")}
    if isinstance(value, list):
        return [_untimed(v) for v in value]
    return value


@pytest.fixture
def logged(monkeypatch):
    """The engine registered as its one line in backends/registry.py registers it."""
    from speceyes.backends import registry

    monkeypatch.setitem(registry.ENGINES, "hf-logged", logged_backend.build)


def test_a_registered_engine_runs_the_models(logged, squares_csv, tiny_dirs, capsys, caplog):
    from speceyes.cli import main
    from speceyes.factory import BackendSettings, make_backend
    from tests.tools.backend_contract import assert_backend_contract

    folder = str(tiny_dirs["qwen2_5_vl"])
    be = make_backend(folder, settings=BackendSettings(engine="hf-logged"))
    assert isinstance(be, logged_backend.LoggedBackend) and be.factor == 28
    assert_backend_contract(be)
    with pytest.raises(ValueError, match="unknown engine 'nope'; choose from hf, vllm, hf-logged"):
        make_backend(folder, settings=BackendSettings(engine="nope"))

    image = squares_csv.parent / "sq1.png"
    results = {}
    for engine in ("hf", "hf-logged"):
        capsys.readouterr()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=logged_backend.log.name):
            assert main(_ask(tiny_dirs, image, "--engine", engine, "--mode", "both")) == 0
        results[engine] = _untimed(json.loads(capsys.readouterr().out))
        calls = {r.getMessage().split(":")[0] for r in caplog.records}
    # Every primitive the funnel used went through the wrapper, and the results are the same.
    assert calls == {"next_token_probs", "answer", "chat"}
    assert results["hf-logged"] == results["hf"]
