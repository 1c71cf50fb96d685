"""FP8 storage in the SGLang dumper (SGLANG_HS_DUMP_DTYPE=fp8_e4m3), on CPU torch.

What is proved, on every copy path the CPU can run: the general path (torch copies)
with the writer process and with writer threads, the driver path through
`MemmoveDriver` (test_dump_gather's named stand-in for libcuda: copies done with
memmove), each step alone and gathered.  The file holds e4m3 values and float32
scales that decode to exactly `fp8.roundtrip` of the model's tensors (the same
`fp8.encode_rows` bytes), says format_version 2 and storage=fp8_e4m3_rowscale with
the model dtype, passes `verify`, and takes 4H + 16 float bytes a token.  The default
(bf16) files are untouched: test_dump_capture and test_dump_gather prove them bit-exact.
The cast's cost on a GPU is measured on the H200 (bench/dumper_gpu.py --storage fp8_e4m3).
"""

from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")

from test_dump_capture import H, make_batch, make_dumper, span_files  # noqa: E402
from test_dump_gather import MemmoveDriver, gathering  # noqa: E402, F401  (a fixture)

from remote_ops.dumper import config as dump_config, dumpfile, fp8, layout, staging  # noqa: E402


def assert_fp8_spans(batch, root):
    """Every span's file: e4m3 values and scales equal to fp8.encode_rows of the model's tensors, ids and
    positions as in bf16 storage, the FP8 metadata."""
    for path, want, _prefix in span_files(batch, root):
        got = st_torch.load_file(str(path))
        assert set(got) == set(dumpfile.FP8_TENSOR_ORDER), path
        for name, segments, scale_name in (
            ("hidden_states", 1, "hidden_states_scale"),
            ("aux_hidden_states", 3, "aux_hidden_states_scale"),
        ):
            q, scale = fp8.encode_rows(want[name], segments)
            assert got[name].dtype == torch.float8_e4m3fn
            assert torch.equal(got[name].view(torch.uint8), q.view(torch.uint8)), (path, name)
            assert torch.equal(got[scale_name], scale), (path, scale_name)
            decoded = fp8.decode_rows(got[name], got[scale_name], torch.bfloat16)
            assert torch.equal(decoded, fp8.roundtrip(want[name], segments)), (path, name)
        for name in ("input_ids", "positions"):
            assert torch.equal(got[name], want[name]), (path, name)
        meta = dumpfile.read_header(str(path)).metadata
        assert meta["storage"] == dumpfile.STORAGE_FP8 == fp8.STORAGE
        assert meta["format_version"] == dumpfile.FORMAT_VERSION_FP8 and meta["dtype"] == "bfloat16"


@pytest.fixture(params=["process", "thread"])
def writer_mode(request):
    """The writer process (the default) and writer threads."""
    return request.param


def test_the_setting_is_validated_like_the_others():
    base = {"SGLANG_HS_DUMP_DIR": "/x"}
    assert dump_config.config_from_env(base).storage == "bf16"
    assert dump_config.config_from_env(dict(base, SGLANG_HS_DUMP_DTYPE="FP8_E4M3")).storage == "fp8_e4m3"
    with pytest.raises(ValueError, match="SGLANG_HS_DUMP_DTYPE='fp16': want one of bf16|fp8_e4m3"):
        dump_config.config_from_env(dict(base, SGLANG_HS_DUMP_DTYPE="fp16"))


def test_general_path_writes_e4m3_and_scales_that_decode_to_the_roundtrip(tmp_path, writer_mode):
    d = make_dumper(tmp_path, dtype="fp8_e4m3", writer=writer_mode)
    try:
        batches = [make_batch([3, 5, 1], [0, 7, 0], seed=1), make_batch([17], seed=2)]
        batches[1].hidden[4] = 0  # an all-zero row: scale 1
        for b in batches:
            d.capture(b.fb, b.hidden, b.aux)
        assert d.flush(30)
        for b in batches:
            assert_fp8_spans(b, tmp_path)
        report = dumpfile.verify_dir(str(tmp_path), hidden_size=H)
        assert report.ok and report.files == 4, report.problems
        assert report.bytes_per_token == dumpfile.fp8_float_bytes(H) == 4 * H + 16
        lines = dumpfile.read_manifest(str(tmp_path / "rank0" / "manifest.jsonl")).records
        assert {(r["dtype"], r["storage"], r["format_version"]) for r in lines} == {("F8_E4M3", fp8.STORAGE, "2")}
        stats = d.stats.snapshot()
        assert stats["storage"] == "fp8_e4m3" and stats["errors"] == 0 and stats["files"] == 4
    finally:
        d.close(timeout=10)


