import math

import numpy as np
import pytest

from speceyes import gate


def _reference_sep(row, k):
    z = sorted(row, reverse=True)[:k]
    comp = z[1:]
    mean = sum(comp) / len(comp)
    std = math.sqrt(sum((c - mean) ** 2 for c in comp) / len(comp))
    return (z[0] - mean) / (std + 1e-6)


def test_hand_computed_example():
    # Top-4 of token 1: 5, 2, 1, 0 -> competitors mean 1, std sqrt(2/3).
    values = np.array([[5.0, 0.0, 1.0, 2.0, -3.0], [1.0, 1.0, 1.0, 4.0, 1.0]])
    s1 = (5 - 1) / (math.sqrt(2 / 3) + 1e-6)
    s2 = (4 - 1) / (0 + 1e-6)  # flat competitors -> huge separability
    np.testing.assert_allclose(gate.token_separability(values, top_k=4), [s1, s2], rtol=1e-9)
    expected = 1 / (1 + math.exp(-0.6 * min(s1, s2)))
    assert abs(gate.answer_confidence(values, top_k=4, agg="min") - expected) < 1e-9
    mean_conf = 1 / (1 + math.exp(-0.6 * (s1 + s2) / 2))
    assert abs(gate.answer_confidence(values, top_k=4, agg="mean") - mean_conf) < 1e-9


def test_matches_reference_loop_to_1e5():
    rng = np.random.default_rng(0)
    values = rng.normal(size=(7, 300)) * 3
    ref = [_reference_sep(list(r), 64) for r in values]
    np.testing.assert_allclose(gate.token_separability(values, 64), ref, atol=1e-5)
    for agg, agg_val in [
        ("min", min(ref)),
        ("mean", sum(ref) / len(ref)),
        ("bottom", sorted(ref)[0]),  # int(0.2 * 7) = 1 lowest
    ]:
        conf = gate.answer_confidence(values, agg=agg)
        assert abs(conf - 1 / (1 + math.exp(-0.6 * agg_val))) < 1e-5


def test_bottom_uses_lowest_fifth():
    rng = np.random.default_rng(1)
    values = rng.normal(size=(10, 80))
    s = np.sort(gate.token_separability(values, 64))
    expected = 1 / (1 + np.exp(-0.6 * s[:2].mean()))
    assert abs(gate.answer_confidence(values, agg="bottom") - expected) < 1e-12


def test_log_baseline_is_geometric_mean_of_max_prob():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(5, 64))
    p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    expected = float(np.exp(np.log(p.max(axis=1)).mean()))
    assert abs(gate.answer_confidence(logits, agg="log") - expected) < 1e-9


def test_invariant_to_constant_per_token_so_logprobs_equal_logits():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(6, 500)) * 2
    shifts = rng.normal(size=(6, 1)) * 100
    logprobs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    for agg in ("min", "mean", "bottom"):
        base = gate.answer_confidence(logits, agg=agg)
        assert abs(gate.answer_confidence(logits + shifts, agg=agg) - base) < 1e-9
        assert abs(gate.answer_confidence(logprobs, agg=agg) - base) < 1e-9


def test_full_vocabulary_equals_its_own_top_k():
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(4, 1000))
    topk = -np.sort(-logits, axis=1)[:, :64]
    shuffled = rng.permuted(topk, axis=1)  # order of the given top-K does not matter
    for agg in gate.AGGREGATIONS:
        full = gate.answer_confidence(logits, agg=agg)
        assert abs(gate.answer_confidence(topk, agg=agg) - full) < 1e-12
        assert abs(gate.answer_confidence(shuffled, agg=agg) - full) < 1e-12


def test_batch_of_different_lengths_matches_single():
    rng = np.random.default_rng(5)
    answers = [rng.normal(size=(n, 70 + n)) for n in (1, 4, 9)] + [np.zeros((0, 70))]
    for agg in gate.AGGREGATIONS:
        batch = gate.batch_confidence(answers, agg=agg)
        for a, c in zip(answers[:3], batch[:3], strict=True):
            assert abs(c - gate.answer_confidence(a, agg=agg)) < 1e-12
        assert np.isnan(batch[3])


def test_errors():
    with pytest.raises(ValueError, match="top_k=64"):
        gate.answer_confidence(np.zeros((3, 20)))
    with pytest.raises(ValueError, match="no tokens"):
        gate.answer_confidence(np.zeros((0, 100)))
    with pytest.raises(ValueError, match="aggregation"):
        gate.answer_confidence(np.zeros((2, 100)), agg="max")
    with pytest.raises(ValueError, match="shape"):
        gate.answer_confidence(np.zeros(100))


def test_accept_is_strict_and_rejects_missing():
    assert gate.accept(0.99, 0.98)
    assert not gate.accept(0.98, 0.98)
    assert not gate.accept(float("nan"), 0.5)
    assert not gate.accept(None, 0.5)
    # tau 0.98 means aggregate > 6.49: sigmoid(0.6 * 6.49) = 0.98
    assert gate.confidence_from_aggregate(6.50) > 0.98 > gate.confidence_from_aggregate(6.48)


def test_missing_logprobs_make_an_answer_unscorable_under_every_aggregation():
    rng = np.random.default_rng(6)
    values = rng.normal(size=(6, 64))
    values[2, 40:] = -np.inf  # a server returned only 40 of the 64 requested logprobs
    for agg in ("min", "mean", "bottom"):
        assert np.isnan(gate.batch_confidence([values], agg=agg)[0])
        assert not gate.accept(gate.batch_confidence([values], agg=agg)[0], 0.0)
