"""``speceyes view``: a static HTML report of run folders."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    from speceyes.view import FULL_SIDE, THUMB_SIDE

    vw = sub.add_parser(
        "view",
        help="static HTML report of run folders: a card per query with its zooms, filters, "
        "two runs side by side (opens from disk, no server)",
    )
    vw.add_argument("runs", nargs="+", help="run folders written by speceyes eval")
    vw.add_argument("--out", required=True, help="output folder (index.html, img/, runs/)")
    vw.add_argument(
        "--data",
        default=None,
        help="the benchmark's path when it moved since the run (default: the path in the run)",
    )
    vw.add_argument(
        "--thumb-size",
        type=int,
        default=THUMB_SIDE,
        help=f"thumbnail side in px (default: {THUMB_SIDE})",
    )
    vw.add_argument(
        "--full-size",
        type=int,
        default=FULL_SIDE,
        help=f"side of the full view in px (default: {FULL_SIDE})",
    )
    vw.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from speceyes.view import build_view

    res = build_view(
        args.runs, args.out, data=args.data, thumb_side=args.thumb_size, full_side=args.full_size
    )
    for note in res.notes:
        print(f"note: {note}", file=sys.stderr)
    print(
        f"{res.cards} queries; images: {res.images_made} made, {res.images_reused} reused",
        file=sys.stderr,
    )
    print(res.index.resolve())
    return 0
