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
    # by hand for one query: prefill of image + prompt (the vision encoder on image tokens),
    # crops for the tool turns, decode at t(1) plus the KV cache read every step
    q = 0
    k = int(d.turns[q]) - 1
    pp, vit, r1 = (
        costs.large_prefill_s_per_token, costs.large_vit_s_per_token, costs.large_kv_read_s_per_token
    )
    by_hand = (
        (costs.image_tokens + costs.agent_text_tokens) * pp + costs.image_tokens * vit
        + k * ((costs.crop_tokens + costs.tool_text_tokens) * pp + costs.crop_tokens * vit)
        + k * costs.tool_s
    )
    ctx = costs.image_tokens + costs.agent_text_tokens
    for turn in range(k + 1):
        tt = int(d.turn_tokens[q, turn])
        ctx += tt + (costs.crop_tokens + costs.tool_text_tokens if turn else 0)
        by_hand += tt * (costs.large_decode_s + ctx * r1)  # the turn's whole context is held
    assert r.latencies[q] == pytest.approx(by_hand, rel=1e-9)
    # queries run back to back: the makespan is the sum of the latencies
    assert r.makespan == pytest.approx(float(expected.sum()), rel=1e-9)
    # the analytic mean (mean turn lengths) is close to the draws' mean
    assert costs.agent_s() == pytest.approx(float(expected.mean()), rel=0.05)


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


def _decode_bound(costs: sm.CostModel, **kw) -> sm.CostModel:
    """Prefill and KV reads almost free: the batching of decode steps alone."""
    return replace(
        costs, large_prefill_s_per_token=1e-7, large_vit_s_per_token=0.0,
        large_kv_read_s_per_token=0.0, **kw,
    )


def test_agent_only_throughput_grows_with_concurrency_and_saturates_at_max_batch():
    costs = _decode_bound(sm.CostModel(), large_max_batch=8)
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
    assert thr[5] < 1 / decode_s  # the tool's CPU time and prefill come on top of the bound
    assert thr[5] > 0.9 / decode_s


def test_prefill_does_not_batch_away():
    """With the default (prefill-heavy) costs agent-only saturates on prefill: going from 16 to
    64 clients gains far less than the 4x that decode batching alone would allow."""
    rows = sm.simulate(None, ["agent-only"], [16, 64], n_queries=1500)
    thr16, thr64 = (_row(rows, "agent-only", c).throughput for c in (16, 64))
    costs = sm.CostModel()
    pre, _, _, _ = costs._agent_parts()
    assert thr64 < 1 / pre  # never more queries per second than prefill seconds allow
    assert thr64 < 1.5 * thr16


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


def test_without_a_judge_the_ideal_counts_the_tool_queries_the_gate_accepts():
    """No judge: the gate also accepts a share alpha_tool of the queries the judge would have
    sent to tools, so the ideal that row is measured against skips those too."""
    costs, alpha_tool = _cheap_funnel(sm.CostModel()), 0.5
    rows = sm.simulate(
        costs, ["agent-only", "speceyes"], [16, 64], n_queries=3000, judges=("large", "none"),
        alpha_tool=alpha_tool,
    )
    gain = 1 / (1 - BETA * ALPHA - (1 - BETA) * alpha_tool)
    for c in (16, 64):
        none = next(r for r in rows if r.concurrency == c and r.judge == "none")
        assert none.vs_agent_only == pytest.approx(gain, rel=0.10)
        assert none.of_ideal == pytest.approx(1.0, rel=0.10)
        large = next(r for r in rows if r.concurrency == c and r.judge == "large")
        assert large.of_ideal == pytest.approx(1.0, rel=0.10)  # its own ideal, beta*alpha


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
        # ... one full-image prefill per query: a third of agent-only's prefill-bound rate
        assert ratio > 0.6
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


def test_costs_from_file_overrides_and_measured_calibration(tmp_path):
    base = sm.CostModel()
    f = tmp_path / "costs.json"
    f.write_text(
        '{"large_gamma": 0.1, "large_batch_curve": [[1, 1.0], [8, 1.5], [32, 3.0]],'
        ' "measured": {"judge_s": 0.3, "small_s": 0.12, "agent_s": 12.0}}'
    )
    c = sm.CostModel.from_file(f)
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


