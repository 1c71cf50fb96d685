"""Dumps on a real lab host: files written by the REAL dumper (torch, CPU), then reconciled,
header-checked on the host (dumpfile.py, no torch), and pulled with verification and resume."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from remote_ops.core import dumpcheck
from remote_ops.remote import transfer
from remote_ops.workflows import dumps

torch = pytest.importorskip("torch")
H = 64


def write_real_dumps(root: Path, lens: list[int], hidden_size: int = H, seed: int = 0) -> None:
    """One EXTEND batch through the real `remote_ops.dumper` Dumper on the CPU."""
    from remote_ops.dumper.config import config_from_env
    from remote_ops.dumper.dumper import Dumper

    cfg = config_from_env(
        {
            "SGLANG_HS_DUMP_DIR": str(root),
            "SGLANG_HS_DUMP_FSYNC": "0",
            "SGLANG_HS_DUMP_BUFFER_TOKENS": str(max(sum(lens), 64)),
        }
    )
    dumper = Dumper(
        cfg, rank=0, writer=True, layers=[2, 4, 5], hidden_size=hidden_size, metadata={"sglang_version": "0.5.9"}
    )
    g = torch.Generator().manual_seed(seed)
    rows = sum(lens)
    fb = SimpleNamespace(
        forward_mode=SimpleNamespace(name="EXTEND"),
        extend_seq_lens_cpu=lens,
        extend_prefix_lens_cpu=[0] * len(lens),
        positions=None,
        input_ids=torch.randint(0, 32000, (rows,), generator=g, dtype=torch.int64),
    )
    hidden = torch.randn(rows, hidden_size, generator=g).to(torch.bfloat16)
    aux = [torch.randn(rows, hidden_size, generator=g).to(torch.bfloat16) for _ in range(3)]
    dumper.capture(fb, hidden, aux)
    dumper.close()


def place_on_host(remote, local_root: Path, dump_dir: Path) -> None:
    """Copy a local dump dir onto the host through the SSH seam."""
    remote.run(["rm", "-rf", str(dump_dir)])
    for path in sorted(local_root.rglob("*")):
        rel = path.relative_to(local_root)
        if path.is_dir():
            remote.run(["mkdir", "-p", str(dump_dir / rel)])
        else:
            remote.put(path, str(dump_dir / rel))


@pytest.fixture
def spec(lab, host):
    return lab.spec(host.name)


@pytest.fixture
def host_dumps(tmp_path, remote, host):
    """Six spans of real dumps (H=64) on lab1's dump dir; returns the latest manifest records."""
    src = tmp_path / "src"
    write_real_dumps(src, [5, 7, 3, 9, 4, 6])
    place_on_host(remote, src, host.paths.dump_dir)
    latest, _ = dumpcheck.latest_records((src / "rank0" / "manifest.jsonl").read_text())
    return sorted(latest.values(), key=lambda r: r["file"])


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0xFF]))


def test_status_reconciles_manifest_and_files(remote, spec, host, host_dumps):
    d = host.paths.dump_dir
    (d / "rank0" / "stray-p0.safetensors").write_bytes(b"x")  # not in the manifest
    (d / host_dumps[0]["file"]).unlink()  # manifest row, no file
    (d / "rank0" / ".tmp-abc").write_bytes(b"partial")
    probe = dumps.probe(remote, str(d))
    r = dumpcheck.reconcile(str(d), probe.files, probe.manifest_text, spec.model.hidden_size)
    assert (r.manifest_rows, r.files_present) == (6, 6)
    assert r.missing_files == [host_dumps[0]["file"]] and r.unlisted_files == ["rank0/stray-p0.safetensors"]
    assert r.temp_files == ["rank0/.tmp-abc"] and not r.ok
    assert r.tokens == sum(x["tokens"] for x in host_dumps[1:])
    assert r.float_bytes_per_token == 4 * H * 2 and probe.free_bytes > 0


def test_host_check_without_torch_finds_corrupt_and_truncated_files(remote, spec, host, host_dumps):
    d = host.paths.dump_dir
    header_hit, truncated, payload_hit = (d / r["file"] for r in host_dumps[:3])
    _flip(header_hit, 10)  # JSON header damaged
    with open(truncated, "r+b") as fh:  # cut short (a crashed copy)
        fh.truncate(truncated.stat().st_size - 100)
    _flip(payload_hit, payload_hit.stat().st_size - 200)  # a flipped bit in the data
    fast = dumps.host_verify(remote, str(d), spec.model.hidden_size, check_sha=False)
    bad = {p["where"] for p in dumpcheck.errors_of(fast)}
    assert {host_dumps[0]["file"], host_dumps[1]["file"]} <= bad and host_dumps[2]["file"] not in bad
    deep = dumps.host_verify(remote, str(d), spec.model.hidden_size, check_sha=True)
    messages = {p["where"]: p["message"] for p in dumpcheck.errors_of(deep)}
    assert "sha256" in messages[host_dumps[2]["file"]]
    assert not deep["ok"] and len(messages) == 3


