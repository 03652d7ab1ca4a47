"""One guarantee over the whole cascade: a threshold per stage (small@0, small@1..n, large_direct)
such that the error rate among ALL accepted answers together is at most E with probability at
least C = 1 - delta over the calibration sample. The statement and its proof are in
docs/cascade.md ("One guarantee over the cascade"); the per-stage replay is
:mod:`speceyes.bench.cascade_replay`, the single-stage tests :mod:`speceyes.bench.ltt`.

Two procedures (``cascade_method``):

- ``fixed-sequence`` (default): Learn-then-Test on the joint threshold vector. For a threshold
  vector fixed in advance, the queries are i.i.d., so the number of wrong answers among the m
  accepted (by any stage) is Binomial(m, R) with R the cascade's error among accepted answers:
  the exact p-value P(Bin(m, E) <= errors) tests H0: R > E on all the calibration data at once.
  Vectors are tested along P paths fixed before the labels are seen: path p sets stage s to
  accept the share lambda * w_p[s] of its eligible queries (a quantile of the stage's unlabeled
  confidences), lambda rising from 0 to 1, so every path goes from conservative to lenient.
  Each path is a fixed sequence at delta / P (Bonferroni over paths); with probability >= 1 -
  delta every rejected vector on every path is valid at once, so the cheapest of them by
  replayed cost may be kept.
- ``bonferroni``: one threshold per stage, stage by stage in cascade order, each certified by
  ``ltt.ltt_max_error`` at delta / S on the queries that reach it. The calibration queries are
  cut into S disjoint parts (seeded, by category, labels unused) and stage s is calibrated on
  part s only, so the thresholds before it were chosen on other queries and the ones that reach
  it are an i.i.d. sample of what reaches it. With probability >= 1 - delta every stage's error
  among its accepted answers is <= E, hence so is their mixture.

``per_category``: the procedure within each category at delta / G (G categories), so with
probability >= 1 - delta the guarantee holds in every category simultaneously, hence also over
any mix of them. The calibration file carries the global thresholds (``stages``) and the
per-category ones (``per_category``); ``read_stage_taus`` / ``read_category_taus`` read them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from speceyes.bench import cascade_replay as cr
from speceyes.bench.calibration_file import Calibration, _json_safe, recorded_setup
from speceyes.bench.ltt import (
    NO_TAU,
    LttScan,
    binom_pvalues,
    clopper_pearson_upper,
    fixed_sequence_choice,
    ltt_max_error,
    min_accepted,
)
from speceyes.bench.runlog import Run
from speceyes.bench.splits import Split, split_indices, split_run
from speceyes.types import DIRECT_PROMPTS

FIXED_SEQUENCE = "fixed-sequence"
BONFERRONI = "bonferroni"
CASCADE_METHODS = (FIXED_SEQUENCE, BONFERRONI)
DEFAULT_GRID = 100  # lambda steps per path
MAX_SUBSET_STAGES = 5  # up to this many stages, a path per subset of them (31 paths at most)


# ---------------------------------------------------------------------------- on arrays


@dataclass(frozen=True)
class CascadeChoice:
    """The chosen thresholds and what the test saw (in-sample numbers on the calibration data)."""

    taus: dict[str, float]  # NO_TAU: the stage accepts nothing
    passed: bool
    method: str
    delta: float  # the level the claim is made at
    n: int
    n_accepted: int = 0
    errors: int = 0
    bound: float = math.nan  # Clopper-Pearson upper bound at the chosen vector's test level
    cost: float = math.nan  # replayed seconds of the calibration queries at the chosen vector
    valid: int = 0  # threshold vectors certified (fixed-sequence), all valid at once
    tested: int = 0  # tests run
    stage_results: list[dict[str, Any]] = field(default_factory=list)  # bonferroni: per stage


BASIC, SUBSETS = "basic", "subsets"
PATH_FAMILIES = (BASIC, SUBSETS)


def path_family(name: str, n_stages: int) -> np.ndarray:
    """The paths of a named family. ``basic`` (the default): every stage alike and each alone,
    S + 1 paths (the single-stage funnels are members of the family). ``subsets``
    (:func:`subset_directions`): one per subset of the stages, so that a stage can be off while
    the others stay on, at the price of more paths, each tested at a smaller share of delta.
    Neither dominates at a few hundred calibration queries (docs/cascade.md)."""
    if name == BASIC:
        return default_directions(n_stages)
    if name == SUBSETS:
        return subset_directions(n_stages)
    raise ValueError(f"unknown path family {name!r}; one of {', '.join(PATH_FAMILIES)}")


def default_directions(n_stages: int) -> np.ndarray:
    """Paths through threshold space, one row of acceptance weights per path: every stage alike,
    then each stage alone (the single-stage funnels are members of the family)."""
    return np.vstack([np.ones((1, n_stages)), np.eye(n_stages)])


def subset_directions(n_stages: int) -> np.ndarray:
    """Paths through threshold space, one row of acceptance weights per path: every non-empty
    subset of the stages, its stages alike and the others off. The single-stage funnels are
    members of the family, and so is any cascade that turns off a stage whose answers are too
    often wrong while the others stay on (on the mini world ``small@1`` is confidently wrong after
    a zoom: with only "every stage" and "each alone" no vector kept ``small@0`` and the middle
    tier together). 2^S - 1 paths, each tested at delta / (2^S - 1). Beyond
    ``MAX_SUBSET_STAGES`` stages, where that many paths would cost the test its power, the
    family is every stage alike, each alone, and every stage but one (2S + 1 paths)."""
    if n_stages > MAX_SUBSET_STAGES:
        ones, eye = np.ones((1, n_stages)), np.eye(n_stages)
        return np.vstack([ones, eye, 1.0 - eye])
    subsets = range(1, 2**n_stages)
    return np.array([[float(m >> s & 1) for s in range(n_stages)] for m in subsets])


def stage_quantile_taus(log: cr.CascadeLog, shares: np.ndarray) -> np.ndarray:
    """(T, S) thresholds accepting about ``shares[t, s]`` of stage s's eligible queries: quantiles
    of its unlabeled confidences (share 0: NO_TAU, share 1: 0.0, which accepts any positive)."""
    shares = np.atleast_2d(shares)
    out = np.full(shares.shape, NO_TAU)
    for s in range(len(log.stages)):
        pool = log.conf[log.eligible[:, s], s]
        pool = pool[np.isfinite(pool)]
        a = np.clip(shares[:, s], 0.0, 1.0)
        if pool.size:
            q = np.quantile(pool, 1.0 - np.minimum(a, 1.0))
            out[:, s] = np.where(a >= 1.0, 0.0, np.clip(q, 0.0, NO_TAU))
        out[a <= 0.0, s] = NO_TAU
    return out


@dataclass(frozen=True)
class Certified:
    """Every threshold vector the fixed-sequence test certified: with probability >= 1 - delta
    all of them hold the bound at once, so any rule may pick among them (the cheapest by the
    run's replayed seconds, or by a simulated deployment: ``calibrate --price-bench``)."""

    taus: np.ndarray  # (V, S)
    idx: np.ndarray  # (n, V) the stage accepting each query, -1: the agent
    path_delta: float  # the level each path was tested at
    tested: int


def certified_vectors(
    log: cr.CascadeLog,
    max_error: float,
    delta: float,
    directions: np.ndarray | None = None,
    n_grid: int = DEFAULT_GRID,
    start_rate: float = 0.5,
) -> Certified:
    """The fixed-sequence test along every path (module doc)."""
    dirs = default_directions(len(log.stages)) if directions is None else np.atleast_2d(directions)
    if dirs.shape[1] != len(log.stages) or np.any(dirs < 0):
        raise ValueError(f"directions must be non-negative rows of {len(log.stages)} weights")
    path_delta = delta / len(dirs)
    lambdas = np.linspace(0.0, 1.0, n_grid + 1)[1:]  # conservative first; 0 accepts nothing
    valid_taus, valid_idx, tested = [], [], 0
    for w in dirs:
        taus = stage_quantile_taus(log, lambdas[:, None] * w[None, :])
        idx = cr.accepted_stage(log, taus)
        m, k = cr.accepted_wrong(log, idx)
        need = min_accepted(max_error, path_delta, start_rate, limit=int(m.max(initial=0)))
        scan = LttScan(lambdas, m, k, binom_pvalues(k, m, max_error), m >= need)
        best, t = fixed_sequence_choice(scan, path_delta)
        tested += t
        if best < 0:
            continue
        order = np.flatnonzero(scan.testable)
        rejected = order[: int(np.searchsorted(order, best)) + 1]
        valid_taus.append(taus[rejected])
        valid_idx.append(idx[:, rejected])
    if not valid_taus:
        return Certified(np.zeros((0, len(log.stages))), np.zeros((log.n, 0), np.int64),
                         path_delta, tested)
    return Certified(np.vstack(valid_taus), np.hstack(valid_idx), path_delta, tested)


def _fixed_sequence(
    log: cr.CascadeLog,
    max_error: float,
    delta: float,
    directions: np.ndarray | None,
    n_grid: int,
    start_rate: float,
    cost_fn: cr.CostFn,
) -> CascadeChoice:
    found = certified_vectors(log, max_error, delta, directions, n_grid, start_rate)
    path_delta, tested = found.path_delta, found.tested
    if not len(found.taus):
        return CascadeChoice(
            {s: NO_TAU for s in log.stages}, False, FIXED_SEQUENCE, delta, log.n, tested=tested
        )
    taus_all, idx_all = found.taus, found.idx
    costs = cost_fn(idx_all, taus_all)
    m, k = cr.accepted_wrong(log, idx_all)
    best = int(np.lexsort((-m, costs))[0])  # cheapest; ties: the one accepting most
    return CascadeChoice(
        taus={s: float(taus_all[best, j]) for j, s in enumerate(log.stages)},
        passed=True,
        method=FIXED_SEQUENCE,
        delta=delta,
        n=log.n,
        n_accepted=int(m[best]),
        errors=int(k[best]),
        bound=clopper_pearson_upper(int(k[best]), int(m[best]), path_delta),
        cost=float(costs[best]),
        valid=len(taus_all),
        tested=tested,
    )


def stage_parts(
    log: cr.CascadeLog, seed: int, ids: Sequence[str] | None = None
) -> list[np.ndarray]:
    """S disjoint parts of the queries, one per stage: seeded, stratified by category, from ids
    and categories only (never the labels)."""
    names = [str(i) for i in range(log.n)] if ids is None else list(ids)
    return split_indices(names, log.categories, Split((1.0,) * len(log.stages), seed))


def _bonferroni(
    log: cr.CascadeLog,
    max_error: float,
    delta: float,
    n_grid: int,
    start_rate: float,
    cost_fn: cr.CostFn,
    parts: list[np.ndarray],
) -> CascadeChoice:
    s_count = len(log.stages)
    stage_delta = delta / s_count
    taus = np.full(s_count, NO_TAU)
    details, tested = [], 0
    for j, name in enumerate(log.stages):
        part = log.subset(parts[j])
        before = taus.copy()
        before[j:] = np.inf  # which part-j queries the chosen earlier stages leave to stage j
        reach = (cr.accepted_stage(part, before[None, :])[:, 0] < 0) & part.eligible[:, j]
        res = ltt_max_error(
            part.conf[reach, j],
            part.wrong[reach, j],
            max_error,
            stage_delta,
            n_grid=n_grid,
            start_rate=start_rate,
        )
        taus[j] = res.tau
        tested += res.tested
        details.append(
            {
                "stage": name,
                "tau": res.tau,
                "passed": res.passed,
                "n": int(reach.sum()),
                "n_accepted": res.n_accepted,
                "bound": res.bound,
                "delta": stage_delta,
            }
        )
    idx = cr.accepted_stage(log, taus[None, :])
    m, k = cr.accepted_wrong(log, idx)
    passed = any(d["passed"] for d in details)
    return CascadeChoice(
        taus={s: float(taus[j]) for j, s in enumerate(log.stages)},
        passed=passed,
        method=BONFERRONI,
        delta=delta,
        n=log.n,
        n_accepted=int(m[0]),
        errors=int(k[0]),
        bound=max((d["bound"] for d in details if d["passed"]), default=math.nan),
        cost=float(cost_fn(idx, taus[None, :])[0]),
        valid=int(passed),
        tested=tested,
        stage_results=details,
    )


def certify_cascade(
    log: cr.CascadeLog,
    max_error: float,
    delta: float,
    *,
    method: str = FIXED_SEQUENCE,
    directions: np.ndarray | None = None,
    n_grid: int = DEFAULT_GRID,
    start_rate: float = 0.5,
    cost_fn: cr.CostFn | None = None,
    seed: int = 0,
    ids: Sequence[str] | None = None,
) -> CascadeChoice:
    """Per-stage thresholds with P(error among all accepted answers > max_error) <= delta.

    ``cost_fn`` prices a routing (default: the GPU-time cost of the log's seconds);
    ``seed``/``ids`` cut the stage parts of the bonferroni method.
    """
    if method not in CASCADE_METHODS:
        raise ValueError(f"unknown cascade method {method!r}; one of {', '.join(CASCADE_METHODS)}")
    if not 0.0 < max_error < 1.0 or not 0.0 < delta < 1.0:
        raise ValueError(f"need 0 < max error, delta < 1, got {max_error}, {delta}")
    cost_fn = cost_fn or cr.gpu_time_cost(log)
    if method == FIXED_SEQUENCE:
        return _fixed_sequence(log, max_error, delta, directions, n_grid, start_rate, cost_fn)
    return _bonferroni(
        log, max_error, delta, n_grid, start_rate, cost_fn, stage_parts(log, seed, ids)
    )


def certify_per_category(
    log: cr.CascadeLog,
    max_error: float,
    delta: float,
    *,
    ids: Sequence[str] | None = None,
    cost_for: Callable[[np.ndarray], cr.CostFn] | None = None,
    **options: Any,
) -> dict[str, CascadeChoice]:
    """``certify_cascade`` within every category at delta / G (G categories): the guarantee holds
    in every category at once with probability >= 1 - delta. ``cost_for(rows)`` prices the
    routings of one category's rows (default: their GPU-time cost)."""
    cats = sorted(set(log.categories.tolist()))
    out = {}
    for cat in cats:
        sel = np.flatnonzero(log.categories == cat)
        out[cat] = certify_cascade(
            log.subset(sel),
            max_error,
            delta / len(cats),
            ids=None if ids is None else [ids[i] for i in sel],
            cost_fn=None if cost_for is None else cost_for(sel),
            **options,
        )
    return out


# ---------------------------------------------------------------------------- a run


@dataclass
class CascadeCalibration:
    """The calibration file of a cascade: the single-stage record (``base``, whose ``tau`` is
    small@0's so readers of the earlier format keep working) plus the stages' thresholds."""

    base: Calibration
    stages: dict[str, float]
    cascade_method: str
    per_category: dict[str, dict[str, float]] | None = None
    cascade: dict[str, Any] = field(default_factory=dict)  # how it was chosen, replayed numbers

    def to_dict(self) -> dict[str, Any]:
        out = self.base.to_dict()
        out |= _json_safe(
            {"stages": self.stages, "cascade_method": self.cascade_method, "cascade": self.cascade}
        )
        if self.per_category is not None:
            out["per_category"] = _json_safe(self.per_category)
        return out


def method_name(method: str) -> str:
    return f"cascade-{method}-clopper-pearson"


def calibrate_cascade(
    run: Run,
    max_error: float = 0.05,
    confidence: float = 0.9,
    *,
    method: str = FIXED_SEQUENCE,
    per_category: bool = False,
    stages: Sequence[str] | None = None,
    split: Split | None = None,
    n_grid: int = DEFAULT_GRID,
    start_rate: float = 0.5,
    seed: int = 0,
    price: Callable[[cr.CascadeLog], cr.CostFn] | None = None,
    price_info: Mapping[str, Any] | None = None,
    paths: str = BASIC,
) -> CascadeCalibration:
    """Calibrate the cascade on a ``both`` run that logged every stage (module doc); ``split``
    calibrates on its calib part and replays the chosen thresholds on its test part.

    ``price(log)`` prices the certified vectors instead of the run's replayed seconds (for
    example a simulated deployment: :class:`speceyes.simulate.cascade_price.DeploymentPrice`);
    ``price_info`` describes it in the file. Either way the kept vector is one the test
    certified, so the guarantee is the same."""
    calib_run, test_run = run, None
    if split is not None:
        parts = split_run(run, split)
        calib_run, test_run = parts["calib"], parts["test"]
    log = cr.cascade_log(calib_run, stages)
    if price is not None and (per_category or method != FIXED_SEQUENCE):
        raise ValueError("a price other than the run's seconds is for the fixed-sequence "
                         "method's overall thresholds (no --per-category)")
    cost_fn = cr.run_cost(calib_run, log)[0] if price is None else price(log)
    delta = 1.0 - confidence
    options = dict(method=method, n_grid=n_grid, start_rate=start_rate, seed=seed, cost_fn=cost_fn)
    if method == FIXED_SEQUENCE:
        options["directions"] = path_family(paths, len(log.stages))
    choice = certify_cascade(log, max_error, delta, ids=calib_run.ids, **options)
    cat_choices = None
    if per_category:
        options.pop("cost_fn")
        cat_choices = certify_per_category(
            log,
            max_error,
            delta,
            ids=calib_run.ids,
            cost_for=lambda rows: _category_cost(calib_run, log, rows),
            **options,
        )
    cat_taus = None if cat_choices is None else {c: v.taus for c, v in cat_choices.items()}
    in_sample = cr.replay_cascade(calib_run, choice.taus, cat_taus)
    held_out = None
    if test_run is not None:
        held_out = asdict(cr.replay_cascade(test_run, choice.taus, cat_taus))
    cfg = run.config
    small0 = choice.taus.get(cr.SMALL0, NO_TAU)
    gate = cr.rg.resolve_gate(calib_run)
    base = Calibration(
        tau=small0,
        top_k=gate.top_k,
        agg=gate.agg,
        scale=gate.scale,
        max_error=max_error,
        confidence=confidence,
        method=method_name(method),
        n=choice.n,
        n_accepted=choice.n_accepted,
        n_queries=calib_run.n,
        bound=choice.bound,
        expected_acceptance=in_sample.accepted / in_sample.n if in_sample.n else None,
        expected_small_share=(
            sum(v for k, v in in_sample.routes.items() if k.startswith("small@")) / in_sample.n
            if in_sample.n
            else None
        ),
        expected_speedup=in_sample.speedup,
        candidates_tested=choice.tested,
        passed=choice.passed or any(c.passed for c in (cat_choices or {}).values()),
        source=str(run.path),
        note="" if choice.passed else "no threshold vector passed the test: accept nothing",
        **recorded_setup(cfg),
        split=None if split is None else str(split),
        held_out=None if held_out is None else _held_out_summary(held_out),
        speedup_model=in_sample.speedup_model,
    )
    kept = cr.tau_matrix(log.stages, choice.taus)
    depths = [cr.stage_sort_key(s)[1] for s in log.stages if s.startswith("small@")]
    details: dict[str, Any] = {
        "guarantee": ("per category, every category at once" if per_category else "overall"),
        "stage_order": list(log.stages),
        "speculate_depth": max(depths, default=0),
        "middle_tier": cr.LARGE_DIRECT in log.stages,
        # the middle tier's prompt moves its answers and confidences: the run's, recorded
        "direct_prompt": cfg.get("direct_prompt", DIRECT_PROMPTS[0]),
        "delta": delta,
        "paths": paths if method == FIXED_SEQUENCE else None,
        "valid_vectors": choice.valid,
        "cost": choice.cost,
        "price": dict(price_info or {"by": "the calibration run's replayed seconds"}),
        # what the kept vector does, in the simulator's terms (simulate --cascade --mix-from)
        "mix": cr.stage_mix(log, kept[0], cr.accepted_stage(log, kept)[:, 0]),
        "errors": choice.errors,
        "stage_results": choice.stage_results,
        "in_sample": asdict(in_sample),
        "held_out": held_out,
    }
    if cat_choices is not None:
        details["per_category_results"] = {
            c: {
                "passed": v.passed,
                "n": v.n,
                "n_accepted": v.n_accepted,
                "bound": v.bound,
                "delta": v.delta,
            }
            for c, v in cat_choices.items()
        }
    return CascadeCalibration(
        base=base,
        stages=choice.taus,
        cascade_method=method,
        per_category=cat_taus,
        cascade=details,
    )


def _category_cost(run: Run, log: cr.CascadeLog, rows: np.ndarray) -> cr.CostFn:
    """Routings of one category's rows priced within the whole run (its other queries go to the
    agent), so the agent phase keeps the run's own schedule."""
    full_cost, _ = cr.run_cost(run, log)

    def cost(stage_idx: np.ndarray, taus: np.ndarray) -> np.ndarray:
        whole = np.full((log.n, stage_idx.shape[1]), -1, dtype=np.int64)
        whole[rows] = stage_idx
        return full_cost(whole, taus)

    return cost


def _held_out_summary(replay: dict[str, Any]) -> dict[str, Any]:
    return {
        k: replay[k]
        for k in ("n", "accepted", "accepted_error", "accuracy", "agent_only_accuracy", "speedup")
    }


def write_cascade_calibration(cal: CascadeCalibration, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cal.to_dict(), indent=2) + "\n", encoding="utf-8")
    return path


