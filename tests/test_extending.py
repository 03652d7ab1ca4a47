"""docs/extending.md, "Adding a benchmark", done from a test: a loader, a metrics function and
one register() call make a benchmark that `speceyes eval`, `report` and `view` all run on."""

from __future__ import annotations

import csv
import json
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
