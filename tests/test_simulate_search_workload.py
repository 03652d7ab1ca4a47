"""The simulator's terms for a CPU-served engine and the search agent's workload: per-request
fixed costs (serial and beside the engine), the search loop's rounds of cell scores, a warm
prefix cache, the funnel's judge-then-answer order; and that the defaults leave every earlier
figure as it was."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from speceyes import simulate as sm
from speceyes.simulate.costs import LARGE, SMALL, judge_costs

# A CPU-like engine: the step and the prefill are nearly free, a request's fixed cost is not.
TINY = dict(
    large_decode_s=1e-5, small_decode_s=1e-5, large_gamma=0.0, small_gamma=0.0,
    large_prefill_s_per_token=1e-9, small_prefill_s_per_token=1e-9,
    large_vit_s_per_token=0.0, small_vit_s_per_token=0.0,
    large_kv_read_s_per_token=0.0, small_kv_read_s_per_token=0.0,
    image_tokens=66, small_image_tokens=66, crop_tokens=66, tool_s=0.0,
    agent_workload="search",
)


def search_costs(**kw) -> sm.CostModel:
    c = sm.CostModel(**{**TINY, **kw})
    c.validate()
    return c


def thr(costs: sm.CostModel, c: int, n: int = 200, schedule: str = "agent-only",
        judge: str = "large", beta: float = 0.5, alpha: float = 1.0) -> float:
    d = sm.draw(costs, n, beta, alpha, 0)
    r = sm.simulate_one(schedule, costs, d, c, judge=judge)
    return n / r.makespan


# --- defaults ------------------------------------------------------------------------------


def test_defaults_leave_the_earlier_figures_unchanged():
    # Throughputs of the code before these terms existed (same seed, same calls).
    before = {
        (False, "agent-only", "-", 16): 0.7279065708607569,
        (False, "speceyes", "large", 16): 0.7813592661638972,
        (False, "speceyes", "prefix", 1): 0.2878619748333989,
        (True, "speceyes", "large", 16): 0.6269031375181392,
        (True, "speceyes", "none", 16): 1.2611109510720582,
    }
    for shared in (False, True):
        rows = sm.simulate(sm.CostModel(shared_gpu=shared), ["agent-only", "speceyes"], [1, 16],
                           300, judges=["large", "prefix", "none"])
        got = {(shared, r.schedule, r.judge, r.concurrency): r.throughput for r in rows}
        for key, value in before.items():
            if key[0] == shared:
                assert got[key] == pytest.approx(value, rel=1e-12)


def test_default_fields_are_off():
    c = sm.CostModel()
    assert c.agent_workload == "deepeyes" and not c.warm_cache and c.phase_overlap
    assert c.large_request_s == c.small_request_s == 0.0
    assert c.large_request_latency_s == c.small_request_latency_s == 0.0
    # explicitly zero terms are the defaults: the same rows
    zero = replace(c, large_request_s=0.0, large_request_latency_s=0.0, warm_cache=False)
    a = sm.simulate(c, ["agent-only"], [8], 200)
    b = sm.simulate(zero, ["agent-only"], [8], 200)
    assert [r.throughput for r in a] == [r.throughput for r in b]


# --- per-request fixed cost ---------------------------------------------------------------


def test_a_fixed_serial_cost_makes_agent_only_flat_in_c():
    costs = search_costs(large_request_s=0.01)
    per_loop = costs.search_requests * 0.01  # 28 requests, none of it batches
    rates = [thr(costs, c) for c in (1, 4, 16, 64)]
    for r in rates:
        assert r == pytest.approx(1.0 / per_loop, rel=0.02)
    # the same engine without it batches: decode-bound throughput grows with C
    batching = search_costs(large_decode_s=0.01)
    grow = [thr(batching, c) for c in (1, 4, 16, 64)]
    assert grow[-1] > 10 * grow[0]


def test_latency_beside_the_engine_costs_at_low_c_only():
    serial = search_costs(large_request_s=0.002)
    both = replace(serial, large_request_latency_s=0.02)
    rounds = serial.search_depth + 1  # a round's cells wait side by side, the rounds in turn
    lat = sm.simulate_one("agent-only", both, sm.draw(both, 20, 0.5, 1.0, 0), 1).latencies
    base = sm.simulate_one("agent-only", serial, sm.draw(serial, 20, 0.5, 1.0, 0), 1).latencies
    assert np.allclose(lat - base, rounds * 0.02, rtol=1e-3)
    # with many loops in flight the engine's serial part decides again
    assert thr(both, 64, n=640) == pytest.approx(thr(serial, 64, n=640), rel=0.05)
    assert thr(both, 1) < 0.5 * thr(serial, 1)


def test_fixed_costs_count_in_the_batch_1_analytics():
    costs = search_costs(large_request_s=0.01, large_request_latency_s=0.005)
    n = costs.search_requests
    assert costs.agent_s() == pytest.approx(n * 0.01 + (costs.search_depth + 1) * 0.005,
                                            rel=1e-3)
    judge = costs.judge_s()
    assert judge == pytest.approx(0.015, rel=1e-3)
    assert costs.small_s() == pytest.approx(0.0, abs=1e-3)  # the small model pays none here


# --- the search workload ------------------------------------------------------------------


class CountingBackend:
    """Enough of a backend for SearchAgent: the 224x224 view of the mini-world checkpoints,
    every scored crop and every answer counted (one request each on an OpenAI server)."""

    box_coords, factor = "absolute", 28
    min_pixels, max_pixels = 4 * 28 * 28, 224 * 224
    max_images, max_logprobs = 6, 64

    def __init__(self) -> None:
        self.scored = 0
        self.rounds = 0
        self.answers = 0
        self.rng = np.random.default_rng(0)

    def view_of(self, image):
        from speceyes.images import view_for_model

        return view_for_model(image, self.factor, self.min_pixels, self.max_pixels)

    def next_token_probs(self, batch, words):
        self.rounds += 1
        self.scored += len(batch)
        p = self.rng.random((len(batch), 1))
        return np.hstack([p, 1 - p])

    def answer(self, batch, max_new_tokens=20, top_k=64):
        self.answers += len(batch)
        return [SimpleNamespace(text="yes", topk=np.zeros((1, top_k))) for _ in batch]


def test_call_counts_match_the_search_agent(tmp_path):
    from speceyes.agents.search import SearchAgent
    from speceyes.types import Query

    path = tmp_path / "scene.png"
    Image.new("RGB", (1024, 1024), (200, 200, 200)).save(path)
    be = CountingBackend()
    # the bundled models' manifest settings (speceyes/miniworld/models/manifest.json)
    agent = SearchAgent(be, depth=3, grid=3, overlap=0.25, min_region=64, min_box=10,
                        fill_view=True, answer_prompt="small", beam=1, stay=False)
    queries = [Query(id=f"q{i}", image=str(path), question="Is there a red circle in the image?")
               for i in range(3)]
    agent.run(queries)
    per_loop = (be.scored + be.answers) / len(queries)
    costs = search_costs()
    assert be.rounds == costs.search_depth  # the loops share each round's batched call
    assert be.scored / len(queries) == costs.search_depth * costs.search_cells == 27
    assert per_loop == costs.search_requests == 28
    # the simulator sends the same number of large-model requests per loop
    r = sm.simulate_one("agent-only", costs, sm.draw(costs, 10, 0.5, 1.0, 0), 2)
    assert r.engines["large"]["jobs"] == 10 * 28


def test_search_rounds_run_in_turn_and_cells_side_by_side():
    # only the step costs: a round of 9 cells at batch 9 is one step, so a loop is 4 steps
    costs = search_costs(large_decode_s=0.01, large_prefill_s_per_token=0.0)
    lat = sm.simulate_one("agent-only", costs, sm.draw(costs, 5, 0.5, 1.0, 0), 1).latencies
    steps = costs.search_depth * costs.search_cell_decode_tokens + \
        costs.search_answer_decode_tokens
    assert np.allclose(lat, steps * 0.01)
    # agent_latency_b1 is the batch-1 analytic loop
    d = sm.draw(costs, 5, 0.5, 1.0, 0)
    assert np.allclose(sm.agent_latency_b1(costs, d), costs.agent_s())
    assert costs.agent_s() == pytest.approx(float(lat[0]), rel=1e-6)


def test_search_prefill_is_crop_and_question():
    costs = search_costs(large_prefill_s_per_token=1e-4, large_vit_s_per_token=1e-4)
    tokens, pre, n, ctx = costs.search_cell_request()
    assert tokens == costs.crop_tokens + costs.search_cell_text_tokens
    assert pre == pytest.approx(tokens * 1e-4 + costs.crop_tokens * 1e-4)
    assert n == 1 and ctx == tokens + 1
    ans = costs.search_answer_request()
    assert ans[0] == costs.crop_tokens + costs.search_answer_text_tokens and ans[2] == 2


def test_the_prefix_judge_saves_nothing_for_the_search_agent():
    deep = sm.CostModel()
    search = replace(deep, agent_workload="search")
    assert judge_costs(deep)["prefix"]["saves_agent_s"] > 0
    assert judge_costs(search)["prefix"]["saves_agent_s"] == 0.0
    # in the engine too: prefix costs what it costs (its longer prompt), it saves no agent turn
    c = search_costs(large_request_s=0.01)
    assert thr(c, 4, schedule="speceyes", judge="prefix") == pytest.approx(
        thr(c, 4, schedule="speceyes", judge="large"), rel=0.02)


def test_workload_is_checked():
    with pytest.raises(ValueError, match="agent_workload"):
        sm.CostModel(agent_workload="thyme").validate()
    with pytest.raises(ValueError, match="search workload"):
        sm.CostModel(agent_workload="search", search_grid=0).validate()
    with pytest.raises(ValueError, match="non-negative"):
        sm.CostModel(large_request_s=-1.0).validate()


# --- warm cache and the funnel's order ----------------------------------------------------


def test_warm_cache_prefills_only_the_last_partial_block():
    cold = search_costs(large_prefill_s_per_token=1e-3, large_vit_s_per_token=1e-3)
    # a cell is 66 + 74 = 140 tokens: 12 past the last full 128-token block (vLLM's CPU size)
    warm = replace(cold, warm_cache=True, cache_block_tokens=128, search_cell_text_tokens=74,
                   search_answer_text_tokens=91)
    assert warm.warm_prefill_s(LARGE, 140) == pytest.approx(12e-3)
    assert warm.warm_prefill_s(LARGE, 256) == pytest.approx(1e-3)  # a whole hit: one token
    assert cold.warm_prefill_s(LARGE, 140) is None
    assert replace(warm, prefix_caching=False).warm_prefill_s(LARGE, 140) is None
    d = warm.search_depth * warm.search_cells
    expect = d * 12e-3 + 29e-3  # the answer: 157 tokens, 29 past the block
    assert warm.agent_s() == pytest.approx(expect, rel=0.01)
    assert cold.agent_s() > 5 * warm.agent_s()
    # the engine prefills the same tails: at C=1 a loop is its rounds' tails in turn
    lat = sm.simulate_one("agent-only", warm, sm.draw(warm, 5, 0.5, 1.0, 0), 1).latencies
    assert np.allclose(lat, expect, rtol=0.01)
    assert thr(warm, 4) > 5 * thr(cold, 4)


def test_judge_first_runs_the_small_answer_for_tool_free_queries_only():
    over = search_costs(small_request_s=0.01, large_request_s=0.01)
    seq = replace(over, phase_overlap=False)
    beta = 0.5
    d = sm.draw(over, 400, beta, 1.0, 0)
    r_over = sm.simulate_one("speceyes", over, d, 4, judge="large")
    r_seq = sm.simulate_one("speceyes", seq, d, 4, judge="large")
    assert r_over.engines["small"]["jobs"] == 400
    assert r_seq.engines["small"]["jobs"] == int((~d.tool).sum())
    # a query the judge sends to tools no longer waits for... nothing; a tool-free one waits
    # for the judge, then its answer: at C=1 the tool-free queries take two requests in turn
    one = sm.simulate_one("speceyes", seq, d, 1, judge="large")
    free = ~d.tool & d.accept
    assert np.allclose(one.latencies[free], 0.02, rtol=0.01)
    # without a judge the order changes nothing
    assert sm.simulate_one("speceyes", seq, d, 4, judge="none").makespan == pytest.approx(
        sm.simulate_one("speceyes", over, d, 4, judge="none").makespan)


def test_shared_engine_adds_both_servers_fixed_costs():
    c = search_costs(large_request_s=0.01, small_request_s=0.01, shared_gpu=True)
    # none: every query one small answer; accepted ones skip the agent's 28 requests
    d = sm.draw(c, 300, 1.0, 0.5, 0, alpha_tool=0.0)
    r = sm.simulate_one("speceyes", c, d, 16, judge="none")
    served = 300 + int((~d.accept).sum()) * c.search_requests
    assert 300 / r.makespan == pytest.approx(1 / (served / 300 * 0.01), rel=0.03)
    assert SMALL != LARGE


# --- the funnel's pipelined schedule --------------------------------------------------------


def test_pipeline_agent_driver_steps_loops_together():
    # rounds cost only the app's crop time: a step cuts every searching loop's crops in turn
    # (the front's short wait gathers the clients that arrive together into one batch)
    c = search_costs(tool_s=0.01, funnel_pipeline=True, front_wait_s=0.001)
    d = sm.draw(c, 8, 0.5, 1.0, 0)
    one = sm.simulate_one("agent-only", c, d, 1).latencies
    assert np.allclose(one, 0.001 + c.search_depth * 0.01, rtol=0.01)  # answers: last step
    four = sm.simulate_one("agent-only", c, d, 4).latencies
    assert np.allclose(four, 0.001 + 4 * c.search_depth * 0.01, rtol=0.01)  # 4 loops a step
    # without the pipeline each loop cuts its own crops beside the others
    free = replace(c, funnel_pipeline=False)
    assert np.allclose(sm.simulate_one("agent-only", free, d, 4).latencies,
                       c.search_depth * 0.01, rtol=0.01)


def test_pipeline_caps_the_loops_in_flight():
    c = search_costs(large_decode_s=0.01, funnel_pipeline=True, front_wait_s=0.0,
                     max_agent_loops=1)
    # one loop at a time whatever C: the throughput of C=1
    assert thr(c, 8, n=40) == pytest.approx(thr(c, 1, n=40), rel=0.02)
    assert thr(replace(c, max_agent_loops=8), 8, n=40) > 4 * thr(c, 1, n=40)


def test_pipeline_front_runs_one_batch_at_a_time_and_waits_for_it():
    c = search_costs(large_request_s=0.01, small_request_s=0.01, funnel_pipeline=True,
                     front_wait_s=0.005, phase_overlap=False, early_agent=0)
    d = sm.draw(c, 50, 0.5, 1.0, 0)
    r = sm.simulate_one("speceyes", c, d, 1, judge="large")
    early = ~d.tool & d.accept
    # alone: the batch's wait, the judge, then the small answer
    assert np.allclose(r.latencies[early], 0.005 + 0.01 + 0.01, rtol=0.01)
    # a query the judge sends to tools: the wait, the judge, then its 28 requests
    assert np.allclose(r.latencies[d.tool], 0.005 + 0.01 + 28 * 0.01, rtol=0.01)
    # the small answers of a batch are sent together: none pays one step for them all
    r16 = sm.simulate_one("speceyes", replace(c, front_batch=16), d, 16, judge="none")
    assert r16.engines["small"]["jobs"] == 50


def test_pipeline_needs_the_search_workload():
    with pytest.raises(ValueError, match="search agent"):
        sm.CostModel(funnel_pipeline=True).validate()
    c = search_costs(funnel_pipeline=True)
    with pytest.raises(ValueError, match="small-prefix"):
        sm.simulate_one("speceyes", c, sm.draw(c, 4, 0.5, 1.0, 0), 2, judge="small-prefix")


# --- the client's CPU on the engine's cores ---------------------------------------------------


def test_client_cpu_on_the_engine_costs_throughput():
    beside = search_costs(large_request_s=0.01, tool_s=0.02)
    shared = replace(beside, client_cpu_on_engine=True)
    per_loop = beside.search_requests * 0.01
    # beside the engine, the crops overlap other loops' requests: only latency
    assert thr(beside, 64, n=640) == pytest.approx(1 / per_loop, rel=0.03)
    # on its cores, each round's cropping is serial work like the requests
    assert thr(shared, 64, n=640) == pytest.approx(
        1 / (per_loop + beside.search_depth * 0.02), rel=0.03)
    # the same with the pipelined funnel's driver (one loop's crops after another)
    piped = replace(shared, funnel_pipeline=True)
    assert thr(piped, 64, n=640) == pytest.approx(thr(shared, 64, n=640), rel=0.05)


def test_image_preprocessing_on_the_engine_is_serial_per_query():
    # none, every answer accepted: a query is one small answer after its view is encoded
    c = search_costs(small_request_s=0.01, image_preprocess_s=0.02)
    d = sm.draw(c, 2000, 1.0, 1.0, 0, alpha_tool=1.0)
    beside = 2000 / sm.simulate_one("speceyes", c, d, 64, judge="none").makespan
    on = replace(c, client_cpu_on_engine=True)
    serial = 2000 / sm.simulate_one("speceyes", on, d, 64, judge="none").makespan
    assert beside == pytest.approx(1 / 0.01, rel=0.05)
    assert serial == pytest.approx(1 / 0.03, rel=0.05)
    assert not sm.CostModel().client_cpu_on_engine


def test_app_intake_delays_every_query_and_loads_no_engine():
    """``app_intake_s`` (a serving app's time per query outside the funnel) comes before the
    query's first request, in the app's threads: it adds its time to every latency and no
    work to an engine, so with the engine the bottleneck the throughput stays."""
    c = search_costs(small_request_s=0.01, client_cpu_on_engine=True)
    d = sm.draw(c, 2000, 1.0, 1.0, 0, alpha_tool=1.0)  # none: every query one small answer
    base = sm.simulate_one("speceyes", c, d, 1, judge="none")
    late = sm.simulate_one("speceyes", replace(c, app_intake_s=0.02), d, 1, judge="none")
    assert np.allclose(late.latencies, base.latencies + 0.02)
    assert late.engines["small"]["busy_s"] == pytest.approx(base.engines["small"]["busy_s"])
    loaded = 2000 / sm.simulate_one("speceyes", replace(c, app_intake_s=0.02), d, 64,
                                    judge="none").makespan
    assert loaded == pytest.approx(1 / 0.01, rel=0.05)
    with pytest.raises(ValueError, match="non-negative"):
        replace(c, app_intake_s=-0.01).validate()


def test_client_cpu_takes_the_idle_servers_core():
    """With a server per core, the client's CPU work runs on the core of a server that is idle:
    a lone query's raced loop cuts its crops beside the judge, not before it; alone on an idle
    server (agent-only, one query) it is where it was."""
    c = search_costs(large_decode_s=0.01, small_decode_s=0.01, funnel_pipeline=True,
                     front_wait_s=0.005, phase_overlap=False, tool_s=0.03)
    on = replace(c, client_cpu_on_engine=True)
    free = replace(on, client_cpu_free_core=True)
    d = sm.draw(c, 50, 0.3, 1.0, 0)
    lat = {k: sm.simulate_one("speceyes", v, d, 1, judge="large").latencies[d.tool].mean()
           for k, v in (("beside", c), ("on", on), ("free", free))}
    assert lat["free"] < lat["on"] - 0.005  # the judge no longer waits for the crops
    # as if beside the servers, up to where the cells meet the large server's step boundaries
    assert lat["free"] == pytest.approx(lat["beside"], abs=0.005)
    alone = [sm.simulate_one("agent-only", v, d, 1).latencies for v in (on, free)]
    assert np.allclose(alone[0], alone[1])
    with pytest.raises(ValueError, match="client_cpu_on_engine"):
        replace(c, client_cpu_free_core=True).validate()


def test_pipeline_early_agent_starts_a_lone_querys_loop_beside_the_front():
    """A query alone starts its loop with the judge: one that needs the agent no longer waits
    for the judge first; answered early, its loop's work is spent beside it. With most queries
    answered early the funnel stops starting loops early."""
    # decode steps that batch (a request's fixed cost would serialise the judge and the cells)
    c = search_costs(large_decode_s=0.01, small_decode_s=0.01, funnel_pipeline=True,
                     front_wait_s=0.005, phase_overlap=False)
    d = sm.draw(c, 50, 0.3, 1.0, 0)  # 30% answered early
    wait = sm.simulate_one("speceyes", replace(c, early_agent=0), d, 1, judge="large")
    race = sm.simulate_one("speceyes", c, d, 1, judge="large")
    tool = d.tool
    assert race.latencies[tool].mean() < wait.latencies[tool].mean() - 0.005
    assert race.engines["large"]["jobs"] > wait.engines["large"]["jobs"]  # the dropped loops
    mostly = sm.draw(c, 50, 0.9, 1.0, 0)  # 90% answered early: after the first, no race
    wait = sm.simulate_one("speceyes", replace(c, early_agent=0), mostly, 1, judge="large")
    race = sm.simulate_one("speceyes", c, mostly, 1, judge="large")
    assert np.allclose(race.latencies[1:], wait.latencies[1:])
