"""Offline scoring by the rules of github.com/MAC-AutoML/SpecEyes judge_code/judge_{vstar,hr,pope}.py."""

from __future__ import annotations

import hashlib

from speceyes.bench import published_scoring as ps

# sha256 of get_prompt('tan it is', 'A. The cup is tan.', 'What color?') in judge_vstar.py and
# judge_pope.py (identical), and in judge_hr.py
VSTAR_POPE_PROMPT_SHA256 = "1087358ffb3052de99b11bac98dde894f2660728c4c0f4c890e37665d7ab4b9f"
HR_PROMPT_SHA256 = "e1d35a8d36fbc0fe96fa5cee082375451be2a53f2f4f82372c82b7e9af10ac4d"


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def test_judge_prompts_are_the_reference_bytes():
    args = ("What color?", "A. The cup is tan.", "tan it is")
    assert _sha(ps.judge_prompt("vstar", *args)) == VSTAR_POPE_PROMPT_SHA256
    assert _sha(ps.judge_prompt("pope", *args)) == VSTAR_POPE_PROMPT_SHA256
    assert _sha(ps.judge_prompt("hrbench", *args)) == HR_PROMPT_SHA256


def test_judge_verdicts():
    assert ps.judge_verdict("vstar", "1") and not ps.judge_verdict("vstar", "1.")
    assert ps.judge_verdict("pope", "Judgement: 1") and not ps.judge_verdict("pope", "0")
    assert ps.judge_verdict("hrbench", "I think 1")


def rec(pred, answer="A", options=("red", "blue"), **kw):
    return {"id": kw.pop("id", "x"), "prediction": pred, "answer": answer, "options": list(options),
            "question": "What color?", "category": "direct_attributes", **kw}  # fmt: skip


def test_vstar_rules():
    assert ps.rule("vstar", rec("A")) == (True, "A")
    assert ps.rule("vstar", rec("a"))[0] is False  # case-sensitive
    assert ps.rule("vstar", rec("A."))[0] is True and ps.rule("vstar", rec("B."))[0] is False
    assert ps.rule("vstar", rec("The answer is A. red"))[0] is True  # 'A. ' + gold inside
    assert ps.rule("vstar", rec("\\boxed{A}"))[0] is True
    assert ps.rule("vstar", rec("red")) == (None, "A. red")  # the LLM judge decides
    # a shuffled run: its own gold letter
    assert ps.rule("vstar", rec("B. blue", answer="B"))[0] is True


def test_hrbench_letter_anywhere_and_pope_case():
    assert ps.rule("hrbench", rec("Because of B, the answer is C", answer="C"))[0] is True
    assert ps.rule("hrbench", rec("BAD", answer="D")) == (True, "D")  # loose: any D counts
    assert ps.rule("hrbench", rec("none", answer="D")) == (None, "D")
    assert ps.rule("pope", rec("yes", answer="yes"))[0] is True
    assert ps.rule("pope", rec("Yes", answer="yes"))[0] is False  # same length: case-sensitive
    assert ps.rule("pope", rec("Yes.", answer="yes"))[0] is None  # other length: LLM judge


def test_score_records_drops_errors_and_lists_judge_rows():
    recs = [rec("A", id="1"), rec("B", id="2"), rec("red", id="3"),
            rec("", id="4", error="Step exceeds maximum number of steps")]  # fmt: skip
    no_judge = ps.score_records("vstar", recs)
    assert (no_judge.n, no_judge.n_errors, no_judge.correct) == (3, 1, 1)
    assert no_judge.needs_judge == ["3"]
    asked = []

    def ask(system, prompt):
        asked.append((system, prompt))
        return "1"

    judged = ps.score_records("vstar", recs, ask)
    assert judged.correct == 2 and judged.judged == 1 and not judged.needs_judge
    assert asked[0][0] == "You are a helpful assistant."
    assert asked[0][1].endswith("[Standard Answer]: A. red\n[Model_answer] : red\nJudgement:")
    assert judged.to_dict()["accuracy"] == 2 / 3
