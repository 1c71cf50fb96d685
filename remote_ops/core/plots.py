"""PNG plots of training and extraction progress (matplotlib, Agg backend, no display).

Pure in spirit: summaries in, files out.  matplotlib is imported lazily so the
rest of remote-ops works without it (`pip install remote-ops[plots]`).

What a practitioner reads first, so each plot answers one question:
- training_acc.png / training_loss.png: how each draft position improves over
  epochs (one colour per position from a sequential map, solid train, dashed
  eval, integer epoch ticks);
- training_positions.png: accuracy against draft position for the last epoch
  (the decay that sets the acceptance length);
- training_tau.png: the expected acceptance length tau per epoch;
- training_steps.png: loss and accuracy at each logged step, on two panels;
- extraction.png: samples and tokens done on two panels, on a time axis in
  seconds, minutes or hours to suit the run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import UsageError
from .logparse import TrainingSummary

PHASE_STYLE = {"train": "-", "eval": "--"}


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise UsageError("--plot needs matplotlib (pip install 'remote-ops[plots]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_training(summary: TrainingSummary, out_dir: Path, title: str = "") -> list[Path]:
    """Every training plot the summary has data for; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    if summary.records:
        written.append(_per_position(summary, "acc", "accuracy", out_dir / "training_acc.png", title))
        if any(r.ploss for r in summary.records):
            written.append(_per_position(summary, "ploss", "loss", out_dir / "training_loss.png", title))
        written.append(_last_epoch_positions(summary, out_dir / "training_positions.png", title))
        written.append(_acceptance(summary, out_dir / "training_tau.png", title))
    if summary.steps:
        written.append(_steps(summary, out_dir / "training_steps.png", title))
    return written


def _position_colours(plt: Any, count: int) -> list:
    """`count` distinct colours in order (position 0 darkest), readable for up to ~20 lines."""
    cmap = plt.get_cmap("viridis")
    return [cmap(i / max(count - 1, 1) * 0.9) for i in range(count)]


def _integer_ticks(axis: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def _per_position(summary: TrainingSummary, metric: str, label: str, path: Path, title: str) -> Path:
    """One line per (phase, position): colour = position, line style = phase."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 5))
    positions = sorted({p for r in summary.records for p in getattr(r, metric)})
    colours = dict(zip(positions, _position_colours(plt, len(positions))))
    for phase, style in PHASE_STYLE.items():
        rows = [r for r in summary.records if r.phase == phase]
        for pos in positions:
            pts = [(r.index, getattr(r, metric)[pos]) for r in rows if pos in getattr(r, metric)]
            if pts:
                ax.plot(
                    *zip(*pts),
                    marker="o",
                    markersize=3,
                    linestyle=style,
                    color=colours[pos],
                    linewidth=2.2 if pos == 0 else 1.3,
                    label=f"{phase} pos {pos}",
                )
    ax.set_xlabel(summary.records[0].unit)
    _integer_ticks(ax.xaxis)
    ax.set_ylabel(label)
    ax.set_title(f"{title} {label} per draft position (solid train, dashed eval)".strip())
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return _save(fig, plt, path)


def _last_epoch_positions(summary: TrainingSummary, path: Path, title: str) -> Path:
    """Accuracy against draft position for the last epoch (or step) of each phase."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for phase, style in PHASE_STYLE.items():
        rec = summary.latest(phase)
        if rec and rec.acc:
            xs = sorted(rec.acc)
            tau = rec.acceptance_length
            ax.plot(
                xs,
                [rec.acc[x] for x in xs],
                marker="o",
                linestyle=style,
                label=f"{phase} {rec.unit} {rec.index}" + (f" (tau {tau:.2f})" if tau else ""),
            )
    ax.set_ylim(0, 1)
    _axes(ax, "draft position", "accuracy", f"{title} accuracy by draft position, last {summary.records[-1].unit}")
    return _save(fig, plt, path)


def _acceptance(summary: TrainingSummary, path: Path, title: str) -> Path:
    """tau = 1 + sum_k prod_{i<=k} acc_i per epoch: the acceptance length a chain draft would give."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for phase, style in PHASE_STYLE.items():
        pts = [
            (r.index, r.acceptance_length)
            for r in summary.records
            if r.phase == phase and r.acceptance_length is not None
        ]
        if pts:
            ax.plot(*zip(*pts), marker="o", linestyle=style, label=phase)
    _axes(
        ax,
        summary.records[0].unit,
        "expected acceptance length tau (tokens/step)",
        f"{title} expected acceptance length (estimate from training accuracy)",
    )
    return _save(fig, plt, path)


def _axes(ax: Any, xlabel: str, ylabel: str, title: str) -> None:
    """One panel's labels (whole numbers along x), title, grid and legend."""
    ax.set_xlabel(xlabel)
    _integer_ticks(ax.xaxis)
    ax.set_ylabel(ylabel)
    ax.set_title(title.strip())
    ax.grid(alpha=0.3)
    ax.legend()


def _steps(summary: TrainingSummary, path: Path, title: str) -> Path:
    """Mean loss and accuracy at each logged step (train_eagle3.py's progress bar), two panels."""
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    xs = _global_steps(summary)
    top.plot(xs, [p.loss for p in summary.steps], color="tab:red", label="loss (mean over positions)")
    bottom.plot(xs, [p.acc for p in summary.steps], color="tab:blue", label="accuracy (mean over positions)")
    for ax, label in ((top, "loss"), (bottom, "accuracy")):
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(loc="best")
    bottom.set_xlabel("step (across epochs)")
    _integer_ticks(bottom.xaxis)
    top.set_title(f"{title} training steps".strip())
    return _save(fig, plt, path)


def _global_steps(summary: TrainingSummary) -> list[int]:
    """Step numbers that keep counting across epochs (tqdm restarts at 0 each epoch)."""
    xs: list[int] = []
    offset, last_epoch = 0, None
    for p in summary.steps:
        if last_epoch is not None and p.epoch != last_epoch:
            offset = xs[-1] if xs else 0
        xs.append(offset + p.step)
        last_epoch = p.epoch
    return xs


def time_axis(seconds: list[float]) -> tuple[list[float], str]:
    """Scale elapsed seconds to the unit that suits the run: s under 2 min, min under 2 h, else h."""
    span = max(seconds, default=0.0)
    unit, div = ("seconds", 1.0) if span < 120 else ("minutes", 60.0) if span < 7200 else ("hours", 3600.0)
    return [s / div for s in seconds], unit


def plot_extraction(points: list[tuple[float, int, int]], out_dir: Path, title: str = "") -> Path | None:
    """Samples and tokens done over time, from (elapsed seconds, done, tokens) points, two panels."""
    if not points:
        return None
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    xs, unit = time_axis([p[0] for p in points])
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    top.plot(xs, [p[1] for p in points], color="tab:green", marker=".", label="samples done")
    bottom.plot(xs, [p[2] for p in points], color="tab:purple", marker=".", label="tokens done")
    for ax, label in ((top, "samples"), (bottom, "tokens")):
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left")
        ax.set_xlim(left=0, right=xs[-1] if xs[-1] > 0 else 1)
    bottom.set_xlabel(f"elapsed ({unit})")
    top.set_title(f"{title} extraction progress".strip())
    return _save(fig, plt, out_dir / "extraction.png")


def _save(fig: Any, plt: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
