"""`dumps export --format specforge`: real CPU dumper output on a real lab host, converted on the host
by the stdlib exporter, then loaded with SpecForge 0.2.0's OWN offline code (the wheel installed with
`pip install --no-deps specforge==0.2.0`; its `datasets` import is only a type annotation in
`specforge.data.preprocessing`, so a placeholder module is put in when `datasets` is absent)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import types
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from remote_ops.onhost import specforge_export as se

torch = pytest.importorskip("torch")
H = 64


def specforge_offline():
    """SpecForge 0.2.0's reader, file store and EAGLE-3 sample normaliser (skip when not installed)."""
    pytest.importorskip("specforge")
    sys.modules.setdefault("datasets", types.SimpleNamespace(Dataset=object))  # type annotation only
    from specforge.data.preprocessing import process_offline_eagle3_sample
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore, load_feature_file
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader

    return OfflineManifestReader, LocalFeatureStore, load_feature_file, process_offline_eagle3_sample


def dataset_samples(lens: list[int], seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lens):
        ids = torch.randint(0, 32000, (n,), generator=g).tolist()
        mask = [0] * (n // 2) + [1] * (n - n // 2)
        out.append({"id": f"s{i}", "input_ids": ids, "loss_mask": mask})
    return out


def dump_samples(
    root: Path,
    samples: list[dict],
    hidden_size: int = H,
    seed: int = 0,
    prefixes: list[int] | None = None,
    storage: str = "bf16",
) -> tuple:
    """The samples' prompts as one EXTEND batch through the REAL dumper on the CPU (`prefixes`: each
    span's prefix length, as a later chunk of chunked prefill has; `storage`: SGLANG_HS_DUMP_DTYPE);
    returns the batch's (hidden, aux) tensors."""
    from remote_ops.dumper.attach import file_metadata
    from remote_ops.dumper.config import config_from_env
    from remote_ops.dumper.dumper import Dumper
    from remote_ops.dumper.runtime import Runtime

    lens = [len(s["input_ids"]) for s in samples]
    cfg = config_from_env(
        {
            "SGLANG_HS_DUMP_DIR": str(root),
            "SGLANG_HS_DUMP_FSYNC": "0",
            "SGLANG_HS_DUMP_BUFFER_TOKENS": str(max(sum(lens), 64)),
            "SGLANG_HS_DUMP_DTYPE": storage,
        }
    )
    model = SimpleNamespace(
        config=SimpleNamespace(num_hidden_layers=8, hidden_size=hidden_size, architectures=["DeepseekV3ForCausalLM"])
    )
    meta = file_metadata(model, Runtime(version="0.5.9"), [2, 4, 5], hidden_size, "disabled")  # the dumper's own
    dumper = Dumper(cfg, rank=0, writer=True, layers=[2, 4, 5], hidden_size=hidden_size, metadata=meta)
    g = torch.Generator().manual_seed(seed)
    rows = sum(lens)
    ids = torch.tensor([t for s in samples for t in s["input_ids"]], dtype=torch.int64)
    fb = SimpleNamespace(
        forward_mode=SimpleNamespace(name="EXTEND"),
        extend_seq_lens_cpu=lens,
        extend_prefix_lens_cpu=prefixes or [0] * len(lens),
        positions=None,
        input_ids=ids,
    )
    hidden = torch.randn(rows, hidden_size, generator=g).to(torch.bfloat16)
    aux = [torch.randn(rows, hidden_size, generator=g).to(torch.bfloat16) for _ in range(3)]
    dumper.capture(fb, hidden, aux)
    dumper.close()
    return hidden, aux


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0xFF]))


# --------------------------------------------------------------------------- pure: the container format


def _record_data_offsets(path: Path) -> dict[str, int]:
    out = {}
    with zipfile.ZipFile(path) as zf, open(path, "rb") as fh:
        for info in zf.infolist():
            fh.seek(info.header_offset)
            local = fh.read(30)
            name_len, extra_len = struct.unpack("<HH", local[26:30])
            out[info.filename] = info.header_offset + 30 + name_len + extra_len
    return out


