"""Pure tests of log parsing and the incremental-pull plan (no hosts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from remote_ops.core import logparse
from remote_ops.probes import logs as fetch
from remote_ops.workflows import logs

DATA = Path(__file__).parent / "data" / "logs"


def test_extraction_log_gives_progress_rate_errors_and_eta_of_the_current_session():
    s = logparse.parse_extraction((DATA / "extraction.log").read_text())
    assert (s.done, s.total, s.tokens, s.state) == (8, 10, 13840, "running")
    assert s.rate_samples_s == 0.5 and s.rate_tokens_s == 865.0  # session: 2 samples in 4 s
    assert s.eta_s == 4.0  # 2 left at 0.5/s
    assert len(s.error_lines) == 1 and "Connection refused" in s.error_lines[0]
    assert s.last_time == "2026-11-30T10:05:04Z"


def test_finished_line_carries_missing_dumps_and_zero_eta():
    text = "2026-11-30T10:00:00Z finished missing_dumps=2 done=10 total=10 tokens=100 errors=0 failed=0 elapsed=5\n"
    s = logparse.parse_extraction(text)
    assert (s.state, s.missing_dumps, s.eta_s, s.rate_samples_s) == ("finished", 2, 0.0, 2.0)


def test_empty_or_foreign_extraction_log_is_unknown():
    assert logparse.parse_extraction("").state == "unknown"
    assert logparse.parse_extraction("random text\nmore\n").done == 0


def test_specforge_epoch_lines_give_per_position_accuracy_and_loss():
    t = logparse.parse_training((DATA / "specforge_epochs.log").read_text())
    train = [r for r in t.records if r.phase == "train"]
    evals = [r for r in t.records if r.phase == "eval"]
    assert [r.index for r in train] == [1, 2, 3] and len(evals) == 3
    assert train[0].unit == "epoch" and train[0].total == 3
    assert sorted(train[0].acc) == list(range(7))
    assert train[0].step0_acc == 0.45 and train[2].step0_acc == 0.65
    assert train[0].ploss[6] == 3.1
    assert train[2].loss < train[0].loss  # weighted 0.8**i like SpecForge's objective
    assert t.latest("eval").acc[0] == 0.62


def test_specforge_step_lines_are_read_as_steps():
    text = (
        "Train Step [200], position 0,  Acc: 0.51\nTrain Step [200], position 0, pLoss: 1.90\n"
        "Train Step [400], position 0,  Acc: 0.55\n"
    )
    t = logparse.parse_training(text)
    assert [(r.unit, r.index, r.step0_acc) for r in t.records] == [("step", 200, 0.51), ("step", 400, 0.55)]
    assert t.records[0].loss == 1.9


def test_specforge_0_2_0_step_metric_lines_give_per_position_accuracy_loss_and_eval():
    """`step N: {...}` as SpecForge 0.2.0's console logger prints it (report_to: none)."""
    t = logparse.parse_training((DATA / "specforge_0_2_0.log").read_text())
    train = [r for r in t.records if r.phase == "train"]
    evals = [r for r in t.records if r.phase == "eval"]
    assert [(r.unit, r.index) for r in train] == [("step", 50), ("step", 100), ("step", 150), ("step", 200)]
    assert sorted(train[0].acc) == list(range(7)) and train[0].step0_acc == 0.37 and train[0].ploss[0] == 2.15
    assert train[0].metrics["lr"] == 5e-05 and train[0].metrics["perf/optimizer_step_time_s"] == 0.7
    assert train[2].loss < train[0].loss and train[2].acceptance_length > train[0].acceptance_length
    assert 1 not in train[3].acc and train[3].acc[0] == 0.6937  # `nan` (not a literal) is skipped
    assert [r.index for r in evals] == [100] and evals[0].acc[1] == 0.4698 and evals[0].ploss[0] == 1.626
    assert evals[0].metrics["eval/simulated_acc_len"] == 2.9 and t.latest("train").index == 200
    assert t.steps == []  # 0.2.0 draws no tqdm bar off a terminal
    assert t.to_dict()["format"] == "specforge"


def test_specforge_0_2_0_tracker_namespaced_keys_read_the_same():
    """With `tracking.report_to` set, keys carry `train/` and lists are flattened to `name/i`."""
    plain = logparse.parse_training((DATA / "specforge_0_2_0.log").read_text())
    tracked = logparse.parse_training((DATA / "specforge_0_2_0_tracker.log").read_text())
    assert [(r.phase, r.index) for r in tracked.records] == [("train", 50), ("train", 100), ("eval", 100)]
    for a, b in zip(tracked.records, plain.records[:3]):
        assert (a.acc, a.ploss, a.metrics.get("lr")) == (b.acc, b.ploss, b.metrics.get("lr"))


def test_the_0_2_0_samples_are_byte_for_byte_what_specforge_0_2_0_prints():
    """Each metrics line of the samples, re-printed by SpecForge 0.2.0's own console logger."""
    import contextlib
    import io

    pytest.importorskip("specforge")
    from specforge.training.assembly import _logger

    for name in ("specforge_0_2_0.log", "specforge_0_2_0_tracker.log"):
        for line in (DATA / name).read_text().splitlines():
            if not line.startswith("step "):
                continue
            step, _, text = line.partition(": ")
            metrics = {k: float("nan") if v is None else v for k, v in logparse.step_metrics(text).items()}
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                _logger(metrics, int(step.split()[1]))
            assert out.getvalue() == line + "\n"


