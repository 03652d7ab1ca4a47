"""The cascade on the bundled mini-world models: multi-depth speculation and the middle tier.

The small model's speculation is the search agent on the small backend (the bundled small model
writes no tool calls); per-stage thresholds (``stage_taus``) steer each query to the stage under
test. A test double drives only the control flow of failures and of the DeepEyes loop's turns;
answers, logits and confidences come from the real tiny models.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import pytest

from speceyes import cascade, prompts
from speceyes.agents.search import SearchAgent
from speceyes.backends.base import BackendError
from speceyes.bench import runner
from speceyes.bench.datasets import load_jsonl
from speceyes.cli.options import add_funnel_args, add_model_args
from speceyes.factory import BackendSettings, Settings, make_backend
from speceyes.funnel import CASCADE_DEFAULTS, Funnel, FunnelConfig, route_of
from speceyes.miniworld import demo
from speceyes.miniworld.splits import level_defaults, make_split
from speceyes.operating_points import AGENT_POINT, OperatingPoint
from speceyes.types import PHASES, ChatTurn, Result, small_stage

# The manifest's search agent, one zoom over a 2x2 grid: enough to exercise every stage.
AGENT_KW = dict(grid=2, overlap=0.25, min_region=64, min_box=10, fill_view=True)
AGENT_KW["answer_prompt"] = "small"
ALL_STAGES = ("small@0", "small@1", "large_direct")
# A gate accepts iff confidence > tau. NEVER runs a stage that refuses every answer (the tiny
# models' confidences stay far below it); OFF (1.0) switches a stage off, as a calibration does.
NEVER, ALWAYS, OFF = 1.0 - 1e-9, 0.0, 1.0


@pytest.fixture(scope="module")
def models():
    b = BackendSettings(dtype="float32")
    small = make_backend(str(demo.MODELS_DIR / "small"), settings=b, role="small")
    large = make_backend(str(demo.MODELS_DIR / "large"), settings=b)
    return small, large, SearchAgent(large, depth=1, **AGENT_KW)


@pytest.fixture(scope="module")
def mw_queries(tmp_path_factory):
    canvas, clutter = level_defaults(1)
    out = tmp_path_factory.mktemp("mw-cascade")
    make_split(out, "test", 1, seed=0, canvas=canvas, clutter=clutter, level=1)
    qs = list(load_jsonl(out / "questions.jsonl"))
    return [qs[0], qs[3]]  # an attribute question and a POPE question


def funnel(models, speculation=None, **cfg):
    small, large, agent = models
    cfg.setdefault("batch_size", 1)  # two queries: two batches
    return Funnel(small, large, agent, FunnelConfig(tau=0.9, **cfg), speculation)


def cascade_run(models, queries, **cfg):
    f = funnel(models, **cfg)
    return f, f.run(queries)


def stage_names(r: Result) -> list[str]:
    return [s["stage"] for s in r.stages]


def test_depth_one_answer_accepted(models, mw_queries):
    taus = {"small@0": NEVER, "small@1": ALWAYS}
    f, res = cascade_run(models, mw_queries, speculate_depth=1, stage_taus=taus)
    for r in res:
        deep = r.stages[-1]
        assert deep["stage"] == "small@1" and deep["tool_calls"] == 1 and deep["accepted"]
        assert r.route == "small_deep" and r.answer == deep["answer"]
        assert "agent" not in r.timings and r.agent_answer is None  # the agent never ran
        assert r.timings["small_deep"] == pytest.approx(deep["seconds"], abs=1e-5)
        # small@0 ran only where the judge found no tools needed, and its gate refused.
        assert (stage_names(r)[0] == "small@0") == (r.judge_tool is False)
        assert not any(s["accepted"] for s in r.stages[:-1])
    assert f.stats.stage_accepted == {"small@1": len(res)}
    assert f.stats.accepted == 0


def test_falls_through_to_the_middle_tier(models, mw_queries):
    taus = {"small@0": NEVER, "small@1": NEVER, "large_direct": ALWAYS}
    f, res = cascade_run(models, mw_queries, speculate_depth=1, middle_tier=True, stage_taus=taus)
    for r in res:
        assert stage_names(r)[-2:] == ["small@1", "large_direct"]
        direct = r.stages[-1]
        assert r.route == "large_direct" and r.answer == direct["answer"] and direct["accepted"]
        assert 0.0 < direct["confidence"] <= 1.0 and direct["tool_calls"] == 0
        assert "agent" not in r.timings
    assert f.stats.stage_accepted == {"large_direct": len(res)}
    assert f.stats.stage_runs["large_direct"] == len(res)


def test_falls_through_to_the_agent(models, mw_queries):
    taus = dict.fromkeys(ALL_STAGES, NEVER)
    f, res = cascade_run(models, mw_queries, speculate_depth=1, middle_tier=True, stage_taus=taus)
    for r in res:
        assert not any(s["accepted"] for s in r.stages) and "large_direct" in stage_names(r)
        want = "agent_after_judge" if r.judge_tool else "agent_after_gate"
        assert r.route == want and r.answer == r.agent_answer and "agent" in r.timings
    assert f.stats.stage_accepted == {}


def test_a_stage_at_tau_one_does_not_run(models, mw_queries):
    taus = {"small@0": NEVER, "small@1": OFF, "large_direct": OFF}
    f, res = cascade_run(models, mw_queries, speculate_depth=1, middle_tier=True, stage_taus=taus)
    for r in res:
        assert set(stage_names(r)) <= {"small@0"} and r.route.startswith("agent_after")
    assert "small@1" not in f.stats.stage_runs and "large_direct" not in f.stats.stage_runs
    # in both mode every stage still runs, so any thresholds can be replayed from the log
    _, logged = cascade_run(models, mw_queries[:1], mode="both", speculate_depth=1,
                            middle_tier=True, stage_taus=taus)
    assert stage_names(logged[0])[-2:] == ["small@1", "large_direct"]


def test_the_middle_tier_alone(models, mw_queries):
    f, res = cascade_run(models, mw_queries, middle_tier=True, stage_taus={"small@0": NEVER})
    for r in res:
        assert stage_names(r)[-1] == "large_direct" and "small@1" not in stage_names(r)
        direct = r.stages[-1]
        assert direct["accepted"] == (direct["confidence"] > 0.9)
        assert (r.route == "large_direct") == direct["accepted"]
    assert f.speculation is None


def test_the_middle_tier_on_the_agents_prefix(models, mw_queries):
    """--direct-prompt agent-prefix: the direct answer's prompt is the agent's own first turn
    and then the direct question, so a prefix cache holds its image prefill (the real server's
    cache hit: tests/test_vllm_middle_tier.py); the real model answers it and its gate decides."""
    _, _, agent = models
    f, res = cascade_run(models, mw_queries, middle_tier=True, direct_prompt="agent-prefix",
                         stage_taus={"small@0": NEVER})  # fmt: skip
    q = mw_queries[0]
    msgs = f._agent_prefix_direct_messages(q.image, q.question, q.options)
    assert msgs[:-1] == agent.first_messages(q)
    assert msgs[-1] == {"role": "user", "content": [{"type": "text", "text": prompts.DIRECT_TURN_TEXT}]}
    spec = funnel(models, middle_tier=True).run(mw_queries)
    for r, s in zip(res, spec, strict=True):
        direct = r.stages[-1]
        assert direct["stage"] == "large_direct" and direct["confidence"] is not None
        assert (r.route == "large_direct") == direct["accepted"]
        # another prompt, another answer distribution: the confidence moves
        assert direct["confidence"] != s.stages[-1]["confidence"]


def test_the_direct_prompt_checks():
    with pytest.raises(ValueError, match="unknown direct prompt"):
        FunnelConfig(middle_tier=True, direct_prompt="agent").validate()
    with pytest.raises(ValueError, match="add --middle-tier"):
        FunnelConfig(direct_prompt="agent-prefix").validate()
    at = FunnelConfig(middle_tier=True, direct_prompt="agent-prefix", judge="auto",
                      points=[{"judge": "large"}]).at_point(OperatingPoint(AGENT_POINT))  # fmt: skip
    at.validate()  # agent-only: no middle tier, so no direct prompt
    assert "direct_prompt" not in FunnelConfig().to_dict()  # a run without it logs as before
    assert FunnelConfig(middle_tier=True, direct_prompt="agent-prefix").to_dict()[
        "direct_prompt"] == "agent-prefix"  # fmt: skip


@pytest.fixture(scope="module")
def both_run(models, mw_queries):
    f, res = cascade_run(models, mw_queries, mode="both", speculate_depth=1, middle_tier=True)
    return f, res


def test_both_mode_logs_every_stage_and_routes_like_speceyes(models, mw_queries, both_run):
    f, both = both_run
    for r in both:
        assert stage_names(r) == list(ALL_STAGES)  # small@0 too: both speculates for all
        assert "agent" in r.timings and r.agent_answer is not None
        for s in r.stages:
            assert s["tau"] == 0.9
            assert s["accepted"] == (
                s["confidence"] > 0.9 and (s["stage"] != "small@0" or not r.judge_tool)
            )
    assert f.stats.stage_runs == dict.fromkeys(ALL_STAGES, len(both))
    _, alone = cascade_run(models, mw_queries, speculate_depth=1, middle_tier=True)
    for b, s in zip(both, alone, strict=True):
        assert (b.route, b.answer) == (s.route, s.answer)
        # speceyes stops at the first stage that passes; both ran the same ones before it.
        assert _same_stages(s.stages, b.stages)


def _same_stages(a: list[dict], b: list[dict]) -> bool:
    """Stage records equal but for their seconds."""
    drop = lambda s: {k: v for k, v in s.items() if k != "seconds"}  # noqa: E731
    return [drop(s) for s in a] == [drop(s) for s in b[: len(a)]]


def test_pipelined_schedule_gives_the_batched_results(models, mw_queries, both_run):
    _, batched = both_run
    _, piped = cascade_run(
        models, mw_queries, mode="both", speculate_depth=1, middle_tier=True, schedule="pipelined"
    )
    piped = sorted(piped, key=lambda r: r.id)
    for a, b in zip(sorted(batched, key=lambda r: r.id), piped, strict=True):
        assert (a.route, a.answer, a.agent_answer) == (b.route, b.answer, b.agent_answer)
        assert _same_stages(a.stages, b.stages)


def test_samples_and_results_score_every_stage(mw_queries, both_run):
    f, res = both_run
    by_id = {q.id: q for q in mw_queries}
    records = [runner.sample_record(by_id[r.id], r, "both") for r in res]
    for rec, r in zip(records, res, strict=True):
        assert [s["stage"] for s in rec["stages"]] == list(ALL_STAGES)
        for s in rec["stages"]:
            assert s["correct"] == runner.scoring.is_correct(by_id[r.id], s["answer"])
        json.dumps(rec)  # a logged line
    summary = runner.summarize(records, "jsonl")
    stages = summary["stages"]
    assert list(stages) == list(ALL_STAGES)
    for name, row in stages.items():
        logged = [s for rec in records for s in rec["stages"] if s["stage"] == name]
        assert row["n"] == len(logged)
        assert row["accuracy"] == pytest.approx(sum(s["correct"] for s in logged) / len(logged))
        assert row["acceptance"] == pytest.approx(sum(s["accepted"] for s in logged) / len(logged))
        assert row["answered"] == f.stats.stage_accepted.get(name, 0)
    assert {"small_deep", "large_direct"} <= set(summary["time_by_phase"])


def test_defaults_are_the_papers_funnel(models, mw_queries):
    cfg = FunnelConfig()
    assert not cfg.cascade and set(CASCADE_DEFAULTS).isdisjoint(cfg.to_dict())
    assert cfg.stages() == (small_stage(0),)
    f = funnel(models)
    assert f.speculation is None
    res = f.run(mw_queries)
    records = [runner.sample_record(q, r, "speceyes") for q, r in zip(mw_queries, res, strict=True)]
    assert all(not r.stages and "stages" not in r.to_dict() for r in res)
    assert all("stages" not in rec for rec in records)
    summary = runner.summarize(records, "jsonl")
    assert "stages" not in summary and tuple(summary["time_by_phase"]) == PHASES
    assert f.stats.stage_runs == {} and f.stats.stage_accepted == {}
    # A cascade's settings are kept in the run configuration.
    deep = FunnelConfig(speculate_depth=2, stage_taus={"small@2": 0.5}).to_dict()
    assert deep["speculate_depth"] == 2 and deep["stage_taus"] == {"small@2": 0.5}


class Breaking:
    """The real search speculation, failing for one query the way ``error`` says."""

    def __init__(self, real: cascade.Speculation, bad_id: str, error: Exception) -> None:
        self.real, self.bad_id, self.error = real, bad_id, error
        self.name = real.name

    def __getattr__(self, name):
        return getattr(self.real, name)

    def step(self, loops):
        if any(lp.query.id == self.bad_id for lp in loops):
            raise self.error
        self.real.step(loops)


def _speculation(models, depth=1):
    small, _, agent = models
    return cascade.make_speculation("search", small, depth, like=agent)


def test_a_broken_query_fails_alone(models, mw_queries):
    bad = mw_queries[1].id
    spec = Breaking(_speculation(models), bad, ValueError("broken crop"))
    taus = {"small@0": NEVER, "small@1": ALWAYS}
    res = funnel(models, spec, speculate_depth=1, stage_taus=taus, batch_size=2).run(mw_queries)
    for r in res:
        if r.id == bad:
            assert r.route == "error" and "broken crop" in r.error and r.answer == ""
        else:
            assert r.route == "small_deep" and r.error is None


def test_a_failed_backend_call_leaves_the_stage_without_an_answer(models, mw_queries):
    spec = Breaking(_speculation(models), mw_queries[0].id, BackendError("server down"))
    taus = {"small@0": NEVER, "small@1": ALWAYS}
    f = funnel(models, spec, speculate_depth=1, stage_taus=taus, batch_size=2)
    for r in f.run(mw_queries):  # the whole batch's step failed: each goes on to the agent
        deep = r.stages[-1]
        assert deep["stage"] == "small@1" and deep["error"] == "server down"
        assert deep["answer"] is None and not deep["accepted"]
        assert r.route in ("agent_after_judge", "agent_after_gate") and r.error is None


class ScriptedChat:
    """The real small model, whose DeepEyes turns come from a script per question."""

    def __init__(self, real, scripts: dict[str, list[str]]) -> None:
        self.real, self.scripts = real, {k: list(v) for k, v in scripts.items()}

    def __getattr__(self, name):
        return getattr(self.real, name)

    def chat(self, batch, stop=(), max_new_tokens=1024):
        out = []
        for messages in batch:
            question = messages[1]["content"][1]["text"]
            script = next(v for k, v in self.scripts.items() if k in question)
            out.append(ChatTurn(text=script.pop(0), finish_reason="stop", stop="</tool_call>"))
        return out


def test_deepeyes_speculation_answers_on_its_crop(models, mw_queries):
    small, large, agent = models
    args = {"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [0, 0, 300, 300]}}
    zoom = f"<tool_call>{json.dumps(args)}</tool_call>"
    a, b = mw_queries
    assert a.question != b.question

    def scripted():
        turns = {a.question: [zoom, zoom], b.question: ["<answer>no</answer>"]}
        return ScriptedChat(small, turns)

    spec = cascade.make_speculation("deepeyes", scripted(), 2)
    assert spec.agent.max_tool_calls == 2
    f = Funnel(small, large, agent, FunnelConfig(mode="both", speculate_depth=2), spec)
    ra, rb = f.run([a, b])
    assert [s["stage"] for s in ra.stages] == ["small@0", "small@1", "small@2"]
    assert [s["tool_calls"] for s in ra.stages] == [0, 1, 2]
    assert stage_names(rb) == ["small@0"]  # it answered instead of zooming: nothing new seen
    # Its answers are the speculative prompt's, asked on the crop: as small@0's on that image.
    fresh = cascade.make_speculation("deepeyes", scripted(), 2)
    loop = fresh.start(a)
    fresh.step([loop])
    crop = fresh.seen(loop)
    assert crop.size != loop.image.size
    direct = Funnel(small, None, None, FunnelConfig(mode="small"))
    again = direct.run([replace(a, image=crop)])[0]
    assert ra.stages[1]["answer"] == again.small_answer
    assert ra.stages[1]["confidence"] == pytest.approx(again.confidence, abs=1e-6)


def test_route_of_reads_the_first_accepted_stage():
    def result(*accepted, judge_tool=False):
        stages = [{"stage": s, "accepted": a} for s, a in zip(ALL_STAGES, accepted, strict=False)]
        return Result(id="q", answer="", judge_tool=judge_tool, stages=stages)

    route = lambda r, acc=False: route_of("speceyes", r, failed=False, accepted=acc)  # noqa: E731
    assert route(result(True, True, True), acc=True) == "small"
    assert route(result(False, True, True)) == "small_deep"
    assert route(result(False, False, True)) == "large_direct"
    assert route(result(False, False, False)) == "agent_after_gate"
    assert route(result(False, False, False, judge_tool=True)) == "agent_after_judge"
    assert route_of("both", result(False, True), failed=True, accepted=False) == "error"


def test_config_checks():
    with pytest.raises(ValueError, match="cascade"):
        FunnelConfig(mode="small", middle_tier=True).validate()
    with pytest.raises(ValueError, match="cascade"):
        FunnelConfig(mode="agent", speculate_depth=1).validate()
    with pytest.raises(ValueError, match="unknown stage"):
        FunnelConfig(stage_taus={"medium": 0.5}).validate()
    with pytest.raises(ValueError, match="small agent"):
        FunnelConfig(speculate_depth=1, small_agent="thyme").validate()
    with pytest.raises(ValueError, match="at least 0"):
        FunnelConfig(speculate_depth=-1).validate()
    cfg = FunnelConfig(tau=0.8, speculate_depth=2, middle_tier=True, stage_taus={"small@1": 0.6})
    assert cfg.stages() == ("small@0", "small@1", "small@2", "large_direct")
    assert [cfg.stage_tau(s) for s in cfg.stages()] == [0.8, 0.6, 0.8, 0.8]


def test_default_small_agent_and_its_settings(models):
    small, _, agent = models
    assert cascade.default_small_agent("search") == "search"
    assert cascade.default_small_agent("deepeyes") == cascade.default_small_agent(None)
    spec = cascade.make_speculation("search", small, 3, like=agent)
    assert spec.agent.backend is small and spec.agent.depth == 3
    assert (spec.agent.grid, spec.agent.fill_view, spec.agent.min_region) == (2, True, 64)


def test_cli_flags_reach_the_funnel_config():
    p = argparse.ArgumentParser()
    add_model_args(p, required=False)
    add_funnel_args(p)
    ns = p.parse_args(["--speculate-depth", "2", "--middle-tier", "--small-agent", "deepeyes"])
    f = Settings.from_args(ns).funnel
    assert (f.speculate_depth, f.middle_tier, f.small_agent) == (2, True, "deepeyes")
    ns = p.parse_args(["--middle-tier", "--direct-prompt", "agent-prefix"])
    assert Settings.from_args(ns).funnel.direct_prompt == "agent-prefix"
    plain = Settings.from_args(p.parse_args([])).funnel
    assert plain == FunnelConfig(batch_size=None, schedule=None)


def test_category_thresholds_steer_each_query_by_its_type(models, mw_queries):
    """Adaptive gating (calibrate --per-category): each query's stages take its category's
    thresholds; a category the calibration does not name takes the overall ones."""
    a, b = (q.category for q in mw_queries)
    assert a != b
    overall = dict.fromkeys(ALL_STAGES, NEVER)
    per = {a: {"small@0": NEVER, "small@1": ALWAYS}, b: {"large_direct": ALWAYS}}
    f, res = cascade_run(models, mw_queries, speculate_depth=1, middle_tier=True,
                         stage_taus=overall, category_taus=per)  # fmt: skip
    assert [r.route for r in res] == ["small_deep", "large_direct"]
    assert res[0].stages[-1]["tau"] == ALWAYS and res[1].stages[-1]["tau"] == ALWAYS
    assert res[1].stages[-2]["stage"] == "small@1" and res[1].stages[-2]["tau"] == NEVER
    # no category named: both fall through to the agent, as with the overall thresholds alone
    _, plain = cascade_run(models, mw_queries, speculate_depth=1, middle_tier=True,
                           stage_taus=overall, category_taus={"other": {"small@1": ALWAYS}})  # fmt: skip
    assert all(r.route.startswith("agent_after") for r in plain)


def test_category_thresholds_config():
    cfg = FunnelConfig(tau=0.8, speculate_depth=1, middle_tier=True,
                       stage_taus={"small@1": OFF, "large_direct": OFF},
                       category_taus={"pope": {"small@1": 0.5}, "(none)": {"small@0": 0.7}})  # fmt: skip
    assert cfg.stage_tau("small@1", "pope") == 0.5 and cfg.stage_tau("small@1", "x") == OFF
    assert cfg.stage_tau("small@0", "pope") == 0.8 and cfg.stage_tau("small@0") == 0.7
    # a stage that only some category can pass still runs; one no category can pass does not
    assert cfg.stage_may_accept("small@1") and not cfg.stage_may_accept("large_direct")
    with pytest.raises(ValueError, match=r"category_taus\[pope\]: unknown stage"):
        FunnelConfig(category_taus={"pope": {"medium": 0.5}}).validate()
    assert "category_taus" not in FunnelConfig().to_dict()
