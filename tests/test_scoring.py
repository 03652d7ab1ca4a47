"""Deterministic answer parsing and the benchmark metrics, checked against hand computations."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from speceyes.bench.benchmarks import get
from speceyes.bench.scoring import (
    accuracy_metrics,
    hrbench_metrics,
    is_correct,
    parse_choice,
    parse_yes_no,
    pope_metrics,
    vstar_metrics,
)
from speceyes.types import Query

COLORS = ["red", "blue", "green", "white"]


@pytest.mark.parametrize(
    "text",
    [
        "B",
        "b",
        "(B)",
        "B.",
        "B. blue",
        "B) blue",
        "(B) blue",
        "B: blue",
        "The answer is B",
        "The answer is B.",
        "The correct answer is (B) blue.",
        "answer: (B)",
        "Answer: B",
        "**B**",
        "**B. blue**",
        "<answer>B</answer>",
        "<think>Maybe A? No, the answer is C... actually</think><answer>(B)</answer>",
        "\\boxed{B}",
        "B\n\nThe car in the corner is painted blue.",
        "blue",
        "Blue.",
        "  BLUE  ",
        "I think it is blue",
        "The car is blue.",
        "The correct option is B because the car is blue.",
    ],
)
def test_parse_choice_accepts(text: str) -> None:
    assert parse_choice(text, COLORS) == "B"


@pytest.mark.parametrize(
    "text",
    [
        None,
        "",
        "   ",
        "<answer></answer>",
        "E",  # not an option letter
        "The answer is E",
        "I cannot tell.",
        "A car",  # the article is not option A; no colour named
        "It is either red or blue.",  # two options named
        "It is not red, it is blue",  # two options named: no guessing
        "Both B and C look plausible",  # letters inside text never count
    ],
)
def test_parse_choice_rejects(text: str | None) -> None:
    assert parse_choice(text, COLORS) is None


def test_parse_choice_letter_anywhere_is_not_a_choice() -> None:
    # "A red car": options are colours, so the "A" is an article and "red" is option B.
    assert parse_choice("A red car", ["blue", "red"]) == "B"
    assert parse_choice("The answer is a red car", ["blue", "red"]) == "B"
    assert parse_choice("The answer is A red car.", ["blue", "red"]) == "B"
    assert parse_choice("I think it is blue", ["red", "blue"]) == "B"
    # A letter inside words or sentences is ignored; nothing else matches -> None.
    assert parse_choice("Definitely a cat, according to the image.", ["dog", "bird"]) is None


def test_parse_choice_option_text_rules() -> None:
    # Exact normalised match wins over containment; a contained option inside a longer
    # matched option does not make the answer ambiguous.
    opts = ["red", "dark red", "blue"]
    assert parse_choice("Dark red!", opts) == "B"
    assert parse_choice("It looks dark red to me", opts) == "B"
    assert parse_choice("red", opts) == "A"
    # V* relative position: full sentences, a short answer, the distinctive word.
    rel = ["The cup is on the left of the plate.", "The cup is on the right of the plate."]
    assert parse_choice("The cup is on the right of the plate", rel) == "B"
    assert parse_choice("left", rel) == "A"
    assert parse_choice("It is on the right side.", rel) == "B"
    assert parse_choice("It is not on the left.", rel) is None  # negation: no guess
    # Numbers as options, letters still accepted.
    nums = ["2", "3", "4", "5"]
    assert parse_choice("3", nums) == "B"
    assert parse_choice("There are 4 people.", nums) == "C"
    assert parse_choice("D", nums) == "D"


def test_parse_choice_option_count_limits_letters() -> None:
    assert parse_choice("C", ["yes", "no"]) is None
    assert parse_choice("B", ["yes", "no"]) == "B"
    assert parse_choice("The answer is C", ["x", "y", "z"]) == "C"


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("Yes.", "yes"),
        ("yes", "yes"),
        ("YES", "yes"),
        ("no, there is not", "no"),
        ("No", "no"),
        ("**Yes**, there is a dog.", "yes"),
        ("<answer>No.</answer>", "no"),
        ("  no.", "no"),
        ("There is no dog.", None),  # first word only
        ("Maybe yes", None),
        ("Yesterday", None),
        ("", None),
        (None, None),
    ],
)
def test_parse_yes_no(text: str | None, want: str | None) -> None:
    assert parse_yes_no(text) == want


def test_is_correct() -> None:
    mc = Query(id="1", image=None, question="?", options=COLORS, answer="B")
    assert is_correct(mc, "The answer is (B).")
    assert is_correct(mc, "blue")
    assert not is_correct(mc, "A red car")
    assert not is_correct(mc, "")
    assert not is_correct(mc, None)
    yn = Query(id="2", image=None, question="?", answer="yes")
    assert is_correct(yn, "Yes, there is.")
    assert not is_correct(yn, "There is, yes")
    assert not is_correct(yn, "no")
    free = Query(id="3", image=None, question="?", answer="Golden Gate")
    assert is_correct(free, "golden gate.")
    assert not is_correct(free, "the golden gate bridge")
    assert not is_correct(Query(id="4", image=None, question="?"), "anything")


# ---------------------------------------------------------------------------------- metrics


def _rec(correct: bool, category: str | None = None, error: str | None = None, **kw) -> dict:
    return {"correct": correct, "category": category, "error": error, "meta": {}, **kw}


@dataclass
class Rec:
    category: str
    correct: bool
    prediction: str = ""
    answer: str = ""
    error: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


def test_vstar_metrics_pooled_overall() -> None:
    # direct_attributes: 3/4, relative_position: 1/2 (one error, counted wrong).
    recs = [
        _rec(True, "direct_attributes"),
        _rec(True, "direct_attributes"),
        _rec(True, "direct_attributes"),
        _rec(False, "direct_attributes"),
        _rec(True, "relative_position"),
        _rec(True, "relative_position", error="timeout"),  # error overrides correct
    ]
    m = vstar_metrics(recs)
    assert m["per_category"]["direct_attributes"]["accuracy"] == pytest.approx(0.75)
    assert m["per_category"]["relative_position"]["accuracy"] == pytest.approx(0.5)
    assert m["per_category"]["relative_position"]["n_errors"] == 1
    # Pooled: 4/6, not the mean of the categories (0.625).
    assert m["accuracy"] == pytest.approx(4 / 6)
    assert m["n"] == 6 and m["correct"] == 4 and m["n_errors"] == 1
    assert get("vstar").metrics(recs) == m


def test_hrbench_metrics_cycle_average_differs_from_pooled() -> None:
    def r(cyc: str, cat: str, ok: bool, err: str | None = None) -> Rec:
        return Rec(category=cat, correct=ok, error=err, meta={"cycle_category": cyc})

    recs = (
        # cycle 0: 2 rows, single 1/1, cross 1/1 -> 1.0
        [r("0", "single", True), r("0", "cross", True)]
        # cycle 1: 4 rows: single 1/2, cross 0/2 -> 1/4; one wrong row is an error
        + [r("1", "single", True), r("1", "single", False, "CUDA OOM")]
        + [r("1", "cross", False), r("1", "cross", False)]
    )
    m = hrbench_metrics(recs)
    assert m["per_cycle"]["0"]["accuracy"] == pytest.approx(1.0)
    assert m["per_cycle"]["1"]["accuracy"] == pytest.approx(0.25)
    assert m["accuracy"] == pytest.approx((1.0 + 0.25) / 2)  # 0.625
    assert m["pooled"]["accuracy"] == pytest.approx(3 / 6)  # 0.5: differs
    assert m["single"] == pytest.approx((1.0 + 0.5) / 2)
    assert m["cross"] == pytest.approx((1.0 + 0.0) / 2)
    assert m["pooled_per_category"]["single"]["accuracy"] == pytest.approx(2 / 3)
    assert m["n"] == 6 and m["n_errors"] == 1
    assert get("hrbench").metrics(recs)["accuracy"] == pytest.approx(0.625)


def test_pope_metrics_by_hand() -> None:
    def r(split: str, gold: str, pred: str | None, err: str | None = None) -> dict:
        return {
            "category": split,
            "answer": gold,
            "prediction": pred,
            "error": err,
            "correct": err is None and parse_yes_no(pred) == gold,
            "meta": {},
        }

    recs = [
        # adversarial: TP, FP, FP, TN, FN, and an error on a yes (FN, wrong)
        r("adversarial", "yes", "Yes."),
        r("adversarial", "no", "yes, there is"),
        r("adversarial", "no", "YES"),
        r("adversarial", "no", "No."),
        r("adversarial", "yes", "no"),
        r("adversarial", "yes", None, err="timeout"),
        # random: TP, TN, unparsable on a no (wrong, not a predicted yes)
        r("random", "yes", "yes"),
        r("random", "no", "no"),
        r("random", "no", "There is no cat."),
    ]
    m = pope_metrics(recs)
    adv = m["per_split"]["adversarial"]
    assert (adv["tp"], adv["fp"], adv["tn"], adv["fn"]) == (1, 2, 1, 2)
    assert adv["n"] == 6 and adv["n_errors"] == 1
    assert adv["accuracy"] == pytest.approx(2 / 6)
    assert adv["precision"] == pytest.approx(1 / 3)
    assert adv["recall"] == pytest.approx(1 / 3)
    assert adv["f1"] == pytest.approx(1 / 3)
    assert adv["yes_ratio"] == pytest.approx(3 / 6)  # predicted yes, not gold yes (3/6 too)
    rnd = m["per_split"]["random"]
    assert rnd["accuracy"] == pytest.approx(2 / 3)
    assert rnd["precision"] == pytest.approx(1.0) and rnd["recall"] == pytest.approx(1.0)
    assert rnd["yes_ratio"] == pytest.approx(1 / 3)  # gold yes share is also 1/3; see below
    assert rnd["n_unparsed"] == 1
    # Overall pooled: TP 2, FP 2, TN 2, FN 2 over 9 records.
    assert m["n"] == 9 and m["n_errors"] == 1
    assert m["accuracy"] == pytest.approx(4 / 9)
    assert m["precision"] == pytest.approx(0.5)
    assert m["recall"] == pytest.approx(0.5)
    assert m["f1"] == pytest.approx(0.5)
    assert m["yes_ratio"] == pytest.approx(4 / 9)  # gold yes share would be 4/9 too...
    # ...so show the difference on a model that always says yes.
    always_yes = [r("popular", g, "Yes") for g in ("yes", "no", "no", "no")]
    ay = pope_metrics(always_yes)
    assert ay["yes_ratio"] == pytest.approx(1.0)
    assert ay["accuracy"] == pytest.approx(0.25)
    assert ay["precision"] == pytest.approx(0.25) and ay["recall"] == pytest.approx(1.0)
    assert ay["f1"] == pytest.approx(0.4)
    assert get("pope").metrics(recs) == m


def test_pope_metrics_degenerate() -> None:
    m = pope_metrics([])
    assert m["n"] == 0 and m["accuracy"] == 0.0 and m["f1"] == 0.0 and m["yes_ratio"] == 0.0
    never_yes = pope_metrics(
        [{"category": "random", "answer": "yes", "prediction": "no", "correct": False}]
    )
    assert never_yes["precision"] == 0.0 and never_yes["recall"] == 0.0


def test_accuracy_metrics_generic_and_objects() -> None:
    recs = [Rec("a", True), Rec("a", False), Rec("b", True, error="boom"), Rec("b", True)]
    m = accuracy_metrics(recs)
    assert m["accuracy"] == pytest.approx(0.5)
    assert m["per_category"]["a"]["accuracy"] == pytest.approx(0.5)
    assert m["per_category"]["b"]["accuracy"] == pytest.approx(0.5)
    assert m["n_errors"] == 1
    nocat = accuracy_metrics([{"correct": True}])
    assert nocat["per_category"]["unknown"]["accuracy"] == 1.0
    assert get("jsonl").metrics(recs) == m
    with pytest.raises(ValueError, match="unknown benchmark 'mmbench'"):
        get("mmbench")
