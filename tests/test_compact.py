"""`dumps compact`: the packed form of a dump file (`remote_ops/dumper/packed.py`) and the on-host pass.

Pure: the codec round-trips every dtype bit for bit and refuses a corrupt or lying file.  On a real
lab host (lab1, its sshd; the pass runs with the host's python3): a compacted dump dir passes
`dumps verify --sha`; `kill -9` at each step of a file's commit, and at random moments, then a
re-run, leaves every key exactly once and readable; files the dumper may still write are never
touched.  On lab2 serving the computing stand-in: a compacted extraction passes `dumps audit` and
`dumps export`, whose records equal bit for bit those exported from the same dumps uncompacted."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_cli

from remote_ops import onhost
from remote_ops.dumper import dumpfile, packed

REPO = Path(__file__).resolve().parent.parent
EXPONENTS = bytes((0x3E, 0x3F, 0xBE, 0xBF, 0x3D, 0x3F, 0x3F, 0x3E)[i % 8] for i in range(256))  # a few values


def _tensors(n: int, h: int, dtype: str, seed: int) -> dict:
    rng = random.Random(seed)
    size = dumpfile.DTYPE_SIZES[dtype]

    def floats(count: int) -> bytes:  # little-endian: the last byte of each element holds sign and exponent
        out = bytearray(rng.randbytes(count * size))
        out[size - 1 :: size] = rng.randbytes(count).translate(EXPONENTS)
        return bytes(out)

    rows, aux = floats(n * h), floats(n * 3 * h)
    ids = dumpfile.token_ids_bytes(rng.randrange(32000) for _ in range(n))
    return {
        "hidden_states": (dtype, [n, h], rows),
        "aux_hidden_states": (dtype, [n, 3 * h], aux),
        "input_ids": ("I32", [n], ids),
        "positions": ("I32", [n], dumpfile.token_ids_bytes(range(n))),
    }


def _write(folder: Path, n: int, h: int = 64, dtype: str = "BF16", seed: int = 0) -> Path:
    path = folder / f"f{seed}.safetensors"
    dumpfile.write_dump_file(str(path), _tensors(n, h, dtype, seed), {"format": dumpfile.FORMAT_NAME}, fsync=False)
    return path


# --------------------------------------------------------------------------- pure: the codec


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32"])
@pytest.mark.parametrize("block", [16, 1000, 4 << 20])
def test_packed_file_decodes_bit_for_bit_and_reads_at_any_offset(tmp_path, dtype, block, version):
    """Both versions (v2 is written by default; v1 files, written before it, are still read)."""
    src = _write(tmp_path, 37, 24, dtype)
    info = packed.pack_file(str(src), str(tmp_path / "f.hsz"), block_bytes=block, fsync=False, version=version)
    with packed.PackedFile(str(tmp_path / "f.hsz")) as pf:
        assert pf.version == version
        transforms = {b[2] for b in pf.blocks}
        assert ("e2" in transforms) == (version == 2 and dtype == "BF16")
    raw = src.read_bytes()
    assert info["source_sha256"] == hashlib.sha256(raw).hexdigest()
    assert info["packed_sha256"] == hashlib.sha256((tmp_path / "f.hsz").read_bytes()).hexdigest()
    assert packed.decoded_sha256(str(tmp_path / "f.hsz")) == (info["source_sha256"], len(raw))
    with packed.open_dump(str(tmp_path / "f.hsz")) as pf:
        for a in (0, 1, 7, 8, 100, len(raw) - 3):
            pf.seek(a)
            assert pf.read(1234) == raw[a : a + 1234]
        assert pf.read() == b""
    assert dumpfile.read_header(str(tmp_path / "f.hsz")) == dumpfile.read_header(str(src))


def test_bf16_activations_keep_fewer_bytes_than_plain_deflate(tmp_path):
    src = _write(tmp_path, 200, 64)
    info = packed.pack_file(str(src), str(tmp_path / "f.hsz"), fsync=False)
    import zlib

    assert info["packed_bytes"] < len(zlib.compress(src.read_bytes(), 6))
    assert info["packed_bytes"] < 0.75 * info["source_bytes"]


def _channel_scaled_bf16(n: int, w: int, seed: int) -> bytes:
    """BF16 rows whose channels have their own scales (as activations do): Gaussian times 2**k(channel)."""
    rng = random.Random(seed)
    scales = [2.0 ** rng.randrange(-6, 7) for _ in range(w)]
    out = bytearray()
    for _ in range(n):
        for c in range(w):
            x = struct.pack("<f", rng.gauss(0, 1) * scales[c])
            out += x[2:]  # the top half of a float32: a bf16 (truncated)
    return bytes(out)


def test_v2_codes_each_exponent_against_its_channel_and_keeps_fewer_bytes_than_v1(tmp_path):
    n, h = 120, 32
    path = tmp_path / "c.safetensors"
    tensors = {
        "hidden_states": ("BF16", [n, h], _channel_scaled_bf16(n, h, 1)),
        "aux_hidden_states": ("BF16", [n, 3 * h], _channel_scaled_bf16(n, 3 * h, 2)),
        "input_ids": ("I32", [n], dumpfile.token_ids_bytes(range(n))),
        "positions": ("I32", [n], dumpfile.token_ids_bytes(range(n))),
    }
    dumpfile.write_dump_file(str(path), tensors, {"format": dumpfile.FORMAT_NAME}, fsync=False)
    raw = path.read_bytes()
    sizes = {}
    for version in (1, 2):
        dst = tmp_path / f"v{version}.hsz"
        sizes[version] = packed.pack_file(str(path), str(dst), block_bytes=1000, fsync=False, version=version)[
            "packed_bytes"
        ]
        assert packed.decoded_sha256(str(dst)) == (hashlib.sha256(raw).hexdigest(), len(raw))
    assert sizes[2] < 0.95 * sizes[1], sizes
    # the planes themselves: every value back, whatever the phase of a block's first value
    data = tensors["aux_hidden_states"][2]
    medians = packed.channel_medians(data, 3 * h)
    for phase in (0, 1, 95):
        planes = packed.exponent_planes(data[: 2 * 500], medians, phase)
        assert packed.join_exponent_planes(planes, medians, phase, 1000) == data[:1000]


def test_a_v2_file_with_a_bad_channel_table_is_refused(tmp_path):
    src = _write(tmp_path, 40, 64)
    dst = tmp_path / "f.hsz"
    packed.pack_file(str(src), str(dst), fsync=False)
    good = dst.read_bytes()
    tail = good[-16:]
    (n,) = struct.unpack("<Q", tail[:8])
    index = json.loads(good[-16 - n : -16])

    def rewritten(change) -> Path:
        doc = json.loads(json.dumps(index))
        change(doc)
        raw = json.dumps(doc).encode()
        dst.write_bytes(good[: -16 - n] + raw + struct.pack("<Q", len(raw)) + tail[8:])
        return dst

    def e2(doc):
        return next(b for b in doc["blocks"] if b[2] == "e2")

    for change in (
        lambda d: d["channels"][0].__setitem__(1, "!!"),  # not base64
        lambda d: d["channels"][0].__setitem__(0, 65),  # decodes to fewer bytes than its width
        lambda d: e2(d).__setitem__(5, 7),  # no such table
        lambda d: e2(d).__setitem__(6, 64),  # a phase past the table
        lambda d: e2(d).pop(),  # no phase
        lambda d: d.__setitem__("version", 1),  # e2 in a version-1 file
        lambda d: d.__setitem__("version", 3),
    ):
        with pytest.raises(packed.PackError):
            packed.decoded_sha256(str(rewritten(change)))
    dst.write_bytes(good)
    assert packed.decoded_sha256(str(dst))[0] == hashlib.sha256(src.read_bytes()).hexdigest()


def test_a_corrupt_truncated_or_lying_packed_file_is_refused(tmp_path):
    src = _write(tmp_path, 50, 64)
    dst = tmp_path / "f.hsz"
    packed.pack_file(str(src), str(dst), block_bytes=4096, fsync=False)
    good = dst.read_bytes()
    flipped = bytearray(good)
    flipped[200] ^= 0x40
    dst.write_bytes(bytes(flipped))
    with pytest.raises(packed.PackError):
        packed.decoded_sha256(str(dst))
    dst.write_bytes(good[:-1])
    with pytest.raises(packed.PackError, match="trailer"):
        packed.PackedFile(str(dst))
    tail = good[-16:]
    (n,) = struct.unpack("<Q", tail[:8])
    index = json.loads(good[-16 - n : -16])
    index["blocks"][1][1] += 2  # a block that says it decodes to more than it does
    raw = json.dumps(index).encode()
    dst.write_bytes(good[: -16 - n] + raw + struct.pack("<Q", len(raw)) + tail[8:])
    with pytest.raises(packed.PackError):
        packed.PackedFile(str(dst))


def test_the_bundled_programs_run_with_a_bare_python3_on_stdin(tmp_path):
    """The codec travels with the program (`onhost.with_codec`): plain python3, no remote_ops."""
    src = _write(tmp_path, 30, 64)
    program = onhost.with_codec(b"import sys, rops_packed as p\nprint(p.decoded_sha256(sys.argv[1])[0])\n", "probe.py")
    packed.pack_file(str(src), str(tmp_path / "f.hsz"), fsync=False)
    out = subprocess.run(
        ["python3", "-I", "-", str(tmp_path / "f.hsz")], input=program, capture_output=True, timeout=60, cwd="/"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.decode().strip() == hashlib.sha256(src.read_bytes()).hexdigest()


# --------------------------------------------------------------------------- the pass, run here with python3


def _dump_dir(root: Path, n: int = 6, seed: int = 3, tokens: int = 300) -> Path:
    """A dump dir written by the dump contract's writer (`dumpfile.write_span`)."""
    rng = random.Random(seed)
    for i in range(n):
        t = rng.randint(2, tokens)
        ids = dumpfile.token_ids_bytes(rng.randrange(32000) for _ in range(t))
        tensors = _tensors(t, 64, "BF16", seed * 100 + i)
        dumpfile.write_span(
            str(root),
            0,
            ids,
            dumpfile.token_ids_bytes(range(t)),
            tensors["hidden_states"][2],
            tensors["aux_hidden_states"][2],
            64,
            fsync=False,
        )
    return root