def test_preallocated_buffers_are_fp8_and_no_capture_makes_them_again(tmp_path, writer_mode, monkeypatch):
    """preallocate() from a bf16 probe makes FP8 buffers: made in bf16, each one would be made again
    (pinned, on a GPU: a device-wide sync on the forward thread) at its first capture."""
    d = make_dumper(tmp_path, dtype="fp8_e4m3", writer=writer_mode)
    try:
        b = make_batch([3, 5])
        d.preallocate(b.hidden, 16)
        assert {buf.dtype for buf in d.pool.buffers} == {staging.FP8}
        remade = []
        real = d.pool._remake
        monkeypatch.setattr(d.pool, "_remake", lambda *a: remade.append(a) or real(*a))
        for seed in range(3):
            b = make_batch([3, 5], seed=seed)
            d.capture(b.fb, b.hidden, b.aux)
        assert d.flush(30) and remade == []
        assert_fp8_spans(b, tmp_path)
    finally:
        d.close(timeout=10)


def test_bad_shapes_are_counted_before_the_cast(tmp_path, writer_mode):
    d = make_dumper(tmp_path, dtype="fp8_e4m3", writer=writer_mode)
    try:
        b = make_batch([4, 4])
        d.capture(b.fb, b.hidden[:5], b.aux)
        d.capture(b.fb, b.hidden.to(torch.int32), b.aux)  # not a float the cast takes
        d.flush(10)
        snap = d.stats.snapshot()
        assert snap["errors"] == 2 and snap["files"] == 0
    finally:
        d.close(timeout=10)


@pytest.fixture
def driver_dumper(gathering):
    """A writer-process dumper whose steps take the driver path (MemmoveDriver), in FP8 storage."""
    return functools.partial(gathering, dtype="fp8_e4m3")


@pytest.mark.parametrize("gather_tokens", [0, 64])
def test_driver_copies_alone_and_gathered_write_the_same_fp8_files(tmp_path, driver_dumper, gather_tokens):
    d, driver = driver_dumper(gather_tokens=gather_tokens)
    batches = [make_batch(lens, seed=10 + i) for i, lens in enumerate([[3], [2, 4], [5]])]
    planned = []
    plan = d.stager.plan
    d.stager.plan = lambda *a: planned.append(plan(*a)) or planned[-1]
    for b in batches:
        d.capture(b.fb, b.hidden, b.aux)
    assert d.flush(10)
    assert planned and all(p is not None and p[7] for p in planned)  # every step took the driver copies
    assert d.job_seq == (1 if gather_tokens else 3) and len(driver.posts) == d.job_seq
    for b in batches:
        assert_fp8_spans(b, tmp_path)
    assert d.stats.snapshot()["errors"] == 0


def test_the_plan_copies_the_aux_block_and_the_scales_like_the_torch_path(monkeypatch):
    """The driver copies of an FP8 step (values, one aux block, the scales) put in the buffer what the
    general path (torch copies) puts there; aux views that are not one block have no plan."""
    rows, h = 5, 8
    b = make_batch([rows + 1], hidden=h, seed=3)
    q_hidden, q_aux, scale = fp8.encode_step(b.hidden, b.aux, rows)
    thirds = [q_aux[:, k * h : (k + 1) * h] for k in range(3)]
    ids, pos = b.fb.input_ids, b.fb.positions.to(torch.int32)
    stager = staging.Stager(MemmoveDriver())
    stager.device_index, stager.side_raw, stager.fence_event = -1, 1, 1
    monkeypatch.setattr(staging, "_RAW_STREAM", lambda index: 0)
    plan = stager.plan(q_hidden, thirds, ids, pos, rows, h, scale)
    assert plan is not None and plan[7] == scale.data_ptr()
    buf = staging.HostBuffer(rows + 3, h, torch.float8_e4m3fn, pin=False)
    ref = staging.HostBuffer(rows + 3, h, torch.float8_e4m3fn, pin=False)
    assert buf.layout.scaled and buf.layout.nbytes == (rows + 3) * (4 * h + 16 + 16)
    stager.queue(plan, buf, rows)
    staging._copy_torch(ref, q_hidden, thirds, ids, pos, rows, non_blocking=False, scale=scale)
    for region, row_bytes in enumerate((h, 3 * h, 8, 4, 16)):
        start = ref.layout.offsets[region]
        assert bytes(buf.mem[start : start + rows * row_bytes]) == bytes(ref.mem[start : start + rows * row_bytes])
    apart = [t.clone() for t in thirds]  # three separate tensors: not one block
    assert stager.plan(q_hidden, apart, ids, pos, rows, h, scale) is None