def test_written_ckpt_is_what_torch_load_reads_mmap_and_weights_only_with_64_byte_aligned_records(tmp_path):
    src = tmp_path / "dumps"
    samples = dataset_samples([5, 9])
    dump_samples(src, samples)
    manifest = se.latest_manifest(str(src))
    s = samples[1]
    rec = manifest[se.dump_key(s["input_ids"])]
    dest = tmp_path / "out" / se.out_name(1)
    read, written = se.convert([(str(src / rec["file"]), rec["sha256"])], str(dest), s["input_ids"], s["loss_mask"])
    assert read == rec["bytes"] and written == dest.stat().st_size
    for kwargs in ({"weights_only": True, "mmap": True}, {"weights_only": False}):
        d = torch.load(dest, **kwargs)
        assert d["input_ids"].dtype == torch.int64 and d["input_ids"].tolist() == s["input_ids"]
        assert d["loss_mask"].tolist() == s["loss_mask"] and d["hidden_state"].shape == (1, 9, H)
        assert d["aux_hidden_state"].shape == (1, 9, 3 * H) and d["hidden_state"].dtype == torch.bfloat16
    offsets = _record_data_offsets(dest)
    assert all(offsets[f"archive/data/{i}"] % 64 == 0 for i in range(4))
    assert dest.parent.name == "rows_0-2000" and dest.name == "data_1.ckpt"


def test_a_pre_norm_final_state_or_a_wrong_sha_is_refused_and_leaves_no_file(tmp_path):
    with pytest.raises(se.ExportError, match="post-norm"):
        se.check_source(
            {k: {} for k in ("hidden_states", "aux_hidden_states", "input_ids", "positions")},
            {"hidden_states_norm": "pre-norm"},
            3,
        )
    src = tmp_path / "dumps"
    samples = dataset_samples([4])
    dump_samples(src, samples)
    rec = next(iter(se.latest_manifest(str(src)).values()))
    dest = tmp_path / "out" / se.out_name(0)
    with pytest.raises(se.ExportError, match="sha256"):
        se.convert([(str(src / rec["file"]), "0" * 64)], str(dest), samples[0]["input_ids"], samples[0]["loss_mask"])
    assert not list((tmp_path / "out").rglob("*.ckpt")) and not list((tmp_path / "out").rglob(".tmp-*"))


def test_a_prompt_split_by_chunked_prefill_is_stitched_from_its_spans(tmp_path):
    """Chunked prefill dumps a long prompt as spans `-p0` (first chunk) and `-p<c>` (the rest), in
    different batches; the export joins them in token order into one sample."""
    pytest.importorskip("specforge")
    from safetensors import safe_open

    whole = dataset_samples([5, 11])
    long = whole[1]
    src = tmp_path / "dumps"
    dump_samples(src, [whole[0], {"input_ids": long["input_ids"][:4]}], seed=1)  # batch 1
    dump_samples(src, [{"input_ids": long["input_ids"][4:]}], seed=2, prefixes=[4])  # batch 2
    manifest = se.latest_manifest(str(src))
    spans = se.find_spans(long["input_ids"], manifest, se.span_lengths(manifest))
    assert [(r["prefix_len"], r["tokens"]) for r in spans] == [(0, 4), (4, 7)]
    dest = tmp_path / "out" / se.out_name(1)
    read, _ = se.convert(
        [(str(src / r["file"]), r["sha256"]) for r in spans], str(dest), long["input_ids"], long["loss_mask"]
    )
    assert sum(r["bytes"] for r in spans) < read < 2 * sum(r["bytes"] for r in spans)  # hashed, then floats copied
    got = specforge_offline()[2](str(dest))
    parts = []
    for r in spans:
        with safe_open(str(src / r["file"]), framework="pt") as f:
            parts.append((f.get_tensor("hidden_states"), f.get_tensor("aux_hidden_states")))
    assert torch.equal(got["hidden_state"][0], torch.cat([p[0] for p in parts]))
    assert torch.equal(got["aux_hidden_state"][0], torch.cat([p[1] for p in parts]))
    assert got["input_ids"].tolist() == long["input_ids"] and got["loss_mask"].tolist() == long["loss_mask"]
    _flip(src / spans[1]["file"], (src / spans[1]["file"]).stat().st_size - 20)
    with pytest.raises(se.ExportError, match="sha256"):
        se.convert(
            [(str(src / r["file"]), r["sha256"]) for r in spans], str(dest), long["input_ids"], long["loss_mask"]
        )


