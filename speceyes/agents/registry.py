"""Every agent loop under its one name, and the one reader of an agent's ``K=V`` settings.

An agent class carries ``name`` (what ``--agent`` and a manifest's ``agent.kind`` say),
``default_tau`` (the gate threshold when none is given), ``shares_first_prompt`` (for the prefix
judge) and ``Settings``, a dataclass of its keyword arguments. A new agent is one class and one
entry in :data:`AGENTS`.
"""

from __future__ import annotations

import warnings
from dataclasses import MISSING, Field, fields
from types import UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints

from speceyes.agents.code import CodeAgent
from speceyes.agents.search import SearchAgent
from speceyes.agents.specreason import SpecReasonAgent
from speceyes.agents.zoom import ZoomAgent

AGENTS: dict[str, type] = {
    cls.name: cls for cls in (ZoomAgent, CodeAgent, SearchAgent, SpecReasonAgent)
}
ALIASES = {"zoom": ZoomAgent.name}  # the name mini-world manifests used before
# Loop budgets have flags of their own (--max-tool-calls, --agent-max-tokens), so K=V text
# does not set them.
BUDGETS = ("max_tool_calls", "max_new_tokens")
_OLD_KEYS = {"answer": "answer_prompt"}  # the names --search used before


def choices() -> tuple[str, ...]:
    """The agents ``--agent`` offers: those that run on the large model alone."""
    return tuple(n for n, cls in AGENTS.items() if not getattr(cls, "needs_small", False))


def agent_class(name: str) -> type:
    """The agent class registered under ``name`` (or an old alias of it)."""
    cls = AGENTS.get(ALIASES.get(name, name))
    if cls is None:
        raise ValueError(f"unknown agent {name!r}; choose from {', '.join(choices())}")
    return cls


def published_loop(cls: type) -> type:
    """The published protocol's variant of an agent loop: the authors' own rules, in a subclass
    of its own file; the published protocol covers DeepEyes and Thyme only."""
    from speceyes.agents.published_code import PublishedCodeAgent
    from speceyes.agents.published_zoom import PublishedZoomAgent

    for sub in (PublishedZoomAgent, PublishedCodeAgent):
        if sub.name == cls.name:
            return sub
    raise ValueError(f"the published protocol covers the deepeyes and thyme agents, not {cls.name!r}")


def flag(text: str) -> bool:
    """1/0, true/false, yes/no, on/off -> bool; anything else is a ValueError."""
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def _reader(tp: Any):
    """How to read a field of type ``tp`` (``int``, ``float | None``, ...) from text."""
    if get_origin(tp) in (Union, UnionType):
        tp = next(a for a in get_args(tp) if a is not type(None))
    return flag if tp is bool else tp


def settings_fields(cls: type) -> dict[str, tuple[Field, Any]]:
    """The agent's settings an option text may set: name -> (field, reader)."""
    hints = get_type_hints(cls.Settings)
    return {
        f.name: (f, _reader(hints[f.name])) for f in fields(cls.Settings) if f.name not in BUDGETS
    }


def settings_help(cls: type) -> str:
    """Each settable field with its help and default (for ``--search``'s help text)."""
    parts = []
    for name, (f, _) in settings_fields(cls).items():
        default = int(f.default) if isinstance(f.default, bool) else f.default
        about = [f.metadata["help"]] if "help" in f.metadata else []
        if default is not None and default is not MISSING:
            about.append(f"default {default}")
        parts.append(f"{name} ({'; '.join(about)})" if about else name)
    return ", ".join(parts)


def _renamed(key: str, known: dict, where: str) -> str:
    new = _OLD_KEYS.get(key)
    if new is None or new not in known:
        return key
    warnings.warn(
        f"{where}: {key!r} is now {new!r} (the name the demo manifest uses); the old name will go",
        FutureWarning,
        stacklevel=3,
    )
    return new


def check_options(cls: type, options: dict[str, Any], where: str = "agent") -> dict[str, Any]:
    """``options`` with old names renamed; a key the agent does not take is a ValueError."""
    known = settings_fields(cls)
    out = {}
    for key, value in options.items():
        key = _renamed(key, known, where)
        if key not in known:
            raise ValueError(f"{where}: unknown {cls.name} setting {key!r}; use {list(known)}")
        out[key] = value
    return out


def parse_options(cls: type, text: str, where: str = "--search") -> dict[str, Any]:
    """``depth=3,grid=3,answer_prompt=small,stay=1`` -> the agent's keyword arguments, each
    read by the type of its ``Settings`` field."""
    known = settings_fields(cls)
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, val = part.partition("=")
        key = _renamed(key, known, where) if sep else key
        if not sep or key not in known:
            raise ValueError(f"{where}: expected K=V with K in {', '.join(known)}, got {part!r}")
        read = known[key][1]
        try:
            out[key] = read(val)
        except ValueError:
            what = "1 or 0" if read is flag else f"a {getattr(read, '__name__', 'value')}"
            raise ValueError(f"{where}: {key} needs {what}, got {val!r}") from None
    return out
