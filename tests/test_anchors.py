"""Syntax-tree anchors on the real SGLang deepseek_v2.py (PyPI wheels) and mutated copies."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from remote_ops import wheels
from remote_ops.core import anchors as A, patchspec

DSV2 = "python/sglang/srt/models/deepseek_v2.py"

FLAG = "        self.capture_aux_hidden_states = False\n"
LOGITS = "        self.logits_processor = LogitsProcessor(config)\n"
# (release, flag line in __init__, `if self.capture_aux_hidden_states:` line in forward)
RELEASES = [
    ("0.5.5", 3050, 3105),
    ("0.5.8", 2817, 2901),
    ("0.5.9", 2837, 2923),
    ("0.5.14", 2631, 2759),
    ("0.5.23", 3310, 3418),
]


@pytest.fixture(scope="module")
def spec():
    return patchspec.load("deepseek-v2")


@pytest.fixture(scope="module")
def v059() -> str:
    return wheels.sglang_source("0.5.9", DSV2).decode()


def replace_once(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, old
    return text.replace(old, new)


def refusal(text, spec) -> A.AnchorRefusal:
    with pytest.raises(A.AnchorRefusal) as info:
        A.plan(text, spec)
    return info.value


# ---------------------------------------------------------------- real releases
@pytest.mark.parametrize("version,flag_line,if_line", RELEASES)
def test_anchors_found_in_each_release(spec, version, flag_line, if_line):
    text = wheels.sglang_source(version, DSV2).decode()
    plan = A.plan(text, spec)
    init, fwd = plan.anchors
    assert (init.line, init.scope) == (flag_line, "DeepseekV2ForCausalLM.__init__")
    assert (fwd.line, fwd.end, fwd.scope) == (if_line, if_line + 1, "DeepseekV2ForCausalLM.forward")
    assert plan.state == A.NOT_APPLIED and plan.changes
    report = A.verify_placement(plan.new_text, spec)
    assert report.status == A.APPLIED, report.to_dict()
    assert A.strip(plan.new_text, spec) == text


def test_0_5_9_layout(spec, v059):
    """The init block starts on line 2838, right under the flag; logits_processor stays at 2828."""
    new = A.plan(v059, spec).new_text.split("\n")
    assert new[2837 - 1] == FLAG.rstrip("\n")
    assert new[2838 - 1].startswith("        # >>> remote-ops:eagle3-hs-dump:init ")
    assert new[2839 - 1] == "        import os as _ro_os"
    assert new[2828 - 1] == LOGITS.rstrip("\n")
    fwd_begin = next(i for i, ln in enumerate(new, 1) if ":forward " in ln and ">>>" in ln)
    assert new[fwd_begin - 3].strip() == "if self.capture_aux_hidden_states:"
    assert fwd_begin == 2923 + 6 + 2


def test_old_release_refused(spec):
    text = wheels.sglang_source("0.5.4.post1", DSV2).decode()
    exc = refusal(text, spec)
    assert exc.reason == "not_found"
    assert "DeepseekV2ForCausalLM.__init__" in exc.message


def test_reapply_is_noop_and_changed_content_replaced_in_place(spec, v059):
    patched = A.plan(v059, spec).new_text
    again = A.plan(patched, spec)
    assert again.state == A.APPLIED and not again.changes and again.new_text == patched
    old = A.Block(name="init", text='if os.environ.get("OLD"):\n    pass', anchor=spec.blocks[0].anchor)
    old_spec = A.PatchSpec(id=spec.id, target=spec.target, blocks=(old, spec.blocks[1]))
    outdated = A.plan(v059, old_spec).new_text
    assert A.verify_placement(outdated, spec).status == A.OUTDATED
    replaced = A.plan(outdated, spec)
    assert replaced.state == A.OUTDATED and replaced.new_text == patched


# ---------------------------------------------------------------- mutated files
def test_duplicate_anchor_refused(spec, v059):
    exc = refusal(replace_once(v059, FLAG, FLAG + FLAG), spec)
    assert exc.reason == "ambiguous" and exc.lines == [2837, 2838]


def test_anchor_only_in_another_class_refused(spec, v059):
    text = replace_once(v059, FLAG, "        self._flag_moved = None\n")
    text = replace_once(text, "        self.layers_to_capture = []\n", "        self.layers_to_capture = []\n" + FLAG)
    exc = refusal(text, spec)
    assert exc.reason == "wrong_scope"
    assert "DeepseekV2Model.__init__" in exc.message and exc.lines == [2632]


def test_anchor_commented_out_refused(spec, v059):
    exc = refusal(replace_once(v059, FLAG, "        # self.capture_aux_hidden_states = False\n"), spec)
    assert exc.reason == "not_found" and exc.lines == [2837]
    assert "not as code" in exc.message


def test_anchor_nested_refused(spec, v059):
    exc = refusal(replace_once(v059, FLAG, "        if True:\n    " + FLAG), spec)
    assert exc.reason == "nested"


def test_syntax_error_refused(spec, v059):
    exc = refusal(replace_once(v059, LOGITS, "        self.logits_processor = LogitsProcessor(config\n"), spec)
    assert exc.reason == "syntax_error"


def test_binary_refused(spec):
    with pytest.raises(A.AnchorRefusal) as info:
        A.plan(b"\x7fELF\x00\x01", spec)
    assert info.value.reason == "not_text"


def test_crlf_file_keeps_its_line_endings(spec, v059):
    crlf = v059.replace("\n", "\r\n")
    plan = A.plan(crlf.encode(), spec)
    inserted = [ln for ln in plan.new_text.split("\n") if "remote-ops:" in ln]
    assert len(inserted) == 4 and all(ln.endswith("\r") for ln in inserted)
    assert "\n" not in plan.new_text.replace("\r\n", "")
    assert A.verify_placement(plan.new_text, spec).status == A.APPLIED
    assert A.strip(plan.new_text, spec) == crlf
    assert A.plan(plan.new_text, spec).new_text == plan.new_text


def test_story_misplaced_marked_block(spec, v059):
    """The story's bug with markers: block right after logits_processor -> misplaced."""
    good = A.plan(v059, spec).new_text
    lines = good.split("\n")
    block = lines[2838 - 1 : 2843]
    del lines[2838 - 1 : 2843]
    lines[2828:2828] = block
    bad = "\n".join(lines)
    report = A.verify_placement(bad, spec)
    assert report.status == A.MISPLACED
    init = report.blocks[0]
    assert init.state == A.MISPLACED
    text = " ".join(f.message for f in init.findings)
    assert "after line 2828 `self.logits_processor = LogitsProcessor(config)`" in text
    assert "before the reset `self.capture_aux_hidden_states = False` at line 2843" in text
    assert A.plan(bad, spec).new_text == good  # apply moves a marked block to its place


