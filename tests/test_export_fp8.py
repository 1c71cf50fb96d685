"""Dumps in FP8 storage through the readers: `dumps export` (specforge_export.py) decodes them to bf16
records equal to `fp8.roundtrip` of the tensors the dumper was given, and `verify` takes them (pure,
on the CPU: the real dumper writes the files, the exporter's stdlib and numpy decoders both run)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from test_export import H, dataset_samples, dump_samples  # noqa: E402

from remote_ops.dumper import dumpfile, fp8  # noqa: E402
from remote_ops.onhost import specforge_export as se  # noqa: E402


@pytest.fixture(params=["numpy", "stdlib"])
def decoder(request, monkeypatch):
    """The exporter with numpy (when the host's python has it) and without (its stdlib decoder)."""
    if request.param == "stdlib":
        monkeypatch.setattr(se, "numpy_or_none", lambda: None)
    else:
        pytest.importorskip("numpy")
    return request.param


def rows_of(tensors, start: int, n: int):
    hidden, aux = tensors
    return hidden[start : start + n], torch.cat([a[start : start + n] for a in aux], 1)


def test_decode_fp8_is_fp8_decode_rows_byte_for_byte(decoder):
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(6, 3 * 8, generator=g) * 100).bfloat16()
    x[1, :8] = 0
    q, scale = fp8.encode_rows(x, 3)
    q[2, 5] = torch.tensor(float("nan")).to(torch.float8_e4m3fn)  # a NaN code decodes to bf16's NaN
    np = se.numpy_or_none()
    got = se.decode_fp8(q.view(torch.uint8).numpy().tobytes(), scale.numpy().tobytes(), 3, 24, "BF16", np)
    want = fp8.decode_rows(q, scale, torch.bfloat16)
    bf16 = torch.frombuffer(bytearray(got), dtype=torch.bfloat16).view(6, 24)
    nan = want.isnan()
    assert nan.sum() == 1 and torch.equal(bf16.isnan(), nan)  # NaN stays NaN (its bits are torch's business)
    assert bf16[~nan].view(torch.int16).tolist() == want[~nan].view(torch.int16).tolist()  # the rest bit for bit
    f32 = se.decode_fp8(q.view(torch.uint8).numpy().tobytes(), scale.numpy().tobytes(), 3, 24, "F32", np)
    assert torch.equal(
        torch.frombuffer(bytearray(f32), dtype=torch.float32).view(6, 24).nan_to_num(7),
        fp8.decode_rows(q, scale, torch.float32).nan_to_num(7),
    )


def test_an_fp8_dump_exports_to_the_roundtrip_of_its_tensors_and_verifies(tmp_path, decoder):
    src = tmp_path / "dumps"
    samples = dataset_samples([5, 9])
    tensors = dump_samples(src, samples, storage="fp8_e4m3")
    report = dumpfile.verify_dir(str(src), hidden_size=H)
    assert report.ok and report.files == 2 and report.bytes_per_token == dumpfile.fp8_float_bytes(H), report.problems
    manifest = se.latest_manifest(str(src))
    start = 0
    for i, s in enumerate(samples):
        rec = manifest[se.dump_key(s["input_ids"])]
        assert rec["storage"] == fp8.STORAGE
        dest = tmp_path / "out" / se.out_name(i)
        read, _ = se.convert([(str(src / rec["file"]), rec["sha256"])], str(dest), s["input_ids"], s["loss_mask"])
        assert read == rec["bytes"]
        got = torch.load(dest, weights_only=True, mmap=True)
        hidden, aux = rows_of(tensors, start, len(s["input_ids"]))
        assert got["hidden_state"].dtype == torch.bfloat16 and got["aux_hidden_state"].dtype == torch.bfloat16
        assert torch.equal(got["hidden_state"][0], fp8.roundtrip(hidden))
        assert torch.equal(got["aux_hidden_state"][0], fp8.roundtrip(aux, 3))
        assert got["input_ids"].tolist() == s["input_ids"]
        start += len(s["input_ids"])


def test_an_fp8_prompt_split_by_chunked_prefill_is_decoded_span_by_span(tmp_path, decoder):
    long = dataset_samples([11])[0]
    src = tmp_path / "dumps"
    first = dump_samples(src, [{"input_ids": long["input_ids"][:4]}], seed=1, storage="fp8_e4m3")
    rest = dump_samples(src, [{"input_ids": long["input_ids"][4:]}], seed=2, prefixes=[4], storage="fp8_e4m3")
    manifest = se.latest_manifest(str(src))
    spans = se.find_spans(long["input_ids"], manifest, se.span_lengths(manifest))
    dest = tmp_path / "out" / se.out_name(0)
    se.convert([(str(src / r["file"]), r["sha256"]) for r in spans], str(dest), long["input_ids"], long["loss_mask"])
    got = torch.load(dest, weights_only=True)
    hidden = torch.cat([rows_of(first, 0, 4)[0], rows_of(rest, 0, 7)[0]])
    aux = torch.cat([rows_of(first, 0, 4)[1], rows_of(rest, 0, 7)[1]])
    assert torch.equal(got["hidden_state"][0], fp8.roundtrip(hidden))
    assert torch.equal(got["aux_hidden_state"][0], fp8.roundtrip(aux, 3))


def test_a_damaged_fp8_file_is_refused_by_its_sha(tmp_path, decoder):
    src = tmp_path / "dumps"
    samples = dataset_samples([4])
    dump_samples(src, samples, storage="fp8_e4m3")
    rec = next(iter(se.latest_manifest(str(src)).values()))
    path = Path(src / rec["file"])
    data = bytearray(path.read_bytes())
    data[-20] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(se.ExportError, match="sha256"):
        se.convert([(str(path), rec["sha256"])], str(tmp_path / "o" / "x.ckpt"), samples[0]["input_ids"], [1] * 4)