def _originals(root: Path) -> dict[str, str]:
    """key -> sha256 of each dump's original bytes, as the manifest records it (either form)."""
    out = {}
    for key, rec in dumpfile.read_manifest(str(root / "rank0" / "manifest.jsonl")).latest_by_key().items():
        out[key] = rec["packed"]["source_sha256"] if rec["file"].endswith(".hsz") else rec["sha256"]
    return out


def _each_once_and_readable(root: Path, want: dict[str, str], *, settled: bool) -> None:
    report = dumpfile.verify_dir(str(root), check_sha=True)
    assert report.ok, report.to_dict()["problems"]
    assert _originals(root) == want  # every key, its original content
    for key, rec in dumpfile.read_manifest(str(root / "rank0" / "manifest.jsonl")).latest_by_key().items():
        with dumpfile.open_dump(str(root / rec["file"])) as fh:
            assert hashlib.sha256(fh.read()).hexdigest() == want[key]
    if settled:  # after a finished pass: one file per key, the packed one, nothing left over
        names = sorted(os.listdir(root / "rank0"))
        assert [n for n in names if n.endswith((".hsz", ".safetensors"))] == sorted(k + ".hsz" for k in want)
        assert not [n for n in names if n.startswith(".tmp-")]
        assert report.problems == []


