"""Plots of a logged run (matplotlib, Agg backend, PNG).

- confidence KDE: correct vs wrong speculative answers, one panel per aggregation;
- Pareto: accuracy vs estimated speedup over tau, with the agent-only and small-only points;
- acceptance: alpha and beta*alpha vs tau.

The KDE is a Gaussian kernel with Scott's bandwidth, in numpy (no scipy).
"""

from __future__ import annotations

import logging
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from speceyes import gate  # noqa: E402
from speceyes.bench import regate as rg  # noqa: E402
from speceyes.bench.runlog import Run, load_run  # noqa: E402

log = logging.getLogger(__name__)

PLOTS_DIR = "plots"
KDE_PNG = "confidence_kde.png"
PARETO_PNG = "pareto.png"
ACCEPTANCE_PNG = "acceptance.png"
_DPI = 110


def scott_bandwidth(x: np.ndarray) -> float:
    """Scott's rule in 1-D: std(ddof=1) * n^(-1/5)."""
    x = np.asarray(x, dtype=np.float64)
    if x.size < 2:
        return float("nan")
    return float(np.std(x, ddof=1) * x.size ** (-0.2))


def gaussian_kde(
    x: np.ndarray, grid: np.ndarray, bandwidth: float | None = None, chunk: int = 4096
) -> np.ndarray:
    """Density of ``x`` on ``grid``; degenerate data (one value) gets a narrow fallback kernel."""
    x = np.asarray(x, dtype=np.float64)
    grid = np.asarray(grid, dtype=np.float64)
    if x.size == 0:
        return np.zeros_like(grid)
    h = scott_bandwidth(x) if bandwidth is None else float(bandwidth)
    if not np.isfinite(h) or h <= 0:
        span = float(grid.max() - grid.min()) if grid.size > 1 else 1.0
        h = max(span / 200.0, 1e-12)
    density = np.zeros_like(grid)
    for start in range(0, x.size, chunk):  # bounded memory: grid x chunk at a time
        z = (grid[:, None] - x[None, start : start + chunk]) / h
        density += np.exp(-0.5 * z * z).sum(axis=1)
    return density / (x.size * h * np.sqrt(2.0 * np.pi))


def _kde_top_k(run: Run) -> int:
    return min(run.top_k, run.k_logged) if run.k_logged else run.top_k


def has_small_labels(run: Run) -> bool:
    return bool(np.any(run.has_small & ~np.isnan(run.small_correct)))


def plot_confidence_kde(run: Run, out_png: str | Path) -> Path:
    """KDE of confidences of correct vs wrong small answers, one panel per aggregation."""
    labelled = run.has_small & ~np.isnan(run.small_correct)
    if not labelled.any():
        raise ValueError(f"{run.path}: no scored small answers with top-K logged")
    k = _kde_top_k(run)
    fig, axes = plt.subplots(1, len(gate.AGGREGATIONS), figsize=(4.2 * len(gate.AGGREGATIONS), 3.4))
    for ax, agg in zip(np.atleast_1d(axes), gate.AGGREGATIONS, strict=True):
        conf = rg.confidences(run, k, agg)
        lo = _panel_low(conf[labelled])
        grid = np.linspace(lo, 1.0, 512)
        for label, mask, color in (
            ("correct", labelled & (run.small_correct == 1), "tab:green"),
            ("wrong", labelled & (run.small_correct == 0), "tab:red"),
        ):
            vals = conf[mask]
            vals = vals[np.isfinite(vals)]
            if vals.size:
                dens = gaussian_kde(vals, grid)
                ax.plot(grid, dens, color=color, label=f"{label} (n={vals.size})")
                ax.fill_between(grid, dens, color=color, alpha=0.15)
        if agg == run.agg and run.tau is not None:
            ax.axvline(run.tau, color="k", ls="--", lw=1, label=f"tau={run.tau:g}")
        ax.set_title(f"{agg} (K={k})")
        ax.set_xlabel("confidence")
        ax.set_xlim(lo, 1.0)
        ax.legend(fontsize=7)
    np.atleast_1d(axes)[0].set_ylabel("density")
    fig.suptitle(f"{run.name}: speculative answer confidence")
    return _save(fig, out_png)


def _panel_low(values: np.ndarray) -> float:
    """Left edge of a KDE panel: confidences crowd near 1, so zoom to where the data is."""
    vals = values[np.isfinite(values)]
    if vals.size == 0:
        return 0.0
    lo = float(np.quantile(vals, 0.01))
    return max(0.0, lo - 0.1 * (1.0 - lo))


