"""`speceyes ask` as a user runs it, on tiny checkpoints built on this machine."""

from __future__ import annotations

import json

import pytest

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


def test_search_agent_settings_parse_and_reject_bad_keys():
    from speceyes.cli import _search_settings

    assert _search_settings("depth=3,grid=3,overlap=0.2,min_region=64,answer=small") == {
        "depth": 3,
        "grid": 3,
        "overlap": 0.2,
        "min_region": 64,
        "answer_prompt": "small",
    }
    assert _search_settings("") == {}
    assert _search_settings("stay=1") == {"stay": True}
    assert _search_settings("stay=off,beam=2") == {"stay": False, "beam": 2}
    assert _search_settings("fill_view=1,min_box=10") == {"fill_view": True, "min_box": 10}
    with pytest.raises(ValueError, match="stay needs 1 or 0"):
        _search_settings("stay=maybe")
    with pytest.raises(ValueError, match="K=V"):
        _search_settings("zoom=3")
    with pytest.raises(ValueError, match="depth needs a int"):
        _search_settings("depth=two")
