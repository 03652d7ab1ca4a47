"""Judge variants of phase I (FunnelConfig.judge) on tiny real models (HF backend).

Each variant is checked for who judges, on which messages and image, and what the funnel does
with the verdict; the prefix-shared judge also token by token: its prompt starts with the exact
tokens of the agent's first turn, which is what lets a prefix-caching server reuse that prefill.
"""

from __future__ import annotations

import pytest

from speceyes import prompts
from speceyes.agents.search import SearchAgent
from speceyes.agents.zoom import ZoomAgent
from speceyes.funnel import JUDGES, PREFIX_JUDGE_TEXT, Funnel, FunnelConfig
from speceyes.types import Query
from tests.conftest import make_scene


class Recorder:
    """A backend wrapper that records every call (method, conversations) in order."""

    def __init__(self, inner, log: list, role: str) -> None:
        self.inner, self.log, self.role = inner, log, role

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def next_token_probs(self, batch, words, top_logprobs=None):
        # In these runs the only next-token step is phase I's tool probability (logit mode).
        self.log.append((self.role, "judge", [list(m) for m in batch]))
        return self.inner.next_token_probs(batch, words, top_logprobs=top_logprobs)

    def answer(self, batch, max_new_tokens=20, top_k=64):
        self.log.append((self.role, "answer", [list(m) for m in batch]))
        return self.inner.answer(batch, max_new_tokens=max_new_tokens, top_k=top_k)

    def chat(self, batch, stop=(), max_new_tokens=1024):
        self.log.append((self.role, "chat", [list(m) for m in batch]))
        return self.inner.chat(batch, stop=stop, max_new_tokens=max_new_tokens)


def queries(n=3):
    return [
        Query(
            id=f"q{i}",
            image=make_scene(size=(560, 420), box=(30 + 60 * i, 40, 110 + 60 * i, 120)),
            question="What color is the square?",
            options=["red", "blue"],
            answer="A",
        )
        for i in range(n)
    ]


@pytest.fixture
def rig(q3, q25):
    log: list = []
    small, large = Recorder(q3, log, "small"), Recorder(q25, log, "large")
    return log, small, large


def run(rig, agent_cls=ZoomAgent, n=3, **cfg):
    log, small, large = rig
    log.clear()
    agent = agent_cls(large, max_new_tokens=8)
    f = Funnel(small, large, agent, FunnelConfig(batch_size=3, **cfg))
    return f, f.run(queries(n)), log


def calls(log, role=None, kind=None):
    return [c for c in log if (role is None or c[0] == role) and (kind is None or c[1] == kind)]


def test_default_is_the_published_judge(rig):
    assert FunnelConfig().judge == "large"
    f, res, log = run(rig, tau=0.0)
    (judge,) = calls(log, kind="judge")
    assert judge[0] == "large" and judge[2][0][0]["content"] == prompts.JUDGE_SYSTEM
    assert all(r.p_tool is not None for r in res)


def test_small_judge_asks_the_small_model(rig):
    f, res, log = run(rig, judge="small", tau=0.0)
    assert calls(log, "large", "judge") == []
    (judge,) = calls(log, "small", "judge")
    assert judge[2][0][0]["content"] == prompts.JUDGE_SYSTEM  # the published judge prompt
    assert all(r.p_tool is not None and r.judge_tool is not None for r in res)
    assert f.stats.judged == 3
    # the routes follow its verdicts
    for r in res:
        if r.judge_tool:
            assert r.route == "agent_after_judge" and r.small_answer is None
        else:
            assert r.route == "small"