def test_story_misplaced_unmarked_code(spec, v059):
    """The story as typed by hand: capture turned on after logits_processor, reset 9 lines later."""
    bad = replace_once(
        v059,
        LOGITS,
        LOGITS + "        self.capture_aux_hidden_states = True\n        self.model.layers_to_capture = [2, 30, 58]\n",
    )
    report = A.verify_placement(bad, spec)
    assert report.status == A.MISPLACED
    assert {tuple(f.lines) for f in report.findings} >= {(2829, 2839), (2830, 2839)}
    exc = refusal(bad, spec)
    assert exc.reason == "capture_before_reset" and 2839 in exc.lines


def test_hand_modified_block(spec, v059):
    patched = A.plan(v059, spec).new_text
    edited = replace_once(patched, "remote_ops_dump.attach(self)", "remote_ops_dump.attach(self, 1)")
    report = A.verify_placement(edited, spec)
    assert report.status == A.MODIFIED and report.blocks[0].state == A.MODIFIED
    assert refusal(edited, spec).reason == "modified_by_hand"
    assert A.strip(edited, spec) == v059


def test_broken_marker_refused(spec, v059):
    patched = A.plan(v059, spec).new_text
    lines = [ln for ln in patched.split("\n") if not ("<<< remote-ops" in ln and ":init " in ln)]
    assert refusal("\n".join(lines), spec).reason == "broken_markers"


def test_unpatched_and_partial_status(spec, v059):
    assert A.verify_placement(v059, spec).status == A.NOT_APPLIED
    only_init = A.PatchSpec(id=spec.id, target=spec.target, blocks=spec.blocks[:1])
    assert A.verify_placement(A.plan(v059, only_init).new_text, spec).status == A.PARTIAL


def test_scope_of_lines(v059):
    src = A.parse_source(v059)
    scopes = A.scope_of_lines(src)
    assert scopes[2837 - 1] == "DeepseekV2ForCausalLM.__init__"
    assert scopes[2923 - 1] == "DeepseekV2ForCausalLM.forward"
    assert scopes[0] == ""


# ---------------------------------------------------------------- standalone
def test_anchors_py_is_python38_syntax_and_stdlib_only():
    source = Path(A.__file__).read_text()
    ast.parse(source, feature_version=(3, 8))
    imported = {n.names[0].name.split(".")[0] for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Import)}
    imported |= {
        n.module.split(".")[0] for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom) and n.module
    }
    assert imported <= set(sys.stdlib_module_names)


def test_standalone_verify_with_system_python(spec, v059, tmp_path):
    """The file shipped to a host: `python3 anchors.py verify --spec SPEC.json FILE`, outside the package."""
    anchors_py = tmp_path / "anchors.py"
    anchors_py.write_text(Path(A.__file__).read_text())
    spec_json = tmp_path / "spec.json"
    spec_json.write_text(patchspec.bundled_json(spec))
    target = tmp_path / "deepseek_v2.py"
    target.write_text(v059)

    def run(*args):
        proc = subprocess.run(
            ["python3", str(anchors_py), *args, "--spec", str(spec_json), str(target)],
            capture_output=True,
            text=True,
            cwd=tmp_path,
        )
        return proc.returncode, json.loads(proc.stdout)

    rc, out = run("verify")
    assert rc == 10 and out["status"] == "not_applied"
    rc, out = run("apply")
    assert rc == 0 and out["changed"] and out["verify"]["status"] == "applied"
    rc, out = run("verify")
    assert rc == 0 and out["status"] == "applied"
    assert target.read_text() == A.plan(v059, spec).new_text