def test_pull_verifies_each_file_and_refuses_a_corrupt_one(remote, lab, spec, host, host_dumps, tmp_path):
    d, dest = host.paths.dump_dir, tmp_path / "pulled"
    probe = dumps.probe(remote, str(d))
    recon = dumpcheck.reconcile(str(d), probe.files, probe.manifest_text)
    items = dumps.pull_items(recon, dest)
    report = transfer.pull(lab.target(host.name), str(d), items, ssh_config=str(lab.ssh_config))
    assert report.fetched == 6 and not report.failed
    dumps.write_local_manifests(recon, dest)
    assert (
        subprocess.run(
            [sys.executable, "remote_ops/dumper/dumpfile.py", "verify", str(dest)], capture_output=True, timeout=60
        ).returncode
        == 0
    )
    _flip(d / host_dumps[3]["file"], 300)  # same size, different bytes
    (dest / host_dumps[3]["file"]).unlink()
    again = transfer.pull(lab.target(host.name), str(d), items, strict=False)
    assert again.skipped == 5 and again.failed == [(host_dumps[3]["file"], "sha256 differs from the manifest")]
    assert not (dest / host_dumps[3]["file"]).exists()
    assert not list(dest.rglob("*.part"))


def test_interrupted_pull_of_a_kimi_sized_dump_resumes_from_the_partial_file(remote, lab, host, tmp_path):
    """One 1,200-token span at H=7168: 57,344 float bytes per token, ~69 MB, pulled in two goes."""
    src = tmp_path / "src"
    write_real_dumps(src, [1200], hidden_size=7168)
    place_on_host(remote, src, host.paths.dump_dir)
    probe = dumps.probe(remote, str(host.paths.dump_dir))
    recon = dumpcheck.reconcile(str(host.paths.dump_dir), probe.files, probe.manifest_text)
    assert recon.float_bytes_per_token == 57344 and recon.records[0]["bytes"] > 1200 * 57344
    items = dumps.pull_items(recon, tmp_path / "pulled")
    seen = {"n": 0}

    def interrupt_midway(n):
        seen["n"] += n
        if seen["n"] > 20 << 20:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        transfer.pull(lab.target(host.name), str(host.paths.dump_dir), items, advance=interrupt_midway)
    part = items[0].part
    assert part.exists() and 0 < part.stat().st_size < items[0].size and not items[0].local.exists()
    resumed = transfer.pull(lab.target(host.name), str(host.paths.dump_dir), items)
    assert resumed.resumed == 1 and resumed.fetched == 1
    assert 0 < resumed.bytes < items[0].size  # only the missing tail travelled
    digest = hashlib.sha256(items[0].local.read_bytes()).hexdigest()
    assert digest == items[0].sha256 and not part.exists()


def test_cli_status_verify_pull_as_json(lab_env, host, host_dumps):
    def cli(*args):
        proc = subprocess.run(
            [sys.executable, "-m", "remote_ops", *args, "--host", host.name, "--json"],
            capture_output=True,
            text=True,
            timeout=120,
            env=lab_env,
        )
        return proc.returncode, json.loads(proc.stdout)

    rc, status = cli("dumps", "status", "--samples", "10")
    assert rc == 0 and status["reconciliation"]["manifest_rows"] == 6
    assert status["projection"]["samples_total"] == 10 and status["projection"]["host_ok"] is True
    rc, verify = cli("dumps", "verify")
    assert rc == 0 and verify["host_check"]["ok"]
    rc, pulled = cli("dumps", "pull")
    assert rc == 0 and pulled["pull"]["fetched"] == 6
    dest = Path(pulled["dest"])
    assert len(list(dest.glob("rank0/*.safetensors"))) == 6 and (dest / "rank0" / "manifest.jsonl").exists()
    _flip(host.paths.dump_dir / host_dumps[0]["file"], 12)
    rc, verify = cli("dumps", "verify")
    assert rc == 10 and verify["error"] == "verify_failed"
    assert verify["host_check"]["problems"][0]["where"] == host_dumps[0]["file"]
