"""Issue 33, findings 1 and 5: a hostile or broken host cannot make `dumps pull` write outside
`--dest`, and a connection lost during a pull is exit 4 ("connection lost"), its `.part` kept and
resumed by the next pull.

The hostile entries are made on a real lab host's dump dir (the lab hosts share this machine's
filesystem: written directly, as `test_fleet_dumps.py` does), the faults are the lab's real ones
(sshd killed mid-stream, the port refusing), and the CLI runs as a subprocess where the exit code
and the message are what is tested.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from remote_ops.errors import ExitCode, Unreachable
from remote_ops.remote import transfer
from remote_ops.workflows import logs

MIB = 1 << 20
ESC = "\x1b"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _row(key: str, file: str, data: bytes) -> dict:
    return {"key": key, "file": file, "bytes": len(data), "sha256": _sha(data), "tokens": 1}


def _write_manifest(d: Path, rows: list[dict]) -> None:
    (d / "rank0").mkdir(parents=True, exist_ok=True)
    (d / "rank0" / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _fresh(d: Path) -> None:
    subprocess.run(["rm", "-rf", str(d)], check=True, timeout=60)
    (d / "rank0").mkdir(parents=True)


def _honest(d: Path, prefix: str, n: int = 3) -> list[dict]:
    """`n` honest dump files under rank0 (64 KiB each) with their manifest rows."""
    rows = []
    for i in range(n):
        data = os.urandom(64 << 10)
        name = f"rank0/{prefix}{i}-p0.safetensors"
        (d / name).write_bytes(data)
        rows.append(_row(f"{prefix}{i}-p0", name, data))
    return rows


class Hostile:
    """The probe's hostile entries in a lab host's dump dir `d`, named uniquely (`uid`).

    - a rank dir `rankZ<newline>..` holding PWN-<uid>.safetensors (9 MiB: fetched alone): the old
      tab/newline listing read it as `../PWN-<uid>.safetensors`; a manifest row names that file,
      and the host serves it (`<d>/../PWN-<uid>.safetensors` exists there);
    - a rank dir `rankY<newline>` holding PWNABS-<uid>.safetensors: the old listing read it as
      `/PWNABS-<uid>.safetensors`; a manifest row names that absolute path, and a file of that
      size lies at `/` (the old pull counted it "already here");
    - manifest rows naming `../../x-<uid>.safetensors` and `/etc/x-<uid>.safetensors`;
    - a dump file whose name holds control characters (ESC, BEL), listed in the manifest.
    """

    def __init__(self, d: Path) -> None:
        self.d, self.uid = d, uuid.uuid4().hex[:12]
        self.pwn = f"PWN-{self.uid}.safetensors"
        self.pwnabs = f"PWNABS-{self.uid}.safetensors"
        self.up = f"../../x-{self.uid}.safetensors"
        self.etc = f"/etc/x-{self.uid}.safetensors"
        self.ctrl = f"rank0/{ESC}[2K{ESC}[32mevil\a-{self.uid}.safetensors"
        self.made: list[Path] = []

    def make(self) -> list[dict]:
        big, small = os.urandom(9 * MIB), os.urandom(100)
        z, y = self.d / "rankZ\n..", self.d / "rankY\n"
        z.mkdir()
        y.mkdir()
        (z / self.pwn).write_bytes(big)
        self._outside(self.d.parent / self.pwn, big)  # what `<d>/../PWN` is on the host
        (y / self.pwnabs).write_bytes(small)
        self._outside(Path("/") / self.pwnabs, small)  # "already here" for the old pull
        (self.d / self.ctrl).write_bytes(small)
        return [
            _row("pwn", "../" + self.pwn, big),
            _row("pwnabs", "/" + self.pwnabs, small),
            _row("up", self.up, small),
            _row("etc", self.etc, small),
            _row("ctrl", self.ctrl, small),
        ]

    def _outside(self, path: Path, data: bytes) -> None:
        path.write_bytes(data)
        self.made.append(path)

    def names(self) -> list[str]:
        """The offending names as the new listing and manifest give them (exact)."""
        return ["../" + self.pwn, "/" + self.pwnabs, self.up, self.etc, self.ctrl]

    def assert_nothing_outside(self, dest: Path) -> None:
        """No PWN file in --dest's parent or at `/` but the ones made here, unchanged."""
        for folder in (dest.parent, Path("/"), Path("/etc"), dest.parent.parent):
            strays = [p for p in folder.iterdir() if self.uid in p.name and p not in self.made]
            assert strays == [], strays
        assert (Path("/") / self.pwnabs).stat().st_size == 100

    def cleanup(self) -> None:
        for path in self.made:
            path.unlink(missing_ok=True)
        for folder in (Path("/"), Path("/etc")):
            for p in folder.iterdir():
                if self.uid in p.name:
                    p.unlink()


