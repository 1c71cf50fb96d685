"""Every patch spec on the real model files of several SGLang releases (PyPI wheels, cached).

For each spec x release: apply, verify, compile, revert byte-identical (pure
anchors), and once per spec the whole local workflow (`patch apply/verify/revert
--local-file`, class auto-detected).  Mutations of the real files (a duplicated
anchor, the block moved after the logits_processor line, the unpack removed from
forward) are refused or caught.  A spec folder written to a temp dir and put on
$REMOTE_OPS_PATCH_PATH patches a model no bundled spec covers, with no Python change.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from remote_ops import wheels
from remote_ops.cli.main import main
from remote_ops.core import anchors as A, patchspec
from remote_ops.errors import Refused
from remote_ops.workflows import patching

RELEASES = ["0.5.5", "0.5.9", "0.5.14", "0.5.23"]
SPECS = [m.name for m in patchspec.catalog()]
CASES = [(n, v) for n in SPECS for v in RELEASES if v in patchspec.model(n).versions]


def source(name: str, version: str) -> str:
    return wheels.sglang_source(version, patchspec.resolve(name).target).decode()


def test_every_spec_has_three_releases_here():
    for name in SPECS:
        assert len([v for n, v in CASES if n == name]) >= 3, name


# ------------------------------------------------------------ real files, pure
@pytest.mark.parametrize("name,version", CASES)
def test_apply_verify_compile_revert(name, version):
    spec = patchspec.resolve(name)
    text = source(name, version)
    assert A.pick_class(text) == spec.model_class
    plan = A.plan(text, spec)
    init, fwd = plan.anchors
    assert init.scope == f"{spec.model_class}.__init__" and fwd.scope == f"{spec.model_class}.forward"
    assert A.verify_placement(plan.new_text, spec).status == A.APPLIED
    compile(plan.new_text, spec.target, "exec")  # what py_compile does
    assert A.strip(plan.new_text, spec) == text  # revert: byte-identical
    assert A.plan(plan.new_text, spec).changes is False  # re-apply: no-op


@pytest.mark.parametrize("name,version", CASES)
def test_known_sha_names_the_release(name, version):
    import hashlib

    spec = patchspec.resolve(name)
    assert patchspec.version_for_sha(spec, hashlib.sha256(source(name, version).encode()).hexdigest()) == version


# ------------------------------------------------------------------ mutations
def _init_stmt(text: str, cls: str, attr: str) -> ast.stmt:
    """The direct statement of cls.__init__ assigning `self.<attr>`."""
    node = next(n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ClassDef) and n.name == cls)
    init = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return next(
        s for s in init.body if isinstance(s, ast.Assign) and any(A.dotted(t) == f"self.{attr}" for t in s.targets)
    )


@pytest.mark.parametrize("name", SPECS)
def test_duplicated_anchor_refused(name):
    spec, text = patchspec.resolve(name), source(name, "0.5.9")
    lines = text.splitlines(True)
    flag = _init_stmt(text, spec.model_class, "capture_aux_hidden_states")
    lines.insert(flag.end_lineno, lines[flag.lineno - 1])
    with pytest.raises(A.AnchorRefusal) as info:
        A.plan("".join(lines), spec)
    assert info.value.reason == "ambiguous" and info.value.lines == [flag.lineno, flag.lineno + 1]


@pytest.mark.parametrize("name", SPECS)
def test_block_moved_after_logits_processor_caught(name):
    """The story's bug on every model: the init block before the flag reset is misplaced;
    apply moves our marked block back, and refuses a hand-made (unmarked) copy."""
    spec, text = patchspec.resolve(name), source(name, "0.5.9")
    patched = A.plan(text, spec).new_text
    lines = patched.splitlines(True)
    begin = next(i for i, ln in enumerate(lines) if re.search(r"# >>> remote-ops:[\w.-]+:init ", ln))
    end = next(i for i in range(begin, len(lines)) if "# <<< remote-ops:" in lines[i])
    block = lines[begin : end + 1]
    del lines[begin : end + 1]
    logits = _init_stmt("".join(lines), spec.model_class, "logits_processor")
    lines[logits.end_lineno : logits.end_lineno] = block
    moved = "".join(lines)
    report = A.verify_placement(moved, spec)
    assert report.status == A.MISPLACED
    assert any("runs before the reset" in f.message for f in report.findings)
    repaired = A.plan(moved, spec)  # our marked block: apply puts it back after the flag
    assert repaired.state == A.MISPLACED and A.verify_placement(repaired.new_text, spec).status == A.APPLIED
    unmarked = "".join(ln for ln in lines if "remote-ops:" not in ln)  # a hand copy: refused
    with pytest.raises(A.AnchorRefusal) as info:
        A.plan(unmarked, spec)
    assert info.value.reason in ("capture_before_reset", "unmarked_block")


@pytest.mark.parametrize("name", SPECS)
def test_missing_unpack_in_forward_refused(name):
    spec, text = patchspec.resolve(name), source(name, "0.5.9")
    unpack = (
        "        if self.capture_aux_hidden_states:\n            hidden_states, aux_hidden_states = hidden_states\n"
    )
    cls_at = text.index(f"class {spec.model_class}(")
    at = text.index(unpack, cls_at)
    mutated = text[:at] + text[at + len(unpack) :]
    with pytest.raises(A.AnchorRefusal) as info:
        A.plan(mutated, spec)
    assert info.value.reason == "not_found" and f"{spec.model_class}.forward" in info.value.message


def test_old_release_without_capture_refused():
    """minimax_m2.py of 0.5.5 exists but has no EAGLE-3 capture: refused, never patched near."""
    text = source("minimax-m2", "0.5.5")
    with pytest.raises(A.AnchorRefusal) as info:
        A.plan(text, patchspec.resolve("minimax-m2"))
    assert info.value.reason == "not_found"
    with pytest.raises(A.AnchorRefusal) as info:
        A.pick_class(text)
    assert info.value.reason == "no_capture_class"


def test_two_flag_assignments_in_one_init_refused():
    """qwen3_vl.py of 0.5.23 resets the flag twice in one __init__: ambiguous, refused."""
    text = wheels.sglang_source("0.5.23", "python/sglang/srt/models/qwen3_vl.py")
    assert [c for c, _ in A.capture_classes(text)] == ["Qwen3VLForConditionalGeneration"] * 2


# -------------------------------------------------- local workflow, detection
@pytest.mark.parametrize("name", SPECS)
def test_local_workflow_autodetects_class(tmp_path, name):
    spec = patchspec.resolve(name)
    original = wheels.sglang_source("0.5.9", spec.target)
    path = tmp_path / Path(spec.target).name
    path.write_bytes(original)
    target = patching.PatchTarget.local(path)
    assert (target.spec_name, target.model_class) == (name, spec.model_class)
    remote = patching.LocalRemote()
    check = patching.check(remote, target)
    assert check.ok and check.sglang_version == "0.5.9"
    assert patching.apply(remote, target).action == "applied"
    result = patching.verify(remote, target)
    assert result.ok and result.compile_ok
    reverted = patching.revert(remote, target)
    assert reverted.identical and path.read_bytes() == original


def test_cli_patch_local_file_llama(tmp_path, capsys):
    path = tmp_path / "llama.py"
    path.write_bytes(wheels.sglang_source("0.5.14", "python/sglang/srt/models/llama.py"))
    assert main(["patch", "apply", "--local-file", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [a["scope"] for a in doc["check"]["anchors"]] == ["LlamaForCausalLM.__init__", "LlamaForCausalLM.forward"]
    assert main(["patch", "status", "--local-file", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "applied"
    assert main(["patch", "revert", "--local-file", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["identical"] is True


def test_several_capture_classes_refused_and_listed(tmp_path, capsys):
    """gemma3_causal.py (0.5.23) has two: refused with both named; --model-class picks,
    and then the refusal is that no spec covers the class (nothing is guessed)."""
    path = tmp_path / "gemma3_causal.py"
    path.write_bytes(wheels.sglang_source("0.5.23", "python/sglang/srt/models/gemma3_causal.py"))
    assert main(["patch", "check", "--local-file", str(path)]) == 9
    err = capsys.readouterr().err
    assert "Gemma3ForCausalLM (line 758)" in err and "EmbeddingGemmaModel (line 982)" in err
    with pytest.raises(Refused) as info:
        patching.PatchTarget.local(path, "Gemma3ForCausalLM")
    assert info.value.details["reason"] == "no_spec"


def test_unknown_model_class_refused(tmp_path):
    path = tmp_path / "llama.py"
    path.write_bytes(wheels.sglang_source("0.5.9", "python/sglang/srt/models/llama.py"))
    with pytest.raises(Refused) as info:
        patching.PatchTarget.local(path, "Phi3ForCausalLM")  # a subclass: no flag reset of its own
    assert info.value.details["reason"] == "no_class"


# -------------------------------------------------- a new spec, no Python change
NEW_SPEC = {
    "extends": "eagle3-hs-dump",
    "models": [
        {
            "name": "gemma3",
            "title": "Gemma 3 (text)",
            "file": "python/sglang/srt/models/gemma3_causal.py",
            "class": "Gemma3ForCausalLM",
            "architectures": ["Gemma3ForCausalLM"],
            "known_sha256": {},
        }
    ],
}


def test_new_spec_folder_on_patch_path(tmp_path, monkeypatch, capsys):
    """A spec folder in a temp dir, on $REMOTE_OPS_PATCH_PATH, patches gemma3_causal.py (0.5.23)."""
    import hashlib

    data = wheels.sglang_source("0.5.23", NEW_SPEC["models"][0]["file"])
    spec_doc = json.loads(json.dumps(NEW_SPEC))
    spec_doc["models"][0]["known_sha256"] = {"0.5.23": hashlib.sha256(data).hexdigest()}
    folder = tmp_path / "specs" / "gemma-hooks"
    folder.mkdir(parents=True)
    (folder / "spec.json").write_text(json.dumps(spec_doc))
    monkeypatch.setenv(patchspec.PATH_ENV, str(tmp_path / "specs"))

    assert main(["patch", "specs", "--json"]) == 0
    assert "gemma3" in [s["spec"] for s in json.loads(capsys.readouterr().out)]
    path = tmp_path / "gemma3_causal.py"
    path.write_bytes(data)
    args = ["--local-file", str(path), "--model-class", "Gemma3ForCausalLM"]
    assert main(["patch", "apply", *args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["action"] == "applied" and doc["check"]["sglang_version"] == "0.5.23"
    assert [a["line"] for a in doc["check"]["anchors"]] == [758, 784]
    assert main(["patch", "verify", *args]) == 0
    assert main(["patch", "revert", *args]) == 0
    assert path.read_bytes() == data


def test_duplicate_spec_name_is_a_config_error(tmp_path, monkeypatch):
    folder = tmp_path / "again"
    folder.mkdir()
    (folder / "spec.json").write_text(
        json.dumps(
            {
                "extends": "eagle3-hs-dump",
                "models": [{"name": "llama", "file": "python/sglang/srt/models/llama.py", "class": "LlamaForCausalLM"}],
            }
        )
    )
    monkeypatch.setenv(patchspec.PATH_ENV, str(tmp_path))
    assert main(["patch", "specs"]) == 3


# ------------------------------------------------------- derivation on a host
@pytest.mark.parametrize(
    "arch,name",
    [
        ("KimiK25ForConditionalGeneration", "deepseek-v2"),
        ("DeepseekV3ForCausalLM", "deepseek-v2"),
        ("Qwen3MoeForCausalLM", "qwen3-moe"),
        ("Phi3ForCausalLM", "llama"),
        ("GptOssForCausalLM", "gpt-oss"),
    ],
)
def test_spec_from_architectures(arch, name):
    d = patchspec.for_architectures([arch], "/m/config.json")
    assert d.spec == name and "architectures[0] = " + arch in d.detail


def test_unknown_architecture_refused():
    with pytest.raises(Refused) as info:
        patchspec.for_architectures(["MambaForCausalLM"])
    assert info.value.details["reason"] == "no_spec" and "LlamaForCausalLM -> llama" in info.value.message


def test_host_spec_derived_from_config_json(tmp_path):
    """Through a real shell (LocalRemote): the host's config.json picks the spec and its target."""
    from remote_ops.core.inventory import parse_inventory_data

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    host = parse_inventory_data(
        {
            "hosts": {
                "h": {"address": "127.0.0.1", "model": {"path": str(tmp_path)}, "sglang": {"checkout": "/srv/sglang"}}
            }
        },
        "t.yaml",
    )[0]
    bound, derivation = patching.bind_host(patching.LocalRemote(), host)
    assert derivation.how == "config.json" and bound.sglang.patch == "llama"
    assert bound.sglang.target_file == "/srv/sglang/python/sglang/srt/models/llama.py"
    assert patching.PatchTarget.for_host(bound).path == bound.sglang.target_file
    (tmp_path / "config.json").unlink()
    with pytest.raises(Refused) as info:
        patching.bind_host(patching.LocalRemote(), host)
    assert info.value.details["reason"] == "no_model_config"


