"""The calibration file: the ``Calibration`` record, its JSON (``write_calibration``,
``read_calibration``, which reads every earlier version's keys) and the setup it is valid for.

A tau's guarantee holds only for the setup it was calibrated on: the :class:`CalibrationSetup`
(the models, the agent, the judge variant and its view). :func:`setup_of` extracts it from a
funnel's settings, both when a file is written (from the calibrated run's recorded settings,
:func:`run_setup`) and when ``eval``/``serve`` check a file (:func:`check_calibration`), so the
two sides are one value compared as one value."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from speceyes import gate
from speceyes.funnel import JUDGES

if TYPE_CHECKING:
    from speceyes.factory import Settings

FORMAT_VERSION = 3  # 2: the setup (models, agent, judge mode) and held-out numbers; 3: the judge


@dataclass
class Calibration:
    """A calibrated gate setting, written as JSON for ``eval``/``serve --calibration FILE``.

    It records the setup it is valid for (``models``, ``agent``, ``judge``, ``judge_max_pixels``:
    :attr:`setup`, written at the top level of the file as every version wrote them) and the
    judge mode and threshold besides the gate (tau, top-K, aggregation, sigmoid scale);
    ``eval``/``serve`` apply the gate and judge mode and refuse another setup
    (:func:`check_calibration`). ``expected_*`` are measured on the calibration queries;
    ``held_out`` on queries the test never saw.
    """

    tau: float
    top_k: int
    agg: str
    scale: float  # the gate's sigmoid scale
    max_error: float | None
    confidence: float  # C: the guarantee holds with probability >= C
    method: str
    n: int  # calibration queries the risk is measured on
    n_accepted: int = 0
    n_queries: int = 0  # all queries of the calibration run (or part)
    bound: float | None = None  # upper bound on the controlled risk at tau (level 1 - C)
    expected_acceptance: float | None = None  # alpha at tau on the calibration queries
    expected_small_share: float | None = None  # beta * alpha
    expected_speedup: float | None = None
    min_relative_accuracy: float | None = None
    candidates_tested: int = 0
    passed: bool = True  # False: no tau passed, tau = 1.0 accepts nothing
    source: str | None = None
    note: str = ""
    models: dict[str, str | None] | None = None  # {"small": ..., "large": ...} as the run had them
    agent: str | None = None
    judge_mode: str | None = None
    judge_threshold: float | None = None
    judge: str = "large"  # the judge variant (funnel.JUDGES) of the calibrated runs
    judge_max_pixels: int | None = None  # their judge view budget; None: the full image
    family: list[dict[str, Any]] = field(default_factory=list)  # every (K, agg) tested
    split: str | None = None  # e.g. "50:50 (seed 0)", or None for the whole run
    holdout: str | None = None  # run folder measured as the held-out part
    held_out: dict[str, Any] | None = None  # accuracy, error among accepted, speedup there
    needed_n: int | None = None  # no tau passed: queries needed at the observed error rate
    speedup_model: str = ""
    version: int = FORMAT_VERSION

    @property
    def setup(self) -> CalibrationSetup:
        """The setup the calibration is valid for."""
        return CalibrationSetup(self.models, self.agent, self.judge, self.judge_max_pixels)

    def to_dict(self) -> dict[str, Any]:
        return {k: _json_safe(v) for k, v in asdict(self).items()}


def _json_safe(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_json_safe(x) for x in v]
    if isinstance(v, (float, np.floating)):
        return None if not math.isfinite(v) else float(v)
    if isinstance(v, np.integer):
        return int(v)
    return v


# ---------------------------------------------------------------------------- setup


@dataclass(frozen=True)
class CalibrationSetup:
    """What a calibration's guarantee depends on besides the gate: the models, the agent and
    the judge variant with the view it is shown. The judge decides which queries reach the
    gate, so the accepted set, and the error rate the guarantee bounds, changes with it.
    ``agent`` None: not recorded, not compared. The judge mode and threshold are not part of
    it: a calibration sets them (``Settings.with_calibration``)."""

    models: dict[str, str | None] | None  # {"small": ..., "large": ...}; None: not recorded
    agent: str | None
    judge: str = "large"  # a funnel.JUDGES variant
    judge_max_pixels: int | None = None  # the judge's view budget; None: the full image

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def differences(self, given: CalibrationSetup) -> list[str]:
        """The fields in which ``given`` is another setup than this recorded one: a model that
        is not the same spec or folder, another agent (where both are named), another judge
        or view."""
        out = [
            role
            for role in ("small", "large")
            if not _same_model((self.models or {}).get(role), (given.models or {}).get(role))
        ]
        if self.agent and given.agent and self.agent != given.agent:
            out.append("agent")
        out += [k for k in ("judge", "judge_max_pixels") if getattr(self, k) != getattr(given, k)]
        return out


def setup_of(settings: Settings) -> CalibrationSetup:
    """The setup a calibration made with ``settings`` depends on, and the one a funnel built
    from them needs: the one extraction used to write a file and to check one."""
    from speceyes.agents import registry

    f = settings.funnel
    return CalibrationSetup(
        models={"small": settings.small, "large": settings.large},
        agent=registry.agent_class(settings.agent.kind).name,
        judge=f.judge,
        judge_max_pixels=f.judge_max_pixels,
    )


SETTINGS_KEY = "settings"  # a run config's key holding the run's resolved settings


def run_setup(config: dict[str, Any]) -> CalibrationSetup:
    """The setup of a logged run: ``setup_of`` its recorded settings (``config["settings"]``);
    a run folder written before the settings were recorded gives its ``models`` and ``agent``
    keys and its judge keys (none: the large judge on the full image, as before the variants)."""
    recorded = config.get(SETTINGS_KEY)
    if isinstance(recorded, dict):
        from speceyes.factory import Settings

        return setup_of(Settings.from_dict(recorded))
    models = config.get("models")
    return CalibrationSetup(
        models=dict(models) if isinstance(models, dict) else None,
        agent=config.get("agent"),
        judge=config.get("judge") or "large",
        judge_max_pixels=config.get("judge_max_pixels"),
    )


def recorded_setup(config: dict[str, Any]) -> dict[str, Any]:
    """The setup fields a calibration file records from the run it was made on: the run's
    setup (:func:`run_setup`) and the judge mode and threshold it ran with."""
    return {
        **run_setup(config).to_dict(),
        "judge_mode": config.get("judge_mode"),
        "judge_threshold": config.get("judge_threshold"),
    }


def _same_model(recorded: str | None, given: str | None) -> bool:
    """Same model spec: equal text, or the same existing folder."""
    if recorded is None or given is None:
        return recorded == given
    if recorded.rstrip("/") == given.rstrip("/"):
        return True
    a, b = Path(recorded), Path(given)
    return a.exists() and b.exists() and a.resolve() == b.resolve()


def judge_words(judge: str, max_pixels: int | None) -> str:
    view = "the full image" if max_pixels is None else f"--judge-max-pixels {max_pixels}"
    return f"--judge {judge} on {view}"


def check_calibration(cal: Calibration, given: CalibrationSetup) -> None:
    """Raise a clear error unless ``cal`` accepts something and was made for the setup
    ``given`` (``setup_of`` the settings it is to be applied to); the error names every field
    that differs."""
    where = f" (calibration from {cal.source})" if cal.source else ""
    if not cal.passed:
        raise ValueError(
            f"this calibration file accepts nothing: no tau passed its test{where}. Use --mode "
            "agent, or calibrate on more queries (the file's needed_n estimates how many)"
        )
    recorded = cal.setup
    if not recorded.models:
        raise ValueError(
            f"the calibration file records no models{where}; it cannot be checked against this "
            "setup. Re-run speceyes calibrate on a run made with these models"
        )
    differing = recorded.differences(given)
    if not differing:
        return
    reasons = []
    for role in ("small", "large"):
        if role in differing:
            reasons.append(
                f"made for --{role} {recorded.models.get(role)!r}, not "
                f"{(given.models or {}).get(role)!r}"
            )
    if "agent" in differing:
        reasons.append(f"made with --agent {recorded.agent}, not {given.agent}")
    judge = {"judge", "judge_max_pixels"} & set(differing)
    if judge:
        reasons.append(
            f"made with {judge_words(recorded.judge, recorded.judge_max_pixels)}, "
            f"not {judge_words(given.judge, given.judge_max_pixels)}"
        )
    why = []
    if set(differing) - judge:
        why.append("tau is only valid for the models, backend and K it was calibrated with")
    if judge:
        why.append("the guarantee holds only for the judge it was calibrated with")
    raise ValueError(
        f"the calibration file was made for another setup ({', '.join(differing)} differ)"
        f"{where}: it was {'; '.join(reasons)}; {''.join(w + '; ' for w in why)}pass the same "
        "options, or calibrate on a run made with these"
    )


def check_setup(
    cal: Calibration,
    small: str | None,
    large: str | None,
    agent: str | None,
    judge: str = "large",
    judge_max_pixels: int | None = None,
) -> None:
    """``check_calibration`` against the setup given by its parts (the defaults are the
    funnel's: the large judge on the full image)."""
    given = CalibrationSetup({"small": small, "large": large}, agent, judge, judge_max_pixels)
    check_calibration(cal, given)


# ---------------------------------------------------------------------------- the JSON file


def write_calibration(calibration: Calibration, path: str | Path) -> Path:
    """Write the calibration JSON; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(calibration.to_dict(), indent=2) + "\n", encoding="utf-8")
    return path


def read_calibration(path: str | Path) -> Calibration:
    """Read and validate a calibration file (as written by ``write_calibration``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"calibration file not found: {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    missing = [k for k in ("tau", "top_k", "agg") if data.get(k) is None]
    if missing:
        raise ValueError(f"{path}: missing required keys: {', '.join(missing)}")
    tau, top_k, agg = float(data["tau"]), int(data["top_k"]), str(data["agg"])
    if not 0.0 <= tau <= 1.0:
        raise ValueError(f"{path}: tau must be in [0, 1], got {tau}")
    if top_k < 2:
        raise ValueError(f"{path}: top_k must be >= 2, got {top_k}")
    if agg not in gate.AGGREGATIONS:
        raise ValueError(f"{path}: unknown aggregation {agg!r}")
    judge_mode = data.get("judge_mode")
    if judge_mode is not None and judge_mode not in ("logit", "decode"):
        raise ValueError(f"{path}: unknown judge_mode {judge_mode!r}")
    judge = data.get("judge") or "large"  # files before version 3: the large judge
    if judge not in JUDGES:
        raise ValueError(f"{path}: unknown judge {judge!r}; one of {', '.join(JUDGES)}")
    judge_max_pixels = data.get("judge_max_pixels")
    if judge_max_pixels is not None and (
        isinstance(judge_max_pixels, bool)
        or not isinstance(judge_max_pixels, int)
        or judge_max_pixels <= 0
    ):
        raise ValueError(f"{path}: judge_max_pixels must be a positive integer or null")
    known = set(Calibration.__dataclass_fields__)
    values = {k: v for k, v in data.items() if k in known}
    values.update(tau=tau, top_k=top_k, agg=agg, judge=judge)
    # Files written before the rename call the sigmoid scale "alpha".
    values["scale"] = float(data.get("scale", data.get("alpha")) or gate.DEFAULT_SCALE)
    if values.get("judge_threshold") is not None:
        values["judge_threshold"] = float(values["judge_threshold"])
    values.setdefault("max_error", None)
    values.setdefault("confidence", float("nan"))
    values.setdefault("method", "unknown")
    values.setdefault("n", 0)
    values.setdefault("version", 1)  # files before version 2 did not write it
    return Calibration(**values)
