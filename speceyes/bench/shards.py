"""A stable split of a benchmark's queries into N shards, for ``speceyes eval --shard i/N``.

A query's shard depends on its id alone: the first 8 bytes of the SHA-256 of the id (UTF-8),
as an unsigned big-endian integer, modulo N. It is the same in every Python process and on
every machine (Python's ``hash()`` of a string is salted per process, so it is not used), and
it does not depend on the order the loader yields queries in. Shards are only as even as the
hash makes them: with few queries one shard may get more than another, or none.

``--limit M`` with ``--shard i/N`` takes the first M queries of the benchmark, then keeps
shard i of those, so the N shards of a limited run together hold exactly that limited run's
queries (``speceyes merge`` puts them back together; :mod:`speceyes.bench.merge`).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from speceyes.types import Query

__all__ = ["Shard", "add_shard_arg", "apply_shard", "parse_shard", "select_shard", "shard_of"]

_SHARD_TEXT = re.compile(r"\s*(\d+)\s*/\s*(\d+)\s*")


def shard_of(query_id: str, n: int) -> int:
    """The shard in [0, n) that ``query_id`` belongs to when the queries are split n ways."""
    if n < 1:
        raise ValueError(f"the number of shards must be at least 1, got {n}")
    digest = hashlib.sha256(str(query_id).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % n


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count``; written ``"index/count"`` (as in run.json)."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"shard {self}: the number of shards N must be at least 1")
        if not 0 <= self.index < self.count:
            raise ValueError(
                f"shard {self}: the index i must be in [0, N), i.e. 0 to {self.count - 1}"
            )

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def holds(self, query_id: str) -> bool:
        return shard_of(query_id, self.count) == self.index


def parse_shard(text: str) -> Shard:
    """``"i/N"`` as a :class:`Shard`; ValueError saying what is wrong for anything else."""
    m = _SHARD_TEXT.fullmatch(str(text))
    if m is None:
        raise ValueError(
            f"bad shard {text!r}: expected i/N with whole numbers, 0 <= i < N (e.g. 0/4)"
        )
    return Shard(int(m.group(1)), int(m.group(2)))


def select_shard(queries: Iterable[Query], i: int, n: int) -> Iterator[Query]:
    """The queries of shard ``i`` of ``n``, lazily and in their original order."""
    shard = Shard(i, n)
    return (q for q in queries if shard.holds(q.id))


# ------------------------------------------------------------------ the eval command's flag


def _shard_type(text: str) -> Shard:
    try:
        return parse_shard(text)
    except ValueError as exc:  # argparse shows an ArgumentTypeError's message as it is
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_shard_arg(parser: argparse.ArgumentParser) -> None:
    """``--shard i/N`` (sets ``args.shard`` to a :class:`Shard`, or None)."""
    parser.add_argument(
        "--shard",
        type=_shard_type,
        default=None,
        metavar="i/N",
        help="run only shard i of N (0 <= i < N), split by a hash of the query id; with "
        "--limit, of the first LIMIT queries. `speceyes merge` joins the N run folders",
    )


def apply_shard(args: argparse.Namespace, queries: Iterable[Query]) -> Iterator[Query]:
    """The queries ``eval`` should run: all of them, or with ``--shard`` the shard's part of
    the first ``--limit`` queries."""
    shard: Shard | None = getattr(args, "shard", None)
    if shard is None:
        return iter(queries)
    limit = getattr(args, "limit", None)
    head = queries if limit is None else itertools.islice(queries, limit)
    return select_shard(head, shard.index, shard.count)
