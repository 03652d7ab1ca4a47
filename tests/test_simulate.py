"""The serving simulator: exact batch-1 costs, batching physics, the funnel's gain, the schedules."""

from __future__ import annotations

import csv
from dataclasses import replace

import numpy as np
import pytest

from speceyes import simulate as sm

BETA, ALPHA = 0.8, 0.71


def _row(rows: list[sm.Row], schedule: str, c: int) -> sm.Row:
    return next(r for r in rows if r.schedule == schedule and r.concurrency == c)


def _cheap_funnel(costs: sm.CostModel) -> sm.CostModel:
    """Judge and small answer almost free: only the agent's cost is left to save."""
    return replace(
        costs, judge_image_tokens=0, judge_text_tokens=1, small_decode_s=1e-4,
        small_prefill_s_per_token=0.0,
    )


def test_agent_only_at_c1_is_the_sum_of_its_turn_costs():
    costs = sm.CostModel()
    d = sm.draw(costs, 500, BETA, ALPHA, seed=3)
    r = sm.simulate_one("agent-only", costs, d, 1)
    expected = sm.agent_latency_b1(costs, d)
    np.testing.assert_allclose(r.latencies, expected, rtol=1e-9, atol=1e-9)
    # by hand for one query: prefill of image + prompt, crops for the tool turns, decode at t(1)
    q = 0
    k = int(d.turns[q]) - 1
    by_hand = (
        (costs.image_tokens + costs.agent_text_tokens) * costs.large_prefill_s_per_token
        + k * (costs.crop_tokens + costs.tool_text_tokens) * costs.large_prefill_s_per_token
        + int(d.turn_tokens[q, : k + 1].sum()) * costs.large_decode_s
        + k * costs.tool_s
    )
    assert r.latencies[q] == pytest.approx(by_hand, rel=1e-9)
    # queries run back to back: the makespan is the sum of the latencies
    assert r.makespan == pytest.approx(float(expected.sum()), rel=1e-9)


def test_published_and_ours_at_c1_match_the_analytic_latency():
    costs = sm.CostModel()
    d = sm.draw(costs, 3000, BETA, ALPHA, seed=0)
    agent = sm.agent_latency_b1(costs, d)
    cj, cs = costs.judge_s(), costs.small_s()
    a = sm.analytic(costs, BETA, ALPHA)
    assert a.expected_latency == pytest.approx(cj + BETA * cs + (1 - BETA * ALPHA) * a.l_agent)
    assert float(agent.mean()) == pytest.approx(a.l_agent, rel=0.02)  # draws vs their mean

    pub = sm.simulate_one("published", costs, d, 1)  # sequential phases: E[L] exactly
    exact = cj + (~d.tool) * cs + (d.tool | ~d.accept) * agent
    np.testing.assert_allclose(pub.latencies, exact, rtol=1e-9, atol=1e-9)
    assert pub.latencies.mean() == pytest.approx(a.expected_latency, rel=0.03)

    ours = sm.simulate_one("speceyes", costs, d, 1)  # phases I and II overlapped
    exact = np.where(d.tool, cj + agent, max(cj, cs) + (~d.accept) * agent)
    np.testing.assert_allclose(ours.latencies, exact, rtol=1e-9, atol=1e-9)
    assert ours.latencies.mean() == pytest.approx(a.expected_latency_overlap, rel=0.03)
    assert a.expected_latency_overlap < a.expected_latency


def test_agent_only_throughput_grows_with_concurrency_and_saturates_at_max_batch():
    costs = replace(sm.CostModel(), large_max_batch=8)
    rows = sm.simulate(costs, ["agent-only"], [1, 2, 4, 8, 16, 32], n_queries=800)
    thr = [_row(rows, "agent-only", c).throughput for c in (1, 2, 4, 8, 16, 32)]
    assert all(b > a * 1.5 for a, b in zip(thr[:3], thr[1:4], strict=True))  # 1 -> 8: batching
    assert thr[4] == pytest.approx(thr[3], rel=0.05)  # past max_batch: flat
    assert thr[5] == pytest.approx(thr[3], rel=0.05)
    assert _row(rows, "agent-only", 32).large_batch == pytest.approx(8, rel=0.02)
    # the saturated rate follows from t(8): ~max_batch sequences per step
    t8 = costs.step_table(sm.LARGE)[8]
    d = sm.draw(costs, 800, BETA, ALPHA, 0)
    mask = np.arange(d.turn_tokens.shape[1]) < d.turns[:, None]
    decode_s = float((d.turn_tokens * mask).sum(axis=1).mean()) * t8 / 8
    assert thr[5] < 1 / decode_s  # prefill comes on top of the decode bound
    assert thr[5] > 0.7 / decode_s


