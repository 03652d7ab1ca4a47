"""Deterministic answer parsing and benchmark metrics (no LLM judge).

Parsing rules (the README's "Fair data handling" and "What is exact" sections):

* Multiple choice: parse the *chosen* letter ("B", "(B)", "B. red", "The answer is B", the option
  text...). A letter merely occurring somewhere in the text never counts (the loose-matching bug
  of some HR-Bench evaluations).
* Yes/no: the first word, case-insensitive, punctuation stripped.

Metrics count errors and timeouts as wrong and keep them in every denominator. Each benchmark's
registry entry (:mod:`speceyes.bench.benchmarks`) names its metrics function.
"""

from __future__ import annotations

import re
import string
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "parse_choice",
    "parse_yes_no",
    "normalize_text",
    "is_correct",
    "record_correct",
    "accuracy_metrics",
    "vstar_metrics",
    "hrbench_metrics",
    "pope_metrics",
]

_LETTERS = string.ascii_uppercase

_THINK_RE = re.compile(r"<think>.*?(</think>|$)", re.S | re.I)
_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)(?:</answer>|$)", re.S | re.I)
_BOXED_RE = re.compile(r"\\boxed\{\s*([^{}]*?)\s*\}")
_MARKDOWN_RE = re.compile(r"\*\*|__|`")
_MAX_DISTINCTIVE_WORDS = 12
_NEGATIONS = frozenset({"not", "no", "t", "never", "neither", "nor", "nothing", "none"})


def _strip_wrappers(text: str) -> str:
    """Drop <think> blocks, unwrap <answer>...</answer> (the last one) and markdown emphasis."""
    t = _THINK_RE.sub(" ", text)
    tags = _ANSWER_TAG_RE.findall(t)
    if tags and any(s.strip() for s in tags):
        t = [s for s in tags if s.strip()][-1]
    t = _MARKDOWN_RE.sub("", t)
    return t.strip()


def normalize_text(s: str) -> str:
    """Lowercase, punctuation to spaces, whitespace collapsed."""
    return " ".join(re.sub(r"[^\w\s]", " ", s.lower()).split())


def _valid(letter: str, n: int) -> str | None:
    letter = letter.upper()
    return letter if letter in _LETTERS[:n] else None


def _letter_patterns(n: int) -> tuple[re.Pattern[str], re.Pattern[str], re.Pattern[str]]:
    cls = f"[A-{_LETTERS[n - 1]}]"
    # The whole answer is a letter: "B", "(B)", "B.", "b)", "[B]".
    whole = re.compile(rf"^[\(\[]?({cls})[\)\]]?[.:;,!]?$", re.I)
    # Leading letter with a delimiter and the option text: "B. red", "B) red", "(B) red", "B: red".
    leading = re.compile(rf"^(?:\(({cls})\)|\[({cls})\]|({cls})[.):])(?:\s|$)")
    # An explicit statement: "The answer is B", "answer: (B)", "correct option is B".
    phrase = re.compile(
        r"(?:\banswer|\bcorrect\s+(?:option|choice)|\bfinal\s+(?:answer|option|choice))\b"
        r"(?:\s+(?:is|would\s+be|should\s+be|will\s+be))?\s*[:=]?\s*(?:option\s+|choice\s+)?"
        rf"[\(\[]?({cls})[\)\]]?(?![A-Za-z0-9])(\s+[a-z])?",
        re.I,
    )
    return whole, leading, phrase


def _match_option_text(t: str, options: list[str]) -> int | None:
    norm_t = normalize_text(t)
    if not norm_t:
        return None
    norm_opts = [normalize_text(o) for o in options]
    exact = [i for i, o in enumerate(norm_opts) if o and o == norm_t]
    if len(exact) == 1:
        return exact[0]
    if exact:
        return None
    padded = f" {norm_t} "
    inside = [i for i, o in enumerate(norm_opts) if o and f" {o} " in padded]
    # "dark red" contains "red": drop a match that is part of another matched option.
    inside = [
        i
        for i in inside
        if not any(j != i and f" {norm_opts[i]} " in f" {norm_opts[j]} " for j in inside)
    ]
    if len(inside) == 1:
        return inside[0]
    if inside:
        return None
    # A short answer that is part of exactly one option ("left" vs "... on the left of ...").
    contained = [i for i, o in enumerate(norm_opts) if padded in f" {o} "]
    if len(contained) == 1:
        return contained[0]
    return None


