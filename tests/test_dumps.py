"""Pure tests of dump reconciliation, disk projection and the host probe parser."""

from __future__ import annotations

import base64
import json

from remote_ops.core import dumpcheck, shell
from remote_ops.probes import batch
from remote_ops.probes.dumps import DumpStatus, DumpVerify
from remote_ops.workflows import dumps


def _rec(key, tokens, size, rank=0, **extra):
    return {
        "key": key,
        "file": f"rank{rank}/{key}.safetensors",
        "tokens": tokens,
        "bytes": size,
        "sha256": "0" * 64,
        "prefix_len": 0,
        "partial": False,
        "rank": rank,
        "hidden_size": 7168,
        "dtype": "BF16",
        **extra,
    }


def _manifest(*recs, torn=False):
    text = "".join(json.dumps(r) + "\n" for r in recs)
    return text + ('{"key": "x", "fi' if torn else "")


def test_57344_float_bytes_per_token_for_kimi():
    assert dumpcheck.float_bytes_per_token(7168) == 57344
    assert dumpcheck.float_bytes_per_token(64) == 512


def test_bytes_per_token_from_hidden_size_dtype_and_storage():
    """The one size estimate: bf16 (and other dtypes) 4*H*size; FP8 storage, as the inventory, a file's
    metadata or a manifest line's dtype says it, 4*H + 16 (the dumper's own count, dumpfile.fp8_float_bytes)."""
    from remote_ops.dumper import dumpfile

    assert dumpcheck.float_bytes_per_token(7168, "F32") == 4 * 7168 * 4
    for fp8 in ({"storage": "fp8_e4m3"}, {"storage": "fp8_e4m3_rowscale"}, {"dtype": "F8_E4M3", "storage": None}):
        assert dumpcheck.float_bytes_per_token(7168, **fp8) == 28688 == dumpfile.fp8_float_bytes(7168)
        assert dumpcheck.bytes_per_token(64, **fp8) == 4 * 64 + 16 + 8
    assert dumpcheck.bytes_per_token(7168) == 57352


def test_an_fp8_host_is_estimated_at_the_fp8_size():
    """`extract start`'s first guess and `dumps status`'s projection follow `dump.storage`."""
    from types import SimpleNamespace

    from remote_ops.workflows import extract

    host = SimpleNamespace(model=SimpleNamespace(hidden_size=7168), dump=SimpleNamespace(storage="fp8_e4m3"))
    assert extract.dump_bytes_per_token(host) == 28688 + 8
    host.dump.storage = "bf16"
    assert extract.dump_bytes_per_token(host) == 57352
    empty = dumpcheck.reconcile("/d", {}, "")
    p = dumpcheck.project(empty, samples_total=10, host_free=None, local_free=None, margin=0.0, storage="fp8_e4m3")
    assert p.remaining_bytes == 10 * 1730 * (28688 + 8) and "FP8 storage" in p.basis
    line = _rec("a-p0", 10, 10 * 28696 + 900, dtype="F8_E4M3", storage="fp8_e4m3_rowscale", format_version="2")
    r = dumpcheck.reconcile("/d", {"rank0/a-p0.safetensors": 10 * 28696 + 900}, _manifest(line), 7168)
    assert r.ok and r.float_bytes_per_token == 28688 and r.storage == "fp8_e4m3_rowscale"


def test_reconcile_counts_and_finds_every_kind_of_disagreement():
    per = 1730 * 57352 + 512
    files = {
        "rank0/a-p0.safetensors": per,
        "rank0/b-p0.safetensors": 5,
        "rank0/u-p0.safetensors": 9,
        "rank0/.tmp-c-p0.safetensors.1.2": 3,
        "rank0/manifest.jsonl": 100,
        "rank0/stats.json": 10,
    }
    text = _manifest(_rec("a-p0", 1730, per), _rec("b-p0", 1, 6), _rec("m-p0", 1, 7), torn=True)
    r = dumpcheck.reconcile("/d", files, text, 7168)
    assert (r.manifest_rows, r.files_present, r.torn_lines) == (3, 3, 1)
    assert r.missing_files == ["rank0/m-p0.safetensors"]
    assert r.unlisted_files == ["rank0/u-p0.safetensors"]
    assert r.size_mismatches == [{"file": "rank0/b-p0.safetensors", "size": 5, "manifest": 6}]
    assert r.temp_files == ["rank0/.tmp-c-p0.safetensors.1.2"]
    assert r.tokens == 1731 and r.float_bytes_per_token == 57344
    assert not r.ok and "records" not in r.to_dict()