def test_prefix_judge_shares_the_agents_first_turn_token_for_token(rig, q25):
    f, res, log = run(rig, judge="prefix", judge_threshold=0.0)  # every query to the agent
    assert all(r.route == "agent_after_judge" for r in res)
    (judge,) = calls(log, "large", "judge")
    first_chat = calls(log, "large", "chat")[0]
    for jm, am in zip(judge[2], first_chat[2], strict=True):
        assert jm[:-1] == am  # the agent's own messages, the same objects and strings
        assert jm[-1] == {"role": "user", "content": [prompts.text_part(PREFIX_JUDGE_TEXT)]}
        # token level: the agent's prompt, up to its assistant header, starts the judge's prompt
        agent_ids = q25._prepare([am])["input_ids"][0].tolist()
        judge_ids = q25._prepare([jm])["input_ids"][0].tolist()
        header = len(q25.tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False))
        shared = agent_ids[:-header]
        assert judge_ids[: len(shared)] == shared
        assert len(shared) > 0.9 * len(agent_ids)  # the whole image and prompt are reusable


def test_prefix_judge_with_the_search_agent_uses_its_deepeyes_answer_prompt(rig):
    f, res, log = run(rig, agent_cls=SearchAgent, judge="prefix", tau=0.0)
    (judge,) = calls(log, "large", "judge")
    q = queries()[0]
    expected = prompts.deepeyes_messages(
        judge[2][0][1]["content"][0]["image"], q.question, q.options
    )
    assert judge[2][0][:-1] == expected


def test_first_messages_are_the_first_call_without_side_effects(rig):
    """Every agent's first_messages (what the prefix judge extends) equals the conversation its
    loop opens with; the code agent builds it without staging the image for its sandbox."""
    from speceyes.agents.code import CodeAgent

    _, _, large = rig
    agent = CodeAgent(large, max_new_tokens=8, max_tool_calls=1)
    try:
        q = queries(1)[0]
        first = agent.first_messages(q)
        assert agent._tmp is None  # nothing written
        assert first[0]["content"] == prompts.THYME_SYSTEM
        loop = agent.start_loop(q)
        try:
            assert loop.messages == first
        finally:
            agent._end(loop)
    finally:
        agent.close()
    zoom = ZoomAgent(large, max_new_tokens=8)
    assert zoom.first_messages(q) == zoom.start_loop(q).messages


def test_small_prefix_judge_continues_the_answer_prompt(rig):
    f, res, log = run(rig, judge="small-prefix", tau=0.0)
    kinds = [(c[0], c[1]) for c in log]
    assert kinds[:2] == [("small", "answer"), ("small", "judge")]  # answer first, then judge
    answer, judge = calls(log, "small")[:2]
    for jm, am in zip(judge[2], answer[2], strict=True):
        assert jm[:-1] == am and jm[-1]["content"][0]["text"] == PREFIX_JUDGE_TEXT
    # answers for queries judged "tool" are dropped, as with --overlap
    for r in res:
        if r.judge_tool:
            assert r.small_answer is None and r.route == "agent_after_judge"
        else:
            assert r.small_answer is not None


def test_no_judge_lets_the_gate_decide(rig):
    f, res, log = run(rig, judge="none", tau=0.0)
    assert calls(log, kind="judge") == []
    assert all(r.p_tool is None and r.judge_tool is False and r.route == "small" for r in res)
    assert f.stats.beta == 1.0 and f.stats.alpha == 1.0
    f, res, log = run(rig, judge="none", tau=1.0)
    assert all(r.route == "agent_after_gate" for r in res)


@pytest.mark.parametrize("judge,model", [("large", "large"), ("small", "small")])
def test_judge_view_budget_shrinks_only_the_judges_image(rig, judge, model):
    budget = 64 * 28 * 28
    f, res, log = run(rig, judge=judge, judge_max_pixels=budget, tau=0.0)
    (jc,) = calls(log, model, "judge")
    for m in jc[2]:
        img = m[1]["content"][0]["image"]
        assert img.width * img.height <= budget
        assert img.size != (560, 420)
    for c in calls(log, kind="answer"):  # the small model's answer sees the full image
        assert all(m[1]["content"][0]["image"].size == (560, 420) for m in c[2])


