"""remote-ops' vLLM connector on a cache in host memory, without vLLM: `gather_on_host` (numpy) gives
upstream's rows bit for bit, and the per-request work done once (issue 37: where extraction's time
goes, bench/vllm_extract.py --profile).  vLLM's base module is a stand-in carrying upstream's
`extract_from_kv_cache` (vllm 0.32.0, three lines)."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("numpy")
st_torch = pytest.importorskip("safetensors.torch")

CONNECTOR = Path(__file__).resolve().parents[1] / "remote_ops" / "dumper" / "vllm_connector.py"
BASE = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"


def upstream_extract(kv_cache, slot_mapping, num_tokens):
    """vllm 0.32.0's extract_from_kv_cache."""
    block_size = kv_cache.shape[2]
    return kv_cache[slot_mapping // block_size, :, slot_mapping % block_size][:num_tokens]


@pytest.fixture
def c(monkeypatch):
    base = types.ModuleType(BASE)
    base.ExampleHiddenStatesConnector = type("ExampleHiddenStatesConnector", (), {})  # type: ignore[attr-defined]
    base.PendingSave = object  # type: ignore[attr-defined]
    base.extract_from_kv_cache = upstream_extract  # type: ignore[attr-defined]
    vllm = types.ModuleType("vllm")
    vllm.__version__ = "0.0-standin"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, BASE, base)
    monkeypatch.delenv("REMOTE_OPS_DUMP_DTYPE", raising=False)
    spec = importlib.util.spec_from_file_location("remote_ops_vllm_connector_host_test", CONNECTOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def slots_of(blocks, block_size):
    ids = torch.tensor(blocks, dtype=torch.long)
    return (torch.arange(block_size).reshape(1, -1) + ids.reshape(-1, 1) * block_size).flatten()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("block_size,num_tokens", [(16, 37), (16, 48), (128, 300)])
def test_gather_on_host_is_upstreams_rows_bit_for_bit(c, dtype, block_size, num_tokens):
    g = torch.Generator().manual_seed(block_size + num_tokens)
    cache = torch.randn(12, 4, block_size, 24, generator=g).to(dtype)  # [blocks, L, block, H]
    blocks = [7, 2, 9, 0][: -(-num_tokens // block_size)]
    slots = slots_of(blocks, block_size)
    want = upstream_extract(cache, slots, num_tokens)
    got = c.gather_on_host(cache, slots, num_tokens)
    assert got.dtype == dtype and got.shape == want.shape == (num_tokens, 4, 24) and got.is_contiguous()
    assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8))
    cache.zero_()  # a copy: the request's blocks may be reused once it is done
    assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8))


def test_a_cache_numpy_cannot_view_falls_back_to_upstreams_indexing(c):
    cache = torch.randn(4, 2, 16, 8).transpose(2, 3).contiguous().transpose(2, 3)  # last dim not contiguous
    slots = slots_of([3, 1], 16)
    assert torch.equal(c.gather_on_host(cache, slots, 20), upstream_extract(cache, slots, 20))


def test_the_written_file_is_the_one_before(c, tmp_path):
    """The file from a host cache through the new gather holds what the one from upstream's indexing +
    `.to("cpu", copy=True)` (what the connector wrote before) holds: the same tensors byte for byte,
    the same metadata (safetensors orders the metadata keys in the header as it likes, so the header
    itself is not byte-stable from one write to the next)."""
    from safetensors import safe_open

    cache = torch.randn(10, 4, 16, 32).bfloat16()
    slots, n = slots_of([4, 8, 1], 16), 40
    ids = torch.arange(n, dtype=torch.int64)
    meta = c.file_metadata(layer_ids=[1, 2, 3, 4], num_hidden_layers=4, hidden=cache[0, 0], model="m", request_id="r")
    old = upstream_extract(cache, slots, n).to("cpu", copy=True).contiguous()
    new = c.gather_on_host(cache, slots, n)
    read = {}
    for name, rows in (("old", old), ("new", new)):
        c.write_atomically({"hidden_states": rows, "token_ids": ids}, meta, c._DoneEvent(), str(tmp_path / name), None)
        with safe_open(str(tmp_path / name), "pt") as f:
            read[name] = (f.metadata(), {k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
        assert len((tmp_path / name).read_bytes()) == len((tmp_path / "old").read_bytes())
    assert read["old"][0] == read["new"][0] == meta
    assert read["old"][1].keys() == read["new"][1].keys() == {"hidden_states", "token_ids"}
    for k, t in read["old"][1].items():
        assert t.dtype == read["new"][1][k].dtype and torch.equal(
            t.view(torch.uint8), read["new"][1][k].view(torch.uint8)
        )


def test_version_and_context_are_read_once(c):
    assert c.vllm_version() == "0.0-standin"
    sys.modules["vllm"].__version__ = "changed"
    assert c.vllm_version() == "0.0-standin"  # cached: the running vLLM does not change
    conn = object.__new__(c.RemoteOpsHiddenStatesConnector)
    reads = []

    def read():
        reads.append(1)
        return [1, 2], 4, "m"

    conn._read_file_context = read
    assert conn._file_context() == conn._file_context() == ([1, 2], 4, "m")
    assert len(reads) == 1
