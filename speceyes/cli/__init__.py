"""Command line: ``speceyes COMMAND``, one module of this package per command.

Commands: ask, eval, prompts, report, view, regate, calibrate, miniworld (a group: scenes,
train, probe, position-probe), demo, serve, simulate. Each module has ``add_parser(subparsers)``
(its flags) and ``run(args)``; heavy imports stay inside ``run``, so ``--help`` loads no model
runtime. The flags ``ask``, ``eval`` and ``serve`` share are in :mod:`speceyes.cli.options`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

COMMANDS = (
    "ask",
    "eval",
    "prompts",
    "report",
    "table1",
    "merge",
    "view",
    "regate",
    "calibrate",
    "miniworld",
    "demo",
    "serve",
    "simulate",
)


class CommandParser(argparse.ArgumentParser):
    """A parser whose subcommands may have a default (``default_command``): words that start
    with no subcommand's name go to that one."""

    def __init__(self, *args, default_command: str | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.default_command = default_command
        self._commands: argparse.Action | None = None

    def add_subparsers(self, **kwargs):
        self._commands = super().add_subparsers(**kwargs)
        return self._commands

    def parse_known_args(self, args=None, namespace=None):
        if self.default_command is not None and self._commands is not None:
            args = list(sys.argv[1:] if args is None else args)
            if not args or args[0] not in self._commands.choices:
                args = [self.default_command, *args]
        return super().parse_known_args(args, namespace)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="speceyes",
        description="Speculative perception and planning for agentic VLMs: a small model answers "
        "first, a separability gate decides, the tool-using agent runs only when needed.",
    )
    sub = p.add_subparsers(dest="command", required=True, parser_class=CommandParser)
    for name in COMMANDS:
        importlib.import_module(f"speceyes.cli.{name}").add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    import logging

    from speceyes.backends.base import BackendError
    from speceyes.backends.hf import ModelLoadError
    from speceyes.images import ImageError

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        return int(args.func(args) or 0)
    except (ImageError, ModelLoadError, BackendError, OSError, ValueError) as e:
        print(f"speceyes {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