def test_every_variant_routes_every_query_in_both_schedules(rig):
    for judge in JUDGES:
        _, batched, _ = run(rig, n=2, judge=judge, tau=0.5, max_agent_loops=2)
        assert all(r.route != "error" for r in batched), judge
        if judge in ("prefix", "small-prefix", "none"):  # phase I on its own paths
            _, piped, _ = run(rig, n=2, judge=judge, tau=0.5, schedule="pipelined")
            by_id = {r.id: (r.route, r.answer) for r in piped}
            assert by_id == {r.id: (r.route, r.answer) for r in batched}, judge


def test_config_errors(q3, q25):
    with pytest.raises(ValueError, match="unknown judge"):
        FunnelConfig(judge="tiny").validate()
    with pytest.raises(ValueError, match="view budget applies"):
        FunnelConfig(judge="prefix", judge_max_pixels=200704).validate()
    with pytest.raises(ValueError, match=">= 3136"):
        FunnelConfig(judge="large", judge_max_pixels=100).validate()

    from speceyes.agents.code import CodeAgent

    class Agent:
        def __init__(self, shares: bool) -> None:
            self.name, self.shares_first_prompt = "thyme", shares

    # The agent's own flag decides (the Thyme code agent's first prompt names a sandbox file).
    assert CodeAgent.shares_first_prompt is False
    with pytest.raises(ValueError, match="cannot be shared with the judge"):
        Funnel(q3, q25, Agent(shares=False), FunnelConfig(judge="prefix"))
    Funnel(q3, q25, Agent(shares=True), FunnelConfig(judge="prefix"))  # not its name
    Funnel(q3, q25, Agent(shares=False), FunnelConfig(judge="small-prefix"))


def test_cli_flags_reach_the_config():
    from speceyes.cli import build_parser
    from speceyes.factory import Settings

    def funnel_config(args):
        return Settings.from_args(args).resolved().funnel

    args = build_parser().parse_args(
        [
            "eval",
            "--bench",
            "jsonl",
            "--data",
            "x.jsonl",
            "--small",
            "s",
            "--large",
            "l",
            "--judge",
            "small",
            "--judge-max-pixels",
            "200704",
        ]
    )
    cfg = funnel_config(args)
    assert cfg.judge == "small" and cfg.judge_max_pixels == 200704
    args = build_parser().parse_args(["serve", "--small", "s", "--large", "l"])
    assert funnel_config(args).judge == "large"


def _bench_module():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_judge_variants.py"
    spec = importlib.util.spec_from_file_location("bench_judge_variants", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_bench_judge_variants_runs_on_a_folder(tiny_dirs, tmp_path, capsys):
    import json

    rows = []
    for i, q in enumerate(queries(3)):
        q.image.save(tmp_path / f"{q.id}.png")
        rows.append(
            {
                "id": q.id,
                "image": f"{q.id}.png",
                "question": q.question,
                "options": q.options,
                "answer": "A" if i % 2 else "B",
            }
        )
    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "variants.json"
    bench = _bench_module()
    rc = bench.main(
        [
            "--data",
            str(data),
            "--small",
            str(tiny_dirs["qwen3_vl"]),
            "--large",
            str(tiny_dirs["qwen2_5_vl"]),
            "--agent-max-tokens",
            "8",
            "--tau",
            "0.5",
            "--view-budgets",
            "50176",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| large@50176px |" in printed and "alpha_tool" in printed
    got = json.loads(out.read_text())
    by = {r["variant"]: r for r in got["rows"]}
    assert set(by) == {*JUDGES, "large@50176px"}
    ref = by["large"]
    assert ref["judge_agreement"] == 1.0 and ref["route_agreement"] == 1.0
    assert ref["points_vs_published"] == 0.0
    assert all(r["n"] == 3 and r["errors"] == 0 for r in got["rows"])
    assert by["none"]["beta"] == 1.0 and by["none"]["judge_s_per_query"] == 0.0
    # "none" says "no tool" for every query: it agrees exactly where the published judge did
    assert by["none"]["judge_agreement"] == pytest.approx(ref["beta"])
