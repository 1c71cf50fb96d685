"""Bulk pull: the ssh command line (host-key policy), job planning, the tar stream reader,
and pulls of many small files over a real lab host."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile

import pytest

from remote_ops.remote import transfer
from remote_ops.remote.sshconfig import SshTarget, Timeouts


def _target(**kw):
    base = dict(
        name="gpu",
        hostname="127.0.0.5",
        port=2222,
        user="ops",
        identity_files=("/k/id",),
        known_hosts=("/k/known hosts", "/k/kh2"),
        timeouts=Timeouts(connect=7, keepalive=9),
    )
    return SshTarget(**{**base, **kw})


def _opt(argv, name):
    return [argv[i + 1] for i, a in enumerate(argv) if a == "-o" and argv[i + 1].startswith(name + "=")]


def test_ssh_argv_carries_the_seams_strict_host_key_policy():
    argv = transfer.ssh_argv(_target())
    assert argv[:3] == ["ssh", "-F", "/dev/null"]
    assert _opt(argv, "StrictHostKeyChecking") == ["StrictHostKeyChecking=yes"]
    assert _opt(argv, "UserKnownHostsFile") == ['UserKnownHostsFile="/k/known hosts" /k/kh2']
    assert _opt(argv, "BatchMode") == ["BatchMode=yes"] and _opt(argv, "ConnectTimeout") == ["ConnectTimeout=7"]
    assert _opt(argv, "ServerAliveInterval") == ["ServerAliveInterval=9"]
    assert argv[argv.index("-i") + 1] == "/k/id" and argv[argv.index("-p") + 1] == "2222"
    assert argv[argv.index("-l") + 1] == "ops" and argv[-2:] == ["--", "127.0.0.5"]
    assert argv[argv.index("-c") + 1].startswith("aes128-gcm@openssh.com")


def test_accept_new_policy_and_given_ssh_config_pass_through():
    argv = transfer.ssh_argv(_target(host_key_policy="accept-new"), ssh_config="/etc/my_ssh_config")
    assert _opt(argv, "StrictHostKeyChecking") == ["StrictHostKeyChecking=accept-new"]
    assert argv[1:3] == ["-F", "/etc/my_ssh_config"]


def test_proxy_jump_becomes_a_proxy_command_with_the_same_policy():
    hop = _target(name="bastion", hostname="127.0.0.9", port=22, identity_files=())
    argv = transfer.ssh_argv(_target(jump=(hop,)))
    (proxy,) = _opt(argv, "ProxyCommand")
    assert "StrictHostKeyChecking=yes" in proxy and "-W %h:%p -- 127.0.0.9" in proxy
    assert "known hosts" in proxy  # quoted for the shell that runs it


def test_plan_jobs_batches_files_resumes_partials_alone_and_streams_huge_ones(tmp_path):
    mib = 1 << 20
    sizes = [100 * mib, 1 * mib, 2 * mib, 3 * mib, 20 * mib, 30 * mib]
    items = [transfer.PullItem(f"f{i}", tmp_path / f"f{i}", s) for i, s in enumerate(sizes)]
    items[5].part.write_bytes(b"x" * 10)  # an interrupted earlier pull

    def names(jobs):
        return [[i.remote for i in j] for j in jobs]

    assert names(transfer.plan_jobs(items)) == [["f0", "f1", "f2", "f3", "f4"], ["f5"]]
    assert names(transfer.plan_jobs(items, jobs=2)) == [["f0"], ["f5"], ["f1", "f2", "f3", "f4"]]
    assert names(transfer.plan_jobs(items, batch_bytes=4 * mib)) == [["f0"], ["f5"], ["f4"], ["f1", "f2", "f3"]]


class _Bytes:
    """Feeds `_tar_members` from memory, like `_StallReader` does from ssh."""

    def __init__(self, data: bytes):
        self.buf = io.BytesIO(data)

    def read_exact(self, n):
        return self.buf.read(n)

    def readinto(self, view):
        return self.buf.readinto(view)


def test_tar_reader_handles_long_names_prefixes_and_padding():
    raw = io.BytesIO()
    long_name = "rank0/" + "k" * 150 + ".safetensors"
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in (("rank0/a-p0.safetensors", b"abc"), (long_name, b"x" * 1000)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    reader = _Bytes(raw.getvalue())
    got = []
    for name, size in transfer._tar_members(reader):
        got.append((name, reader.read_exact(size)))
        reader.read_exact(-size % 512)
    assert got == [("rank0/a-p0.safetensors", b"abc"), (long_name, b"x" * 1000)]


# --------------------------------------------------------------------------- lab host


def test_many_small_files_pull_in_tar_batches_and_a_missing_one_is_reported(lab, host, tmp_path):
    root = host.paths.dump_dir / "small"
    root.mkdir(parents=True, exist_ok=True)
    items = []
    for i in range(300):
        data = hashlib.sha256(str(i).encode()).digest() * (i + 1)
        (root / f"f{i:03d}").write_bytes(data)
        items.append(
            transfer.PullItem(f"f{i:03d}", tmp_path / "out" / f"f{i:03d}", len(data), hashlib.sha256(data).hexdigest())
        )
    items.append(transfer.PullItem("gone", tmp_path / "out" / "gone", 5, None))
    report = transfer.Puller(lab.target(host.name), str(root), jobs=3).pull(items)
    assert report.fetched == 300 and report.failed == [("gone", "missing on the host")]
    for item in items[:300]:
        assert hashlib.sha256(item.local.read_bytes()).hexdigest() == item.sha256
    again = transfer.Puller(lab.target(host.name), str(root)).pull(items[:300])
    assert again.skipped == 300 and again.bytes == 0


def test_unknown_host_key_is_refused_by_the_bulk_path_too(lab, host, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    target = lab.target(host.name, known_hosts=str(empty))
    (host.paths.dump_dir).mkdir(parents=True, exist_ok=True)
    (host.paths.dump_dir / "one").write_bytes(b"x" * 10)
    report = transfer.Puller(target, str(host.paths.dump_dir), ssh_config=None).pull(
        [transfer.PullItem("one", tmp_path / "one", 10)]
    )
    assert report.fetched == 0 and "Host key verification failed" in report.failed[0][1]
    assert not (tmp_path / "one").exists()


def test_a_stale_partial_file_is_fetched_again_from_byte_zero(lab, host, tmp_path):
    root = host.paths.dump_dir / "stale"
    root.mkdir(parents=True, exist_ok=True)
    data = os.urandom(10 << 20)  # above SMALL_FILE: streamed
    (root / "big").write_bytes(data)
    item = transfer.PullItem("big", tmp_path / "big", len(data), hashlib.sha256(data).hexdigest())
    item.part.write_bytes(b"\0" * (3 << 20))  # left by an older version of the file
    report = transfer.Puller(lab.target(host.name), str(root)).pull([item])
    assert report.resumed == 1 and report.fetched == 1 and not report.failed
    assert item.local.read_bytes() == data and not item.part.exists()


def test_an_interrupted_tar_batch_keeps_verified_files_and_resumes_the_partial_one(lab, host, tmp_path):
    root = host.paths.dump_dir / "batch"
    root.mkdir(parents=True, exist_ok=True)
    items = []
    for i in range(4):
        data = os.urandom(10 << 20)
        (root / f"d{i}").write_bytes(data)
        items.append(transfer.PullItem(f"d{i}", tmp_path / f"d{i}", len(data), hashlib.sha256(data).hexdigest()))
    seen = {"n": 0}

    def ctrl_c_at_15_mib(n):
        seen["n"] += n
        if seen["n"] > 15 << 20:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        transfer.Puller(lab.target(host.name), str(root), jobs=1, advance=ctrl_c_at_15_mib).pull(items)
    assert items[0].local.exists() and items[1].part.stat().st_size > 0
    assert not any(i.part.exists() for i in items[2:])  # created ahead, removed on the way out
    report = transfer.Puller(lab.target(host.name), str(root), jobs=1).pull(items)
    assert (report.skipped, report.resumed, report.fetched) == (1, 1, 3) and not report.failed
    assert report.bytes < 30 << 20
    for item in items:
        assert hashlib.sha256(item.local.read_bytes()).hexdigest() == item.sha256
