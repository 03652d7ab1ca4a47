"""lmms-eval as a host (speceyes.lmms): model_args, requests as queries, answers in the form the
tasks score, the funnel's metrics; and ``lmms-eval --model speceyes`` end to end, offline.

The end-to-end test runs two local tasks (``tests/lmms_task``) that put a generated mini-world
split in lmms-eval's POPE and V* layouts and score it with those tasks' own functions.
lmms-eval runs as a command, in an interpreter that has it: ``SPECEYES_LMMS_PYTHON``, this one,
or the environment ``make test`` builds for it (``.venv-lmms``), since lmms-eval's requirements
stay out of the main one. It is skipped only when no interpreter has lmms-eval.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from speceyes.lmms import MODEL_CLASS, MODEL_ID
from speceyes.lmms.args import ModelArgsError, settings_from_model_args
from speceyes.lmms.metrics import PREFIX, funnel_metrics, lmms_metrics
from speceyes.lmms.queries import (
    first_image,
    question_and_options,
    request_query,
    split_inline_options,
    task_answer,
)
from speceyes.miniworld.demo import MODELS_DIR
from speceyes.miniworld.splits import level_defaults, make_split
from speceyes.rates import analytic_speedup
from speceyes.types import Result

ROOT = Path(__file__).resolve().parent.parent
TASK_DIR = Path(__file__).resolve().parent / "lmms_task"
TASKS = ("speceyes_mw_pope", "speceyes_mw_vstar")
# The bundled models' world (level 1): one small-target and one large-target scene, 8 questions
# each (colour and shape as multiple choice, six POPE-style yes/no), so both routes are taken.
LEVEL, SCENES = 1, 2
LETTERS = "ABCDEFGH"


# ---- model_args ----------------------------------------------------------------------------
def test_models_folder_gives_the_manifest_settings_and_takes_funnel_keys():
    s = settings_from_model_args({"models": "miniworld", "tau": 0.5, "schedule": "pipelined"})
    assert Path(s.small) == MODELS_DIR / "small" and Path(s.large) == MODELS_DIR / "large"
    assert s.agent.kind == "search" and s.backend.dtype == "float32"
    assert (s.funnel.tau, s.funnel.schedule, s.funnel.top_k) == (0.5, "pipelined", 64)
    assert s.funnel.batch_size == 16  # the manifest's: lmms-eval's default batch_size=1 is not
    assert settings_from_model_args({"models": "miniworld"}, batch_size=4).funnel.batch_size == 4
    assert (
        settings_from_model_args({"models": "miniworld"}, batch_size="auto").funnel.batch_size == 16
    )


def test_flags_keys_mean_what_the_cli_flags_mean():
    s = settings_from_model_args(
        {
            "small": "S",
            "large": "http://127.0.0.1:9/v1",
            "mode": "both",
            "top_k": 16,
            "agent": "search",
            "search": '"depth=2,grid=2"',  # quoted by lmms-eval's model_args rules
            "overlap": True,
            "max_tool_calls": 3,
        },
        device="cuda:0",
    )
    assert (s.small, s.large, s.funnel.mode, s.funnel.top_k) == (
        "S",
        "http://127.0.0.1:9/v1",
        "both",
        16,
    )
    assert s.agent.options == {"depth": 2, "grid": 2} and s.agent.max_tool_calls == 3
    assert s.funnel.overlap is True and s.backend.device_map == "cuda:0"


@pytest.mark.parametrize(
    "args, message",
    [
        ({"models": "miniworld", "bogus": 1}, "unknown model_args key 'bogus'"),
        ({"models": "miniworld", "small": "X"}, "drop small"),
        ({"models": "miniworld", "mode": "fast"}, "invalid choice"),
        ({"models": "miniworld", "overlap": "maybe"}, "overlap takes true or false"),
        ({"tau": 0.5}, "give small="),
        ({"models": "/nonexistent"}, "no manifest.json"),
    ],
)
def test_bad_model_args_are_refused_clearly(args, message):
    with pytest.raises(ModelArgsError, match=message):
        settings_from_model_args(args)


# ---- requests as queries, answers as the tasks score them -----------------------------------
def test_question_and_options_follow_the_documents_layout():
    hr = {"question": "Colour of the cup?", "A": "red", "B": "blue", "C": "green", "D": "tan"}
    assert question_and_options(hr, "prompt") == (
        "Colour of the cup?",
        ["red", "blue", "green", "tan"],
    )
    vstar = {"text": "What is the colour of the bag? (A) white (B) black", "label": "B"}
    assert question_and_options(vstar, "prompt") == (
        "What is the colour of the bag?",
        ["white", "black"],
    )
    pope = {"question": "Is there a dog in the image?", "answer": "no"}
    assert question_and_options(pope, "prompt") == ("Is there a dog in the image?", None)
    listed = {"question": "Which?", "options": ["x", "y", "z"]}
    assert question_and_options(listed, "prompt") == ("Which?", ["x", "y", "z"])
    assert question_and_options({"caption": 3}, " the task's text ") == ("the task's text", None)


def test_inline_options_need_consecutive_letters():
    assert split_inline_options("Is it (B) here?") == ("Is it (B) here?", None)
    assert split_inline_options("Pick (A) one (C) two") == ("Pick (A) one (C) two", None)
    assert split_inline_options("Q (A) a b (B) c") == ("Q", ["a b", "c"])


def test_request_query_takes_the_first_image_and_no_gold():
    image = {"type": "image", "url": "a.png"}
    messages = [{"role": "user", "content": [image, {"type": "text", "text": "Q? (A) x (B) y"}]}]
    assert first_image(messages) == "a.png"
    q = request_query({"caption": "", "answer": "A", "category": "c"}, messages, "t/test/0")
    assert (q.id, q.image, q.question, q.options) == ("t/test/0", "a.png", "Q? (A) x (B) y", None)
    assert (q.answer, q.category) == (None, "c")
    with pytest.raises(ValueError, match="no image"):
        request_query({"question": "Q?"}, [{"role": "user", "content": []}], "t/test/1")


@pytest.mark.parametrize(
    "answer, options, sent",
    [
        ("B. black", ["white", "black"], "B"),
        ("The answer is black.", ["white", "black"], "B"),
        ("black", ["white", "black"], "B"),  # V*'s own rule would read "BLACK" as B by luck only
        ("brown", ["white", "black"], ""),  # no option named: wrong, as speceyes scores it
        ("Yes.", None, "yes"),  # POPE compares exactly: "Yes." would count as wrong
        ("<answer>no</answer>", None, "no"),
        (" a red car ", None, "a red car"),
    ],
)
def test_task_answer_is_the_bare_letter_or_word(answer, options, sent):
    assert task_answer(answer, options) == sent


def test_raw_answers_pass_as_they_are():
    assert task_answer(" Yes. ", None, "raw") == "Yes."


# ---- the funnel's numbers -------------------------------------------------------------------
def _result(route: str, judge_tool: bool | None, **timings: float) -> Result:
    return Result(id=route, answer="", route=route, judge_tool=judge_tool, timings=timings)


def test_funnel_metrics_are_the_rates_and_the_analytic_speedup():
    results = [
        _result("small", False, judge=0.1, small=0.2, gate=0.0),
        _result("small", False, judge=0.1, small=0.2, gate=0.0),
        _result("agent_after_gate", False, judge=0.1, small=0.2, gate=0.0, agent=2.0),
        _result("agent_after_judge", True, judge=0.1, agent=4.0),
    ]
    m = funnel_metrics(results, wall_seconds=2.0)
    assert (m["beta"], m["alpha"]) == (pytest.approx(3 / 4), pytest.approx(2 / 3))
    assert m["seconds_per_query_by_route"]["small"] == pytest.approx(0.3)
    assert m["seconds_per_query_by_route"]["agent_after_judge"] == pytest.approx(4.1)
    expected = analytic_speedup(0.1, 0.2, 3.0, 3 / 4, 2 / 3)
    assert m["speedup"] == pytest.approx(expected)
    flat = lmms_metrics(m)
    assert flat[PREFIX + "speedup"] == pytest.approx(expected)
    assert flat[PREFIX + "share_small"] == pytest.approx(0.5)
    assert flat[PREFIX + "seconds_per_query"] == pytest.approx(0.5)
    assert all(isinstance(v, float) for v in flat.values())  # log_metrics keeps numbers only


def test_without_agent_runs_there_is_no_speedup():
    m = funnel_metrics([_result("small_only", None, small=0.2, gate=0.0)])
    assert m["speedup"] is None and m["beta"] is None and m["seconds_per_query"] is None
    assert PREFIX + "speedup" not in lmms_metrics(m)


# ---- the extra and the entry point ----------------------------------------------------------
def test_the_lmms_extra_pins_lmms_eval_and_filelock_and_leaves_torch_alone():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extra = project["optional-dependencies"]["lmms"]
    assert any(r.startswith("lmms-eval==") for r in extra)
    assert any(
        r.startswith("filelock") and "<4" in r for r in extra
    )  # lmms-eval imports filelock._api
    assert not any(
        r.split("=")[0].split("<")[0].split(">")[0].strip() in ("torch", "torchvision")
        for r in extra
    )
    assert project["entry-points"]["lmms_eval.models"][MODEL_ID] == "speceyes.lmms:manifest"
    module, cls = MODEL_CLASS.rsplit(".", 1)
    assert (ROOT / (module.replace(".", "/") + ".py")).is_file()


# ---- lmms-eval end to end -------------------------------------------------------------------
def lmms_python() -> str | None:
    """An interpreter with lmms-eval, or None."""
    given = os.environ.get("SPECEYES_LMMS_PYTHON")
    if given:
        return given
    if importlib.util.find_spec("lmms_eval") is not None:
        return sys.executable
    venv = ROOT / ".venv-lmms" / "bin" / "python"
    return str(venv) if venv.is_file() else None


def write_task_data(split: Path, out: Path) -> dict[str, list[dict]]:
    """The split's questions as the two tasks' documents: yes/no questions in POPE's fields,
    multiple choice in V*'s (options inline in ``text``, ``label`` the letter)."""
    docs: dict[str, list[dict]] = {t: [] for t in TASKS}
    for line in (split / "questions.jsonl").read_text(encoding="utf-8").splitlines():
        q = json.loads(line)
        doc = {"question_id": q["id"], "category": q["category"], "image": str(split / q["image"])}
        if q["options"]:
            inline = " ".join(f"({LETTERS[i]}) {o}" for i, o in enumerate(q["options"]))
            doc.update(text=f"{q['question']} {inline}", label=q["answer"])
            docs["speceyes_mw_vstar"].append(doc)
        else:
            doc.update(question=q["question"], answer=q["answer"])
            docs["speceyes_mw_pope"].append(doc)
    for task, rows in docs.items():
        with open(out / f"{task}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return docs


def run_lmms_eval(python: str, work: Path, model_args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(work / "hf-home"),
        "HF_DATASETS_CACHE": str(work / "hf-datasets"),
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    cmd = [python, "-m", "lmms_eval", "--model", MODEL_ID, "--model_args", model_args]
    cmd += ["--tasks", ",".join(TASKS), "--include_path", str(TASK_DIR)]
    cmd += ["--output_path", str(work / "results"), "--log_samples"]
    # cwd: the task YAMLs name their data files relative to the working directory
    return subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=900)


def _one(pattern: str, root: Path) -> Path:
    found = sorted(root.rglob(pattern))
    assert len(found) == 1, f"expected one {pattern} under {root}, found {found}"
    return found[0]


@pytest.mark.slow
def test_lmms_eval_runs_the_funnel_and_reports_its_metrics(tmp_path):
    python = lmms_python()
    if python is None:
        pytest.skip(
            "lmms-eval is not installed (make test builds .venv-lmms; or pip install "
            "'.[lmms]' beside your torch, see README 'lmms-eval')"
        )
    split = tmp_path / "split"
    canvas, clutter = level_defaults(LEVEL)
    make_split(split, "test", SCENES, seed=0, canvas=canvas, clutter=clutter, level=LEVEL)
    docs = write_task_data(split, tmp_path)
    n = sum(len(rows) for rows in docs.values())
    out = tmp_path / "speceyes"

    proc = run_lmms_eval(python, tmp_path, f"models=miniworld,output={out}")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    print(proc.stdout[-3000:])  # lmms-eval's tables with the funnel's numbers (pytest -s)

    # The funnel's numbers are in lmms-eval's results and its throughput table.
    results = json.loads(_one("*_results.json", tmp_path / "results").read_text())
    throughput = results["throughput"]
    for key in ("beta", "alpha", "speedup", "seconds_per_query", "seconds_small"):
        assert f"avg_{PREFIX}{key}" in throughput, sorted(throughput)
    assert throughput[f"avg_{PREFIX}queries"] == n
    assert "Throughput Summary" in log and f"avg_{PREFIX}beta" in log

    # They are the rates of the routes the funnel logged.
    report = json.loads((out / "speceyes_metrics.json").read_text())
    samples = {}
    for line in (out / "speceyes_samples.jsonl").read_text().splitlines():
        s = json.loads(line)
        samples[s["id"]] = s
    assert len(samples) == n and set(report["tasks"]) == set(TASKS)
    judged = [s for s in samples.values() if s["judge_tool"] is not None]
    free = [s for s in judged if not s["judge_tool"]]
    accepted = [s for s in free if s["route"] == "small"]
    assert throughput[f"avg_{PREFIX}beta"] == pytest.approx(len(free) / len(judged))
    assert throughput[f"avg_{PREFIX}alpha"] == pytest.approx(len(accepted) / len(free))
    routes = {s["route"] for s in samples.values()}
    assert "small" in routes and routes & {"agent_after_judge", "agent_after_gate"}, routes

    # Each answer reached lmms-eval as the bare word or letter its task scores, and lmms-eval's
    # scores are those answers against the gold ones.
    for task, metric, scale in (
        ("speceyes_mw_pope", "pope_accuracy,none", 1.0),
        ("speceyes_mw_vstar", "vstar_overall_acc,none", 100.0),
    ):
        rows = [json.loads(s) for s in _one(f"*_{task}.jsonl", tmp_path / "results").open()]
        assert len(rows) == len(docs[task])
        hits = []
        for row in rows:
            doc = docs[task][row["doc_id"]]
            mine = samples[f"{task}/test/{row['doc_id']}"]
            sent = row["filtered_resps"]
            sent = sent[0] if isinstance(sent, list) else sent
            assert sent == mine["task_answer"]
            if task == "speceyes_mw_pope":
                assert sent in ("yes", "no"), mine["answer"]
                hits.append(sent == doc["answer"])
            else:
                options = split_inline_options(doc["text"])[1]
                assert sent in LETTERS[: len(options)], mine["answer"]
                hits.append(sent == doc["label"])
        assert results["results"][task][metric] == pytest.approx(scale * sum(hits) / len(hits))