def _local_pass(root: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        ["python3", "-", "compact", str(root), "--no-fsync", *extra],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def test_kill_9_at_random_moments_then_a_rerun_leaves_every_sample_once_and_readable(tmp_path):
    root = _dump_dir(tmp_path / "d", n=12, tokens=3000)
    want = _originals(root)
    program = onhost.bundled("compact_onhost.py")
    rng = random.Random(5)
    for _ in range(6):
        p = _local_pass(root, "--jobs", "1", "--block-bytes", "4096")
        p.stdin.write(program)
        p.stdin.close()
        time.sleep(rng.uniform(0.05, 0.4))
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)
        _each_once_and_readable(root, want, settled=False)
    p = _local_pass(root, "--jobs", "2")
    out, err = p.communicate(program, timeout=120)
    assert p.returncode == 0, err
    _each_once_and_readable(root, want, settled=True)


# --------------------------------------------------------------------------- on a lab host


@pytest.fixture
def lab1_fresh(host):
    dump_dir = host.paths.dump_dir
    subprocess.run(["rm", "-rf", str(dump_dir)], check=True, timeout=30)
    _dump_dir(dump_dir, n=8)
    yield dump_dir
    subprocess.run(["rm", "-rf", str(dump_dir)], check=True, timeout=30)
    dump_dir.mkdir(parents=True)


def _compact(lab_env, host, *args: str) -> tuple[int, dict, str]:
    rc, out, err = run_cli(lab_env, "dumps", "compact", "--host", host.name, "--json", *args, timeout=300)
    return rc, (json.loads(out) if out.strip() else {}), err


def _tree(root: Path) -> dict[str, tuple[str, int]]:
    return {
        str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != ".compact.lock"
    }


def test_compacted_dumps_pass_verify_sha_and_dry_run_changes_nothing(lab_env, host, lab1_fresh):
    root = lab1_fresh
    want = _originals(root)
    before = _tree(root)
    rc, doc, err = _compact(lab_env, host, "--dry-run")
    assert rc == 0, err
    assert doc["counts"]["would_compact"] == 8 and _tree(root) == before
    rc, doc, err = _compact(lab_env, host, "--jobs", "2")
    assert rc == 0, err
    assert doc["counts"]["compacted"] == 8 and doc["ok"] and doc["bytes_after"] < 0.8 * doc["bytes_before"]
    _each_once_and_readable(root, want, settled=True)
    rc, out, err = run_cli(lab_env, "dumps", "verify", "--host", host.name, "--sha", "--json", timeout=300)
    assert rc == 0, out + err
    check = json.loads(out)["host_check"]
    assert check["ok"] and check["files"] == 8 and check["problems"] == []
    rc, doc, err = _compact(lab_env, host)  # nothing left to do
    assert rc == 0 and doc["counts"]["compacted"] == 0, err