def test_scales_split_into_the_files_two_tensors_bit_for_bit():
    import struct

    words = [0x7FC00001, 1, 2, 3, 4, 5, 6, 0xFFFFFFFF]  # a NaN payload kept: moved as integers
    hidden, aux = layout.split_scales(memoryview(struct.pack("<8I", *words)))
    assert struct.unpack("<2I", hidden) == (0x7FC00001, 4) and struct.unpack("<6I", aux) == (1, 2, 3, 5, 6, 0xFFFFFFFF)


def test_write_span_refuses_values_and_scales_that_do_not_go_together(tmp_path):
    ids = dumpfile.token_ids_bytes([1, 2])
    with pytest.raises(ValueError, match="FP8 storage has both"):
        dumpfile.write_span(str(tmp_path), 0, ids, ids, b"\0" * 4, b"\0" * 12, 2, "F8_E4M3")
    with pytest.raises(ValueError, match="FP8 storage has both"):
        dumpfile.write_span(str(tmp_path), 0, ids, ids, b"\0" * 8, b"\0" * 24, 2, "BF16", scales=(b"", b""))


def fp8_header(tokens=2, h=4, **changes):
    """A parsed header of a well-formed FP8 file, with `changes` ({name: (dtype, shape)} or metadata)."""
    tensors = {
        "hidden_states": ("F8_E4M3", [tokens, h]),
        "aux_hidden_states": ("F8_E4M3", [tokens, 3 * h]),
        "input_ids": ("I32", [tokens]),
        "positions": ("I32", [tokens]),
        "hidden_states_scale": ("F32", [tokens, 1]),
        "aux_hidden_states_scale": ("F32", [tokens, 3]),
    }
    meta = {"storage": dumpfile.STORAGE_FP8, "format_version": "2", "dtype": "bfloat16", "format": "remote-ops-hs-dump"}
    for k, v in changes.items():
        if k in tensors:
            tensors[k] = v
        elif v is None:
            tensors.pop(k.replace("drop_", ""), None) if k.startswith("drop_") else meta.pop(k, None)
        else:
            meta[k] = v
    raw = dumpfile.build_header(
        {n: (dt, shape, b"") for n, (dt, shape) in tensors.items()}, meta, dumpfile.FP8_TENSOR_ORDER
    )
    header = dumpfile.parse_header(raw[8:])
    return header, 8 + header.header_len + header.data_len


@pytest.mark.parametrize(
    "changes, message",
    [
        ({}, None),
        ({"drop_aux_hidden_states_scale": None}, "tensors are"),
        ({"hidden_states_scale": ("F32", [2, 3])}, "hidden_states_scale shape"),
        ({"aux_hidden_states_scale": ("BF16", [2, 3])}, "aux_hidden_states_scale dtype BF16"),
        ({"aux_hidden_states": ("BF16", [2, 12])}, "aux_hidden_states dtype BF16"),
        ({"format_version": "1"}, "format_version='1'"),
        ({"dtype": None}, "not a model dtype"),
    ],
)
def test_check_layout_takes_fp8_files_and_names_what_is_wrong(changes, message):
    header, size = fp8_header(**changes)
    errs, h, per_token = dumpfile.check_layout(header, size, 2, 4)
    if message is None:
        assert errs == [] and h == 4 and per_token == dumpfile.fp8_float_bytes(4)
    else:
        assert any(message in e for e in errs), errs