def test_cost_file_fields_go_over_a_benchmarks_token_counts(tmp_path):
    hr = sm.bench_costs("hrbench8k")
    f = tmp_path / "costs.json"
    f.write_text('{"crop_tokens": 123, "large_decode_s": 0.02}')
    c = sm.CostModel.from_file(f, base=hr)
    assert (c.crop_tokens, c.large_decode_s) == (123, 0.02)  # the file's fields win
    assert (c.image_tokens, c.small_image_tokens) == (hr.image_tokens, hr.small_image_tokens)
    assert c.image_tokens != sm.CostModel().image_tokens  # the base's, not the defaults
    f.write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        sm.CostModel.from_file(f, base=hr)


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


# --- realism: image tokens, KV cache, prefix caching, GPUs, judge variants ---------------------


def test_bench_token_counts_come_from_smart_resize():
    from speceyes.images import smart_resize

    for bench, info in sm.BENCH_IMAGES.items():
        c = sm.bench_costs(bench)
        w, h = info.size
        hh, ww = smart_resize(h, w, 28, 4 * 28 * 28, 16384 * 28 * 28)
        assert c.image_tokens == (hh // 28) * (ww // 28), bench
        hh, ww = smart_resize(h, w, 32, 4 * 32 * 32, 16384 * 32 * 32)
        assert c.small_view_tokens == (hh // 32) * (ww // 32), bench
        assert c.image_wh == [w, h]
    assert sm.bench_costs("vstar").image_tokens == 4480  # 2246x1582 -> 1568x2240 px
    assert sm.bench_costs("vstar").image_tokens == sm.CostModel().image_tokens  # the default
    assert sm.bench_costs("pope").image_tokens == 391  # 640x480
    assert sm.bench_costs("hrbench8k").image_tokens <= 16384  # capped by max_pixels
    assert sm.bench_costs("hrbench8k").crop_tokens > 10 * sm.bench_costs("vstar").crop_tokens // 2
    with pytest.raises(ValueError, match="unknown benchmark"):
        sm.bench_costs("mmmu")


def test_judge_view_budget_shrinks_the_judge_only():
    full = sm.CostModel()
    small_view = replace(full, judge_max_pixels=256 * 28 * 28)
    assert small_view.judge_view_tokens(sm.LARGE) <= 256
    assert small_view.judge_view_tokens(sm.SMALL) <= 256 * 28 * 28 // (32 * 32) + 1
    assert small_view.judge_s() < full.judge_s() / 5
    assert small_view.agent_s() == full.agent_s() and small_view.small_s() == full.small_s()
    rows = sm.simulate(small_view, ["agent-only", "speceyes"], [16], 1000)
    base = sm.simulate(full, ["agent-only", "speceyes"], [16], 1000)
    assert _row(rows, "speceyes", 16).throughput > _row(base, "speceyes", 16).throughput
    with pytest.raises(ValueError, match="view budget"):
        sm.simulate(small_view, ["speceyes"], [1], 10, judges=["prefix"])


def test_kv_cache_limits_the_batch_and_never_deadlocks():
    costs = sm.CostModel()
    ctx = costs.agent_prefill_tokens + 2 * costs.tool_turn_prefill_tokens + 900  # a long loop
    tight = replace(costs, large_kv_tokens=4 * ctx)
    rows = sm.simulate(tight, ["agent-only"], [4, 32], n_queries=400)
    assert _row(rows, "agent-only", 32).large_batch <= 4 * ctx / costs.agent_prefill_tokens
    assert _row(rows, "agent-only", 32).large_batch < 8
    free = sm.simulate(costs, ["agent-only"], [32], n_queries=400)
    assert _row(free, "agent-only", 32).throughput > 1.5 * _row(rows, "agent-only", 32).throughput
    # a request larger than the whole cache still runs (alone)
    tiny = replace(costs, large_kv_tokens=100)
    r = sm.simulate_one("agent-only", tiny, sm.draw(tiny, 50, BETA, ALPHA, 0), 8)
    assert np.isfinite(r.finished).all() and r.engines["large"]["mean_batch"] == pytest.approx(1)


def test_kv_capacity_from_memory_and_shared_gpu():
    c = sm.CostModel()
    # 90% of 80 GB, less 16.6 GB of weights and 6 GB of activations, at 57,344 bytes a token
    assert c.kv_tokens(sm.LARGE) == int((72 - 16.6 - 6) * 1e9 // 57344)
    shared = replace(c, shared_gpu=True)
    assert shared.kv_tokens(sm.LARGE) < c.kv_tokens(sm.LARGE)
    assert shared.kv_tokens(sm.SMALL) == int(8e9 // 114688)
    assert replace(c, large_kv_tokens=1234).kv_tokens(sm.LARGE) == 1234
    with pytest.raises(ValueError, match="KV-cache memory"):
        replace(c, large_weights_gb=80.0).validate()


def test_agent_only_is_the_same_whatever_the_shared_gpu_flag():
    d = sm.draw(sm.CostModel(), 600, BETA, ALPHA, 0)
    a = sm.simulate_one("agent-only", sm.CostModel(), d, 16)
    b = sm.simulate_one("agent-only", sm.CostModel(shared_gpu=True), d, 16)
    np.testing.assert_allclose(a.finished, b.finished)


def test_agent_only_on_two_gpus_is_data_parallel():
    costs = sm.CostModel()
    rows = sm.simulate(costs, ["agent-only", "agent-only-2gpu", "speceyes"], [1, 2, 16], 600)
    one, two = _row(rows, "agent-only", 1), _row(rows, "agent-only-2gpu", 2)
    assert two.gpus == 2 and one.gpus == 1
    assert two.throughput == pytest.approx(2 * one.throughput, rel=0.1)  # one client each
    assert _row(rows, "agent-only-2gpu", 1).throughput == pytest.approx(one.throughput)
    ours = _row(rows, "speceyes", 16)
    assert ours.gpus == 2
    assert ours.per_gpu_vs_agent_only == pytest.approx(ours.vs_agent_only / 2)
    assert ours.vs_agent_only_2gpu == pytest.approx(
        ours.throughput / _row(rows, "agent-only-2gpu", 16).throughput
    )
    shared = sm.simulate(replace(costs, shared_gpu=True), ["agent-only", "speceyes"], [16], 600)
    assert _row(shared, "speceyes", 16).gpus == 1


def test_prefix_judge_turns_the_agents_first_prefill_into_a_cache_hit():
    costs = sm.CostModel()
    d = sm.draw(costs, 400, BETA, ALPHA, seed=1)
    jc = sm.judge_costs(costs)
    tail = costs.prefill_s(sm.LARGE, costs.prefix_tail_tokens)
    agent_hit = sm.agent_latency_b1(costs, d, first_prefill_s=tail)
    ours = sm.simulate_one("speceyes", costs, d, 1, judge="prefix")
    cj, cs = jc["prefix"]["s"], costs.small_s()
    exact = np.where(d.tool, cj + agent_hit, max(cj, cs) + (~d.accept) * agent_hit)
    np.testing.assert_allclose(ours.latencies, exact, rtol=1e-9, atol=1e-9)
    # the saving is the agent's first-turn image prefill
    full = sm.agent_latency_b1(costs, d)
    np.testing.assert_allclose(full - agent_hit, jc["prefix"]["saves_agent_s"], rtol=1e-9)
    # without prefix caching nothing is saved, and every tool turn prefills its history again
    off = replace(costs, prefix_caching=False)
    ours_off = sm.simulate_one("speceyes", off, d, 1, judge="prefix")
    assert ours_off.latencies.sum() > ours.latencies.sum()
    assert off.agent_s() > costs.agent_s()
    np.testing.assert_allclose(
        sm.simulate_one("agent-only", off, d, 1).latencies, sm.agent_latency_b1(off, d),
        rtol=1e-9,
    )


def test_small_judges_run_on_the_small_model():
    costs = sm.CostModel()
    d = sm.draw(costs, 300, BETA, ALPHA, seed=2)
    turns = int(np.where(d.tool | ~d.accept, d.turns, 0).sum())  # agent turns of ours
    for judge in ("small", "small-prefix"):
        r = sm.simulate_one("speceyes", costs, d, 4, judge=judge)
        assert r.engines["large"]["jobs"] == turns  # no judge call on the large model
        assert r.engines["small"]["jobs"] == 2 * 300  # an answer and a judgment per query
    # small-prefix at C=1: the judgment continues the answer's cached prompt
    r = sm.simulate_one("speceyes", costs, d, 1, judge="small-prefix")
    cont = sm.judge_costs(costs)["small-prefix"]["s"]
    agent = sm.agent_latency_b1(costs, d)
    exact = costs.small_s() + cont + np.where(d.tool | ~d.accept, agent, 0.0)
    np.testing.assert_allclose(r.latencies, exact, rtol=1e-9, atol=1e-9)


def test_no_judge_lets_the_gate_decide_for_every_query():
    costs = sm.CostModel()
    n = 4000
    for alpha_tool in (0.0, 0.5):
        d = sm.draw(costs, n, BETA, ALPHA, seed=4, alpha_tool=alpha_tool)
        r = sm.simulate_one("speceyes", costs, d, 1, judge="none")
        fast = r.latencies <= costs.small_s() + 1e-9  # answered by the small model alone
        accepted = np.where(d.tool, d.accept_tool, d.accept)
        np.testing.assert_array_equal(fast, accepted)
        assert fast.mean() == pytest.approx(BETA * ALPHA + (1 - BETA) * alpha_tool, abs=0.03)
        assert r.engines["large"]["jobs"] == int(np.where(accepted, 0, d.turns).sum())


def test_every_judge_variant_runs_in_the_table_and_cli(tmp_path, capsys):
    rows = sm.simulate(None, ["agent-only", "speceyes"], [8], 300, judges=sm.JUDGES)
    assert [r.judge for r in rows if r.schedule == "speceyes"] == list(sm.JUDGES)
    text = sm.format_table(rows)
    assert "| speceyes | 8 | small-prefix | 2 |" in text
    with pytest.raises(ValueError, match="unknown judge"):
        sm.simulate(None, ["speceyes"], [1], 10, judges=["tiny"])

    from speceyes.cli import main

    out = tmp_path / "sim"
    rc = main([
        "simulate", "--queries", "200", "--concurrency", "4", "--bench", "pope", "--shared-gpu",
        "--judge", "large,none", "--schedules", "agent-only,speceyes", "--output", str(out),
    ])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| speceyes | 4 | none | 1 |" in printed
    md = (out / sm.MD_FILE).read_text()
    assert "pope images, one GPU for both models" in md and "KV cache:" in md
    costs_file = tmp_path / "c.json"
    costs_file.write_text('{"large_decode_s": 0.02}')
    rc = main([
        "simulate", "--queries", "100", "--concurrency", "2", "--bench", "hrbench8k",
        "--costs", str(costs_file), "--judge-max-pixels", "200704", "--no-prefix-caching",
        "--output", str(out),
    ])
    assert rc == 0
    md = (out / sm.MD_FILE).read_text()
    assert '"large_decode_s": 0.02' in md and '"image_tokens": 16320' in md
    assert "no prefix caching" in md and "judge view 200704 px" in md


def test_image_preprocessing_delays_the_first_request_with_the_image_once_per_server():
    base = sm.CostModel()
    slow = replace(base, image_preprocess_s=0.25)
    d = sm.draw(base, 40, 0.8, 0.71, seed=3)
    for schedule, judge, extra in (("agent-only", "large", 0.25), ("speceyes", "large", 0.25),
                                   ("speceyes", "none", 0.25)):
        a = sm.simulate_one(schedule, base, d, 1, judge=judge).latencies
        b = sm.simulate_one(schedule, slow, d, 1, judge=judge).latencies
        if schedule == "speceyes" and judge == "none":
            # no judge on the large server: an agent loop pays for the image again there
            to_agent = b - a > 0.3
            assert np.allclose((b - a)[to_agent], 0.5) and np.allclose((b - a)[~to_agent], extra)
        else:  # judge and small answer wait side by side; the agent's turn finds it processed
            assert np.allclose(b - a, extra), (schedule, judge)
