"""Export a trained role's stage weights as a Hugging Face model folder, and bundle both roles
(bfloat16) with the demo's ``manifest.json`` into the package (what ``speceyes demo`` loads)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speceyes.miniworld.tinymodel import load_backend, load_ckpt
from speceyes.miniworld.traindata import CANVAS

if TYPE_CHECKING:
    from speceyes.miniworld.trainconfig import TrainConfig


def export(role_dir: Path, stage: str, dest: Path, dtype: str = "float32") -> Path:
    """save_pretrained the stage's weights with the base folder's tokenizer and processor."""
    import torch

    backend = load_backend(role_dir / "base")
    backend.model.load_state_dict(load_ckpt(role_dir / f"stage_{stage}" / "ckpt.pt")["model"])
    if dtype != "float32":
        backend.model.to(getattr(torch, dtype))
    dest.mkdir(parents=True, exist_ok=True)
    backend.model.save_pretrained(dest)
    for f in (role_dir / "base").iterdir():
        if f.name not in ("config.json", "model.safetensors", "generation_config.json"):
            shutil.copy(f, dest / f.name)
    return dest


def bundle(small_dir: Path, large_dir: Path, dest: Path, settings: dict[str, Any]) -> Path:
    """Write both trained models (stage B, bfloat16) and the demo's ``manifest.json`` to
    ``dest`` (by default the package's ``models`` folder, which ``speceyes demo`` loads)."""
    for role, src in (("small", small_dir), ("large", large_dir)):
        tmp = dest / f".{role}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        export(src, "B", tmp, dtype="bfloat16")
        shutil.rmtree(dest / role, ignore_errors=True)
        os.replace(tmp, dest / role)
    steps = {
        role: load_ckpt(src / "stage_B" / "ckpt.pt")["step"]
        for role, src in (("small", small_dir), ("large", large_dir))
    }
    manifest = {"canvas": list(CANVAS), **settings, "trained_steps": steps}
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return dest


def stage_bundle(cfg: TrainConfig) -> None:
    settings = json.loads(cfg.settings.read_text()) if cfg.settings else {}
    dest = bundle(cfg.small_dir, cfg.large_dir, cfg.dest, settings)
    size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    print(f"bundled into {dest} ({size / 1e6:.1f} MB)")
