"""Offline scoring by the rules of github.com/MAC-AutoML/SpecEyes judge_code/judge_{vstar,hr,pope}.py."""

from __future__ import annotations

import hashlib

import pytest

from speceyes.bench import published_scoring as ps
from speceyes.bench.benchmarks import get


def script(bench: str) -> ps.JudgeScript:
    """The judge script the registry names for ``bench``."""
    found = get(bench).published
    assert found is not None
    return found

# sha256 of get_prompt('tan it is', 'A. The cup is tan.', 'What color?') in judge_vstar.py and
# judge_pope.py (identical), and in judge_hr.py
VSTAR_POPE_PROMPT_SHA256 = "1087358ffb3052de99b11bac98dde894f2660728c4c0f4c890e37665d7ab4b9f"
HR_PROMPT_SHA256 = "e1d35a8d36fbc0fe96fa5cee082375451be2a53f2f4f82372c82b7e9af10ac4d"


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def test_judge_prompts_are_the_reference_bytes():
    args = ("What color?", "A. The cup is tan.", "tan it is")
    assert _sha(script("vstar").prompt(*args)) == VSTAR_POPE_PROMPT_SHA256
    assert _sha(script("pope").prompt(*args)) == VSTAR_POPE_PROMPT_SHA256
    assert _sha(script("hrbench").prompt(*args)) == HR_PROMPT_SHA256


def test_judge_verdicts():
    assert script("vstar").verdict("1") and not script("vstar").verdict("1.")
    assert script("pope").verdict("Judgement: 1") and not script("pope").verdict("0")
    assert script("hrbench").verdict("I think 1")


def rec(pred, answer="A", options=("red", "blue"), **kw):
    return {"id": kw.pop("id", "x"), "prediction": pred, "answer": answer, "options": list(options),
            "question": "What color?", "category": "direct_attributes", **kw}  # fmt: skip


def test_vstar_rules():
    assert script("vstar").rule(rec("A")) == (True, "A")
    assert script("vstar").rule(rec("a"))[0] is False  # case-sensitive
    assert script("vstar").rule(rec("A."))[0] is True and script("vstar").rule(rec("B."))[0] is False
    assert script("vstar").rule(rec("The answer is A. red"))[0] is True  # 'A. ' + gold inside
    assert script("vstar").rule(rec("\\boxed{A}"))[0] is True
    assert script("vstar").rule(rec("red")) == (None, "A. red")  # the LLM judge decides
    # a shuffled run: its own gold letter
    assert script("vstar").rule(rec("B. blue", answer="B"))[0] is True


def test_hrbench_letter_anywhere_and_pope_case():
    assert script("hrbench").rule(rec("Because of B, the answer is C", answer="C"))[0] is True
    assert script("hrbench").rule(rec("BAD", answer="D")) == (True, "D")  # loose: any D counts
    assert script("hrbench").rule(rec("none", answer="D")) == (None, "D")
    assert script("pope").rule(rec("yes", answer="yes"))[0] is True
    assert script("pope").rule(rec("Yes", answer="yes"))[0] is False  # same length: case-sensitive
    assert script("pope").rule(rec("Yes.", answer="yes"))[0] is None  # other length: LLM judge


def test_score_records_drops_errors_and_lists_judge_rows():
    recs = [rec("A", id="1"), rec("B", id="2"), rec("red", id="3"),
            rec("", id="4", error="Step exceeds maximum number of steps")]  # fmt: skip
    no_judge = get("vstar").score_published(recs)
    assert (no_judge.n, no_judge.n_errors, no_judge.correct) == (3, 1, 1)
    assert no_judge.needs_judge == ["3"]
    asked = []

    def ask(system, prompt):
        asked.append((system, prompt))
        return "1"

    judged = get("vstar").score_published(recs, ask)
    assert judged.correct == 2 and judged.judged == 1 and not judged.needs_judge
    assert asked[0][0] == "You are a helpful assistant."
    assert asked[0][1].endswith("[Standard Answer]: A. red\n[Model_answer] : red\nJudgement:")
    assert judged.to_dict()["accuracy"] == 2 / 3


def test_registry_names_each_benchmarks_script():
    assert script("vstar") is ps.VSTAR_SCRIPT and script("HR-Bench") is ps.HR_SCRIPT
    assert script("pope") is ps.POPE_SCRIPT
    with pytest.raises(ValueError, match="cover vstar, hrbench and pope, not 'jsonl'"):
        get("jsonl").score_published([rec("A")])