def test_large_ints_pickle_as_long1():
    assert se._int(2**31) == b"\x8a\x05\x00\x00\x00\x80\x00" and se._int(7) == b"J\x07\x00\x00\x00"


# --------------------------------------------------------------------------- on a real lab host


@pytest.fixture
def exported_setup(tmp_path, remote, host):
    """Six samples dumped by the real dumper, placed in lab1's dump dir; a local prepared dataset."""
    samples = dataset_samples([5, 7, 3, 9, 4, 6])
    src = tmp_path / "src"
    dump_samples(src, samples)
    d = host.paths.dump_dir
    remote.run(["rm", "-rf", str(d), str(d) + "-specforge"])
    remote.run(["mkdir", "-p", str(d / "rank0")])
    for f in sorted((src / "rank0").iterdir()):
        remote.put(f, str(d / "rank0" / f.name))
    extra = dataset_samples([8], seed=99)[0] | {"id": "never-dumped"}
    dataset = write_jsonl(tmp_path / "prepared.jsonl", samples + [extra])
    return samples, dataset, d


def cli(lab_env, *args, timeout=180):
    proc = subprocess.run(
        [sys.executable, "-m", "remote_ops", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=lab_env,
    )
    try:
        doc = json.loads(proc.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"{' '.join(args)}: exit {proc.returncode}, no JSON on stdout; stderr: {proc.stderr[-3000:]}")
    return proc.returncode, doc, proc.stderr


def test_export_on_the_host_loads_with_specforges_own_offline_code(lab_env, host, exported_setup):
    Reader, Store, load_feature_file, process = specforge_offline()
    samples, dataset, dump_dir = exported_setup
    rc, rep, err = cli(
        lab_env,
        "dumps",
        "export",
        "--format",
        "specforge",
        "--host",
        host.name,
        "--dataset",
        str(dataset),
        "--probe-mb",
        "1",
    )
    assert rc == 0, err
    assert rep["exported"] == 6 and rep["missing_count"] == 1 and rep["missing"][0]["id"] == "never-dumped"
    assert rep["mb_per_s"] > 0 and rep["disk_copy_probe"]["mb_per_s"] > 0 and rep["ratio_to_disk"] > 0
    out = Path(rep["out"])
    refs = Reader(str(out)).read()
    assert len(refs) == 6
    store = Store()
    by_path = {r.feature_store_uri[len("file://") :]: r for r in refs}
    for i, s in enumerate(samples):
        path = str(out / se.out_name(i))
        tensors, handle = store.get(by_path[path])
        store.release(handle)
        assert tensors["input_ids"].tolist() == s["input_ids"] and tensors["loss_mask"].tolist() == s["loss_mask"]
        _assert_same_as_dump(dump_dir, s, load_feature_file(path))
        norm = process(load_feature_file(path), max_len=2048)
        assert norm["target"].shape == (1, len(s["input_ids"]), H)
        assert norm["hidden_state"].shape == (1, len(s["input_ids"]), 3 * H)
        assert norm["loss_mask"][0, :-1].tolist() == s["loss_mask"][:-1]


def _assert_same_as_dump(dump_dir: Path, sample: dict, exported: dict) -> None:
    """hidden_state IS the dump's post-norm final state; aux_hidden_state the 3 aux layers."""
    from safetensors import safe_open

    path = dump_dir / "rank0" / f"{se.dump_key(sample['input_ids'])}.safetensors"
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["hidden_states_norm"] == "post-norm"
        assert torch.equal(exported["hidden_state"][0], f.get_tensor("hidden_states"))
        assert torch.equal(exported["aux_hidden_state"][0], f.get_tensor("aux_hidden_states"))


def test_export_resumes_and_refuses_a_corrupt_source(lab_env, host, exported_setup):
    samples, dataset, dump_dir = exported_setup
    args = ("dumps", "export", "--host", host.name, "--dataset", str(dataset), "--probe-mb", "0")
    rc, plan, _ = cli(lab_env, *args, "--dry-run")
    assert rc == 0 and plan["dry_run"] and (plan["todo"], plan["missing_count"]) == (6, 1)
    assert not Path(plan["out"]).exists()  # nothing written
    rc, first, err = cli(lab_env, *args, "--limit", "2")
    assert rc == 0 and first["exported"] == 2, err
    out = Path(first["out"])
    (out / se.out_name(1)).unlink()  # lost: exported again
    victim = dump_dir / "rank0" / f"{se.dump_key(samples[4]['input_ids'])}.safetensors"
    _flip(victim, victim.stat().st_size - 50)  # a flipped bit in the data
    rc, second, _ = cli(lab_env, *args)
    assert rc == 10 and second["error"] == "verify_failed"
    details = second  # the error document carries the report
    assert details["skipped_done"] == 1 and details["exported"] == 4
    assert [f["index"] for f in details["failed"]] == [4] and "sha256" in details["failed"][0]["reason"]
    assert not (out / se.out_name(4)).exists() and not list(out.rglob(".tmp-*"))
    lines = [json.loads(l) for l in (out / "export.jsonl").read_text().splitlines()]
    assert sorted({l["index"] for l in lines}) == [0, 1, 2, 3, 5]


def test_export_refuses_a_dataset_without_loss_mask(lab_env, host, exported_setup, tmp_path):
    samples, _, _ = exported_setup
    bare = write_jsonl(tmp_path / "bare.jsonl", [{"id": s["id"], "input_ids": s["input_ids"]} for s in samples])
    rc, doc, _ = cli(lab_env, "dumps", "export", "--host", host.name, "--dataset", str(bare))
    assert rc == 7 and "loss_mask" in doc["message"]


# --------------------------------------------------------------------------- which hidden state (source proof)


def _method(tree, cls: str, name: str):
    klass = next(n for n in tree.body if getattr(n, "name", None) == cls)
    return next(f for f in klass.body if getattr(f, "name", None) == name)


def test_specforge_wants_the_post_norm_state_and_the_dump_holds_exactly_that():
    """Read from the real sources: SpecForge 0.2.0's TargetHead applies lm_head alone (no norm), and in
    SGLang 0.5.9 the `hidden_states` that DeepseekV2ForCausalLM unpacks (where the dump hook sits) and
    hands to the logits processor with lm_head is the model output after `self.norm`."""
    import ast
    import inspect

    from remote_ops import wheels

    pytest.importorskip("specforge")
    from specforge.modeling.target.target_head import TargetHead

    head = ast.parse(inspect.getsource(TargetHead).strip())
    forward = _method(head, "TargetHead", "forward")
    assert ast.unparse(forward.body[-1]) == "return self.fc(hidden_states)"  # lm_head only
    tree = ast.parse(wheels.sglang_source("0.5.9", "python/sglang/srt/models/deepseek_v2.py").decode())
    model_fwd = ast.unparse(_method(tree, "DeepseekV2Model", "forward"))
    tail = model_fwd[model_fwd.rindex("if not self.pp_group.is_last_rank") :]
    assert "hidden_states, _ = self.norm(hidden_states, residual)" in tail
    assert tail.rstrip().endswith("return (hidden_states, aux_hidden_states)")
    causal = ast.unparse(_method(tree, "DeepseekV2ForCausalLM", "forward"))
    assert "hidden_states, aux_hidden_states = hidden_states" in causal
    assert "self.logits_processor(input_ids, hidden_states, self.lm_head, forward_batch, aux_hidden_states)" in causal
