"""`speceyes ask` as a user runs it, on tiny checkpoints built on this machine."""

from __future__ import annotations

import json

from speceyes.cli import main
from tests.conftest import make_scene


def _ask(tiny_dirs, *extra):
    return [
        "ask",
        *extra,
        "--small",
        str(tiny_dirs["qwen3_vl"]),
        "--large",
        str(tiny_dirs["qwen2_5_vl"]),
    ]


def test_ask_prints_route_and_confidence(tiny_dirs, tmp_path, capsys):
    img = tmp_path / "scene.png"
    make_scene().save(img)
    rc = main(
        _ask(
            tiny_dirs,
            str(img),
            "What color is the square?",
            "--option",
            "red",
            "--option",
            "blue",
            "--tau",
            "0.5",
        )
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "route:" in out and "P(tool):" in out and "confidence" in out and "tool calls:" in out


def test_ask_json_goes_through_all_four_phases(tiny_dirs, tmp_path, capsys):
    img = tmp_path / "scene.jpg"
    make_scene().save(img)
    rc = main(_ask(tiny_dirs, str(img), "What color?", "--json", "--tau", "1.0"))
    data = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert data["route"] == "agent_after_gate"  # judged tool-free, rejected by the gate
    assert set(data["timings"]) >= {"judge", "small", "gate", "agent"}
    assert 0 <= data["confidence"] <= 1 and data["small_answer"] is not None


def test_ask_missing_and_corrupt_image(tiny_dirs, tmp_path, capsys):
    assert main(_ask(tiny_dirs, str(tmp_path / "none.png"), "q")) == 2
    assert "none.png" in capsys.readouterr().err
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"not an image")
    assert main(_ask(tiny_dirs, str(bad), "q")) == 2
    assert "bad.jpg" in capsys.readouterr().err


def test_ask_unknown_model(tmp_path, capsys):
    img = tmp_path / "s.png"
    make_scene().save(img)
    rc = main(["ask", str(img), "q", "--small", str(tmp_path / "nomodel"), "--large", "x/y/z"])
    assert rc == 2 and "does not exist" in capsys.readouterr().err


def test_search_flag_reaches_the_agent_settings():
    from speceyes.cli import build_parser
    from speceyes.factory import Settings

    argv = ["ask", "i.png", "q", "--small", "s", "--large", "l", "--agent", "search"]
    s = Settings.from_args(build_parser().parse_args([*argv, "--search", "depth=3,stay=1"]))
    assert s.agent.kind == "search" and s.agent.options == {"depth": 3, "stay": True}
    r = s.resolved()
    assert r.agent.max_new_tokens == 1024 and r.funnel.batch_size == 8  # the fair protocol's
    assert (s.small, s.large, s.backend.engine, s.backend.max_logprobs) == ("s", "l", "hf", 20)
    # --search is read only for the search agent, as before
    other = build_parser().parse_args([*argv[:-1], "deepeyes", "--search", "zoom=3"])
    assert Settings.from_args(other).agent.options == {}


def test_miniworld_is_a_group_of_tools(monkeypatch, capsys):
    """Each tool gets the words after its name, --help included; words naming no tool go to
    the scene generator."""
    import importlib

    from speceyes.cli import miniworld

    got = {}
    for name, (module, _) in miniworld.TOOLS.items():
        mod = importlib.import_module(module)
        monkeypatch.setattr(mod, "main", lambda argv, name=name: got.setdefault(name, argv) and 0)
    assert main(["miniworld", "train", "--out", "x", "--help"]) == 0
    assert main(["miniworld", "probe", "M", "--scenes", "1"]) == 0
    assert main(["miniworld", "--out", "d", "--split", "val"]) == 0
    assert got == {
        "train": ["--out", "x", "--help"],
        "probe": ["M", "--scenes", "1"],
        "scenes": ["--out", "d", "--split", "val"],
    }
