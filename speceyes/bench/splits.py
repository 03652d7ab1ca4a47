"""Seeded, category-stratified splits of a logged run, so that choosing, calibrating and
measuring each happen on their own queries.

A threshold tested on the same queries that were used to choose K or the aggregation, or whose
accuracy is then reported, is measured in-sample: the guarantee and the numbers are optimistic.
``--split 40:30:30`` cuts a run into parts (sweep, calib, test) by weight within every category;
a part depends only on the query ids, the category labels, the weights and the seed, never on the
order of the log or on correctness, so ``regate`` and ``calibrate`` given the same split string
and seed see the same parts.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from speceyes.bench.runlog import Run

PART_NAMES = {2: ("calib", "test"), 3: ("sweep", "calib", "test")}
DEFAULT_SEED = 0


@dataclasses.dataclass(frozen=True)
class Split:
    """Weights of the parts in order; names follow from their number (see PART_NAMES)."""

    weights: tuple[float, ...]
    seed: int = DEFAULT_SEED

    @property
    def names(self) -> tuple[str, ...]:
        return PART_NAMES[len(self.weights)]

    def index(self, part: str | int) -> int:
        """Position of a part given by name (``calib``) or 1-based number."""
        if isinstance(part, int) or str(part).isdigit():
            i = int(part) - 1
            if not 0 <= i < len(self.weights):
                raise ValueError(f"part {part} out of range 1..{len(self.weights)}")
            return i
        if part not in self.names:
            raise ValueError(f"unknown part {part!r}; this split has {', '.join(self.names)}")
        return self.names.index(str(part))

    def __str__(self) -> str:
        return ":".join(f"{w:g}" for w in self.weights) + f" (seed {self.seed})"


def parse_split(text: str, seed: int = DEFAULT_SEED) -> Split:
    """'calib:test' weights ('50:50', '0.6:0.4') or 'sweep:calib:test' ('40:30:30')."""
    parts = [p.strip() for p in str(text).split(":")]
    try:
        weights = tuple(float(p) for p in parts)
    except ValueError:
        raise ValueError(
            f"--split expects weights like 50:50 (calib:test) or 40:30:30 (sweep:calib:test), "
            f"got {text!r}"
        ) from None
    if len(weights) not in PART_NAMES:
        raise ValueError(
            f"--split needs 2 or 3 weights (calib:test or sweep:calib:test), got {text!r}"
        )
    if any(not np.isfinite(w) or w <= 0 for w in weights):
        raise ValueError(f"--split weights must be positive numbers, got {text!r}")
    return Split(weights, int(seed))


def split_indices(ids: list[str], categories: np.ndarray, split: Split) -> list[np.ndarray]:
    """Indices of every part, stratified by category (sorted indices per part).

    Within each category the queries are ordered by id, then permuted by a generator seeded from
    the seed and the category name; part sizes follow the weights by largest remainder, so every
    category is cut in the same proportions (up to one query).
    """
    if len(ids) != len(categories):
        raise ValueError("ids and categories must have the same length")
    if len(set(ids)) != len(ids):
        raise ValueError("query ids must be unique to split a run")
    w = np.asarray(split.weights, dtype=np.float64)
    w = w / w.sum()
    parts: list[list[int]] = [[] for _ in w]
    cats = np.asarray(categories, dtype=object)
    for cat in sorted(set(cats.tolist())):
        members = np.flatnonzero(cats == cat)
        members = members[np.argsort([ids[i] for i in members], kind="stable")]
        rng = np.random.default_rng([split.seed, _stable_hash(str(cat))])
        members = members[rng.permutation(len(members))]
        sizes = _largest_remainder(len(members), w)
        start = 0
        for p, size in enumerate(sizes):
            parts[p].extend(members[start : start + size].tolist())
            start += size
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def _stable_hash(text: str) -> int:
    """A seed component from text that does not change between Python processes."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def _largest_remainder(n: int, weights: np.ndarray) -> list[int]:
    exact = n * weights
    sizes = np.floor(exact).astype(int)
    order = np.argsort(-(exact - sizes), kind="stable")
    sizes[order[: n - sizes.sum()]] += 1
    return sizes.tolist()


def subset_run(run: Run, idx: np.ndarray, label: str = "") -> Run:
    """A Run holding only the queries at ``idx`` (same config, results and path).

    Per-query cached arrays (confidences, schedule data) are sliced along, so anything computed
    on the whole log (e.g. which batch a query ran in) stays as it was measured.
    """
    idx = np.asarray(idx, dtype=np.int64)
    n = run.n
    cache: dict = {}
    for k, v in run._cache.items():
        if isinstance(v, np.ndarray) and len(v) == n:
            cache[k] = v[idx]
        elif k[0] == "occupancy":  # the step cost fitted on the whole log
            cache[k] = v
    sub = dataclasses.replace(
        run,
        samples=[run.samples[i] for i in idx],
        ids=[run.ids[i] for i in idx],
        categories=run.categories[idx],
        routes=run.routes[idx],
        judge_tool=run.judge_tool[idx],
        small_correct=run.small_correct[idx],
        agent_correct=run.agent_correct[idx],
        correct=run.correct[idx],
        has_small=run.has_small[idx],
        has_agent=run.has_agent[idx],
        is_error=run.is_error[idx],
        logged_confidence=run.logged_confidence[idx],
        timings={k: v[idx] for k, v in run.timings.items()},
        small_topk=[run.small_topk[i] for i in idx],
        _cache=cache,
    )
    if label:
        sub._cache[("part",)] = label  # type: ignore[assignment]
    return sub


def part_label(run: Run) -> str:
    """The part a Run was cut to ('' for a whole run)."""
    label = run._cache.get(("part",))
    return label if isinstance(label, str) else ""


def split_run(run: Run, split: Split) -> dict[str, Run]:
    """The run's parts by name."""
    from speceyes.bench import occupancy

    occupancy.schedule_arrays(run)  # batches are where the queries ran in the whole log
    return {
        name: subset_run(run, idx, f"{name} part of {split}")
        for name, idx in zip(
            split.names, split_indices(run.ids, run.categories, split), strict=True
        )
    }
