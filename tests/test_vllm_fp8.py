"""FP8 storage in remote-ops' vLLM connector (REMOTE_OPS_DUMP_DTYPE=fp8_e4m3), without vLLM.

The connector travels alone into the serving container, so it carries the FP8 arithmetic of
`remote_ops/dumper/fp8.py` as its own copy (`encode_layers`); here the two are held byte-equal,
and the file it writes in FP8 storage is checked: e4m3 `hidden_states` [S, L, H], float32
`hidden_states_scale` [S, L], format `vllm-hidden-states/2`, storage and model dtype in the
metadata.  vLLM's base class is a named stand-in module (`vllm` is not installed here); the real
connector runs in the vLLM lab tests (tests/test_vllm_real.py) in the default storage.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")

from remote_ops.dumper import dumpfile, fp8  # noqa: E402

CONNECTOR = Path(__file__).resolve().parents[1] / "remote_ops" / "dumper" / "vllm_connector.py"
BASE = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"


def load_connector(monkeypatch, dtype=None):
    """The connector module, imported with a stand-in for the vLLM module it extends."""
    base = types.ModuleType(BASE)
    base.ExampleHiddenStatesConnector = type("ExampleHiddenStatesConnector", (), {})  # type: ignore[attr-defined]
    base.PendingSave = object  # type: ignore[attr-defined]
    base.extract_from_kv_cache = lambda cache, slots, n: cache[slots][:n]  # type: ignore[attr-defined]
    vllm = types.ModuleType("vllm")
    vllm.__version__ = "0.0-standin"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, BASE, base)
    if dtype is None:
        monkeypatch.delenv("REMOTE_OPS_DUMP_DTYPE", raising=False)
    else:
        monkeypatch.setenv("REMOTE_OPS_DUMP_DTYPE", dtype)
    spec = importlib.util.spec_from_file_location("remote_ops_vllm_connector_fp8_test", CONNECTOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows_of(seed=0, s=9, layers=4, h=16):
    g = torch.Generator().manual_seed(seed)
    rows = (torch.randn(s, layers, h, generator=g) * torch.logspace(-2, 2, layers)[None, :, None]).bfloat16()
    rows[2, 1] = 0  # an all-zero segment: scale 1
    return rows


def test_its_copy_of_the_codec_is_byte_equal_to_fp8_py(monkeypatch):
    c = load_connector(monkeypatch, "fp8_e4m3")
    rows = rows_of()
    for chunk in (c.ENCODE_CHUNK_VALUES, 20):  # one chunk, and several per layer
        monkeypatch.setattr(c, "ENCODE_CHUNK_VALUES", chunk)
        q, scale = c.encode_layers(rows)
        want_q, want_scale = fp8.encode_rows(rows.reshape(9, 4 * 16), 4)
        assert q.shape == (9, 4, 16) and scale.shape == (9, 4)
        assert torch.equal(q.reshape(9, 64).view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(scale, want_scale)
    assert c.STORAGE_FP8 == fp8.STORAGE and c.E4M3_MAX == fp8.E4M3_MAX


def test_the_setting_defaults_to_bf16_and_refuses_what_it_does_not_know(monkeypatch):
    c = load_connector(monkeypatch)
    assert c.STORAGE == "bf16"
    rows = rows_of()
    assert set(c.stored(rows, "bf16")) == {"hidden_states"} and c.stored(rows, "bf16")["hidden_states"] is rows
    with pytest.raises(ValueError, match="REMOTE_OPS_DUMP_DTYPE='int8': want one of bf16|fp8_e4m3"):
        load_connector(monkeypatch, "int8")


def test_an_fp8_file_holds_values_scales_and_says_what_they_decode_to(monkeypatch, tmp_path):
    c = load_connector(monkeypatch, "fp8_e4m3")
    assert c.STORAGE == "fp8_e4m3"
    rows = rows_of(seed=1)
    floats = c.stored(rows, c.STORAGE)
    meta = c.file_metadata(
        layer_ids=[1, 2, 3, 4],
        num_hidden_layers=4,
        hidden=floats["hidden_states"],
        model="m",
        request_id="r",
        model_dtype=rows.dtype,
    )
    path = tmp_path / "r.safetensors"
    tensors = {**floats, "token_ids": torch.arange(9, dtype=torch.int64)}
    c.write_atomically(tensors, meta, c._DoneEvent(), str(path), None)
    got = st_torch.load_file(str(path))
    assert got["hidden_states"].dtype == torch.float8_e4m3fn and got["hidden_states_scale"].shape == (9, 4)
    decoded = fp8.decode_rows(got["hidden_states"].reshape(9, 64), got["hidden_states_scale"]).reshape(9, 4, 16)
    assert torch.equal(decoded, fp8.roundtrip(rows.reshape(9, 64), 4).reshape(9, 4, 16))
    header = dumpfile.read_header(str(path))
    assert header.metadata["format"] == "vllm-hidden-states/2" and header.metadata["storage"] == fp8.STORAGE
    assert header.metadata["dtype"] == "bfloat16" and header.tensors["hidden_states"].dtype == "F8_E4M3"
    plain = c.file_metadata(layer_ids=[1], num_hidden_layers=4, hidden=rows, model="m", request_id="r")
    assert plain["format"] == "vllm-hidden-states/1" and "storage" not in plain and plain["dtype"] == "bfloat16"


def adopt(path: Path, root: Path, ids) -> dict:
    """The file moved into a dump dir as the extraction client does (`rank0/<key>.safetensors` and its
    manifest line)."""
    import hashlib

    key = dumpfile.dump_key(dumpfile.token_ids_bytes(ids), 0)
    dest = root / "rank0" / dumpfile.dump_file_name(key)
    dest.parent.mkdir(parents=True, exist_ok=True)
    path.rename(dest)
    data = dest.read_bytes()
    rec = {"key": key, "file": f"rank0/{dest.name}", "tokens": len(ids), "bytes": len(data), "rank": 0}
    rec.update(sha256=hashlib.sha256(data).hexdigest(), prefix_len=0, partial=False)
    dumpfile.append_manifest(str(dest.parent / dumpfile.MANIFEST_NAME), rec)
    return rec


def test_verify_takes_an_fp8_vllm_file_and_counts_its_bytes(monkeypatch, tmp_path):
    c = load_connector(monkeypatch, "fp8_e4m3")
    rows = rows_of(seed=2)
    floats = c.stored(rows, c.STORAGE)
    meta = c.file_metadata(
        layer_ids=[1, 2, 3], num_hidden_layers=4, hidden=floats["hidden_states"], model="m", request_id="r",
        model_dtype=rows.dtype,
    )  # fmt: skip
    ids = list(range(100, 109))
    path = tmp_path / "r.safetensors"
    c.write_atomically({**floats, "token_ids": torch.tensor(ids)}, meta, c._DoneEvent(), str(path), None)
    adopt(path, tmp_path / "dump", ids)
    report = dumpfile.verify_dir(str(tmp_path / "dump"), hidden_size=16)
    assert report.ok, report.problems
    assert report.bytes_per_token == 4 * 16 + 4 * 4  # 4 layers of 16 e4m3 values, 4 float32 scales
