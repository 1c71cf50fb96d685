"""patch drift: tree anchor vs `git apply --check` vs GNU `patch --dry-run` on real releases."""

from __future__ import annotations

import json
import shutil

import pytest

from remote_ops.cli.main import main
from remote_ops.core import patchspec
from remote_ops.workflows import drift

pytestmark = pytest.mark.skipif(
    not (shutil.which("git") and shutil.which("patch")), reason="needs git and GNU patch (apt-get install -y patch)"
)


@pytest.fixture(scope="module")
def report() -> drift.DriftReport:
    return drift.drift(["0.5.4.post1", "0.5.5", "0.5.8", "0.5.9", "0.5.14"], patchspec.resolve("deepseek-v2"))


def row(report, version) -> drift.DriftRow:
    return next(r for r in report.rows if r.version == version)


def test_hunk_is_for_0_5_9(report):
    assert report.hunk.startswith("--- a/python/sglang/srt/models/deepseek_v2.py")
    assert "@@ -2835," in report.hunk


def test_base_release_all_three_agree(report):
    r = row(report, "0.5.9")
    assert r.tree.ok and [a.line for a in r.anchors] == [2837, 2923]
    assert r.git_apply.ok and r.git_apply.landed == "applied"
    assert r.gnu_patch.ok and r.gnu_patch.hunks and all(h["offset"] == 0 and h["fuzz"] == 0 for h in r.gnu_patch.hunks)


def test_tree_finds_the_flag_line_in_every_release(report):
    assert [a.line for a in row(report, "0.5.5").anchors][0] == 3050
    assert [a.line for a in row(report, "0.5.8").anchors][0] == 2817
    assert [a.line for a in row(report, "0.5.14").anchors][0] == 2631
    assert row(report, "0.5.14").anchors[0].next_text.startswith("self.dsa_enable_prefill_cp")
    assert row(report, "0.5.5").anchors[0].next_line == 0  # last statement of __init__


def test_gnu_patch_needs_fuzz_and_offset_where_git_apply_rejects(report):
    r = row(report, "0.5.14")
    assert r.git_apply.ok is False and "patch failed" in r.git_apply.summary
    first = r.gnu_patch.hunks[0]
    assert r.gnu_patch.ok and first["offset"] == -206 and first["fuzz"] == 2
    assert "offset -206" in r.gnu_patch.summary and "fuzz 2" in r.gnu_patch.summary


def test_old_release_refused_by_tree(report):
    r = row(report, "0.5.4.post1")
    assert r.tree.ok is False and "not_found" in r.tree.summary and r.anchors == []


def test_render_marks_wrong_landing():
    v = drift.Verdict(True, "#1 succeeded at 2829 (fuzz 2); tree says misplaced", landed="misplaced")
    assert drift._v(v).startswith("WRONG")


def test_cli_drift_json(capsys):
    assert main(["patch", "drift", "--spec", "deepseek-v2", "--versions", "0.5.8,0.5.9", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["version"] for r in doc["rows"]] == ["0.5.8", "0.5.9"]
    assert doc["rows"][0]["gnu_patch"]["hunks"][0]["offset"] == -20


def test_all_specs_table(capsys):
    """spec x release -> anchor lines or the refusal reason, over every bundled spec."""
    assert main(["patch", "drift", "--all-specs", "--versions", "0.5.4.post1,0.5.5,0.5.9", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    cells = {(c["spec"], c["version"]): c for c in doc["cells"]}
    assert cells[("deepseek-v2", "0.5.9")]["summary"] == "2837/2923"
    assert cells[("llama", "0.5.9")]["lines"] == [492, 521]
    assert cells[("deepseek-v2", "0.5.4.post1")]["summary"] == "refused (not_found)"
    assert cells[("minimax-m2", "0.5.5")]["reason"] == "not_found"  # file there, no EAGLE-3 flag yet
    assert {s for s, _ in cells} == {m.name for m in patchspec.catalog()}


def test_drift_needs_a_spec():
    assert main(["patch", "drift", "--versions", "0.5.9"]) == 2
