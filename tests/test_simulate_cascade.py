"""The cascade as a simulated schedule (speceyes.simulate.cascade)."""

from dataclasses import replace

import numpy as np
import pytest

from speceyes import simulate as sm
from speceyes.simulate import cascade as sc

N = 300


@pytest.fixture(scope="module")
def costs():
    return sm.bench_costs("hrbench8k", shared_gpu=True)


@pytest.fixture(scope="module")
def draws(costs):
    return sm.draw(costs, N, 0.8, 0.71, seed=0)


@pytest.mark.parametrize("judge", ["large", "prefix", "small-prefix", "none"])
def test_no_later_stage_is_the_two_stage_funnel(costs, draws, judge):
    funnel = sm.simulate_one("speceyes", costs, draws, 8, judge=judge)
    cascade = sc.simulate_cascade_one(costs, draws, 8, sc.CascadeSpec(0, False), judge)
    np.testing.assert_allclose(cascade.finished, funnel.finished, rtol=1e-12)


def test_a_stage_that_accepts_everything_ends_every_query(draws):
    spec = sc.CascadeSpec(1, True, {"small@1": 1.0})
    own_gpus = sm.bench_costs("hrbench8k")  # the large engine's jobs are the large model's
    r = sc.simulate_cascade_one(own_gpus, draws, 8, spec, "large")
    # The large engine ran the judge of every query and nothing else: no direct answer, no agent.
    assert r.engines["large"]["jobs"] == N
    assert sc.skipped_share(0.8, 0.71, spec, "large", 0.5) == 1.0


def test_more_acceptance_is_faster(costs, draws):
    speeds = []
    for p in (0.0, 0.3, 0.6):
        spec = sc.CascadeSpec(1, False, {"small@1": p})
        r = sc.simulate_cascade_one(costs, draws, 16, spec, "small-prefix")
        speeds.append(N / r.makespan)
    assert speeds == sorted(speeds) and speeds[-1] > 1.2 * speeds[0]


def test_the_direct_answer_shares_the_agents_prefix(costs, draws):
    """The direct answer's prompt is the agent's own prefix: with prefix caching a rejected
    direct answer moves the image prefill from the agent's first turn instead of adding one;
    without prefix caching it adds a full-image prefill per query."""
    spec = sc.CascadeSpec(0, True, {"large_direct": 0.0}, direct_prompt="agent-prefix")
    full = costs.prefill_s(sm.LARGE, costs.agent_text_tokens, costs.image_tokens)
    for caching in (True, False):
        c = replace(costs, prefix_caching=caching)
        d = sm.draw(c, N, 0.8, 0.71, seed=0)
        with_direct = sc.simulate_cascade_one(c, d, 1, spec, "large")
        without = sc.simulate_cascade_one(c, d, 1, sc.CascadeSpec(0, False), "large")
        extra = with_direct.engines["large"]["busy_s"] - without.engines["large"]["busy_s"]
        reached = int(np.sum(d.tool | ~d.accept))  # every query small@0 did not accept
        if caching:
            assert 0 < extra < 0.1 * reached * full
        else:
            assert reached * full < extra < 1.2 * reached * full


def test_the_speculative_prompt_adds_its_prefill(costs, draws):
    """The funnel's direct answer (the speculative prompt on the large model) shares no prefix
    with the agent: a stage that accepts nothing adds its image prefill per query it reaches."""
    spec = sc.CascadeSpec(0, True, {"large_direct": 0.0})
    with_direct = sc.simulate_cascade_one(costs, draws, 1, spec, "prefix")
    without = sc.simulate_cascade_one(costs, draws, 1, sc.CascadeSpec(0, False), "prefix")
    extra = with_direct.engines["large"]["busy_s"] - without.engines["large"]["busy_s"]
    reached = int(np.sum(draws.tool | ~draws.accept))
    prefill = costs.prefill_s(sm.LARGE, costs.small_text_tokens, costs.image_tokens)
    assert reached * prefill < extra < 1.2 * reached * prefill
    with pytest.raises(ValueError, match="unknown direct prompt"):
        sc.CascadeSpec(0, True, direct_prompt="mine").validate()


def test_compare_and_skipped_share(costs):
    spec = sc.CascadeSpec(1, True, {"small@1": 0.4, "large_direct": 0.3})
    rows = sc.compare(costs, spec, [4], 200, 0.8, 0.71, judges=["none"])
    assert [r.schedule for r in rows] == ["agent-only", "speceyes", "cascade"]
    assert rows[0].vs_agent_only == 1.0 and rows[2].throughput > rows[1].throughput
    first = 0.8 * 0.71 + 0.2 * sm.DEFAULT_ALPHA_TOOL
    assert sc.skipped_share(0.8, 0.71, spec, "none", sm.DEFAULT_ALPHA_TOOL) == pytest.approx(
        1 - (1 - first) * 0.6 * 0.7
    )


def test_stage_acceptance_is_checked():
    assert sc.parse_stage_accept("small@0=0.6, small@1=0.4") == {"small@0": 0.6, "small@1": 0.4}
    with pytest.raises(ValueError, match="does not run: small@2"):
        sc.CascadeSpec(1, True, {"small@2": 0.3}).validate()
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        sc.CascadeSpec(1, True, {"small@1": 1.3}).validate()
    with pytest.raises(ValueError, match="stage=share"):
        sc.parse_stage_accept("small@1")


def test_cli_writes_the_comparison(tmp_path, capsys):
    from speceyes.cli import main

    code = main(
        ["simulate", "--cascade", "--bench", "hrbench8k", "--shared-gpu", "--queries", "120",
         "--concurrency", "4", "--stage-accept", "small@0=0.6,small@1=0.4,large_direct=0.3",
         "--output", str(tmp_path)]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and "| cascade | 4 |" in out
    md = (tmp_path / "cascade.md").read_text()
    assert "small@0 alpha=0.6" in md and "small@1=0.4, large_direct=0.3" in md
    assert (tmp_path / "cascade.csv").read_text().count("\n") == 4