@pytest.fixture
def hostile(host):
    h = Hostile(host.paths.dump_dir)
    yield h
    h.cleanup()


def _cli(env, *args, timeout=180):
    p = subprocess.run(
        [sys.executable, "-m", "remote_ops", *args, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    return p.returncode, json.loads(p.stdout) if p.stdout.strip() else None, p.stderr


def _local_tree(dest: Path) -> list[str]:
    return sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())


# --------------------------------------------------------------------------- finding 1: hostile names


def test_hostile_names_are_named_skipped_and_nothing_lands_outside_dest(host, hostile, lab_env, tmp_path):
    d = host.paths.dump_dir
    _fresh(d)
    honest = _honest(d, "h")
    _write_manifest(d, honest + hostile.make())
    dest = tmp_path / "pulled"
    for attempt in (1, 2):  # a repeat does the same: nothing outside, non-zero, named
        rc, doc, err = _cli(lab_env, "dumps", "pull", "--host", host.name, "--dest", str(dest))
        hostile.assert_nothing_outside(dest)
        assert rc == ExitCode.VERIFY_FAILED, err
        unsafe = doc["problems"]["unsafe"]
        for name in hostile.names():
            assert any(e.startswith(name + ": ") for e in unsafe), (name, unsafe)
        assert any(e.startswith("rankZ\n../" + hostile.pwn) for e in unsafe)  # the listing entry
        assert doc["pull"]["fetched"] == (3 if attempt == 1 else 0)
        assert doc["pull"]["skipped"] == (0 if attempt == 1 else 3)  # PWNABS is never "already here"
        assert "unsafe" in err and hostile.up in err and hostile.etc in err
        assert _local_tree(dest) == sorted([r["file"] for r in honest] + ["rank0/manifest.jsonl"])
    for r in honest:
        assert _sha((dest / r["file"]).read_bytes()) == r["sha256"]
    local_keys = [json.loads(l)["key"] for l in (dest / "rank0" / "manifest.jsonl").read_text().splitlines()]
    assert sorted(local_keys) == sorted(r["key"] for r in honest)


def test_a_group_pull_skips_one_hosts_hostile_names_and_keeps_everyones_honest_files(
    lab, host, hostile, lab_env, tmp_path
):
    d1, d2 = host.paths.dump_dir, lab.host("lab2").paths.dump_dir
    _fresh(d1)
    _fresh(d2)
    honest1, honest2 = _honest(d1, "a"), _honest(d2, "b", 2)
    _write_manifest(d1, honest1 + hostile.make())
    _write_manifest(d2, honest2)
    dest = tmp_path / "merged"
    rc, doc, err = _cli(lab_env, "dumps", "pull", "--host", "lab1,lab2", "--dest", str(dest))
    hostile.assert_nothing_outside(dest)
    assert rc == ExitCode.VERIFY_FAILED, err
    for name in hostile.names():
        assert any(e.startswith(f"lab1:{name}: ") for e in doc["unsafe"]), (name, doc["unsafe"])
    assert doc["kept_from"] == {**{r["key"]: "lab1" for r in honest1}, **{r["key"]: "lab2" for r in honest2}}
    assert _local_tree(dest) == sorted([r["file"] for r in honest1 + honest2] + ["rank0/manifest.jsonl"])
    assert hostile.etc in err


def test_host_names_are_checked_by_one_pure_validator():
    from remote_ops.core import hostpaths

    ok = ["rank0/a-p0.safetensors", "rank12/b c.safetensors", "rank0/ünï.safetensors"]
    assert [hostpaths.problem(n) for n in ok] == [None, None, None]
    assert hostpaths.problem("/etc/x") == "absolute path"
    assert hostpaths.problem("rank0/../../x") == "'..' component"
    assert hostpaths.problem("rank0//x") == "empty component" and hostpaths.problem("") == "empty name"
    assert hostpaths.problem("rankZ\n../x") == "control character"
    assert hostpaths.problem("rank0/\x9bx") == "control character"  # C1: a one-character CSI
    assert hostpaths.problem(7) == "not a string"
    root = Path("/dest")
    assert hostpaths.local_path(root, "rank0/a.safetensors") == root / "rank0" / "a.safetensors"
    with pytest.raises(hostpaths.UnsafeName, match="absolute path"):
        hostpaths.local_path(root, "/PWNABS.safetensors")


def test_the_listing_is_nul_separated_so_a_newline_cannot_forge_an_entry():
    from remote_ops.core import shell
    from remote_ops.probes import batch
    from remote_ops.probes.dumps import DumpStatus

    listing = b"rankZ\n../PWN.safetensors\x009437184\x00f\x00rank0/a-p0.safetensors\x00123\x00f\x00rank0/\xff.bin\x004\x00f\x00"
    import base64

    out = "\n".join(
        [
            shell.SECTION + "exists:begin",
            shell.SECTION + "exists:end 0",
            shell.SECTION + "files:begin",
            base64.b64encode(listing).decode(),
            shell.SECTION + "files:end 0",
        ]
    )
    p = DumpStatus("/d").read(batch.split(out))
    assert p.files == {"rank0/a-p0.safetensors": 123}
    assert p.unsafe == ["rankZ\n../PWN.safetensors: control character", "rank0/\\xff.bin: not UTF-8"]


def test_the_transfer_refuses_an_item_that_would_land_outside_dest_before_opening_anything(tmp_path):
    """The last guard: a host name that fails the check, or a local path that resolves out of
    `dest` (a symlinked folder or file), is listed in `report.unsafe`, never opened or counted."""
    from remote_ops.remote.sshconfig import SshTarget

    dest, outside = tmp_path / "dest", tmp_path / "outside"
    (dest / "rank0").mkdir(parents=True)
    outside.mkdir()
    (dest / "rank1").symlink_to(outside)
    (outside / "there.safetensors").write_bytes(b"x" * 5)  # "already here", through the link
    (dest / "rank0" / "a.safetensors.part").symlink_to(outside / "a.part")
    items = [
        transfer.PullItem("rank1/there.safetensors", dest / "rank1" / "there.safetensors", 5),
        transfer.PullItem("rank0/a.safetensors", dest / "rank0" / "a.safetensors", 5),
        transfer.PullItem("../up.safetensors", tmp_path / "up.safetensors", 5),
    ]
    target = SshTarget(name="h", hostname="127.0.0.1", port=1, user="nobody")
    report = transfer.Puller(target, "/d", dest=dest).pull(items)
    assert report.unsafe == [
        ("rank1/there.safetensors", "local path outside the destination"),
        ("rank0/a.safetensors", "local path outside the destination"),
        ("../up.safetensors", "'..' component"),
    ]
    assert (report.files, report.skipped, report.fetched) == (0, 0, 0)
    assert sorted(os.listdir(outside)) == ["there.safetensors"] and not (tmp_path / "up.safetensors").exists()


# --------------------------------------------------------------------------- finding 5: connection lost


def _big(root: Path, name: str, size: int) -> transfer.PullItem:
    """A file of `size` random bytes on the host under `root`; the item that pulls it."""
    root.mkdir(parents=True, exist_ok=True)
    data = os.urandom(size)
    (root / name).write_bytes(data)
    return transfer.PullItem(name, Path("unset"), size, _sha(data))


def _items(root: Path, dest: Path, sizes: dict[str, int]) -> list[transfer.PullItem]:
    return [
        transfer.PullItem(i.remote, dest / i.remote, i.size, i.sha256)
        for i in (_big(root, n, s) for n, s in sizes.items())
    ]


def _assert_lost(exc: pytest.ExceptionInfo, host) -> None:
    assert exc.value.exit_code == ExitCode.UNREACHABLE == 4
    assert "connection lost" in exc.value.message and exc.value.host == host.name


def _crash_after(faults, host, nbytes: int):
    seen = {"n": 0, "crashed": False}

    def advance(n):
        seen["n"] += n
        if seen["n"] > nbytes and not seen["crashed"]:
            seen["crashed"] = True
            faults.crash(host)

    return advance


def test_sshd_killed_mid_stream_is_exit_4_and_the_part_resumes(lab, spare_host, faults, tmp_path):
    root, dest = spare_host.paths.dump_dir / "lost", tmp_path / "dest"
    (item,) = _items(root, dest, {"big": 96 * MIB})
    with pytest.raises(Unreachable) as exc:
        transfer.pull(
            lab.target(spare_host.name), str(root), [item], advance=_crash_after(faults, spare_host, 24 * MIB)
        )
    _assert_lost(exc, spare_host)
    kept = item.part.stat().st_size
    assert 24 * MIB <= kept < item.size and not item.local.exists()
    faults.restart(spare_host)
    report = transfer.pull(lab.target(spare_host.name), str(root), [item])
    assert report.resumed == 1 and report.fetched == 1 and report.bytes == item.size - kept
    assert _sha(item.local.read_bytes()) == item.sha256 and not item.part.exists()


def test_a_tar_member_cut_by_a_lost_connection_keeps_its_part_and_resumes_alone(lab, spare_host, faults, tmp_path):
    root, dest = spare_host.paths.dump_dir / "cut", tmp_path / "dest"
    first, second = _items(root, dest, {"t0": 40 * MIB, "t1": 40 * MIB})  # one tar batch (jobs=1)
    assert transfer.plan_jobs([first, second], jobs=1) == [[first, second]]
    with pytest.raises(Unreachable) as exc:
        transfer.pull(
            lab.target(spare_host.name),
            str(root),
            [first, second],
            jobs=1,
            advance=_crash_after(faults, spare_host, 50 * MIB),
        )
    _assert_lost(exc, spare_host)
    assert first.local.exists()  # verified and renamed before the cut
    kept = second.part.stat().st_size
    assert transfer.SMALL_FILE <= kept < second.size
    faults.restart(spare_host)
    report = transfer.pull(lab.target(spare_host.name), str(root), [first, second], jobs=1)
    assert (report.skipped, report.resumed, report.fetched) == (1, 1, 1) and report.bytes == second.size - kept
    assert _sha(second.local.read_bytes()) == second.sha256


def test_a_refused_connection_before_the_first_byte_is_exit_4_and_keeps_the_part(lab, spare_host, faults, tmp_path):
    root, dest = spare_host.paths.dump_dir / "refused", tmp_path / "dest"
    big, small = _items(root, dest, {"big": 24 * MIB, "small": 1 * MIB})
    dest.mkdir()
    big.part.write_bytes((root / "big").read_bytes()[: 10 * MIB])  # an earlier pull's verified prefix
    faults.refuse(spare_host)
    with pytest.raises(Unreachable) as exc:
        transfer.pull(lab.target(spare_host.name), str(root), [big, small])
    _assert_lost(exc, spare_host)
    assert big.part.stat().st_size == 10 * MIB and not small.part.exists()
    faults.unblock(spare_host)
    report = transfer.pull(lab.target(spare_host.name), str(root), [big, small])
    assert report.resumed == 1 and report.fetched == 2 and report.bytes == big.size - 10 * MIB + small.size


def test_cli_pull_whose_sshd_dies_mid_file_exits_4_then_resumes(lab, spare_host, faults, lab_env, tmp_path):
    d, dest = spare_host.paths.dump_dir, tmp_path / "dest"
    _fresh(d)
    data = os.urandom(256 * MIB)
    (d / "rank0" / "k-p0.safetensors").write_bytes(data)
    _write_manifest(d, [_row("k-p0", "rank0/k-p0.safetensors", data)])
    part = dest / "rank0" / "k-p0.safetensors.part"
    args = [sys.executable, "-m", "remote_ops", "dumps", "pull", "--host", spare_host.name, "--dest", str(dest)]
    proc = subprocess.Popen(args, env=lab_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (part.exists() and part.stat().st_size >= 16 * MIB):
            assert time.monotonic() < deadline and proc.poll() is None, "the pull never got going"
            time.sleep(0.01)
        faults.crash(spare_host)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert proc.returncode == ExitCode.UNREACHABLE, err
    assert "connection lost" in err and "corrupt" not in err
    kept = part.stat().st_size
    assert 16 * MIB <= kept < len(data)
    faults.restart(spare_host)
    rc, doc, err = _cli(lab_env, "dumps", "pull", "--host", spare_host.name, "--dest", str(dest))
    assert rc == 0, err
    assert doc["pull"]["resumed"] == 1 and doc["pull"]["bytes"] == len(data) - kept
    assert _sha((dest / "rank0" / "k-p0.safetensors").read_bytes()) == _sha(data)


def test_cli_group_pull_whose_host_dies_mid_file_exits_4_naming_the_keys_not_reached(
    lab, host, spare_host, faults, lab_env, tmp_path
):
    d1, d3, dest = host.paths.dump_dir, spare_host.paths.dump_dir, tmp_path / "merged"
    _fresh(d1)
    _fresh(d3)
    honest = _honest(d1, "a", 2)
    _write_manifest(d1, honest)
    data = os.urandom(256 * MIB)
    (d3 / "rank0" / "big-p0.safetensors").write_bytes(data)
    _write_manifest(d3, [_row("big-p0", "rank0/big-p0.safetensors", data)])
    part = dest / "rank0" / "big-p0.safetensors.part"
    args = [sys.executable, "-m", "remote_ops", "dumps", "pull", "--host", f"lab1,{spare_host.name}"]
    proc = subprocess.Popen(
        [*args, "--dest", str(dest), "--json"], env=lab_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 60
        while not (part.exists() and part.stat().st_size >= 16 * MIB):
            assert time.monotonic() < deadline and proc.poll() is None, "the pull never got going"
            time.sleep(0.01)
        faults.crash(spare_host)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert proc.returncode == ExitCode.UNREACHABLE, err
    doc = json.loads(out)
    assert doc["not_reached"] == ["big-p0"] and doc["connection_lost"] == [spare_host.name]
    assert doc["no_good_copy"] == [] and "connection lost" in err and "corrupt" not in err
    assert sorted(doc["kept_from"]) == sorted(r["key"] for r in honest)
    assert 16 * MIB <= part.stat().st_size < len(data)


# --------------------------------------------------------------------------- logs pull


def test_logs_pull_of_a_hostile_log_name_writes_only_its_own_copy(lab, host, remote, tmp_path):
    """The host file's name (newline, `..`, ESC) never becomes a local name: the copy is `<kind>.log`."""
    name = f"x\n..{ESC}[2J\n..PWNLOG-{uuid.uuid4().hex[:8]}.log"
    host.paths.logs_dir.mkdir(parents=True, exist_ok=True)
    hostile = host.paths.logs_dir / name
    hostile.write_bytes(b"2026-11-30T10:00:00Z started done=0 total=4\n")
    try:
        spec = lab.spec(host.name)
        spec = spec.model_copy(update={"logs": spec.logs.model_copy(update={"extraction": str(hostile)})})
        local = tmp_path / "logs"
        (pulled,) = logs.pull_logs(remote, spec, ("extraction",), local)
        assert pulled.local == str(local / "extraction.log") and not pulled.missing
        assert (local / "extraction.log").read_bytes() == hostile.read_bytes()
        assert sorted(os.listdir(tmp_path)) == ["logs"]
        assert sorted(os.listdir(local)) == [".pull-state.json", "extraction.log"]
    finally:
        hostile.unlink(missing_ok=True)
