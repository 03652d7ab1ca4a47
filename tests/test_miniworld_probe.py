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


# --- the position probe ----------------------------------------------------------------------


def _turns_per_step(folder, axis: int):
    """Angles (radians) by which each frequency pair of the model's own text rotary embedding
    turns when only position component ``axis`` (0 t, 1 h, 2 w) steps from 0 to 1."""
    import torch
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(folder)
    rotary = model.model.language_model.rotary_emb
    pos = torch.zeros(3, 1, 2, dtype=torch.long)
    pos[axis, 0, 1] = 1
    cos, sin = rotary(torch.zeros(1, 2, 8), pos)
    half = cos.shape[-1] // 2
    return torch.atan2(sin[0, 1, :half], cos[0, 1, :half]).double().numpy()


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_section_frequencies_are_the_models_own(tmp_path, arch):
    import json

    import numpy as np

    from speceyes.miniworld import position_probe as P

    folder = M.build_base(tmp_path, "large", M.TINY, 0, arch)
    config = json.loads((folder / "config.json").read_text())
    freqs = P.section_frequencies(config)
    for axis, name in enumerate("thw"):
        turns = _turns_per_step(folder, axis)
        mine = turns[np.abs(turns) > 1e-9]
        assert np.allclose(np.sort(mine), np.sort(freqs[name]), rtol=1e-4), name
    reach = P.rotary_reach(config, (7, 9))
    assert reach["t"] == 0.0
    assert reach["w"] == pytest.approx(8 * freqs["w"].max()) and reach["h"] > 0
    if arch == "qwen2_5_vl":  # contiguous sections: width gets the slowest frequencies
        assert freqs["w"].max() < freqs["h"].min()
    else:  # interleaved: width gets fast ones too
        assert freqs["w"].max() > freqs["h"].min()


def test_rope_levers_rebuild_the_text_model(tmp_path):
    import json

    from speceyes.miniworld import position_probe as P

    plain = P.build_probe_model(tmp_path / "plain", "qwen2_5_vl")
    wide = P.build_probe_model(tmp_path / "wide", "qwen2_5_vl", rope_theta=1e4, head_dim=128)
    cfg = json.loads((wide / "config.json").read_text())["text_config"]
    base_cfg = json.loads((plain / "config.json").read_text())["text_config"]
    assert cfg["hidden_size"] == base_cfg["hidden_size"] == 256
    assert cfg["num_attention_heads"] == 2 and cfg["num_key_value_heads"] == 1
    assert cfg["rope_parameters"]["rope_theta"] == 1e4
    # The sections scale with the head: the real Qwen2.5-VL layout for 128-dim heads.
    assert base_cfg["rope_parameters"]["mrope_section"] == [8, 12, 12]
    assert cfg["rope_parameters"]["mrope_section"] == [16, 24, 24]
    sizes = [sum(p.numel() for p in M.load_backend(f).model.parameters()) for f in (plain, wide)]
    assert sizes[0] == sizes[1]
    # Same sizes, other rotary base: the model's own rotary embedding follows the config.
    turns = _turns_per_step(wide, 2)
    assert turns.max() == pytest.approx(P.section_frequencies({"text_config": cfg})["w"].max())
    sec = P.build_probe_model(tmp_path / "sec", "qwen3_vl", mrope_section=(16, 8, 8))
    rope = json.loads((sec / "config.json").read_text())["text_config"]["rope_parameters"]
    assert rope["mrope_section"] == [16, 8, 8] and rope["mrope_interleaved"]


def test_position_probe_cli_on_a_fresh_architecture(tmp_path, capsys):
    from speceyes.cli import main as cli_main
    from speceyes.miniworld import position_probe as P

    args = ["miniworld", "position-probe", "--arch", "qwen3_vl", "--scenes", "10"]
    assert cli_main([*args, "--threads", "1", "--build-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "qwen3_vl: head size 64" in out and "left/right" in out
    with pytest.raises(SystemExit):
        P.model_folder(tmp_path / "nothing")
    with pytest.raises(SystemExit):
        P.main(["--arch", "qwen3_vl", str(tmp_path)])  # MODEL and --arch exclude each other
    with pytest.raises(SystemExit):
        P.main(["--vision-pos", "sincos", str(tmp_path)])  # a lever of a fresh model only
    with pytest.raises(SystemExit):
        P.main(["--arch", "qwen2_5_vl", "--vision-pos", "sincos"])  # no learned grid there


def test_a_runs_role_folder_is_probed_through_its_stage_b_export(tmp_path):
    import torch

    from speceyes.miniworld import position_probe as P

    role = tmp_path / "large"
    base = M.build_base(role, "large", M.TINY, 0, "qwen3_vl")
    trained = M.load_backend(base).model.state_dict()
    key = next(k for k in trained if k.endswith("lm_head.weight"))
    trained[key] = torch.ones_like(trained[key])  # what a stage-B step would have changed
    (role / "stage_B").mkdir()
    torch.save({"model": trained}, role / "stage_B" / "ckpt.pt")
    folder = P.model_folder(role)
    assert folder == role / "export"
    assert torch.equal(M.load_backend(folder).model.state_dict()[key], trained[key])
    assert P.model_folder(base) == base  # a model folder is used as it is


def test_sincos_grid_gives_every_cell_its_own_unit_code_and_near_cells_near_codes():
    import numpy as np

    g = M.sincos_grid(8, 32)
    assert g.shape == (64, 32)
    assert np.allclose(np.linalg.norm(g, axis=1), 1.0)
    sim = g @ g.T
    assert (sim[~np.eye(64, dtype=bool)] < 1 - 1e-6).all()  # no two cells alike
    # cell (3, 3): its row and column neighbours are nearer than the far corner
    c, right, below, corner = 3 * 8 + 3, 3 * 8 + 4, 4 * 8 + 3, 7 * 8 + 7
    assert sim[c, right] > sim[c, corner] and sim[c, below] > sim[c, corner]
    with pytest.raises(ValueError, match="multiple of 4"):
        M.sincos_grid(8, 30)


def test_a_fresh_qwen3_vl_base_can_start_with_the_sincos_position_grid(tmp_path):
    import numpy as np
    import torch

    random_base = M.build_base(tmp_path / "a", "large", M.TINY, 0, "qwen3_vl")
    base = M.build_base(tmp_path / "b", "large", M.TINY, 0, "qwen3_vl", vision_pos="sincos")
    assert not (tmp_path / "b" / ".base.tmp").exists()  # built aside, moved in whole
    weights = {
        name: M.load_backend(folder).model.model.visual.pos_embed.weight.detach()
        for name, folder in (("random", random_base), ("sincos", base))
    }
    grid = weights["sincos"].numpy()
    side = int(round(len(grid) ** 0.5))
    code = M.sincos_grid(side, grid.shape[1])
    norms = np.linalg.norm(grid, axis=1)
    assert np.allclose(grid / norms[:, None], code, atol=1e-5)  # the grid, one scale for all
    assert np.allclose(norms, norms[0])
    assert norms[0] > 10 * torch.linalg.norm(weights["random"], dim=1).mean().item()
    with pytest.raises(ValueError, match="unknown vision position init"):
        M.build_base(tmp_path / "c", "large", M.TINY, 0, "qwen3_vl", vision_pos="learned")
    with pytest.raises(ValueError, match="no learned vision position grid"):
        M.init_vision_positions(M.build_base(tmp_path / "d", "large", M.TINY, 0, "qwen2_5_vl"))