def test_inventory_rejects_unknown_spec():
    from remote_ops.core.inventory import parse_inventory_data
    from remote_ops.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        parse_inventory_data({"hosts": {"h": {"address": "127.0.0.1", "sglang": {"patch": "llama-9"}}}}, "t.yaml")
    assert "sglang.patch" in str(info.value) and "unknown patch spec 'llama-9'" in str(info.value)


# ------------------------------------------------------- verify in the image
def test_verify_patch_in_image_reads_the_target_from_the_spec(tmp_path):
    """docker/verify_patch.py, as the image runs it: the installed sglang's qwen3_moe.py, found
    from the shipped (bound) spec; ok only once it is patched and has the expected sha."""
    import hashlib
    import subprocess
    import sys

    from remote_ops.paths import repo_resource

    spec = patchspec.resolve("qwen3-moe")
    tool = tmp_path / "tool"
    tool.mkdir()
    (tool / "anchors.py").write_bytes(Path(A.__file__).read_bytes())
    (tool / "verify_patch.py").write_bytes(repo_resource("docker", "verify_patch.py").read_bytes())
    (tool / "patch-spec.json").write_text(patchspec.bundled_json(spec))
    site = tmp_path / "site"
    (site / "sglang/srt/models").mkdir(parents=True)
    (site / "sglang/__init__.py").write_text("")
    target = site / "sglang/srt/models/qwen3_moe.py"
    original = source("qwen3-moe", "0.5.9")
    target.write_text(original)

    def run(expect):
        proc = subprocess.run(
            [sys.executable, str(tool / "verify_patch.py"), "--expect-sha256", expect],
            capture_output=True,
            text=True,
            env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        )
        return proc.returncode, json.loads(proc.stdout)

    rc, out = run("0" * 64)
    assert rc == 1 and out["file"] == str(target) and "anchor verification failed" in out["reason"]
    new = A.plan(original, spec).new_text
    target.write_text(new)
    rc, out = run(hashlib.sha256(new.encode()).hexdigest())
    assert rc == 0 and out["ok"] and out["verify"]["status"] == "applied"


