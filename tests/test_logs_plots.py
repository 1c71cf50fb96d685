"""`--plot`: PNG files from parsed logs (matplotlib Agg, no display)."""

from __future__ import annotations

from pathlib import Path

import pytest

from remote_ops.core import logparse, plots

pytest.importorskip("matplotlib")
DATA = Path(__file__).parent / "data" / "logs"
PNG = b"\x89PNG\r\n\x1a\n"


def test_training_and_extraction_plots_are_written(tmp_path):
    epochs = logparse.parse_training((DATA / "specforge_epochs.log").read_text())
    steps = logparse.parse_training((DATA / "specforge_train_eagle3_tqdm.log").read_text())
    written = plots.plot_training(epochs, tmp_path, "lab1") + plots.plot_training(steps, tmp_path / "s")
    written.append(plots.plot_extraction(logparse.extraction_points((DATA / "extraction.log").read_text()), tmp_path))
    names = sorted(p.name for p in written)
    assert names == [
        "extraction.png",
        "training_acc.png",
        "training_loss.png",
        "training_positions.png",
        "training_steps.png",
        "training_tau.png",
    ]
    for p in written:
        assert p.read_bytes()[:8] == PNG and p.stat().st_size > 5000


def test_nothing_to_plot_writes_nothing(tmp_path):
    assert plots.plot_training(logparse.TrainingSummary(), tmp_path) == []
    assert plots.plot_extraction([], tmp_path) is None
