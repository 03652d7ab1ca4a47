"""The four phases end to end on tiny real models, in every mode."""

from __future__ import annotations

import pytest

from speceyes.agents.zoom import ZoomAgent
from speceyes.funnel import Funnel, FunnelConfig
from speceyes.types import Query
from tests.conftest import make_scene


def queries(n=4):
    out = []
    for i in range(n):
        box = (20 + 40 * i, 30, 90 + 40 * i, 100)
        out.append(
            Query(id=f"q{i}", image=make_scene(box=box), question="What color?", options=["red", "blue"], answer="A")
        )
    return out


@pytest.fixture
def parts(q3, q25):
    return q3, q25, ZoomAgent(q25, max_new_tokens=16)


def run(parts, **cfg):
    small, large, agent = parts
    f = Funnel(small, large, agent, FunnelConfig(batch_size=3, **cfg))
    return f, f.run(queries())


def test_speceyes_runs_all_four_phases(parts):
    # The tiny large model's judge leans "no" (P(tool) ~0.35): everything goes to phase II.
    f, res = run(parts, tau=0.0)
    assert all(r.judge_tool is False and 0 <= r.p_tool < 0.5 for r in res)
    assert all(r.route == "small" and r.answer == r.small_answer for r in res)
    assert f.stats.beta == 1.0 and f.stats.alpha == 1.0
    assert all({"judge", "small", "gate"} <= set(r.timings) for r in res)
    f, res = run(parts, tau=1.0)
    assert all(r.route == "agent_after_gate" and "agent" in r.timings for r in res)
    assert all(r.answer == r.agent_answer for r in res)
    assert f.stats.alpha == 0.0


