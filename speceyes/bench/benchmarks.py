"""The benchmark registry: each benchmark once, under its name and aliases.

An entry holds everything the rest of the project asks of a benchmark by name: its loader (and
which command-line flags become the loader's keywords), its metrics function, the authors'
judge script that scores it by the published rules, and its typical image size for the
simulator. ``speceyes eval``, ``prompts``, ``report``, ``view`` and the runner look a benchmark
up here once with :func:`get` and use the entry's fields.

Adding a benchmark is one loader (yielding :class:`speceyes.types.Query`), one metrics function
(records -> dict) and one :func:`register` call; ``docs/extending.md`` walks through it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from speceyes.bench import datasets, scoring
from speceyes.bench.published_scoring import (
    HR_SCRIPT,
    POPE_SCRIPT,
    VSTAR_SCRIPT,
    JudgeScript,
    PublishedScore,
    score_records,
)
from speceyes.types import Query

__all__ = [
    "BENCHMARKS",
    "BenchImages",
    "Benchmark",
    "Loaded",
    "get",
    "image_profiles",
    "load_from_args",
    "register",
]


@dataclass(frozen=True)
class BenchImages:
    """A benchmark's typical image, for the simulator's token counts."""

    size: tuple[int, int]  # (width, height) used for the token counts
    note: str  # where the size comes from


def _no_flags(args: Any) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Benchmark:
    """One benchmark: how to load it, score it and describe its images.

    ``load(path, **loader_kw)`` yields queries lazily. ``loader_kw_from_args`` turns the parsed
    command line (``speceyes eval`` / ``prompts``) into those keywords; they are logged in the
    run's config. ``metrics(records)`` scores logged records (dicts, or anything with the same
    attributes). ``published`` is the authors' judge script for ``report --protocol published``
    (None: no published rules). ``images`` maps a simulator name to a typical image.
    ``checks_user_text``: the loader applies the user-text rule to each query itself, with a
    better location than the query id (``load_jsonl``: the file's line), so :meth:`open` does
    not apply it a second time.
    """

    name: str
    load: Callable[..., Iterator[Query]]
    metrics: Callable[[Iterable[Any]], dict[str, Any]]
    aliases: tuple[str, ...] = ()
    loader_kw_from_args: Callable[[Any], dict[str, Any]] = _no_flags
    published: JudgeScript | None = None
    images: Mapping[str, BenchImages] = field(default_factory=dict)
    checks_user_text: bool = False

    def open(self, path: str | Path, loader_kw: Mapping[str, Any]) -> Iterator[Query]:
        """The loader's queries, each under the user-text rule once (:func:`checked`, unless
        the loader applies it itself)."""
        queries = self.load(path, **loader_kw)
        return queries if self.checks_user_text else checked(queries)

    def load_logged(self, path: str | Path, loader_kw: Mapping[str, Any]) -> Iterator[Query]:
        """The queries again from a run's logged loader settings. Keywords the loader does not
        take are dropped: a run's config may log more (the demo logs its split)."""
        accepted = inspect.signature(self.load).parameters
        return self.load(path, **{k: v for k, v in loader_kw.items() if k in accepted})

    def score_published(
        self, records: Iterable[Mapping[str, Any]], ask: Callable[[str, str], str] | None = None
    ) -> PublishedScore:
        """Score logged records by the published judge script's rules (see
        :func:`speceyes.bench.published_scoring.score_records`)."""
        if self.published is None:
            covered = _listed([b.name for b in BENCHMARKS.values() if b.published], "and")
            raise ValueError(f"the published judge scripts cover {covered}, not {self.name!r}")
        return score_records(self.published, records, ask)


BENCHMARKS: dict[str, Benchmark] = {}


def register(bench: Benchmark) -> Benchmark:
    """Add ``bench`` to the registry; its name and aliases must be lowercase and new."""
    keys = (bench.name, *bench.aliases)
    for key in keys:
        if key != key.strip().lower():
            raise ValueError(f"benchmark names are lowercase without spaces: {key!r}")
        for other in BENCHMARKS.values():
            if key == other.name or key in other.aliases:
                raise ValueError(f"benchmark name {key!r} is taken by {other.name!r}")
    BENCHMARKS[bench.name] = bench
    return bench


def get(name: str) -> Benchmark:
    """The entry for a name or alias (case and surrounding spaces ignored)."""
    key = name.strip().lower()
    for bench in BENCHMARKS.values():
        if key == bench.name or key in bench.aliases:
            return bench
    raise ValueError(f"unknown benchmark {name!r}; expected {_listed(list(BENCHMARKS), 'or')}")