def test_ours_approaches_the_ideal_gain_when_judge_and_small_are_cheap():
    costs = _cheap_funnel(sm.CostModel())
    rows = sm.simulate(costs, ["agent-only", "speceyes"], [1, 16, 64], n_queries=3000)
    gain = 1 / (1 - BETA * ALPHA)
    for c in (16, 64):
        r = _row(rows, "speceyes", c)
        assert r.vs_agent_only == pytest.approx(gain, rel=0.10)
        assert r.of_ideal == pytest.approx(1.0, rel=0.10)
        assert _row(rows, sm.IDEAL, c).throughput == pytest.approx(
            _row(rows, "agent-only", c).throughput * gain
        )


def test_published_is_at_least_2x_slower_than_ours_at_c16():
    rows = sm.simulate(None, ["published", "speceyes"], [16], n_queries=1500)
    ours, pub = _row(rows, "speceyes", 16), _row(rows, "published", 16)
    # phase IV one query at a time keeps the large engine at batch ~1
    assert ours.throughput >= 2 * pub.throughput
    assert pub.large_batch < 1.5 < ours.large_batch


@pytest.mark.parametrize("beta,alpha", [(0.0, 0.71), (0.8, 0.0)])
def test_no_speculation_gives_no_gain_beyond_overheads(beta, alpha):
    costs = sm.CostModel()
    rows = sm.simulate(costs, ["agent-only", "speceyes"], [1, 16], 1000, beta, alpha)
    for c in (1, 16):
        ratio = _row(rows, "speceyes", c).vs_agent_only
        assert ratio <= 1.0 + 1e-9  # the judge (and the small answer) only cost
        assert ratio > 0.8  # ... and not much: one prefill per query
    # with the funnel free, nothing is lost either
    rows = sm.simulate(_cheap_funnel(costs), ["agent-only", "speceyes"], [16], 1000, beta, alpha)
    assert _row(rows, "speceyes", 16).vs_agent_only == pytest.approx(1.0, abs=0.03)


def test_seeded_runs_are_deterministic_and_seeds_differ():
    kw = dict(concurrencies=[4, 32], n_queries=600)
    a = sm.simulate(seed=7, **kw)
    b = sm.simulate(seed=7, **kw)
    c = sm.simulate(seed=8, **kw)
    def key(rows):
        return [(r.schedule, r.concurrency, r.throughput, r.p50_s, r.p95_s) for r in rows]

    assert key(a) == key(b)
    assert key(a) != key(c)


def test_shared_gpu_is_slower_than_two_gpus_for_ours():
    two = sm.simulate(None, ["speceyes"], [32], n_queries=800)[0]
    one = sm.simulate(sm.CostModel(shared_gpu=True), ["speceyes"], [32], n_queries=800)[0]
    assert one.throughput < two.throughput


def test_costs_from_json_overrides_and_measured_calibration(tmp_path):
    base = sm.CostModel()
    f = tmp_path / "costs.json"
    f.write_text(
        '{"large_gamma": 0.1, "large_batch_curve": [[1, 1.0], [8, 1.5], [32, 3.0]],'
        ' "measured": {"judge_s": 0.3, "small_s": 0.12, "agent_s": 12.0}}'
    )
    c = sm.CostModel.from_json(f)
    assert c.large_gamma == 0.1
    assert c.judge_s() == pytest.approx(0.3)
    assert c.small_s() == pytest.approx(0.12)
    assert c.agent_s() == pytest.approx(12.0)
    table = c.step_table(sm.LARGE)
    assert table[8] == pytest.approx(1.5 * table[1])
    assert table[64] > table[32]  # extended past the last point, never flat
    assert c.image_tokens == base.image_tokens
    with pytest.raises(ValueError, match="unknown cost fields"):
        sm.CostModel.from_dict({"large_decode": 1})
    with pytest.raises(ValueError, match="tool_call_probs"):
        sm.CostModel.from_dict({"tool_call_probs": [0.5, 0.2]})


def test_outputs_table_csv_and_png(tmp_path):
    costs = sm.CostModel()
    rows = sm.simulate(costs, concurrencies=[1, 4], n_queries=200)
    assert {r.schedule for r in rows} == {*sm.SCHEDULES, sm.IDEAL}
    paths = sm.write_outputs(rows, tmp_path, costs, BETA, ALPHA, 200, 0)
    md, csv_path, png = paths
    assert "| speceyes | 4 |" in md.read_text() and "E[L]" in md.read_text()
    with csv_path.open() as fh:
        got = list(csv.DictReader(fh))
    assert len(got) == len(rows) and float(got[0]["throughput"]) > 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    from PIL import Image

    with Image.open(png) as im:
        im.verify()


def test_cli_simulate_writes_the_three_files(tmp_path, capsys):
    from speceyes.cli import main

    out = tmp_path / "sim"
    rc = main(["simulate", "--queries", "300", "--concurrency", "1,8", "--output", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| speceyes | 8 |" in text
    assert {p.name for p in out.iterdir()} >= {sm.MD_FILE, sm.CSV_FILE, sm.PNG_FILE}