def _match_distinctive_words(t: str, options: list[str]) -> int | None:
    """The single option whose distinctive words (absent from every other option) occur in the
    answer: "It is on the left." for "The cup is on the left/right of the plate.".

    Only for short answers without negation, so reasoning that mentions several options, or
    "not on the left", never picks one by accident."""
    tokens = normalize_text(t).split()
    if len(tokens) > _MAX_DISTINCTIVE_WORDS or _NEGATIONS & set(tokens):
        return None
    words = set(tokens)
    opt_words = [set(normalize_text(o).split()) for o in options]
    hits = []
    for i, ow in enumerate(opt_words):
        others = set().union(*(w for j, w in enumerate(opt_words) if j != i))
        if (ow - others) & words:
            hits.append(i)
    return hits[0] if len(hits) == 1 else None


def parse_choice(text: str | None, options: list[str] | None) -> str | None:
    """The letter chosen in ``text`` among ``options`` (A, B, ...), or None.

    Accepts a bare letter ("B", "(B)", "B."), a leading letter with a delimiter ("B. red",
    "B) red"), an explicit statement ("The answer is B", "answer: (B)"), ``**B**``,
    ``<answer>B</answer>``, ``\\boxed{B}``, or the option text (exact after normalisation, else the
    single option whose text occurs in the answer, else the single option the whole short answer
    is part of, else the single option whose distinctive words a short answer uses). A letter
    elsewhere in the text is ignored, so "A red car" is not "A".
    """
    if text is None:
        return None
    n = len(options) if options else 4
    n = max(1, min(n, len(_LETTERS)))
    t = _strip_wrappers(str(text))
    if not t:
        return None
    whole, leading, phrase = _letter_patterns(n)
    m = whole.match(t)
    if m:
        return _valid(m.group(1), n)
    m = leading.match(t)
    if m:
        return _valid(next(g for g in m.groups() if g), n)
    boxed = _BOXED_RE.findall(t)
    if boxed:
        got = parse_choice(boxed[-1], options)
        if got:
            return got
    matches = []
    for m in phrase.finditer(t):
        letter = m.group(1)
        # "The answer is a red car": a lowercase "a" (or "A" followed by a lowercase word) there
        # is the article, not option A.
        if letter.upper() == "A" and (letter == "a" or m.group(2)):
            continue
        if letter.islower() and m.group(2):
            continue
        matches.append(letter)
    if matches:
        return _valid(matches[-1], n)
    first = t.splitlines()[0].strip()
    if first != t:  # "B\n\nBecause ...", "B. red\nThe car ..."
        m = whole.match(first) or leading.match(first)
        if m:
            return _valid(next(g for g in m.groups() if g), n)
    if options:
        for candidate in (t, first) if first != t else (t,):
            i = _match_option_text(candidate, options)
            if i is not None:
                return _LETTERS[i]
        i = _match_distinctive_words(t, options)
        if i is not None:
            return _LETTERS[i]
    return None


def parse_yes_no(text: str | None) -> str | None:
    """Return "yes"/"no" from the first word of ``text`` (case-insensitive, punctuation stripped)."""
    if text is None:
        return None
    t = _strip_wrappers(str(text))
    words = normalize_text(t).split()
    if not words:
        return None
    return words[0] if words[0] in ("yes", "no") else None


def is_correct(query: Any, prediction: str | None) -> bool:
    """Whether ``prediction`` answers ``query`` (a :class:`speceyes.types.Query`).

    Multiple choice compares the parsed letter, yes/no gold compares the first word, anything
    else compares normalised text exactly. No gold answer -> False.
    """
    gold = getattr(query, "answer", None)
    if gold is None or prediction is None:
        return False
    options = getattr(query, "options", None)
    if options:
        return parse_choice(prediction, options) == str(gold).strip().upper()
    g = str(gold).strip().lower()
    if g in ("yes", "no"):
        return parse_yes_no(prediction) == g
    return normalize_text(str(prediction)) == normalize_text(str(gold))


# ----------------------------------------------------------------------------------------- metrics


def _get(rec: Any, name: str, default: Any = None) -> Any:
    if isinstance(rec, Mapping):
        return rec.get(name, default)
    return getattr(rec, name, default)


def _has_error(rec: Any) -> bool:
    return bool(_get(rec, "error"))


def record_correct(rec: Any) -> bool:
    """A record's correctness: wrong when it carries an error, else its ``correct`` field."""
    if _has_error(rec):
        return False
    return bool(_get(rec, "correct", False))