def test_train_eagle3_progress_bar_gives_one_point_per_step_across_carriage_returns():
    t = logparse.parse_training((DATA / "specforge_train_eagle3_tqdm.log").read_text())
    assert [(p.epoch, p.step) for p in t.steps] == [(0, 1), (0, 2), (0, 3), (0, 4), (1, 1), (1, 2), (1, 3), (1, 4)]
    assert t.steps[0].loss == 2.7 and t.steps[-1].acc == 0.6
    assert t.records == []
    assert t.to_dict()["format"] == "specforge"


# --------------------------------------------------------------------------- pull plan


def _chunk(inode, size, start, data):
    return fetch.FileChunk(inode, size, start, data)


def test_chunks_append_and_the_cursor_advances(tmp_path):
    local = tmp_path / "x.log"
    cur, reason = logs.apply_chunk(local, logparse.FileCursor(), _chunk("7", 6, 0, b"hello\n"))
    cur, reason = logs.apply_chunk(local, cur, _chunk("7", 12, 6, b"world\n"))
    assert local.read_bytes() == b"hello\nworld\n" and cur.offset == 12 and reason is None
    assert cur.head and cur.inode == "7"


def test_a_rotated_file_keeps_the_old_copy_and_starts_over(tmp_path):
    local = tmp_path / "x.log"
    cur, _ = logs.apply_chunk(local, logparse.FileCursor(), _chunk("7", 6, 0, b"hello\n"))
    cur, reason = logs.apply_chunk(local, cur, _chunk("8", 4, 0, b"new\n"))
    assert reason == "rotated" and cur.generation == 1
    assert local.read_bytes() == b"new\n" and (tmp_path / "x.log.1").read_bytes() == b"hello\n"


def test_a_truncated_file_is_noticed(tmp_path):
    cur = logparse.FileCursor("7", 100, 0, "abc")
    assert logparse.reset_needed(cur, "7", 10) == "truncated"
    assert logparse.reset_needed(cur, "7", 150) is None


def test_bytes_a_crash_left_after_the_saved_cursor_are_replaced(tmp_path):
    local = tmp_path / "x.log"
    local.write_bytes(b"hello\nGARBAGE")  # written, cursor never saved
    cur = logparse.FileCursor("7", 6, 0, "")
    cur, _ = logs.apply_chunk(local, cur, _chunk("7", 12, 6, b"world\n"))
    assert local.read_bytes() == b"hello\nworld\n"


def test_state_round_trips_and_a_torn_state_file_means_start_over(tmp_path):
    st = logs.PullState()
    st.files["training"] = logparse.FileCursor("1", 5, 0, "h")
    path = tmp_path / "s.json"
    st.save(path)
    assert logs.PullState.load(path).files["training"].offset == 5
    path.write_text("{torn")
    assert logs.PullState.load(path).files == {}


def test_fetch_output_is_byte_exact_through_gzip_and_base64():
    import base64
    import gzip

    payload = bytes(range(256)) * 3
    out = "11 900 100 768\n" + base64.b64encode(gzip.compress(payload)).decode()
    chunk = fetch.parse_file_fetch(out)
    assert chunk == fetch.FileChunk("11", 900, 100, payload)
    assert fetch.parse_file_fetch("missing\n") is None
    with pytest.raises(ValueError):
        fetch.parse_file_fetch("11 900 100 5\n" + base64.b64encode(gzip.compress(b"abc")).decode())


def test_server_lines_already_pulled_at_the_last_timestamp_are_skipped():
    lines = ["2026-01-01T00:00:01.1Z a", "2026-01-01T00:00:02.2Z b", "2026-01-01T00:00:02.2Z c"]
    fresh, cur = logparse.new_server_lines(logparse.ServerCursor(), "cid", lines, None)
    assert fresh == lines and cur.last_ts == "2026-01-01T00:00:02.2Z" and cur.lines_at_last_ts == 2
    again = lines[1:] + ["2026-01-01T00:00:03.0Z d"]  # docker's --since is inclusive
    fresh, cur = logparse.new_server_lines(cur, "cid", again, None)
    assert fresh == ["2026-01-01T00:00:03.0Z d"] and cur.lines_at_last_ts == 1


def test_a_new_container_starts_a_new_generation():
    cur = logparse.ServerCursor("old", "2026-01-01T00:00:02Z", 1, 0)
    fresh, cur = logparse.new_server_lines(cur, "new", ["2026-01-01T00:00:00Z x"], None)
    assert fresh == ["2026-01-01T00:00:00Z x"] and cur.generation == 1 and cur.container_id == "new"


def test_follow_command_tags_each_source_and_quotes_paths():
    from remote_ops.core.inventory import HostSpec

    spec = HostSpec(name="h", logs={"extraction": "/data/a b.log"}, container={"name": "c1"})
    cmd = logs.follow_command(spec, ("server", "extraction"), None, 5, duration=60)
    assert cmd.startswith("timeout -k 2 60 sh -c ")
    assert "docker logs -f --tail 5 c1" in cmd and "/data/a b.log" in cmd
    assert "s/^/server|/" in cmd and "s/^/extraction|/" in cmd
    assert logparse.split_tagged("extraction|hello|x") == ("extraction", "hello|x")
    assert logparse.split_tagged("plain") == ("remote", "plain")


def test_unknown_log_kind_is_a_usage_error():
    from remote_ops.core.inventory import HostSpec
    from remote_ops.errors import UsageError

    with pytest.raises(UsageError):
        logparse.log_sources(HostSpec(name="h"), ("nope",))


def test_extraction_points_for_plots():
    pts = logparse.extraction_points((DATA / "extraction.log").read_text())
    assert pts[0] == (0.0, 0, 0) and pts[2] == (10.0, 6, 10380)
