"""PNG plots of training and extraction progress (matplotlib, Agg backend, no display).

Pure in spirit: summaries in, files out.  matplotlib is imported lazily so the
rest of remote-ops works without it (`pip install remote-ops[plots]`).
"""
from __future__ import annotations

from pathlib import Path

from .errors import UsageError
from .logs import TrainingSummary


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise UsageError("--plot needs matplotlib (pip install 'remote-ops[plots]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_training(summary: TrainingSummary, out_dir: Path, title: str = "") -> list[Path]:
    """Accuracy per position and loss per epoch/step (train and eval), plus the tqdm steps."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    if summary.records:
        written.append(_per_position(summary, "acc", "accuracy", out_dir / "training_acc.png", title))
        written.append(_per_position(summary, "ploss", "loss", out_dir / "training_loss.png", title))
    if summary.steps:
        written.append(_steps(summary, out_dir / "training_steps.png", title))
    return written


def _per_position(summary: TrainingSummary, metric: str, label: str, path: Path, title: str) -> Path:
    """One line per (phase, position): how each draft position improves over epochs."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for phase in ("train", "eval"):
        rows = [r for r in summary.records if r.phase == phase and getattr(r, metric)]
        positions = sorted({p for r in rows for p in getattr(r, metric)})
        for pos in positions:
            xs = [r.index for r in rows if pos in getattr(r, metric)]
            ys = [getattr(r, metric)[pos] for r in rows if pos in getattr(r, metric)]
            ax.plot(xs, ys, marker="o", linestyle="-" if phase == "train" else "--",
                    linewidth=2.5 if pos == 0 else 1.2, label=f"{phase} pos {pos}")
    unit = summary.records[0].unit
    ax.set_xlabel(unit)
    ax.set_ylabel(label)
    ax.set_title(f"{title} {label} per draft position".strip())
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, plt, path)


def _steps(summary: TrainingSummary, path: Path, title: str) -> Path:
    """Mean loss and accuracy at each logged step (train_eagle3.py's progress bar)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    xs, offset, last_epoch = [], 0, None
    for p in summary.steps:
        if last_epoch is not None and p.epoch != last_epoch:
            offset = xs[-1] if xs else 0
        xs.append(offset + p.step)
        last_epoch = p.epoch
    ax.plot(xs, [p.loss for p in summary.steps], color="tab:red", label="loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax2 = ax.twinx()
    ax2.plot(xs, [p.acc for p in summary.steps], color="tab:blue", label="acc")
    ax2.set_ylabel("accuracy")
    ax.set_title(f"{title} training steps".strip())
    ax.grid(alpha=0.3)
    return _save(fig, plt, path)


def plot_extraction(points: list[tuple[float, int, int]], out_dir: Path, title: str = "") -> Path | None:
    """Samples and tokens done over time, from (elapsed seconds, done, tokens) points."""
    if not points:
        return None
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot([p[0] / 60 for p in points], [p[1] for p in points], color="tab:green", label="samples")
    ax.set_xlabel("minutes")
    ax.set_ylabel("samples done")
    ax2 = ax.twinx()
    ax2.plot([p[0] / 60 for p in points], [p[2] for p in points], color="tab:gray", linestyle="--")
    ax2.set_ylabel("tokens")
    ax.set_title(f"{title} extraction progress".strip())
    ax.grid(alpha=0.3)
    return _save(fig, plt, out_dir / "extraction.png")


def _save(fig, plt, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