def _acc_block(recs: list[Any]) -> dict[str, Any]:
    n = len(recs)
    c = sum(record_correct(r) for r in recs)
    return {
        "n": n,
        "correct": c,
        "accuracy": c / n if n else 0.0,
        "n_errors": sum(_has_error(r) for r in recs),
    }


def _by(recs: Iterable[Any], key) -> dict[Any, list[Any]]:
    groups: dict[Any, list[Any]] = defaultdict(list)
    for r in recs:
        groups[key(r)].append(r)
    return dict(sorted(groups.items(), key=lambda kv: str(kv[0])))


def _category(r: Any) -> str:
    c = _get(r, "category")
    return "unknown" if c is None else str(c)


def accuracy_metrics(records: Iterable[Any]) -> dict[str, Any]:
    """Accuracy per category and overall (all records pooled)."""
    recs = list(records)
    out = _acc_block(recs)
    out["per_category"] = {k: _acc_block(v) for k, v in _by(recs, _category).items()}
    return out


def vstar_metrics(records: Iterable[Any]) -> dict[str, Any]:
    """V* Bench: accuracy per category and overall, pooled over all samples (official script)."""
    return accuracy_metrics(records)


def hrbench_metrics(records: Iterable[Any]) -> dict[str, Any]:
    """HR-Bench, as the official evaluation: within each ``cycle_category`` compute the accuracy
    over all rows and per category (single, cross); then average each over the cycles.

    ``accuracy`` is that cycle-averaged overall accuracy, ``single``/``cross`` the cycle-averaged
    per-category ones (averaged over the cycles holding that category). ``pooled`` and
    ``pooled_per_category`` give plain accuracies over all rows for reference.
    """
    recs = list(records)

    def cycle(r: Any) -> str:
        meta = _get(r, "meta") or {}
        c = meta.get("cycle_category") if isinstance(meta, Mapping) else None
        return "unknown" if c is None else str(c)

    per_cycle: dict[str, dict[str, Any]] = {}
    cat_accs: dict[str, list[float]] = defaultdict(list)
    for cyc, group in _by(recs, cycle).items():
        block = _acc_block(group)
        block["per_category"] = {}
        for cat, sub in _by(group, _category).items():
            sb = _acc_block(sub)
            block["per_category"][cat] = sb
            cat_accs[cat].append(sb["accuracy"])
        per_cycle[cyc] = block
    cyc_accs = [b["accuracy"] for b in per_cycle.values()]
    out: dict[str, Any] = {
        "n": len(recs),
        "n_errors": sum(_has_error(r) for r in recs),
        "accuracy": sum(cyc_accs) / len(cyc_accs) if cyc_accs else 0.0,
        "per_category": {cat: sum(v) / len(v) for cat, v in sorted(cat_accs.items())},
    }
    for cat in ("single", "cross"):
        out[cat] = out["per_category"].get(cat)
    out["per_cycle"] = per_cycle
    out["pooled"] = _acc_block(recs)
    out["pooled_per_category"] = {k: _acc_block(v) for k, v in _by(recs, _category).items()}
    return out


def _pope_block(recs: list[Any]) -> dict[str, Any]:
    tp = fp = tn = fn = pred_yes = unparsed = 0
    for r in recs:
        gold = str(_get(r, "answer") or "").strip().lower()
        pred = None if _has_error(r) else parse_yes_no(_get(r, "prediction"))
        if pred is None:
            unparsed += not _has_error(r)
            fn += gold == "yes"  # a missing answer on a positive is a miss
            continue
        if pred == "yes":
            pred_yes += 1
            tp += gold == "yes"
            fp += gold != "yes"
        else:
            fn += gold == "yes"
            tn += gold != "yes"
    block = _acc_block(recs)
    n = block["n"]
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    block.update(
        precision=precision,
        recall=recall,
        f1=f1,
        yes_ratio=pred_yes / n if n else 0.0,
        tp=tp,
        fp=fp,
        tn=tn,
        fn=fn,
        n_unparsed=unparsed,
    )
    return block


def pope_metrics(records: Iterable[Any]) -> dict[str, Any]:
    """POPE: accuracy, precision, recall, F1 (positive = "yes") and ``yes_ratio`` (the share of
    *predicted* yes among all records), per split (``category``) and overall (pooled).

    Errors and unparsable answers are never a predicted yes: they count as wrong, and as misses
    (FN) when the gold answer is yes.
    """
    recs = list(records)
    out = _pope_block(recs)
    out["per_split"] = {k: _pope_block(v) for k, v in _by(recs, _category).items()}
    return out