@pytest.mark.parametrize("point", ["packed", "renamed", "appended", "removed"])
def test_kill_9_at_each_step_then_a_rerun_leaves_every_sample_once_and_readable(lab_env, host, lab1_fresh, point):
    root = lab1_fresh
    want = _originals(root)
    rc, doc, err = _compact(lab_env, host, "--jobs", "1", "--crash-at", point)
    assert rc != 0  # the host's program died of SIGKILL mid-pass
    _each_once_and_readable(root, want, settled=False)
    rc, out, err = run_cli(lab_env, "dumps", "verify", "--host", host.name, "--sha", "--json", timeout=300)
    assert json.loads(out)["host_check"]["ok"], out
    rc, doc, err = _compact(lab_env, host, "--jobs", "2")
    assert rc == 0, err
    _each_once_and_readable(root, want, settled=True)


def test_a_file_the_dumper_may_still_write_is_never_touched(lab_env, host, lab1_fresh):
    """A `.tmp-*` file being written, a file renamed but not yet in the manifest, and a file being
    replaced (its size differs from its last manifest line) stay exactly as they are."""
    root = lab1_fresh
    rank = root / "rank0"
    (rank / ".tmp-abc.safetensors.1.2").write_bytes(b"\x08" + b"\x00" * 1000)
    unlisted = _write(rank, 40, 64, seed=9).rename(rank / ("f" * 32 + "-p0.safetensors"))
    recs = dumpfile.read_manifest(str(rank / "manifest.jsonl")).latest_by_key()
    key, rec = sorted(recs.items())[0]
    replaced = root / rec["file"]
    with open(replaced, "ab") as fh:  # the dumper rewriting the key: not the file its line names
        fh.write(b"\x00" * 64)
    keep = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (rank / ".tmp-abc.safetensors.1.2", unlisted, replaced)}
    rc, doc, err = _compact(lab_env, host, "--jobs", "2")
    assert rc == 0, err
    assert doc["counts"]["compacted"] == 7
    for p, (data, mtime) in keep.items():
        assert p.read_bytes() == data and p.stat().st_mtime_ns == mtime, p
    assert not (rank / (key + ".hsz")).exists()


# --------------------------------------------------------------------------- lab2: audit and export


@pytest.fixture
def run_of(lab, _sglang_installed, standin_base):
    from standin_runs import extraction

    return lambda faults=None: extraction(lab, standin_base, faults)


def _ckpts(out: Path) -> dict[str, str]:
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.rglob("*.ckpt"))}


@pytest.mark.docker
def test_a_compacted_extraction_passes_audit_and_exports_bit_equal_records(run_of, lab_env, lab, tmp_path):
    run = run_of()
    host = lab.host("lab2")
    root = run.dump_dir
    plain_out, packed_out = tmp_path / "plain", tmp_path / "packed"
    base = ("dumps", "export", "--host", "lab2", "--probe-mb", "0", "--json")
    rc, out, err = run_cli(lab_env, *base, "--out", str(plain_out), timeout=600)
    assert rc == 0, out + err
    rc, doc, err = _compact(lab_env, host, "--jobs", "2")
    assert rc == 0 and doc["counts"]["compacted"] == 16, err
    assert not list((root / "rank0").glob("*.safetensors"))
    rc, out, err = run_cli(lab_env, "dumps", "verify", "--host", "lab2", "--sha", "--json", timeout=300)
    assert rc == 0, out + err
    rc, out, err = run_cli(lab_env, "dumps", "audit", "--host", "lab2", "--samples", "16", "--json", timeout=300)
    assert rc == 0, out + err
    assert all(c["status"] == "ok" for c in json.loads(out)["checks"])
    rc, out, err = run_cli(lab_env, *base, "--out", str(packed_out), timeout=600)
    assert rc == 0, out + err
    assert json.loads(out)["exported"] == 16
    plain, compacted = _ckpts(plain_out), _ckpts(packed_out)
    assert len(plain) == 16 and plain == compacted
    shutil.rmtree(plain_out)
    shutil.rmtree(packed_out)


def test_compress_bench_runs_on_tiny_inputs(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "r.json"
    p = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "compress.py"),
            "--prompts",
            "3",
            "--max-tokens",
            "64",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert [r["source"] for r in doc["results"]] == ["learned", "standin"]
    assert all(r["export_bit_equal"] and 0 < r["kept"]["packed_hsz"] < 1 for r in doc["results"])
