"""The stdlib dump format: safetensors bytes, keys, manifest, crash-safe writes, the verifier."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from remote_ops.dumper import dumpfile

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")

FORMAT_PY = Path(dumpfile.__file__)


def raw(t) -> bytes:
    """Bytes of a CPU tensor (bf16 through an int16 view)."""
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def write_random_span(root, rank=0, tokens=7, hidden=16, prefix=0, seed=0):
    """One span through `write_span`; returns (record, tensors written)."""
    g = torch.Generator().manual_seed(seed)
    t = {
        "hidden_states": torch.randn(tokens, hidden, generator=g).bfloat16(),
        "aux_hidden_states": torch.randn(tokens, 3 * hidden, generator=g).bfloat16(),
        "input_ids": torch.randint(0, 163840, (tokens,), generator=g, dtype=torch.int32),
        "positions": torch.arange(prefix, prefix + tokens, dtype=torch.int32),
    }
    rec = dumpfile.write_span(
        str(root),
        rank,
        raw(t["input_ids"]),
        raw(t["positions"]),
        raw(t["hidden_states"]),
        raw(t["aux_hidden_states"]),
        hidden,
        "BF16",
        prefix,
        {"sglang_version": "0.5.9"},
    )
    return rec, t


def test_write_span_round_trips_bit_exact_through_the_safetensors_library(tmp_path):
    rec, want = write_random_span(tmp_path, tokens=11, prefix=3)
    got = st_torch.load_file(str(tmp_path / rec["file"]))
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8))
    assert rec["partial"] is True and rec["prefix_len"] == 3 and rec["tokens"] == 11
    assert rec["sha256"] == hashlib.sha256((tmp_path / rec["file"]).read_bytes()).hexdigest()
    assert rec["bytes"] == (tmp_path / rec["file"]).stat().st_size


def test_read_header_parses_files_written_by_the_safetensors_library(tmp_path):
    path = str(tmp_path / "lib.safetensors")
    st_torch.save_file(
        {"a": torch.zeros(3, 5, dtype=torch.bfloat16), "b": torch.ones(4, dtype=torch.int64)}, path, metadata={"k": "v"}
    )
    header = dumpfile.read_header(path)
    assert header.metadata == {"k": "v"}
    assert header.tensors["a"].shape == [3, 5] and header.tensors["a"].dtype == "BF16"
    assert header.data_start + header.data_len == os.path.getsize(path)


def test_key_is_sha256_of_int32_le_ids_plus_prefix():
    ids = [1, 163839, 0, 42]
    want = hashlib.sha256(struct.pack("<4i", *ids)).hexdigest()[:32] + "-p5"
    assert dumpfile.dump_key(dumpfile.token_ids_bytes(ids), 5) == want


def test_header_is_padded_to_eight_bytes_and_tensors_follow_the_contract_order(tmp_path):
    rec, _ = write_random_span(tmp_path, tokens=3)
    header = dumpfile.read_header(str(tmp_path / rec["file"]))
    assert header.header_len % 8 == 0
    starts = sorted(header.tensors, key=lambda n: header.tensors[n].start)
    assert starts == list(dumpfile.TENSOR_ORDER)


def test_kimi_size_gives_57344_float_bytes_per_token(tmp_path):
    rec, _ = write_random_span(tmp_path, tokens=2, hidden=dumpfile.KIMI_K25_HIDDEN_SIZE)
    report = dumpfile.verify_dir(str(tmp_path), hidden_size=7168)
    assert report.ok, report.problems
    assert report.bytes_per_token == 57344 == 4 * 7168 * 2
    assert rec["bytes"] == 8 + dumpfile.read_header(str(tmp_path / rec["file"])).header_len + 2 * (57344 + 8)


def test_failed_write_leaves_neither_the_file_nor_a_temp(tmp_path, monkeypatch):
    calls = {"n": 0}
    real_write = os.write

    def failing_write(fd, data):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(dumpfile.os, "write", failing_write)
    with pytest.raises(OSError):
        write_random_span(tmp_path)
    monkeypatch.undo()
    assert [p.name for p in (tmp_path / "rank0").iterdir()] == []


def test_size_mismatch_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="hidden_states"):
        dumpfile.write_dump_file(str(tmp_path / "x.safetensors"), {"hidden_states": ("BF16", [2, 4], b"\0" * 15)}, {})
    assert list(tmp_path.iterdir()) == []


def corrupt_cases():
    """(name, mutation of (root, record)) pairs the verifier must flag as errors."""

    def truncate(root, rec):
        p = root / rec["file"]
        p.write_bytes(p.read_bytes()[:-10])

    def flip_byte(root, rec):
        p = root / rec["file"]
        b = bytearray(p.read_bytes())
        b[-20] ^= 0xFF
        p.write_bytes(bytes(b))

    def delete(root, rec):
        (root / rec["file"]).unlink()

    def wrong_ids(root, rec):
        p = root / rec["file"]
        b = bytearray(p.read_bytes())
        b[-1 - 4 * rec["tokens"]] ^= 0x01  # last byte of input_ids (positions follow)
        p.write_bytes(bytes(b))

    return [("truncated", truncate), ("flipped", flip_byte), ("missing", delete), ("ids", wrong_ids)]


@pytest.mark.parametrize("name,mutate", corrupt_cases())
def test_verifier_flags_damaged_files(tmp_path, name, mutate):
    rec, _ = write_random_span(tmp_path, tokens=9)
    write_random_span(tmp_path, tokens=4, seed=1)
    assert dumpfile.verify_dir(str(tmp_path)).ok
    mutate(tmp_path, rec)
    report = dumpfile.verify_dir(str(tmp_path))
    assert not report.ok
    assert any(p.level == "error" and rec["file"] in p.where for p in report.problems)


def test_verifier_checks_hidden_size_and_reports_leftovers_as_warnings(tmp_path):
    write_random_span(tmp_path, tokens=5, hidden=16)
    folder = tmp_path / "rank0"
    (folder / ".tmp-abc.safetensors.1.2").write_bytes(b"partial")
    shutil.copy(next(folder.glob("*.safetensors")), folder / ("f" * 32 + "-p0.safetensors"))
    with open(folder / dumpfile.MANIFEST_NAME, "ab") as fh:
        fh.write(b'{"key": "torn')
    report = dumpfile.verify_dir(str(tmp_path))
    assert report.ok
    messages = " ".join(p.message for p in report.problems if p.level == "warning")
    assert "temp file" in messages and "not in the manifest" in messages and "torn" in messages
    assert not dumpfile.verify_dir(str(tmp_path), hidden_size=7168).ok


def test_repeated_key_keeps_the_last_manifest_line(tmp_path):
    write_random_span(tmp_path, tokens=5)
    write_random_span(tmp_path, tokens=5)
    manifest = dumpfile.read_manifest(str(tmp_path / "rank0" / dumpfile.MANIFEST_NAME))
    assert len(manifest.records) == 2 and len(manifest.latest_by_key()) == 1
    assert dumpfile.verify_dir(str(tmp_path)).files == 1


def test_compare_ranks_sees_identical_and_differing_payloads(tmp_path):
    for rank in (0, 1):
        write_random_span(tmp_path, rank=rank, tokens=6, seed=3)
    result = dumpfile.compare_ranks(str(tmp_path))
    assert result["ok"] and result["compared"] == 1
    files = list((tmp_path / "rank0").glob("*.safetensors")) + list((tmp_path / "rank1").glob("*.safetensors"))
    assert files[0].read_bytes() != files[1].read_bytes()  # only the rank in the header differs
    b = bytearray(files[1].read_bytes())
    b[-30] ^= 1
    files[1].write_bytes(bytes(b))
    assert dumpfile.compare_ranks(str(tmp_path))["differing"] == [files[0].stem]


def test_verifier_runs_standalone_with_plain_python_and_no_torch(tmp_path):
    """As shipped to a host: dumpfile.py alone, `python3 -I -S` (no site-packages, so no torch)."""
    dumps = tmp_path / "dumps"
    for i in range(3):
        write_random_span(dumps, tokens=random.Random(i).randint(1, 20), seed=i)
    shipped = tmp_path / "bin" / "dumpfile.py"
    shipped.parent.mkdir()
    shutil.copy(FORMAT_PY, shipped)
    python = shutil.which("python3") or sys.executable
    proc = subprocess.run(
        [python, "-I", "-S", str(shipped), "verify", str(dumps), "--hidden-size", "16", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] and report["files"] == 3 and report["bytes_per_token"] == 4 * 16 * 2
    bad = subprocess.run(
        [python, "-I", "-S", str(shipped), "verify", str(dumps), "--hidden-size", "32"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 1 and "hidden size 16, want 32" in bad.stdout