# ---------------------------------------------------------------------------- reading


def _as_dict(path_or_dict: str | Path | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(path_or_dict, Mapping):
        return path_or_dict
    path = Path(path_or_dict)
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _checked_taus(taus: Any, where: str) -> dict[str, float]:
    if not isinstance(taus, Mapping):
        raise ValueError(f"{where} must be an object of stage: tau")
    out = {}
    for stage, tau in taus.items():
        cr.stage_sort_key(str(stage))  # raises on an unknown stage name
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0.0 <= tau <= 1.0:
            raise ValueError(f"{where}: tau of {stage} must be a number in [0, 1], got {tau!r}")
        out[str(stage)] = float(tau)
    return dict(sorted(out.items(), key=lambda kv: cr.stage_sort_key(kv[0])))


def read_stage_taus(path_or_dict: str | Path | Mapping[str, Any]) -> dict[str, float]:
    """{stage: tau} of a cascade calibration file (or its parsed dict); {} for a file of the
    two-stage funnel, which calibrated no stage beyond its ``tau``."""
    data = _as_dict(path_or_dict)
    stages = data.get("stages")
    return {} if stages is None else _checked_taus(stages, "stages")


def read_category_taus(
    path_or_dict: str | Path | Mapping[str, Any],
) -> dict[str, dict[str, float]]:
    """{category: {stage: tau}} (adaptive gating by query type); {} when none was calibrated."""
    data = _as_dict(path_or_dict)
    per = data.get("per_category")
    if per is None:
        return {}
    if not isinstance(per, Mapping):
        raise ValueError("per_category must be an object of category: {stage: tau}")
    return {str(c): _checked_taus(t, f"per_category[{c}]") for c, t in per.items()}


def format_cascade_calibration(cal: CascadeCalibration) -> str:
    b, d = cal.base, cal.cascade
    claim = (
        f"error among ALL accepted answers of the cascade <= {b.max_error:g}, with probability "
        f">= {b.confidence:g} ({cal.cascade_method}; {d['guarantee']})"
    )
    lines = [f"guarantee (n={b.n_queries} calibration queries): {claim}"]
    if cal.stages and any(t < NO_TAU for t in cal.stages.values()):
        lines.append("thresholds: " + ", ".join(f"{s}={t:.6f}" for s, t in cal.stages.items()))
        if cal.cascade_method == FIXED_SEQUENCE:
            how = f"{d['valid_vectors']} vectors certified at once, the cheapest kept"
        else:
            how = f"each stage certified at delta/{len(cal.stages)} on its own part"
        lines.append(f"{b.n_accepted} accepted, bound {b.bound:.4f}; {how}")
    else:
        lines.append("NO threshold vector passed the test: every stage accepts nothing.")
    ins = d["in_sample"]
    lines.append(
        f"in-sample: accuracy {100 * ins['accuracy']:.2f}% (agent-only "
        f"{100 * ins['agent_only_accuracy']:.2f}%), speedup {ins['speedup']:.2f}x"
    )
    if cal.per_category is not None:
        for c, taus in cal.per_category.items():
            r = d["per_category_results"][c]
            t = ", ".join(f"{s}={v:.4f}" for s, v in taus.items())
            lines.append(f"category {c}: {'passed' if r['passed'] else 'accept nothing'} ({t})")
    h = d.get("held_out")
    if h:
        err = "-" if not h["accepted"] else f"{100 * h['accepted_error']:.2f}%"
        lines.append(
            f"held out (n={h['n']}): accepted {h['accepted']}, error among accepted {err}, "
            f"accuracy {100 * h['accuracy']:.2f}% (agent-only "
            f"{100 * h['agent_only_accuracy']:.2f}%), speedup {h['speedup']:.2f}x"
        )
    else:
        lines.append("numbers above are in-sample; --split calib:test measures them held out")
    return "\n".join(lines)