def test_last_manifest_line_of_a_key_wins():
    text = _manifest(_rec("a-p0", 1, 10), _rec("a-p0", 2, 20))
    r = dumpcheck.reconcile("/d", {"rank0/a-p0.safetensors": 20}, text)
    assert r.ok and r.manifest_rows == 1 and r.tokens == 2


def test_projection_uses_the_average_file_and_compares_free_space():
    text = _manifest(_rec("a-p0", 10, 1000), _rec("b-p0", 10, 3000))
    r = dumpcheck.reconcile("/d", {"rank0/a-p0.safetensors": 1000, "rank0/b-p0.safetensors": 3000}, text)
    p = dumpcheck.project(r, samples_total=12, host_free=50_000, local_free=10_000, local_bytes=1000, margin=0.0)
    assert p.bytes_per_sample == 2000 and p.remaining_bytes == 20_000 and p.host_ok
    assert p.local_needed == 23_000 and p.local_ok is False


def test_projection_without_files_uses_the_typical_sample():
    r = dumpcheck.reconcile("/d", {}, "")
    p = dumpcheck.project(r, samples_total=10_000, host_free=None, local_free=None, margin=0.0)
    assert p.remaining_bytes == 10_000 * 1730 * (57344 + 8)
    assert p.host_ok is None and "typical" in p.basis


def test_probe_output_parses_files_manifest_and_free_space():
    out = "\n".join(
        [
            shell.SECTION + "exists:begin",
            shell.SECTION + "exists:end 0",
            shell.SECTION + "files:begin",
            base64.b64encode(b"rank0/a-p0.safetensors\x00123\x00f\x00rank0/manifest.jsonl\x009\x00f\x00").decode(),
            shell.SECTION + "files:end 0",
            shell.SECTION + "manifest:begin",
            '{"key":"a-p0","file":"rank0/a-p0.safetensors"}',
            shell.SECTION + "manifest:end 0",
            shell.SECTION + "df:begin",
            "/dev/vda 1000 400 600 40% /",
            shell.SECTION + "df:end 0",
        ]
    )
    p = DumpStatus("/d").read(batch.split(out))
    assert p.exists and p.files == {"rank0/a-p0.safetensors": 123, "rank0/manifest.jsonl": 9}
    assert p.free_bytes == 600 and "a-p0" in p.manifest_text


def test_verify_command_ships_format_py_on_stdin():
    cmd = DumpVerify("/data/d x", 7168, check_sha=False).command()
    assert cmd == (  # in the dir as the host resolves it (the configured one may be a symlink)
        "cd -P -- '/data/d x' 2>/dev/null || exit 3; python3 - verify \"$(pwd -P)\" --json --hidden-size 7168 --no-sha"
    )
    assert b"def verify_dir" in dumps.format_script()


def test_pull_items_skip_rows_without_a_file_and_local_manifests_list_only_pulled_files(tmp_path):
    text = _manifest(_rec("a-p0", 1, 4), _rec("m-p0", 1, 7))
    r = dumpcheck.reconcile("/d", {"rank0/a-p0.safetensors": 4}, text)
    items = dumps.pull_items(r, tmp_path)
    assert [i.remote for i in items] == ["rank0/a-p0.safetensors"] and items[0].size == 4
    items[0].local.parent.mkdir(parents=True)
    items[0].local.write_bytes(b"abcd")
    assert dumps.write_local_manifests(r, tmp_path) == 1
    assert json.loads((tmp_path / "rank0" / "manifest.jsonl").read_text())["key"] == "a-p0"
