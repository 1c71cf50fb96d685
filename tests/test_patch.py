"""patch check/apply/verify/revert/status on local files (LocalRemote runs the same shell scripts)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from remote_ops import wheels
from remote_ops.cli.main import main
from remote_ops.core import anchors
from remote_ops.errors import Refused, VerifyFailed
from remote_ops.workflows import patching

DSV2 = "python/sglang/srt/models/deepseek_v2.py"

SHA_059 = "4071b9a6a6ac71e1143204708df42f2ba5bd163a5d7a020579242df56e490a35"
LOGITS = b"        self.logits_processor = LogitsProcessor(config)\n"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def original() -> bytes:
    return wheels.sglang_source("0.5.9", DSV2)


@pytest.fixture
def target_file(tmp_path, original) -> Path:
    path = tmp_path / "deepseek_v2.py"
    path.write_bytes(original)
    return path


@pytest.fixture
def checkout(tmp_path) -> Path:
    """A checkout layout (python/sglang/...) unpacked from the real 0.5.9 wheel."""
    root = tmp_path / "sglang"
    wheels.unpack_python_tree(wheels.fetch_sglang_wheel("0.5.9"), root)
    return root


def local(path) -> tuple[patching.LocalRemote, patching.PatchTarget]:
    return patching.LocalRemote(), patching.PatchTarget.local(path)


# ------------------------------------------------------------------- workflow
def test_apply_verify_reapply_revert(target_file, original):
    remote, target = local(target_file)
    report = patching.check(remote, target)
    assert report.ok and report.sglang_version == "0.5.9" and [a.line for a in report.anchors] == [2837, 2923]
    assert remote.round_trips == 1

    result = patching.apply(remote, target)
    assert result.action == "applied" and result.round_trips == 2
    assert result.verify.ok and result.verify.compile_ok
    patched = target_file.read_bytes()
    assert sha(patched) == result.sha_after and result.backup_sha256 == SHA_059
    backup = Path(str(target_file) + patching.BACKUP_SUFFIX)
    assert backup.read_bytes() == original
    assert Path(f"{backup}.sha256").read_text().split()[0] == SHA_059

    again = patching.apply(remote, target)
    assert again.action == "noop" and again.round_trips == 1 and target_file.read_bytes() == patched

    verified = patching.verify(remote, target)
    assert verified.ok and verified.compile_ok is True

    st = patching.status(remote, target)
    assert st.status == "applied" and st.pristine_sha256 == SHA_059 and st.backup_sha256 == SHA_059

    reverted = patching.revert(remote, target)
    assert reverted.action == "reverted" and reverted.identical and target_file.read_bytes() == original
    assert not backup.exists()
    assert sorted(p.name for p in target_file.parent.iterdir()) == ["deepseek_v2.py"]


def test_dry_run_changes_nothing(target_file, original):
    remote, target = local(target_file)
    result = patching.apply(remote, target, dry_run=True)
    assert result.action == "dry_run" and target_file.read_bytes() == original
    assert "+        import os as _ro_os" in result.diff and result.diff.startswith("--- a/")
    assert result.round_trips == 1


def test_mode_and_owner_kept(target_file):
    os.chmod(target_file, 0o640)
    if os.geteuid() == 0:
        os.chown(target_file, 65534, 65534)
    remote, target = local(target_file)
    patching.apply(remote, target)
    st = target_file.stat()
    assert st.st_mode & 0o7777 == 0o640
    if os.geteuid() == 0:
        assert (st.st_uid, st.st_gid) == (65534, 65534)


def test_version_from_checkout_and_gate(checkout):
    path = checkout / "python/sglang/srt/models/deepseek_v2.py"
    remote, target = local(path)
    assert target.checkout == str(checkout)
    report = patching.check(remote, target)
    assert (report.sglang_version, report.version_source) == ("0.5.9", "python/sglang/_version.py")
    (checkout / "python/sglang/_version.py").write_text("__version__ = version = '0.5.6'\n")
    refused = patching.check(remote, target)
    assert refused.refusal["reason"] == "version_not_validated"
    with pytest.raises(Refused) as info:
        patching.apply(remote, target)
    assert info.value.exit_code == 9
    assert patching.apply(remote, target, force=True).action == "applied"


def test_force_does_not_override_anchor_refusal(tmp_path, original):
    path = tmp_path / "deepseek_v2.py"
    path.write_bytes(
        original.replace(
            b"        self.capture_aux_hidden_states = False\n",
            b"        self.capture_aux_hidden_states = False\n" * 2,
            1,
        )
    )
    with pytest.raises(Refused) as info:
        patching.apply(*local(path), force=True)
    assert info.value.details["reason"] == "ambiguous"
    assert path.read_bytes() != b"" and "ambiguous" in json.dumps(info.value.to_dict())


def test_failed_verification_restores_backup(target_file, original, monkeypatch):
    real = patching.verify_bytes

    def failing(*args, **kwargs):
        result = real(*args, **kwargs)
        result.status = anchors.MISPLACED
        return result

    monkeypatch.setattr(patching, "verify_bytes", failing)
    with pytest.raises(VerifyFailed) as info:
        patching.apply(*local(target_file))
    assert "restored" in info.value.message
    assert target_file.read_bytes() == original


def test_py_compile_failure_leaves_file_unchanged(target_file, original, monkeypatch):
    remote, target = local(target_file)
    with pytest.raises(VerifyFailed):
        patching._write(
            remote,
            target,
            SHA_059,
            b"def broken(:\n",
            backup="make",
            lock=True,
            what="test",
            new_sha=sha(b"def broken(:\n"),
        )
    assert target_file.read_bytes() == original


def test_write_refuses_when_file_changed_since_read(target_file):
    remote, target = local(target_file)
    with pytest.raises(Refused) as info:
        patching._write(
            remote, target, "0" * 64, b"x = 1\n", backup="make", lock=True, what="t", new_sha=sha(b"x = 1\n")
        )
    assert info.value.details["reason"] == "changed_since_read"


def test_lock_held_by_live_process_refuses(target_file, original, monkeypatch):
    remote, target = local(target_file)
    lock = Path(target.lock_dir)
    lock.mkdir()
    (lock / "info").write_text(f"pid={os.getpid()}\nwho=test\nwhen=now\nwhat=holding\n")
    monkeypatch.setattr(patching, "LOCK_WAIT_S", 1.0)
    with pytest.raises(Refused) as info:
        patching.apply(remote, target)
    assert info.value.details["reason"] == "lock_held" and "holding" in info.value.message
    assert target_file.read_bytes() == original


def test_stale_lock_of_dead_pid_is_broken(target_file):
    remote, target = local(target_file)
    dead = subprocess.Popen(["true"])
    dead.wait()
    lock = Path(target.lock_dir)
    lock.mkdir()
    (lock / "info").write_text(f"pid={dead.pid}\nwho=crashed\n")
    assert patching.apply(remote, target).action == "applied"
    assert not lock.exists()


def test_revert_refuses_when_changed_outside_blocks(target_file, original):
    remote, target = local(target_file)
    patching.apply(remote, target)
    target_file.write_bytes(target_file.read_bytes().replace(b"# Copyright", b"# Copyleft", 1))
    with pytest.raises(Refused) as info:
        patching.revert(remote, target)
    assert info.value.details["reason"] == "not_identical"
    restored = patching.revert(remote, target, from_backup=True)
    assert restored.identical and target_file.read_bytes() == original


def test_crlf_file_round_trip(tmp_path, original):
    path = tmp_path / "deepseek_v2.py"
    crlf = original.replace(b"\n", b"\r\n")
    path.write_bytes(crlf)
    remote, target = local(path)
    assert patching.apply(remote, target, force=True).action == "applied"
    assert b"\n" not in path.read_bytes().replace(b"\r\n", b"")
    assert patching.revert(remote, target).identical and path.read_bytes() == crlf


# -------------------------------------------------------------------- the CLI
def test_cli_end_to_end_local(target_file, original, capsys):
    f = str(target_file)
    assert main(["patch", "check", "--local-file", f]) == 0
    assert main(["patch", "apply", "--local-file", f, "--dry-run"]) == 0
    assert target_file.read_bytes() == original
    assert main(["patch", "apply", "--local-file", f, "--diff"]) == 0
    capsys.readouterr()
    assert main(["patch", "status", "--local-file", f, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "applied"
    assert main(["patch", "verify", "--local-file", f]) == 0
    assert main(["patch", "revert", "--local-file", f]) == 0
    assert target_file.read_bytes() == original


def test_cli_story_misplaced_file_fails_verify(target_file, original, capsys):
    """Block right after the logits_processor line: verify exits 10 and shows the lines."""
    patched = anchors.plan(original, patching.PatchTarget.local(target_file).spec()).new_text.encode()
    lines = patched.split(b"\n")
    block = lines[2837:2843]
    del lines[2837:2843]
    lines[2828:2828] = block
    target_file.write_bytes(b"\n".join(lines))
    assert main(["patch", "verify", "--local-file", str(target_file)]) == 10
    err = capsys.readouterr().err
    assert "misplaced" in err and "2828" in err and "logits_processor" in err
    assert main(["patch", "status", "--local-file", str(target_file)]) == 10


def test_cli_refusals_exit_9(tmp_path):
    old = tmp_path / "deepseek_v2.py"
    old.write_bytes(wheels.sglang_source("0.5.4.post1", DSV2))
    assert main(["patch", "check", "--local-file", str(old), "--force"]) == 9
    assert main(["patch", "apply", "--local-file", str(old), "--force"]) == 9
    assert old.read_bytes() == wheels.sglang_source("0.5.4.post1", DSV2)


def test_cli_unknown_version_needs_force(target_file, original, capsys):
    target_file.write_bytes(original + b"# local edit\n")
    assert main(["patch", "check", "--local-file", str(target_file), "--json"]) == 9
    assert json.loads(capsys.readouterr().out)["reason"] == "version_unknown"
    assert main(["patch", "apply", "--local-file", str(target_file), "--force"]) == 0


# --------------------------------------------------------------- atomicity
@pytest.mark.slow
def test_kill_9_during_apply_leaves_original_or_patched(target_file, original):
    """SIGKILL the whole apply (python + sh + cp/mv) at random points, 12 times."""
    spec = patching.PatchTarget.local(target_file).spec()
    patched_sha = sha(anchors.plan(original, spec).new_text.encode())
    argv = [sys.executable, "-m", "remote_ops", "patch", "apply", "--local-file", str(target_file), "-q"]
    start = time.monotonic()
    subprocess.run(argv, check=True, timeout=60)
    whole = time.monotonic() - start  # one unkilled run: kill points spread over all of it
    rng = random.Random(1234)
    seen = set()
    for i in range(12):
        target_file.write_bytes(original)
        proc = subprocess.Popen(argv, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(whole * (0.4 + 0.7 * rng.random()))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        now = sha(target_file.read_bytes())
        assert now in (SHA_059, patched_sha), f"kill {i}: file is neither original nor patched"
        seen.add(now)
    print(f"apply took {whole:.2f}s; states seen after kill -9: {sorted(x[:12] for x in seen)}")
    # a later apply still works (stale lock of a dead pid broken, stale temp files removed)
    assert patching.apply(*local(target_file)).verify.ok
    leftovers = [p.name for p in target_file.parent.iterdir() if ".remote-ops-tmp." in p.name]
    assert leftovers == []