def _listed(names: list[str], last: str) -> str:
    """'a, b or c'."""
    return f"{', '.join(names[:-1])} {last} {names[-1]}" if len(names) > 1 else "".join(names)


class Loaded(NamedTuple):
    """A benchmark opened from the command line."""

    name: str  # the canonical name
    loader_kw: dict[str, Any]  # the loader's keywords, as logged in the run's config
    queries: Iterator[Query]


def load_from_args(args: Any) -> Loaded:
    """Open ``args.bench`` at ``args.data`` with the loader keywords its flags give."""
    bench = get(args.bench)
    loader_kw = bench.loader_kw_from_args(args)
    return Loaded(bench.name, loader_kw, bench.open(args.data, loader_kw))


def checked(queries: Iterable[Query]) -> Iterator[Query]:
    """Every query of a benchmark file under the rule user text follows everywhere (no
    chat-template control tokens: ``speceyes.usertext.check_question``), located by its id."""
    from speceyes.usertext import check_question

    for q in queries:
        check_question(q.question, q.options, f"query {q.id}: ")
        yield q


def image_profiles() -> dict[str, BenchImages]:
    """Every registered typical image by its simulator name (``speceyes simulate --bench``)."""
    return {key: img for bench in BENCHMARKS.values() for key, img in bench.images.items()}


# ------------------------------------------------------------------------------- the entries


def _vstar_flags(args: Any) -> dict[str, Any]:
    """Options are shuffled unless ``--no-shuffle``; under ``--protocol published`` they keep
    the published order (the authors never shuffle) unless ``--shuffle``. ``--split`` names one
    category folder: the released scripts run and time each split on its own (SpecEyes'
    scripts/gather_result.py takes each split's seconds per row), so Table 1's two V* speedups
    come from two runs."""
    if getattr(args, "shuffle", False):
        shuffle = True
    else:
        shuffle = not args.no_shuffle and getattr(args, "protocol", "fair") != "published"
    flags: dict[str, Any] = {"shuffle": shuffle, "seed": args.seed}
    split = getattr(args, "split", None)
    if split:
        if split not in datasets.VSTAR_CATEGORIES:
            raise ValueError(
                f"V* has no split {split!r}; --split is one of "
                f"{', '.join(datasets.VSTAR_CATEGORIES)}"
            )
        flags["categories"] = [split]
    return flags


def _pope_flags(args: Any) -> dict[str, Any]:
    return {k: v for k, v in (("split", args.split), ("image_dir", args.image_dir)) if v}


register(
    Benchmark(
        name="vstar",
        aliases=("v*", "vstar_bench", "v_star"),
        load=datasets.load_vstar,
        loader_kw_from_args=_vstar_flags,
        metrics=scoring.vstar_metrics,
        published=VSTAR_SCRIPT,
        images={
            "vstar": BenchImages(
                (2246, 1582),
                "V* Bench: 191 images, average 2246x1582 (Wu & Xie, arXiv 2312.14135); range "
                "1690x1500 to 5759x1440",
            )
        },
    )
)
register(
    Benchmark(
        name="hrbench",
        aliases=("hr-bench", "hr_bench", "hrbench_4k", "hrbench_8k", "hrbench4k", "hrbench8k"),
        load=datasets.load_hrbench,
        metrics=scoring.hrbench_metrics,
        published=HR_SCRIPT,
        images={
            "hrbench4k": BenchImages(
                (4096, 2160),
                "HR-Bench 4K: 4K crops of 8K images (Wang et al., arXiv 2408.15556); 4096x2160 "
                "taken as typical (a 4096x3000 image gives 15.6k tokens)",
            ),
            "hrbench8k": BenchImages(
                (7680, 4320),
                "HR-Bench 8K: 8K images from DIV8K and the web (arXiv 2408.15556); downscaled to "
                "the 16384-token cap",
            ),
        },
    )
)
register(
    Benchmark(
        name="pope",
        load=datasets.load_pope,
        loader_kw_from_args=_pope_flags,
        metrics=scoring.pope_metrics,
        published=POPE_SCRIPT,
        images={
            "pope": BenchImages(
                (640, 480), "POPE: COCO val2014 images, longest side 640 px (arXiv 2305.10355)"
            )
        },
    )
)
register(
    Benchmark(
        name="jsonl",
        load=datasets.load_jsonl,
        metrics=scoring.accuracy_metrics,
        checks_user_text=True,  # located by file and line
        # The mini world (``speceyes demo``) is written in this format.
        images={"miniworld": BenchImages((1024, 1024), "the mini world's 1024x1024 canvas")},
    )
)
