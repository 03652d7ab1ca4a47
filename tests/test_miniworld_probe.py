"""The existence probe runs the real (tiny) model on the search's own cells."""

from __future__ import annotations

import pytest

pytest.importorskip("easy_vqa")

from speceyes.miniworld import probe  # noqa: E402
from speceyes.miniworld import tinymodel as M  # noqa: E402


def test_probe_reports_p_yes_per_depth_and_kind(tmp_path, capsys):
    base = M.build_base(tmp_path, "small", M.TINY, 0)
    table = probe.cell_existence(M.load_backend(base), scenes=1)
    depths = {k.split("/")[0] for k in table}
    kinds = {k.split("/")[1] for k in table}
    assert depths == {"depth 1", "depth 2"}  # the scene's small object has a depth-1 cell
    assert kinds <= set(probe.KINDS) and {"yes", "no-elsewhere", "no-absent"} <= kinds
    for v in table.values():
        assert v["n"] > 0 and 0.0 <= v["mean_p_yes"] <= 1.0 and 0.0 <= v["share_yes"] <= 1.0
    # Depth 1 asks about every cell of the 3x3 grid: each shows or misses each scene pair.
    assert table["depth 1/yes"]["n"] + table["depth 1/no-elsewhere"]["n"] >= 9
    from speceyes.cli import main as cli_main

    assert cli_main(["miniworld", "probe", str(base), "--scenes", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "| depth 1/yes |" in out and "mean P(yes)" in out