def plot_pareto(run: Run, out_png: str | Path, taus: np.ndarray | None = None) -> Path:
    """Accuracy vs estimated speedup over tau; agent-only (1x) and small-only points marked."""
    rows = rg.regate(run, rg.default_taus() if taus is None else taus)
    speed = np.array([r.speedup for r in rows])
    acc = 100 * np.array([r.accuracy for r in rows])
    fig, ax = plt.subplots(figsize=(6, 4.4))
    ax.plot(speed, acc, "-", color="tab:blue", lw=1.5, label=f"funnel over tau ({run.agg})")
    sc = ax.scatter(speed, acc, c=[r.tau for r in rows], cmap="viridis", s=12, zorder=3)
    fig.colorbar(sc, ax=ax, label="tau")
    agent_acc = 100 * float(np.mean(rg.known_correct(run.agent_correct)))
    ax.scatter([1.0], [agent_acc], marker="s", s=60, color="k", zorder=4, label="agent only")
    small = _small_only_point(run)
    if small is not None:
        ax.scatter([small[0]], [small[1]], marker="^", s=70, color="tab:orange", zorder=4)
        ax.annotate("small only", small, textcoords="offset points", xytext=(-30, 8))
    if run.tau is not None:
        own = rg.regate(run, [run.tau])[0]
        ax.scatter([own.speedup], [100 * own.accuracy], marker="*", s=150, color="tab:red",
                   zorder=5, label=f"run's tau={run.tau:g}")  # fmt: skip
    ax.set_xlabel("estimated speedup vs agent only (x)")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(f"{run.name}: accuracy vs speedup")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out_png)


def _small_only_point(run: Run) -> tuple[float, float] | None:
    """(speedup, accuracy %) of answering everything with the small model, if it ran on all."""
    if not np.all(run.has_small | run.is_error):
        return None
    t = rg.phase_times(run)
    small_total = float(t.small.sum())
    speed = float(t.agent.sum()) / small_total if small_total > 0 else float("nan")
    return speed, 100 * float(np.mean(rg.known_correct(run.small_correct)))


def plot_acceptance(run: Run, out_png: str | Path, taus: np.ndarray | None = None) -> Path:
    """Acceptance alpha (among judged tool-free) and beta*alpha (of all queries) vs tau."""
    taus = rg.default_taus() if taus is None else np.asarray(taus, dtype=float)
    beta, alphas = rg.acceptance(run, taus)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(taus, alphas, label="alpha (accepted / judged tool-free)")
    ax.plot(taus, beta * alphas, label=f"beta*alpha (small share), beta={beta:.2f}")
    if run.tau is not None:
        ax.axvline(run.tau, color="k", ls="--", lw=1, label=f"run's tau={run.tau:g}")
    ax.set_xlabel("tau")
    ax.set_ylabel("share")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"{run.name}: acceptance ({run.agg}, K={_kde_top_k(run)})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out_png)


def _save(fig, out_png: str | Path) -> Path:
    path = Path(out_png)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI, format="png")
    plt.close(fig)
    return path


def _replayable(run: Run) -> str | None:
    try:
        rg.check_replayable(run)
    except ValueError as exc:
        return str(exc)
    return None


def write_run_plots(
    run_dir: str | Path | Run,
    out_dir: str | Path | None = None,
    notes: list[str] | None = None,
    taus: np.ndarray | None = None,
) -> list[Path]:
    """Write every plot the run's data supports into ``out_dir`` (default run_dir/plots/).

    Plots the data cannot support are skipped; why goes to ``notes`` (and the log).
    """
    run = run_dir if isinstance(run_dir, Run) else load_run(run_dir)
    out = Path(out_dir) if out_dir is not None else run.path / PLOTS_DIR
    notes = [] if notes is None else notes
    paths: list[Path] = []

    def skip(what: str, why: str) -> None:
        notes.append(f"{run.name}: skipped {what}: {why}")
        log.info(notes[-1])

    if has_small_labels(run):
        paths.append(plot_confidence_kde(run, out / KDE_PNG))
    else:
        skip("confidence KDE", f"no scored small answers with top-K logged (mode {run.mode!r})")
    if np.any(run.judge_tool == 0) and np.any(run.has_small):
        paths.append(plot_acceptance(run, out / ACCEPTANCE_PNG, taus))
    else:
        skip("acceptance", f"needs judge decisions and small top-K (mode {run.mode!r})")
    if (why := _replayable(run)) is None:
        paths.append(plot_pareto(run, out / PARETO_PNG, taus))
    else:
        skip("Pareto plot", why)
    return paths
