"""``--model_args k=v,...`` of ``lmms-eval --model speceyes`` to a funnel's :class:`Settings`.

The keys are the model and funnel flags of ``speceyes eval`` with underscores (``small=``,
``large=``, ``mode=``, ``tau=``, ``agent=``, ``top_k=``, ``judge=``, ``schedule=``,
``calibration=`` ...), parsed by the same argparse options, so a key means what its flag means.
A value holding commas (``search``) is quoted: ``search="depth=3,grid=3"``.

``models=DIR`` takes a mini-world models folder (``DIR/manifest.json`` beside ``small/`` and
``large/``; ``models=miniworld`` is the bundled one) as ``speceyes demo --models`` does; funnel
and backend keys (and ``calibration``) then change its settings, and the models and the agent
are the folder's.

lmms-eval's own ``--batch_size N`` sets the funnel's batch size when N > 1; at lmms-eval's
default of 1 the funnel keeps its own (the protocol's, or the manifest's). ``--device`` becomes
the backends' ``device_map`` unless ``device_map`` is given.
"""

from __future__ import annotations

import argparse
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from speceyes.factory import MANIFEST, BackendSettings, Settings
from speceyes.funnel import FunnelConfig

BUNDLED_MODELS = "miniworld"  # models=miniworld: the bundled level-1 mini-world models
# Keys a models folder decides: its manifest names the models and the agent.
_MANIFEST_OWNS = ("small", "large", "small_family", "large_family", "agent", "search")
_AGENT_BUDGETS = {"max_tool_calls": "max_tool_calls", "agent_max_tokens": "max_new_tokens"}


class ModelArgsError(ValueError):
    """A ``--model_args`` key or value that speceyes cannot use."""


def _parser() -> argparse.ArgumentParser:
    from speceyes.cli.options import add_funnel_args, add_model_args

    p = argparse.ArgumentParser(prog="--model_args", add_help=False, exit_on_error=False)
    add_model_args(p, required=False)
    add_funnel_args(p)
    return p


def _unquote(value: Any) -> str:
    text = str(value)
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    return text


def _parse(args: dict[str, Any]) -> argparse.Namespace:
    """The namespace the flags of ``args`` give; an unknown key or a bad value raises."""
    parser = _parser()
    known = {a.dest: a for a in parser._actions}  # argparse keeps no public list of options
    argv: list[str] = []
    for key, value in args.items():
        action = known.get(key)
        if action is None:
            names = ", ".join(sorted(k for k in known if k != "help"))
            raise ModelArgsError(f"unknown model_args key {key!r}; speceyes takes: models, {names}")
        flag = action.option_strings[0]
        if action.nargs == 0:  # a switch (overlap): true turns it on
            if str(value).lower() not in ("true", "false", "1", "0"):
                raise ModelArgsError(f"{key} takes true or false, got {value!r}")
            if str(value).lower() in ("true", "1"):
                argv.append(flag)
        else:
            argv += [flag, _unquote(value)]
    try:
        ns, extra = parser.parse_known_args(argv)
    except argparse.ArgumentError as e:
        raise ModelArgsError(str(e)) from e
    if extra:
        raise ModelArgsError(f"cannot read model_args {' '.join(extra)}")
    return ns


def models_manifest(models: str) -> Path:
    """The manifest file that ``models=`` names (a folder, its manifest, or the bundled one)."""
    if models == BUNDLED_MODELS:
        from speceyes.miniworld.demo import MODELS_DIR

        return MODELS_DIR / MANIFEST
    path = Path(models)
    return path if path.name == MANIFEST else path / MANIFEST


def settings_from_model_args(
    args: dict[str, Any], *, batch_size: Any = None, device: str | None = None
) -> Settings:
    """The funnel settings ``args`` (lmms-eval's parsed ``--model_args``) describe;
    ``batch_size`` and ``device`` are lmms-eval's own options."""
    args = dict(args)
    models = args.pop("models", None)
    ns = _parse(args)
    if models is None:
        settings = Settings.from_args(ns)
        if settings.small is None and settings.funnel.mode != "agent":
            raise ModelArgsError("give small=... and large=... (or models=DIR) in --model_args")
    else:
        owned = [k for k in _MANIFEST_OWNS if k in args]
        if owned:
            raise ModelArgsError(
                f"models={models} names the models and the agent; drop {', '.join(owned)}"
            )
        settings = _manifest_settings(models_manifest(str(models)), ns, set(args))
    funnel_batch = _lmms_batch_size(batch_size)
    if funnel_batch is not None:
        settings = settings.with_funnel(batch_size=funnel_batch)
    if device and "device_map" not in args:
        settings = replace(settings, backend=replace(settings.backend, device_map=device))
    return settings


def _manifest_settings(path: Path, ns: argparse.Namespace, given: set[str]) -> Settings:
    if not path.is_file():
        raise ModelArgsError(f"models: no {MANIFEST} at {path}")
    settings = Settings.from_manifest(path)
    funnel = {f.name: getattr(ns, f.name) for f in fields(FunnelConfig) if f.name in given}
    backend = {f.name: getattr(ns, f.name) for f in fields(BackendSettings) if f.name in given}
    budgets = {field: getattr(ns, key) for key, field in _AGENT_BUDGETS.items() if key in given}
    settings = replace(
        settings,
        funnel=replace(settings.funnel, **funnel),
        backend=replace(settings.backend, **backend),
        agent=replace(settings.agent, **budgets),
    )
    if "calibration" in given:
        settings = settings.with_calibration(ns.calibration)
    return settings


def _lmms_batch_size(value: Any) -> int | None:
    """lmms-eval's ``--batch_size`` as the funnel's, when it asks for more than its default 1."""
    try:
        n = int(str(value))
    except ValueError:  # "auto", "auto:N": lmms-eval's own batch search, not the funnel's
        return None
    return n if n > 1 else None