# --------------------------------------------- the architectures table, checked
def _classes(version: str) -> dict:
    """class name -> (ClassDef, file) over every model file of the release."""
    import zipfile

    out = {}
    with zipfile.ZipFile(wheels.fetch_sglang_wheel(version)) as zf:
        for member in zf.namelist():
            if member.startswith("sglang/srt/models/") and member.endswith(".py"):
                text = zf.read(member).decode("utf-8", "replace")
                try:
                    tree = ast.parse(text)
                except SyntaxError:  # a file needing a newer Python than this one
                    continue
                for node in tree.body:
                    if isinstance(node, ast.ClassDef):
                        out.setdefault(node.name, (node, member))
    return out


def _serves(classes: dict, arch: str, cls: str) -> str:
    """How `arch` runs the patched class: itself, a subclass that keeps its __init__ and
    forward, or a wrapper whose __init__ builds one; "" when it does not."""

    def keeps(name, seen=()):
        if name == cls:
            return True
        node = classes.get(name, (None,))[0]
        if node is None or name in seen:
            return False
        own = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
        bases = [A.dotted(b) for b in node.bases]
        return not own & {"__init__", "forward"} and any(keeps(b, seen + (name,)) for b in bases)

    if keeps(arch):
        return "class" if arch == cls else "subclass"
    node = classes.get(arch, (None,))[0]
    init = next(
        (n for n in (node.body if node else []) if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None
    )
    built = (
        [A.dotted(s.value.func) for s in ast.walk(init) if isinstance(s, ast.Assign) and isinstance(s.value, ast.Call)]
        if init
        else []
    )
    return "wrapper" if any(b and keeps(b) for b in built) else ""


@pytest.mark.parametrize("version", ["0.5.9", "0.5.23"])
def test_every_listed_architecture_runs_the_patched_class(version):
    """The derivation table is checked, not guessed: each architecture a spec lists is
    the class, a subclass keeping its __init__/forward, or a wrapper building one."""
    classes = _classes(version)
    for m in patchspec.catalog():
        for arch in m.architectures:
            assert _serves(classes, arch, m.cls), f"{version}: {arch} does not run {m.cls} ({m.name})"
    assert _serves(classes, "KimiK25ForConditionalGeneration", "DeepseekV2ForCausalLM") == "wrapper"
