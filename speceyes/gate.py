"""The cognitive gate: answer separability from the small model's own logits.

Pure array code; knows nothing of models. Definitions follow the published implementation of
SpecEyes (arXiv 2603.23483): per generated token, with the top-K values z1 >= ... >= zK,

    s = (z1 - mean(z2..zK)) / (std(z2..zK) + eps),   population std, eps = 1e-6

aggregated over the answer's tokens (``min`` by default), and

    confidence = sigmoid(scale * aggregate),   accept iff confidence > tau.

Separability is invariant to adding a constant per token, so logprobs give the same score as
logits over the same K.

A blank answer (empty or whitespace-only text) answers nothing, however peaked its logits: its
confidence is ``BLANK_CONFIDENCE`` (0.0), so the gate never accepts it at any tau >= 0 and the
agent answers instead (:func:`without_blank`; an answer with no tokens keeps NaN, no score).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from speceyes.types import AGGREGATIONS, Aggregation  # defined with the other names; re-exported

EPS = 1e-6
DEFAULT_TOP_K = 64
DEFAULT_SCALE = 0.6
BOTTOM_RATIO = 0.2
BLANK_CONFIDENCE = 0.0


def _top_k_sorted(values: np.ndarray, top_k: int) -> np.ndarray:
    """Top-K of the last axis, sorted descending. Accepts full logits or an existing top-K."""
    if values.shape[-1] < top_k:
        raise ValueError(
            f"need at least top_k={top_k} values per token, got {values.shape[-1]}; "
            "lower top_k or log more logprobs"
        )
    if top_k < 2:
        raise ValueError("top_k must be at least 2 (the top value and one competitor)")
    x = values.astype(np.float64, copy=False)
    if x.shape[-1] > top_k:
        x = np.partition(x, x.shape[-1] - top_k, axis=-1)[..., -top_k:]
    return -np.sort(-x, axis=-1)


def token_separability(values: np.ndarray, top_k: int = DEFAULT_TOP_K) -> np.ndarray:
    """Separability of every token: ``values`` has shape [..., V] with V >= top_k."""
    z = _top_k_sorted(np.asarray(values), top_k)
    competitors = z[..., 1:]
    return (z[..., 0] - competitors.mean(axis=-1)) / (competitors.std(axis=-1) + EPS)


def _log_max_prob(values: np.ndarray, top_k: int) -> np.ndarray:
    """log of the max-softmax probability per token over the given (top-K) values."""
    z = _top_k_sorted(np.asarray(values), top_k)
    shifted = z - z[..., :1]
    return -np.log(np.exp(shifted).sum(axis=-1))


def confidence_from_aggregate(aggregate: np.ndarray | float, scale: float = DEFAULT_SCALE):
    return 1.0 / (1.0 + np.exp(-scale * np.asarray(aggregate, dtype=np.float64)))


def batch_confidence(
    answers: Sequence[np.ndarray],
    top_k: int = DEFAULT_TOP_K,
    agg: Aggregation = "min",
    scale: float = DEFAULT_SCALE,
    ratio: float = BOTTOM_RATIO,
) -> np.ndarray:
    """Confidence of each answer in a batch of answers of different lengths.

    Each element has shape [tokens_i, V_i >= top_k]. The work runs on one padded array with a
    mask, with no Python loop over tokens. An answer with no tokens gets NaN (never accepted).
    """
    if agg not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {agg!r}; choose from {', '.join(AGGREGATIONS)}")
    n = len(answers)
    lengths = np.array([len(a) for a in answers], dtype=np.int64)
    out = np.full(n, np.nan)
    if n == 0 or lengths.max(initial=0) == 0:
        return out
    tmax = int(lengths.max())
    width = max(np.shape(a)[-1] if np.ndim(a) == 2 else 0 for a in answers)
    if any(len(a) and np.ndim(a) != 2 for a in answers):
        raise ValueError("each answer's values must have shape [tokens, V]")
    # Pad the vocabulary axis with -inf so narrower rows keep their own top-K; pad tokens are masked.
    padded = np.full((n, tmax, width), -np.inf)
    for i, a in enumerate(answers):
        if len(a):
            a = np.asarray(a, dtype=np.float64)
            if a.shape[-1] < top_k:
                raise ValueError(
                    f"answer {i}: need at least top_k={top_k} values per token, got {a.shape[-1]}"
                )
            padded[i, : len(a), : a.shape[-1]] = a
    mask = np.arange(tmax)[None, :] < lengths[:, None]
    # Masked rows are all -inf; give them finite values so no warnings leak, then ignore them.
    padded[~mask] = 0.0

    # A server may return fewer than K logprobs (rows padded with -inf): such a token scores NaN
    # and its answer is never accepted; that is intended, so the float warnings are not shown.
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        conf = _aggregate(padded, mask, lengths, top_k, agg, scale, ratio)
    out[lengths > 0] = conf[lengths > 0]
    return out


def _aggregate(
    padded: np.ndarray,
    mask: np.ndarray,
    lengths: np.ndarray,
    top_k: int,
    agg: str,
    scale: float,
    ratio: float,
) -> np.ndarray:
    tmax = padded.shape[1]
    if agg == "log":
        logp = np.where(mask, _log_max_prob(padded, top_k), 0.0)
        conf = np.exp(logp.sum(axis=1) / np.maximum(lengths, 1))
    else:
        s = token_separability(padded, top_k)
        if agg == "min":
            aggregate = np.where(mask, s, np.inf).min(axis=1)
        elif agg == "mean":
            aggregate = np.where(mask, s, 0.0).sum(axis=1) / np.maximum(lengths, 1)
        else:  # bottom: mean of the lowest max(1, int(r * n)) scores
            m = np.maximum(1, (ratio * lengths).astype(np.int64))
            ordered = np.sort(np.where(mask, s, np.inf), axis=1)
            take = np.arange(tmax)[None, :] < m[:, None]
            aggregate = np.where(take, ordered, 0.0).sum(axis=1) / m
            # Sorting moves NaN (a token with fewer than K logprobs) past the lowest scores;
            # such an answer must stay unscorable, as it is under min and mean.
            aggregate[np.isnan(np.where(mask, s, 0.0)).any(axis=1)] = np.nan
        conf = confidence_from_aggregate(aggregate, scale)
    return conf


def answer_confidence(
    values: np.ndarray,
    top_k: int = DEFAULT_TOP_K,
    agg: Aggregation = "min",
    scale: float = DEFAULT_SCALE,
) -> float:
    """Confidence of one answer; ``values`` is [tokens, V] of logits, or top-K logits/logprobs."""
    arr = np.asarray(values)
    if arr.ndim != 2:
        raise ValueError(f"values must have shape [tokens, V], got shape {arr.shape}")
    if arr.shape[0] == 0:
        raise ValueError("the answer has no tokens before EOS: nothing to score")
    if arr.shape[1] < top_k:
        raise ValueError(
            f"need at least top_k={top_k} values per token, got {arr.shape[1]}; "
            "lower top_k or log more logprobs"
        )
    return float(batch_confidence([arr], top_k=top_k, agg=agg, scale=scale)[0])


def accept(confidence: float | None, tau: float) -> bool:
    """Accept iff confidence > tau (strict); a missing or NaN confidence is never accepted."""
    return confidence is not None and not np.isnan(confidence) and confidence > tau


def is_blank(text: str | None) -> bool:
    """Whether an answer's text is empty or whitespace only."""
    return text is None or not text.strip()


def without_blank(confidence: np.ndarray, texts: Sequence[str | None]) -> np.ndarray:
    """``confidence`` (one per answer) with each blank answer's set to ``BLANK_CONFIDENCE``;
    NaN (an answer with no tokens) stays NaN. A new array."""
    out = np.array(confidence, dtype=np.float64)
    blank = np.array([is_blank(t) for t in texts], dtype=bool)
    out[blank & ~np.isnan(out)] = BLANK_CONFIDENCE
    return out