def test_gate_splits_by_confidence(parts):
    _, base = run(parts, tau=0.0)
    confs = sorted(r.confidence for r in base)
    tau = confs[len(confs) // 2]
    f, res = run(parts, tau=tau)
    for r in res:
        assert r.route == ("small" if r.confidence > tau else "agent_after_gate")
    assert f.stats.accepted == sum(r.confidence > tau for r in res)


def test_judge_routes_straight_to_agent(parts):
    f, res = run(parts, judge_threshold=0.0)  # every P(tool) >= 0: tools always needed
    assert all(r.route == "agent_after_judge" and r.small_answer is None for r in res)
    assert f.stats.beta == 0.0 and f.stats.alpha is None


def test_decode_judge_mode(parts):
    from speceyes import prompts
    from speceyes.judging import decode_rule_p_tool

    _, res = run(parts, judge_mode="decode")
    # The published rule on the large model's own greedy 10-token reply to the judge prompt.
    msgs = [prompts.judge_messages(q.image, q.question, q.options) for q in queries()]
    replies = parts[1].chat(msgs, max_new_tokens=10)
    assert [r.p_tool for r in res] == [decode_rule_p_tool(t.text) for t in replies]
    assert all(r.judge_tool == (r.p_tool >= 0.5) for r in res)


def test_baseline_modes(parts):
    _, agent_only = run(parts, mode="agent")
    assert all(r.route == "agent_only" and r.p_tool is None and r.small_answer is None for r in agent_only)
    _, small_only = run(parts, mode="small")
    assert all(r.route == "small_only" and r.agent_answer is None and r.confidence is not None for r in small_only)
    assert all("agent" not in r.timings and "judge" not in r.timings for r in small_only)


def test_both_mode_logs_everything_and_routes_like_speceyes(parts):
    _, spec = run(parts, tau=0.5)
    _, both = run(parts, tau=0.5, mode="both")
    for s, b in zip(spec, both, strict=True):
        assert b.route == s.route and b.answer == s.answer
        assert b.small_answer is not None and b.agent_answer is not None
        assert b.small_topk is not None and "agent" in b.timings


def test_empty_speculative_answer_goes_to_the_agent(silent, q25):
    f = Funnel(silent, q25, ZoomAgent(q25, max_new_tokens=8), FunnelConfig(tau=0.0))
    res = f.run(queries(2))
    assert all(r.small_answer == "" and r.confidence is None for r in res)
    assert all(r.route == "agent_after_gate" for r in res)


def test_corrupt_image_is_an_error_result_and_the_rest_goes_on(parts, tmp_path):
    bad = tmp_path / "corrupt.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    qs = queries(2)
    qs.insert(1, Query(id="bad", image=str(bad), question="?"))
    f = Funnel(*parts, FunnelConfig(tau=0.0))
    res = f.run(qs)
    assert [r.id for r in res] == ["q0", "bad", "q1"]
    assert res[1].route == "error" and "corrupt.png" in res[1].error
    assert res[0].route == "small" and f.stats.errors == 1


def test_streams_results_per_batch(parts):
    small, large, agent = parts
    f = Funnel(small, large, agent, FunnelConfig(batch_size=2, tau=0.0))
    seen = []
    it = f.iter_results(queries(4))
    seen.append(next(it).id)
    assert f.stats.queries == 2  # only the first batch has run
    seen.extend(r.id for r in it)
    assert seen == ["q0", "q1", "q2", "q3"]


def test_config_errors(parts):
    with pytest.raises(ValueError, match="mode"):
        Funnel(*parts, FunnelConfig(mode="fast"))
    with pytest.raises(ValueError, match="aggregation"):
        Funnel(*parts, FunnelConfig(agg="max"))
    with pytest.raises(ValueError, match="needs the large"):
        Funnel(parts[0], None, None, FunnelConfig(mode="speceyes"))


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("mode", ["speceyes", "both", "agent"])
def test_pipelined_schedule_and_overlap_give_the_sequential_results(parts, mode, overlap):
    small, large, agent = parts
    qs = queries(5)
    ref = Funnel(small, large, agent, FunnelConfig(mode=mode, tau=0.5, batch_size=2)).run(qs)
    cfg = FunnelConfig(mode=mode, tau=0.5, batch_size=2, schedule="pipelined", overlap=overlap,
                       max_agent_loops=2)
    f = Funnel(small, large, agent, cfg)
    got = {r.id: r for r in f.run(qs)}
    assert set(got) == {r.id for r in ref}
    for r in ref:
        g = got[r.id]
        assert (g.route, g.answer, g.small_answer, g.agent_answer, g.tool_calls) == (
            r.route, r.answer, r.small_answer, r.agent_answer, r.tool_calls)
        assert g.confidence == pytest.approx(r.confidence, abs=1e-4) if r.confidence else True
    assert f.stats.queries == 5


def test_agent_loops_join_as_others_finish(q25):
    """Continuous batching: a finished loop's place goes to the next query at once."""
    from tests.test_zoom_agent import ScriptedBackend, call, q

    be = ScriptedBackend(q25, [[call([0, 0, 300, 300]), call([0, 0, 300, 300]), "<answer>a</answer>"],
                               ["<answer>b</answer>"], ["<answer>c</answer>"]])
    outs = ZoomAgent(be).run([q(0), q(1), q(2)], max_active=2)
    assert [o.answer for o in outs] == ["a", "b", "c"]
    assert [len(step) for step in be.seen] == [2, 2, 1]


class _StepLog(Funnel):
    """A funnel that records which of its four steps ran, in order."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.ran: list[str] = []

    def _judge(self, batch):
        self.ran.append("judge")
        super()._judge(batch)

    def _speculate(self, batch, idx):
        self.ran.append("speculate")
        super()._speculate(batch, idx)

    def _gate(self, batch):
        self.ran.append("gate")
        super()._gate(batch)

    def _agent(self, batch):
        self.ran.append("agent")
        super()._agent(batch)


@pytest.mark.parametrize(
    ("mode", "judge", "steps"),
    [
        ("speceyes", "large", ["judge", "speculate", "gate", "agent"]),
        ("both", "large", ["judge", "speculate", "gate", "agent"]),
        ("small", "large", ["speculate", "gate"]),
        ("agent", "large", ["agent"]),
        ("speceyes", "small-prefix", ["speculate", "judge", "gate", "agent"]),  # answer first
    ],
)
def test_each_mode_runs_its_steps(parts, mode, judge, steps):
    from speceyes.funnel import MODES, PLANS

    assert set(PLANS) == set(MODES)
    f = _StepLog(*parts, FunnelConfig(mode=mode, judge=judge, tau=0.5, batch_size=2))
    res = f.run(queries(2))
    assert f.ran == steps and sorted(PLANS[mode].steps) == sorted(steps)
    if mode == "small":  # the gate only records: nothing accepted, no agent
        assert all(r.confidence is not None and r.route == "small_only" for r in res)
        assert f.stats.tool_free == f.stats.accepted == 0
    assert PLANS["specreason"].steps == PLANS["agent"].steps == ("agent",)


@pytest.mark.parametrize("schedule", ["batched", "pipelined"])
@pytest.mark.parametrize("mode", ["speceyes", "both", "small", "agent"])
def test_each_route_is_decided_once(parts, tmp_path, monkeypatch, mode, schedule):
    from collections import Counter

    from speceyes import funnel as funnel_module

    decided: Counter = Counter()
    real = funnel_module.route_of

    def counting(mode_, result, **facts):
        assert result.route is None  # nothing set it before
        decided[result.id] += 1
        return real(mode_, result, **facts)

    monkeypatch.setattr(funnel_module, "route_of", counting)
    bad = tmp_path / "corrupt.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    qs = [*queries(3), Query(id="bad", image=str(bad), question="?")]
    f = Funnel(*parts, FunnelConfig(mode=mode, tau=0.5, batch_size=2, schedule=schedule))
    res = f.run(qs)
    assert decided == Counter(r.id for r in qs)
    assert {r.id: r.route for r in res}["bad"] == "error"
    assert all(r.route is not None for r in res)


def test_route_of_names_where_the_answer_comes_from():
    from speceyes.funnel import route_of
    from speceyes.types import MODES, Result

    judged_tool, judged_free = Result(id="t", answer="", judge_tool=True), Result(id="f", answer="")
    for mode in MODES:
        assert route_of(mode, judged_free, failed=True, accepted=False) == "error"
    assert route_of("small", judged_free, failed=False, accepted=False) == "small_only"
    assert route_of("agent", judged_free, failed=False, accepted=False) == "agent_only"
    assert route_of("specreason", judged_free, failed=False, accepted=False) == "specreason"
    for mode in ("speceyes", "both"):
        assert route_of(mode, judged_free, failed=False, accepted=True) == "small"
        assert route_of(mode, judged_free, failed=False, accepted=False) == "agent_after_gate"
        assert route_of(mode, judged_tool, failed=False, accepted=False) == "agent_after_judge"


def _without_times(r) -> dict:
    d = r.to_dict()
    d.pop("timings")
    d["trace"] = [{k: v for k, v in s.items() if k != "seconds"} for s in d["trace"]]
    return d


@pytest.mark.parametrize("mode", ["speceyes", "both", "small", "agent"])
def test_pipelined_and_batched_give_identical_results(parts, tmp_path, mode):
    """Every logged field but the timings, exactly, and the same counts, with a failed query."""
    bad = tmp_path / "corrupt.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    qs = queries(5)
    qs.insert(2, Query(id="bad", image=str(bad), question="?"))

    def run_with(schedule):
        cfg = FunnelConfig(mode=mode, tau=0.5, batch_size=2, schedule=schedule, max_agent_loops=2)
        f = Funnel(*parts, cfg)
        return f, {r.id: r for r in f.run(qs)}

    fb, batched = run_with("batched")
    fp, piped = run_with("pipelined")
    assert list(batched) == [q.id for q in qs]
    assert {i: _without_times(r) for i, r in piped.items()} == {
        i: _without_times(r) for i, r in batched.items()
    }
    assert all((r.small_topk is None) == (piped[i].small_topk is None) for i, r in batched.items())
    assert fp.stats == fb.stats


@pytest.mark.parametrize("schedule", ["batched", "pipelined"])
def test_both_mode_keeps_a_failed_query_out_of_the_agent(parts, schedule):
    """A query whose prompt breaks the tokenizer (a lone surrogate) fails alone in "both" mode
    too, though that mode runs the agent for every query."""
    qs = queries(2)
    qs.insert(1, Query(id="bad", image=qs[0].image, question="What \ud800 color?"))
    f = Funnel(*parts, FunnelConfig(mode="both", tau=0.5, batch_size=3, schedule=schedule))
    got = {r.id: r for r in f.run(qs)}
    assert got["bad"].route == "error" and got["bad"].error and got["bad"].agent_answer is None
    assert all(got[i].route != "error" and got[i].agent_answer is not None for i in ("q0", "q1"))
    assert f.stats.errors == 1
