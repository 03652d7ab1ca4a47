"""Every default a command's --help prints is the default of the type that owns it."""

from __future__ import annotations

import re

import pytest

from speceyes import protocols
from speceyes.agents import registry
from speceyes.cli import build_parser
from speceyes.factory import AgentSettings, BackendSettings, Settings
from speceyes.funnel import FunnelConfig

# flag -> the value it takes when not given, from its owner
OWNED = {
    "--engine": BackendSettings.engine,
    "--dtype": BackendSettings.dtype,
    "--tensor-parallel-size": BackendSettings.tensor_parallel_size,
    "--small-family": Settings.small_family,
    "--large-family": Settings.large_family,
    "--max-logprobs": BackendSettings.max_logprobs,
    "--mode": FunnelConfig.mode,
    "--agent": AgentSettings.kind,
    "--top-k": FunnelConfig.top_k,
    "--agg": FunnelConfig.agg,
    "--judge-mode": FunnelConfig.judge_mode,
    "--protocol": FunnelConfig.protocol,
    "--max-agent-loops": FunnelConfig.max_agent_loops,
}
# each command with the arguments it requires
COMMANDS = {
    "ask": ["i.png", "q", "--small", "s", "--large", "l"],
    "eval": ["--bench", "jsonl", "--data", "x", "--small", "s", "--large", "l"],
    "serve": ["--small", "s", "--large", "l"],
}


def _help(command: str, capsys) -> dict[str, str]:
    """flag -> its help text, from what ``speceyes COMMAND --help`` prints."""
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    text = capsys.readouterr().out
    out: dict[str, str] = {}
    flag = None
    for line in text.splitlines():
        m = re.match(r"  (--[a-z0-9-]+)", line)
        if m:
            flag = m.group(1)
            out[flag] = line[len(m.group(0)) :]
        elif flag and line.startswith(" " * 6):
            out[flag] += " " + line.strip()
        else:
            flag = None
    return {k: " ".join(v.split()) for k, v in out.items()}


def _default(text: str) -> str:
    found = re.findall(r"\(default: ([^()]*)\)", text)
    assert found, text
    return found[-1]


@pytest.mark.parametrize("command", COMMANDS)
def test_judge_default_is_the_published_one_or_auto_with_points(command, capsys, tmp_path):
    """--judge: the funnel's judge, or auto where a points file is given (auto needs one)."""
    shown = _default(_help(command, capsys)["--judge"])
    assert shown == f"{FunnelConfig.judge}; auto when --points is given"
    points = tmp_path / "p.json"
    points.write_text('[{"judge": "none", "tau": 0.9}]')
    for extra, judge in (([], FunnelConfig.judge), (["--points", str(points)], "auto")):
        args = build_parser().parse_args([command, *COMMANDS[command], *extra])
        assert Settings.from_args(args).funnel.judge == judge, (command, extra)


@pytest.mark.parametrize("command", COMMANDS)
def test_printed_defaults_are_the_owners(command, capsys):
    helps = _help(command, capsys)
    args = vars(build_parser().parse_args([command, *COMMANDS[command]]))
    for flag, value in OWNED.items():
        assert _default(helps[flag]) == str(value), (command, flag)
        assert args[flag[2:].replace("-", "_")] == value, (command, flag)  # what it takes
    # schedule: the protocol's, except serve, which answers each query as soon as it is final
    if command == "serve":
        assert _default(helps["--schedule"]) == "pipelined" == args["schedule"]
    else:
        assert args["schedule"] is None
        shown = _default(helps["--schedule"])
        for p in protocols.PROTOCOLS.values():
            assert f"{p.name} {p.schedule}" in shown


@pytest.mark.parametrize("command", COMMANDS)
def test_defaults_left_to_the_agent_and_protocol_are_spelled_out(command, capsys):
    helps = _help(command, capsys)
    for name in registry.choices():
        tau = registry.AGENTS[name].default_tau
        assert f"{name} {tau}" in _default(helps["--tau"])
    for flag, read in (
        ("--batch-size", lambda s: s.batch_size),
        ("--max-tool-calls", lambda s: s.max_tool_calls),
        ("--agent-max-tokens", lambda s: s.agent_max_tokens),
    ):
        shown = _default(helps[flag])
        assert f"fair {read(protocols.FAIR.loop_settings())};" in shown, flag
        for family in protocols.PUBLISHED_AGENTS:
            assert f"{read(protocols.PUBLISHED.loop_settings(family))} {family}" in shown
    search = helps["--search"]
    for name, (f, _) in registry.settings_fields(registry.AGENTS["search"]).items():
        if f.default is not None:
            shown = int(f.default) if isinstance(f.default, bool) else f.default
            assert re.search(rf"{name} \([^()]*default {re.escape(str(shown))}\)", search), name
