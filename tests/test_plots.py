"""Training/extraction plots: which files, the acceptance length, and the axes a practitioner reads."""

from __future__ import annotations

from pathlib import Path

import pytest

from remote_ops.core import logparse, plots

pytest.importorskip("matplotlib")
DATA = Path(__file__).parent / "data" / "logs"


def test_acceptance_length_is_one_plus_the_sum_of_chained_accuracies():
    rec = logparse.TrainRecord("train", "epoch", 1, acc={0: 0.5, 1: 0.5, 2: 0.5})
    assert rec.acceptance_length == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert logparse.TrainRecord("train", "epoch", 1, acc={0: 0.74}).acceptance_length == 1.74
    assert logparse.TrainRecord("train", "epoch", 1, acc={1: 0.5}).acceptance_length is None  # no position 0
    assert logparse.TrainRecord("train", "epoch", 1, acc={0: 0.5, 2: 0.9}).acceptance_length == 1.5  # stops at a gap


def test_summary_json_carries_tau_per_record():
    t = logparse.parse_training((DATA / "specforge_epochs.log").read_text())
    taus = [r["acceptance_length"] for r in t.to_dict()["records"] if r["phase"] == "train"]
    assert taus == sorted(taus) and taus[-1] == pytest.approx(2.488, abs=1e-3)


def test_epoch_log_gives_accuracy_loss_positions_and_tau_plots(tmp_path):
    t = logparse.parse_training((DATA / "specforge_epochs.log").read_text())
    names = [p.name for p in plots.plot_training(t, tmp_path)]
    assert names == ["training_acc.png", "training_loss.png", "training_positions.png", "training_tau.png"]
    assert all((tmp_path / n).stat().st_size > 10_000 for n in names)


def test_progress_bar_log_gives_the_two_panel_steps_plot(tmp_path):
    t = logparse.parse_training((DATA / "specforge_train_eagle3_tqdm.log").read_text())
    assert [p.name for p in plots.plot_training(t, tmp_path)] == ["training_steps.png"]


def test_distinct_colours_for_many_positions():
    import matplotlib.pyplot as plt

    colours = plots._position_colours(plt, 14)
    assert len(set(colours)) == 14


@pytest.mark.parametrize("span,unit", [(30, "seconds"), (600, "minutes"), (3 * 3600, "hours"), (0, "seconds")])
def test_time_axis_suits_the_run(span, unit):
    xs, got = plots.time_axis([0.0, float(span)])
    assert got == unit and xs[0] == 0


def test_extraction_plot_of_a_short_run(tmp_path):
    path = plots.plot_extraction([(0.0, 0, 0), (4.0, 3, 300), (9.0, 6, 600)], tmp_path)
    assert path.name == "extraction.png" and path.stat().st_size > 10_000
    assert plots.plot_extraction([], tmp_path) is None
