"""Score a logged run by the rules of the authors' judge scripts (offline).

github.com/MAC-AutoML/SpecEyes ``judge_code/judge_{vstar,hr,pope}.py``:

* rows whose status is an error leave every denominator (``fair`` counts them wrong);
* ``\\boxed{x}`` is unwrapped first;
* V*: a one-character answer is right iff it is the gold letter; a two-character answer with a
  "." iff it holds the gold letter; else right iff ``"<letter>. <gold option>"`` occurs in it;
  else the LLM judge decides. The published options are never shuffled, so its letter is
  always A; a shuffled run is scored with its own gold letter;
* HR-Bench: the same first two rules, then the gold letter *anywhere* in the answer, else the
  LLM judge; accuracy is pooled over rows (no cycle averaging);
* POPE: an answer as long as the gold one is compared case-sensitively ("Yes" is wrong for
  "yes"); any other length goes to the LLM judge.

The LLM judge is any OpenAI-compatible chat endpoint (the authors used Qwen2.5-72B through
vLLM), asked with the scripts' own few-shot prompt at temperature 0. Without one, the rows that
need it are listed and counted wrong.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from speceyes.bench.datasets import option_letter

# get_chat_template(): V* and POPE share one text (with its "Judement" spelling and two spaces
# before "Determine"); HR-Bench spells "Judgement" and has one space.
_TEMPLATE = (
    "\nBelow are two answers to a question. Question is [Question], [Standard Answer] is the "
    "standard answer to the question, and [Model_answer] is the answer extracted from a model's "
    "output to this question.{gap}Determine whether these two answers are consistent.\n"
    "Note that [Model Answer] is consistent with [Standard Answer] whenever they are essentially "
    "the same. If the meaning is expressed in the same way, it is considered consistent, for "
    "example, 'pink' and 'it is pink'.\n"
    "If they are consistent, {j} is 1; if they are different, {j} is 0. Just output {j} and "
    "don't output anything else.\n\n\n"
)
VSTAR_POPE_TEMPLATE = _TEMPLATE.format(gap="  ", j="Judement")
HR_TEMPLATE = _TEMPLATE.format(gap=" ", j="Judgement")
# get_gpt4_score_ICE(): the seven in-context examples, the same in all three scripts.
_EXAMPLES = (
    ("Is the countertop tan or blue?", "A. The countertop is tan.", "tan", 1),
    ("On which side of the picture is the barrier?",
     "A. The barrier is on the left side of the picture.", "A", 1),
    ("Is the kite brown and large?", "A. Yes, the kite is brown and large.", "Yes", 1),
    ("Are the spots on a giraffe?", "A. No, the spots are on a banana.", "no", 1),
    ("Who is wearing pants?", "A. The boy is wearing pants.",
     "C. The girl in the picture is wearing pants.", 0),
    ("Is the man phone both blue and closed?", "A. Yes, the man phone is both blue and closed.",
     "No.", 0),
    ("What color is the towel in the center of the picture?",
     "A. The towel in the center of the picture is blue.",
     "The towel in the center of the picture is pink.", 0),
)  # fmt: skip
EXAMPLES = tuple(
    f"\n[Question]: {q}\n[Standard Answer]: {a}\n[Model_answer] : {m}\nJudgement: {j}\n"
    for q, a, m, j in _EXAMPLES
)
JUDGE_SYSTEM = "You are a helpful assistant."


def _vstar_pope_prompt(question: str, reference: str, prediction: str) -> str:
    """get_prompt() of judge_vstar.py and judge_pope.py, byte for byte."""
    examples = "".join(e + "\n\n" for e in EXAMPLES)
    return VSTAR_POPE_TEMPLATE + examples + _query(question, reference, prediction)


def _hr_prompt(question: str, reference: str, prediction: str) -> str:
    """get_prompt() of judge_hr.py, byte for byte."""
    examples = "\n\n".join(EXAMPLES) + "\n\n"
    return HR_TEMPLATE + examples + _query(question, reference, prediction)


def _query(question: str, reference: str, prediction: str) -> str:
    return (
        f"\n[Question]: {question}\n[Standard Answer]: {reference}\n"
        f"[Model_answer] : {prediction}\nJudgement:"
    )


def _judged_part(reply: str) -> str | None:
    """The text after the last "Judgement:", where the scripts look first (None: no such tag)."""
    reply = reply.strip()
    return reply.split("Judgement:")[-1].strip() if "Judgement:" in reply else None


def _strict_verdict(reply: str) -> bool:
    """judge_vstar.py / judge_pope.py: without the tag, the reply must be exactly "1"."""
    part = _judged_part(reply)
    return "1" in part if part is not None else reply.strip() == "1"


def _loose_verdict(reply: str) -> bool:
    """judge_hr.py: without the tag, any "1" in the reply."""
    part = _judged_part(reply)
    return "1" in (part if part is not None else reply.strip())


def _unbox(pred: str) -> str:
    if "\\boxed" in pred:
        return pred.split("\\boxed{")[1].split("}")[0]
    return pred


def _letter_rule(pred: str, letter: str) -> bool | None:
    """The first two rules of the V* and HR-Bench scripts (None: they do not decide)."""
    if len(pred) == 1:
        return pred == letter
    if len(pred) == 2 and "." in pred:
        return letter in pred
    return None


def _vstar_rule(rec: Mapping[str, Any]) -> tuple[bool | None, str]:
    pred, gold = _unbox(str(rec.get("prediction") or "")), str(rec.get("answer") or "")
    letter = gold.strip().upper()
    decided = _letter_rule(pred, letter)
    if decided is not None:
        return decided, gold
    options = rec.get("options") or []
    idx = ord(letter) - ord("A") if len(letter) == 1 else -1
    text = options[idx] if 0 <= idx < len(options) else ""
    reference = f"{option_letter(idx)}. {text}" if text else letter
    return (True if reference in pred else None), reference


def _hr_rule(rec: Mapping[str, Any]) -> tuple[bool | None, str]:
    pred, gold = _unbox(str(rec.get("prediction") or "")), str(rec.get("answer") or "")
    letter = gold.strip().upper()
    decided = _letter_rule(pred, letter)
    if decided is not None:
        return decided, gold
    return (True if letter in pred else None), letter


def _pope_rule(rec: Mapping[str, Any]) -> tuple[bool | None, str]:
    pred, gold = _unbox(str(rec.get("prediction") or "")), str(rec.get("answer") or "")
    return (pred == gold if len(pred) == len(gold) else None), gold


@dataclass(frozen=True)
class JudgeScript:
    """One of the authors' judge scripts: its rules, its LLM-judge prompt, its reading of the
    judge's reply. A benchmark's registry entry names the script that scores it."""

    name: str  # the script's file name in judge_code/
    rule: Callable[[Mapping[str, Any]], tuple[bool | None, str]]
    prompt: Callable[[str, str, str], str]  # (question, reference, prediction) -> prompt
    verdict: Callable[[str], bool]


VSTAR_SCRIPT = JudgeScript("judge_vstar.py", _vstar_rule, _vstar_pope_prompt, _strict_verdict)
HR_SCRIPT = JudgeScript("judge_hr.py", _hr_rule, _hr_prompt, _loose_verdict)
POPE_SCRIPT = JudgeScript("judge_pope.py", _pope_rule, _vstar_pope_prompt, _strict_verdict)


@dataclass
class PublishedScore:
    n_rows: int
    n_errors: int  # dropped from every denominator
    correct: int
    judged: int  # rows decided by the LLM judge
    needs_judge: list[str] = field(default_factory=list)  # ids left undecided (no judge)
    per_category: dict[str, tuple[int, int]] = field(default_factory=dict)  # (correct, n)

    @property
    def n(self) -> int:
        return self.n_rows - self.n_errors

    @property
    def accuracy(self) -> float:
        return self.correct / self.n if self.n else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "n": self.n,
            "n_errors_dropped": self.n_errors,
            "correct": self.correct,
            "accuracy": self.accuracy,
            "llm_judged": self.judged,
            "needs_llm_judge": list(self.needs_judge),
            "per_category": {
                k: {"n": n, "correct": c, "accuracy": c / n if n else 0.0}
                for k, (c, n) in sorted(self.per_category.items())
            },
        }


def score_records(
    script: JudgeScript,
    records: Iterable[Mapping[str, Any]],
    ask: Callable[[str, str], str] | None = None,
) -> PublishedScore:
    """Score logged records by ``script``'s rules; ``ask(system, prompt)`` returns the LLM
    judge's reply (or None: undecided rows count as wrong and are listed)."""
    recs = list(records)
    errors = [r for r in recs if r.get("error") or r.get("route") == "error"]
    cats: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    out = PublishedScore(n_rows=len(recs), n_errors=len(errors), correct=0, judged=0)
    for r in recs:
        if r.get("error") or r.get("route") == "error":
            continue
        ok, reference = script.rule(r)
        if ok is None:
            if ask is None:
                out.needs_judge.append(str(r.get("id")))
                ok = False
            else:
                pred = _unbox(str(r.get("prediction") or ""))
                prompt = script.prompt(str(r.get("question") or ""), reference, pred)
                ok = script.verdict(ask(JUDGE_SYSTEM, prompt))
                out.judged += 1
        cat = cats[str(r.get("category") or "all")]
        cat[0] += bool(ok)
        cat[1] += 1
        out.correct += bool(ok)
    out.per_category = {k: (c, n) for k, (c, n) in cats.items()}
    return out


def openai_judge(base_url: str, model: str | None = None) -> Callable[[str, str], str]:
    """``ask`` over an OpenAI-compatible endpoint, greedy, as the judge scripts call it."""
    import openai

    client = openai.OpenAI(
        base_url=base_url, api_key="EMPTY", http_client=openai.DefaultHttpxClient(trust_env=False)
    )
    name = model or client.models.list().data[0].id

    def ask(system: str, prompt: str) -> str:
        resp = client.chat.completions.create(
            model=name,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": prompt}],
            temperature=0.0,
        )
        return resp.choices[0].message.content or ""

    return ask
