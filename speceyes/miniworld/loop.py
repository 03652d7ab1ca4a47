"""The training loop the mini-world's stages share, and their checkpoint.

A stage builds its model, optimizer and data, then hands :func:`run_loop` one function that takes
a training step and returns its named losses. The loop owns everything around the steps: the
deadline (``--minutes``), ``--max-steps``, the step count, averaged losses in ``log.jsonl`` every
``--log-every`` steps, a checkpoint every ``--save-every`` seconds and at the end, and the
``end`` record.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from speceyes.miniworld.tinymodel import load_ckpt, log_event, save_ckpt, set_rng_state
from speceyes.miniworld.trainconfig import TrainConfig

# One training step: its losses by name, "loss" (the optimised total) first and always there;
# None for a loss this step did not compute (logged as None if no step since the last line did).
StepFn = Callable[[], dict[str, float | None]]


@dataclass
class Checkpoint:
    """A stage's ``ckpt.pt``: the model, the optimizer, and named modules saved beside them.

    The layout is :func:`save_ckpt`'s (model, head, opt, step, rng, plus ``seconds``): a module
    named ``head`` goes in the ``head`` slot, any other (stage B's ``aux``) under its own key.
    """

    path: Path
    backend: Any  # what the model lives in (HFBackend): its .model is saved
    opt: Any  # the torch optimizer
    modules: dict[str, Any] = field(default_factory=dict)  # torch modules, by checkpoint key

    def save(self, step: int, seconds: float) -> None:
        extra = {n: m.state_dict() for n, m in self.modules.items() if n != "head"}
        head = self.modules.get("head")
        save_ckpt(self.path, self.backend, head, self.opt, step, {"seconds": seconds, **extra})

    def seed_or_resume(
        self, seed: int, resume: bool, role_dir: Path, stage: str
    ) -> tuple[int, float, bool]:
        """Seed every RNG; with ``resume`` and a checkpoint, restore the model, the optimizer,
        the modules saved under their names, the RNG states and the step.
        Returns ``(step, seconds, resumed)``: ``(0, 0.0, False)`` for a fresh start."""
        import torch

        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        if not (resume and self.path.is_file()):
            return 0, 0.0, False
        s = load_ckpt(self.path)
        self.backend.model.load_state_dict(s["model"])
        for name, module in self.modules.items():
            if s.get(name):
                module.load_state_dict(s[name])
        self.opt.load_state_dict(s["opt"])
        set_rng_state(s["rng"])
        log_event(role_dir, {"stage": stage, "event": "resume", "step": s["step"]})
        return s["step"], s.get("seconds", 0.0), True


def optimizer_step(opt, loss, clip: Iterable) -> None:
    """Backpropagate ``loss`` and take one step of ``opt``, the gradients of the parameters in
    ``clip`` clipped to norm 1."""
    import torch

    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(clip, 1.0)
    opt.step()


def run_loop(
    cfg: TrainConfig,
    role_dir: Path,
    stage: str,
    ckpt: Checkpoint,
    step_fn: StepFn,
    *,
    step: int = 0,
    seconds: float = 0.0,
    on_log: Callable[[int], dict] | None = None,
    on_end: Callable[[], dict] | None = None,
) -> dict:
    """Call ``step_fn`` until ``cfg.minutes`` have passed or the step count reaches
    ``cfg.max_steps``, starting from ``step`` (and ``seconds`` of earlier training, on a resume).

    Every ``cfg.log_every`` steps one log record holds each loss averaged since the last one,
    plus what ``on_log(step)`` returns (evaluations). A non-finite ``loss`` raises
    ``RuntimeError`` naming the step. ``on_end()`` runs before the last checkpoint and its
    fields go in the ``end`` record, which is returned."""
    ckpt.backend.model.train()
    start = time.time() - seconds
    last_save = time.time()
    deadline = time.time() + cfg.minutes * 60
    seen: dict[str, list[float]] = {}
    while time.time() < deadline and (cfg.max_steps is None or step < cfg.max_steps):
        losses = step_fn()
        step += 1
        for name, value in losses.items():
            got = seen.setdefault(name, [])
            if value is not None:
                got.append(value)
        if not math.isfinite(losses["loss"]):
            raise RuntimeError(f"loss is {losses['loss']} at step {step}")
        if step % cfg.log_every == 0:
            evals = on_log(step) if on_log else {}
            means = {k: round(float(np.mean(v)), 4) if v else None for k, v in seen.items()}
            log_event(
                role_dir,
                {
                    "stage": stage,
                    "step": step,
                    **means,
                    "seconds": round(time.time() - start, 1),
                    **evals,
                },
            )
            seen = {}
        if time.time() - last_save > cfg.save_every:
            ckpt.save(step, time.time() - start)
            last_save = time.time()
    evals = on_end() if on_end else {}
    ckpt.save(step, time.time() - start)
    rec = {
        "stage": stage,
        "event": "end",
        "step": step,
        "seconds": round(time.time() - start, 1),
        **evals,
    }
    log_event(role_dir, rec)
    return rec
