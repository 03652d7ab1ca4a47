"""``speceyes miniworld TOOL ...``: the mini world's tools as one subcommand group.

Each tool keeps its own parser (its ``--help`` included) and gets the words after its name;
words that name no tool go to the scene generator, so ``speceyes miniworld --out DIR ...``
generates a split as ``speceyes miniworld scenes --out DIR ...`` does.
"""

from __future__ import annotations

import argparse
import importlib

# tool -> (module whose main(argv) runs it, help)
TOOLS: dict[str, tuple[str, str]] = {
    "scenes": (
        "speceyes.miniworld.splits",
        "generate a split of scenes and questions (the default tool; see docs/miniworld.md)",
    ),
    "train": ("speceyes.miniworld.train", "train the tiny models (docs/miniworld-training.md)"),
    "probe": (
        "speceyes.miniworld.probe",
        "measure a model's existence answers on the search agent's cells",
    ),
    "position-probe": (
        "speceyes.miniworld.position_probe",
        "measure whether a model can tell where the target is",
    ),
}
DEFAULT_TOOL = "scenes"


def add_parser(sub: argparse._SubParsersAction) -> None:
    mw = sub.add_parser(
        "miniworld",
        help="mini-world tools: "
        + "; ".join(f"'miniworld {name}' {text}" for name, (_, text) in TOOLS.items()),
        add_help=False,  # a tool's own --help answers
        default_command=DEFAULT_TOOL,
    )
    tools = mw.add_subparsers(dest="tool", metavar="TOOL", parser_class=argparse.ArgumentParser)
    for name, (_, text) in TOOLS.items():
        # '+' as the only option prefix: every word, --help included, is the tool's
        t = tools.add_parser(name, help=text, add_help=False, prefix_chars="+")
        t.add_argument("rest", nargs=argparse.REMAINDER)
    mw.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    module = importlib.import_module(TOOLS[args.tool][0])
    return int(module.main(args.rest) or 0)
