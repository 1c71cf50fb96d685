"""`dumps audit`: sampled dumps checked on the host against what the served model computes.

Pure: the aux layer-id numbering per SGLang release (spec data, checked against the released
model files), the drafter config as SGLang reads it, the verdicts; the on-host auditor
(`remote_ops/onhost/audit_onhost.py`, the shipped file run as a program) over dumps that the
stand-in network (docker/standin/standin_model.py) computes and the dump contract's writer
writes, post-norm and with each fault, numpy and its stdlib fallback alike.

On the lab (the "Done when" of the issue): a 16-sample extraction on the computing stand-in
deployed on lab2, then `remote-ops dumps audit` passes; pre-norm finals, a dropped aux layer, a
NaN written into a dump (its manifest sha256 updated, so `dumps verify --sha` passes) and a
draft config whose layer ids are off by one each fail with exit 10, naming the fault.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_cli

from remote_ops import onhost
from remote_ops.core import layerids, patchspec
from remote_ops.dumper import dumpfile
from remote_ops.errors import ConfigError
from remote_ops.onhost import audit_onhost as onhost_audit
from remote_ops.probes.audit import DumpAudit, audit_mounts, evaluate
from remote_ops.workflows import sandbox

REPO = Path(__file__).resolve().parents[1]
AUDITOR = REPO / "remote_ops" / "onhost" / "audit_onhost.py"
LAYERS = [2, 4, 5]  # the 8-layer stand-in's default [2, L//2, L-3]


# --------------------------------------------------------------------------- the numbering per release


def test_each_release_numbers_drafter_ids_as_its_model_file_does():
    rule = lambda name, v: patchspec.layer_convention(name, v).rule  # noqa: E731
    assert rule("deepseek-v2", "0.5.9") == rule("deepseek-v2", "0.5.12.post1") == "plus_one"
    assert rule("deepseek-v2", "0.5.13") == rule("deepseek-v2", "0.5.23") == "plus_one_if_first_is_1"
    assert rule("llama", "0.5.23") == rule("qwen3-moe", "0.5.14") == "plus_one"
    assert "25454" in patchspec.layer_convention("deepseek-v2", "0.5.13").source
    assert patchspec.layer_convention("deepseek-v2", "nightly") is None
    # Kimi-K2.5 (61 layers) captures [2, 30, 58]: ids [1, 29, 57] give it on every release ...
    for v in ("0.5.9", "0.5.13"):
        assert layerids.served_layers(rule("deepseek-v2", v), [1, 29, 57], 61) == [2, 30, 58]
    # ... ids [2, 30, 58] (the capture-before numbering) only from 0.5.13 on; no ids: the default
    assert layerids.served_layers("plus_one", [2, 30, 58], 61) == [3, 31, 59]
    assert layerids.served_layers("plus_one_if_first_is_1", [2, 30, 58], 61) == [2, 30, 58]
    assert layerids.served_layers("plus_one", None, 61) == [2, 30, 58]
    assert layerids.ids_for("plus_one_if_first_is_1", [3, 25, 45]) == [3, 25, 45]
    assert layerids.ids_for("plus_one", [3, 25, 45]) == [2, 24, 44]
    assert layerids.version_key("v0.5.9-cu129") == (0, 5, 9) and layerids.version_key("main") is None


def _rule_in_source(text: str, cls: str) -> str | None:
    node = next((n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ClassDef) and n.name == cls), None)
    fn = next(
        (f for f in (node.body if node else []) if getattr(f, "name", "") == "set_eagle3_layers_to_capture"), None
    )
    if fn is None:
        return None
    src = ast.get_source_segment(text, fn) or ""
    return "plus_one_if_first_is_1" if "layer_ids[0] == 1" in src else "plus_one" if "+ 1" in src else "?"


def test_the_table_is_what_the_released_model_files_do():
    """Every cached SGLang wheel (the lab's and `patch drift`'s cache): each spec model's
    set_eagle3_layers_to_capture, read from the wheel, applies the rule the spec data says."""
    import zipfile

    from remote_ops import wheels

    found = sorted(wheels.wheel_dir().glob("sglang-0.5.*.whl"))
    if not found:
        pytest.skip("no SGLang wheel in the cache (the lab fixtures download 0.5.9)")
    checked = 0
    for wheel in found:
        version = wheel.name.split("-")[1]
        with zipfile.ZipFile(wheel) as z:
            for m in patchspec.catalog():
                try:
                    text = z.read(m.file.removeprefix("python/")).decode()
                except KeyError:
                    continue
                got = _rule_in_source(text, m.cls)
                if got is not None:
                    assert got == patchspec.layer_convention(m.name, version).rule, (m.name, version)
                    checked += 1
    assert checked


def test_a_bad_numbering_table_is_a_config_error_naming_the_field(tmp_path, monkeypatch):
    folder = tmp_path / "specs" / "my-models"
    folder.mkdir(parents=True)
    entry = {"name": "mine", "file": "python/sglang/srt/models/mine.py", "class": "MineForCausalLM"}
    table = [{"since": "0", "rule": "minus_one", "source": "made up"}]
    (folder / "spec.json").write_text(
        json.dumps({"extends": "eagle3-hs-dump", "models": [entry | {"eagle3_layer_ids": table}]})
    )
    monkeypatch.setenv("REMOTE_OPS_PATCH_PATH", str(tmp_path / "specs"))
    with pytest.raises(ConfigError, match=r"models\[0\]\.eagle3_layer_ids\[0\]\.rule: rule 'minus_one'"):
        patchspec.catalog()
    for bad, said in (
        ([{"since": "0.5.1", "rule": "plus_one", "source": "x"}], "starts at release 0"),
        (
            [{"since": "0", "rule": "plus_one", "source": "x"}, {"since": "0", "rule": "plus_one", "source": "y"}],
            "after",
        ),
        ([{"since": "0", "rule": "plus_one"}], "exactly the keys"),
    ):
        with pytest.raises(ConfigError, match=said):
            layerids.parse_table(bad, "spec.json", "eagle3_layer_ids")


def test_the_drafter_ids_are_read_where_sglang_reads_them():
    nested = layerids.read_draft_config(
        {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]}, "hidden_size": 7168}
    )
    assert (nested.ids, nested.hidden_size, nested.notes) == ([1, 29, 57], 7168, ())
    top = layerids.read_draft_config(
        {"eagle_aux_hidden_state_layer_ids": [1, 29, 57], "target_hidden_size": 7168, "hidden_size": 4096}
    )
    assert top.ids is None and top.hidden_size == 7168 and "does not read it" in top.notes[0]
    fails, _ = layerids.layer_problems(
        [2, 30, 58], [1, 29, 57], patchspec.layer_convention("deepseek-v2", "0.5.9"), "0.5.9", 61, top
    )
    assert fails and "top level" in fails[0]  # SGLang would capture its default: [2, 30, 58] (right, by luck)


def test_an_off_by_one_drafter_is_named_with_the_ids_it_needs():
    c9, c13 = (patchspec.layer_convention("deepseek-v2", v) for v in ("0.5.9", "0.5.13"))
    off = layerids.DraftConfig([2, 30, 58], 7168)
    fails, _ = layerids.layer_problems([2, 30, 58], [1, 29, 57], c9, "0.5.9", 61, off)
    assert fails == [
        "the drafter's eagle_config.eagle_aux_hidden_state_layer_ids [2, 30, 58] would make SGLang 0.5.9 "
        "(plus_one (every id + 1)) capture layers [3, 31, 59]; the dumps hold layers [2, 30, 58] "
        "(a drafter served there needs [1, 29, 57])"
    ]
    assert layerids.layer_problems([2, 30, 58], [1, 29, 57], c13, "0.5.13", 61, off) == ([], [])
    # no drafter: dumps of [3, 25, 45] need ids [3, 25, 45] on DeepSeek 0.5.13, not the recorded [2, 24, 44]
    fails, notes = layerids.layer_problems([3, 25, 45], [2, 24, 44], c13, "0.5.13", 61)
    assert not fails and "needs eagle_config.eagle_aux_hidden_state_layer_ids = [3, 25, 45]" in notes[0]


# --------------------------------------------------------------------------- the auditor on local dumps


def _network(model_dir: Path, tied: bool = False):
    sandbox.write_model_config(model_dir, tie_word_embeddings=tied)
    model = sandbox.standin_model_module()
    net, _ = model.Network.load(str(model_dir))
    return model, net


def local_run(
    tmp: Path,
    n: int = 6,
    *,
    pre: bool = False,
    drop: bool = False,
    nan_index=None,
    tied=False,
    seed=3,
    storage: str = "bf16",
):
    """A host's layout on this machine: dumps written by the dump contract's writer with the stand-in
    network's states, the client's manifest (its generated tokens), run.json, dataset.keys.
    `storage="fp8_e4m3"`: the states as the dumper stores them in FP8 (`fp8.encode_rows`)."""
    import random

    import numpy as np

    model, net = _network(tmp / "model", tied)
    rng = random.Random(seed)
    dumps, work = tmp / "dumps", tmp / "extract"
    (dumps / "rank0").mkdir(parents=True)
    work.mkdir()
    samples, lines = [], []
    meta = {"layers_to_capture": json.dumps(LAYERS), "eagle_aux_hidden_state_layer_ids": json.dumps([1, 3, 4])}
    meta |= {"sglang_version": "0.5.9", "model_arch": "DeepseekV3ForCausalLM", "num_hidden_layers": "8"}
    for i in range(n):
        ids = [rng.randrange(32000) for _ in range(rng.randint(2, 200))]
        states, pre_f, post_f, _ = net.forward(ids, LAYERS)
        layers = LAYERS[:-1] if drop else LAYERS
        final = model.round_bf16(np, pre_f if pre else post_f)
        aux = model.round_bf16(np, np.concatenate([states[k] for k in layers], axis=1))
        if nan_index == i and storage == "bf16":
            final[len(ids) // 2, 7] = 0x7FC0
        ids_le = dumpfile.token_ids_bytes(ids)
        key = dumpfile.dump_key(ids_le, 0)
        tensors = {
            "hidden_states": ("BF16", [len(ids), 64], final.tobytes()),
            "aux_hidden_states": ("BF16", [len(ids), aux.shape[1]], aux.tobytes()),
            "input_ids": ("I32", [len(ids)], ids_le),
            "positions": ("I32", [len(ids)], dumpfile.token_ids_bytes(range(len(ids)))),
        }
        span_meta = dumpfile.span_metadata(meta, key, len(ids), 0, 0)
        if storage == "fp8_e4m3":
            tensors.update(fp8_tensors(final, aux, len(layers), nan_row=len(ids) // 2 if nan_index == i else None))
            span_meta |= {"dtype": "bfloat16", "storage": dumpfile.STORAGE_FP8, "format_version": "2"}
        path = dumps / "rank0" / dumpfile.dump_file_name(key)
        w = dumpfile.write_dump_file(str(path), tensors, span_meta, False)
        rec = dumpfile.manifest_record(str(dumps), w, key, len(ids), 0, 0, 64, tensors["hidden_states"][0])
        if storage == "fp8_e4m3":
            rec |= {"storage": dumpfile.STORAGE_FP8, "format_version": "2"}
        dumpfile.append_manifest(str(dumps / "rank0" / "manifest.jsonl"), rec, False)
        token = net.next_token(post_f[-1])  # the server's answer: always the post-norm state's
        lines.append({"id": f"s{i}", "key": key, "status": "ok", "tokens": len(ids), "generated_token": token})
        samples.append({"id": f"s{i}", "input_ids": ids, "loss_mask": [1] * len(ids)})
    (tmp / "ds.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    (work / "manifest.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))
    (work / "dataset.keys").write_text("".join(l["key"] + "\n" for l in lines))
    (work / "run.json").write_text(json.dumps({"dataset": str(tmp / "ds.jsonl"), "dataset_id": "x"}))
    return tmp


def fp8_tensors(final, aux, aux_states: int, nan_row=None) -> dict:
    """The bf16 states (uint16 arrays) in FP8 storage, as the dumper writes them: e4m3 values and
    a float32 scale per token and layer (`nan_row`: a NaN code written at that row's column 7)."""
    torch = pytest.importorskip("torch")
    from remote_ops.dumper import fp8

    out = {}
    for name, bits, segments in (("hidden_states", final, 1), ("aux_hidden_states", aux, aux_states)):
        x = torch.frombuffer(bytearray(bits.tobytes()), dtype=torch.bfloat16).view(bits.shape)
        q, scale = fp8.encode_rows(x, segments)
        if nan_row is not None and name == "hidden_states":
            q.view(torch.uint8)[nan_row, 7] = 0x7F
        out[name] = ("F8_E4M3", list(q.shape), q.view(torch.uint8).numpy().tobytes())
        out[name + "_scale"] = ("F32", list(scale.shape), scale.numpy().tobytes())
    return out


def auditor(tmp: Path, *extra: str, action: str = "audit", bundled: bool = False) -> dict:
    """The auditor run as a program: the file itself, or (`bundled`) on stdin as the workflows ship it."""
    program = [str(AUDITOR)] if not bundled else ["-"]
    argv = [sys.executable, *program, action, "--dump-dir", str(tmp / "dumps"), "--model-dir", str(tmp / "model")]
    argv += ["--workdir", str(tmp / "extract"), *extra]
    stdin = onhost.bundled("audit_onhost.py").decode() if bundled else None
    p = subprocess.run(argv, capture_output=True, text=True, timeout=300, input=stdin)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(p.stdout)


def problems(doc: dict, check: str) -> list[str]:
    return [s["problems"][check] for s in doc["samples"] if check in s["problems"]]


def test_post_norm_dumps_pass_and_the_stdlib_fallback_finds_the_same(tmp_path):
    run = local_run(tmp_path)
    fast, slow = auditor(run, "--samples", "6"), auditor(run, "--samples", "6", "--no-numpy")
    assert fast["numpy"] is True and slow["numpy"] is False
    assert fast["norm"] == slow["norm"] and 0 <= fast["norm"]["ambiguous"] <= 6
    assert {k: v for k, v in fast["norm"].items() if k != "ambiguous"} == {
        "checked": 6,
        "match": 6,
        "prenorm": 0,
        "mismatch": 0,
        "no_token": 0,
        "verdict": "post-norm",
    }

    def strip(d):  # the logit gaps differ in their last bits (float64 sums in another order)
        return [{k: v for k, v in s.items() if k != "token"} | {"argmax": s["token"]["argmax"]} for s in d["samples"]]

    assert strip(fast) == strip(slow) and all(not s["problems"] for s in fast["samples"])
    assert fast["model"]["lm_head"] | {"bytes_read": 0} == {
        "lm_head": "lm_head.weight",
        "tied": False,
        "norm": "model.norm.weight",
        "shape": [32000, 64],
        "bytes_read": 0,
    }
    assert fast["layers"] == [
        {"layers_to_capture": LAYERS, "eagle_aux_hidden_state_layer_ids": [1, 3, 4], "samples": 6}
    ]


def test_a_tied_embedding_serves_as_lm_head(tmp_path):
    doc = auditor(local_run(tmp_path, 3, tied=True))
    assert doc["model"]["lm_head"]["lm_head"] == "model.embed_tokens.weight" and doc["model"]["lm_head"]["tied"]
    assert doc["norm"]["verdict"] == "post-norm"


def test_the_auditor_names_pre_norm_finals_a_dropped_aux_layer_and_a_nan(tmp_path):
    pre = auditor(local_run(tmp_path / "pre", 8, pre=True))
    assert pre["norm"]["verdict"] == "pre-norm" and pre["norm"]["prenorm"] >= 4
    assert all("PRE-norm final state" in p for p in problems(pre, "token"))
    drop = auditor(local_run(tmp_path / "drop", 3, drop=True))
    assert problems(drop, "shape") == [
        "aux_hidden_states holds 2 aux states ([%d, 128]), not 3: an aux layer was dropped" % s["tokens"]
        for s in drop["samples"]
    ]
    assert drop["norm"]["verdict"] == "post-norm"  # the final states are fine
    nan = auditor(local_run(tmp_path / "nan", 4, nan_index=2), "--no-numpy")
    bad = [s for s in nan["samples"] if s["problems"]]
    assert len(bad) == 1 and bad[0]["id"] == "s2" and bad[0]["nonfinite"] == {"hidden_states": {"nan": 1, "inf": 0}}
    assert "1 NaN, 0 Inf in hidden_states (first at token %d)" % (bad[0]["tokens"] // 2) in bad[0]["problems"]["finite"]


def _strip(doc):  # the logit gaps (and FP8 allowances) differ in their last bits between numpy and stdlib
    return [
        {k: v for k, v in s.items() if k != "token"} | {"argmax": s["token"]["argmax"], "status": s["token"]["status"]}
        for s in doc["samples"]
    ]


def test_fp8_dumps_are_audited_decoded_and_give_the_servers_token(tmp_path):
    """FP8 storage: the auditor (shipped on stdin with its codecs, and the file itself without numpy)
    decodes the e4m3 states and judges them as it judges bf16 ones: post-norm, every token matches."""
    run = local_run(tmp_path, 8, storage="fp8_e4m3")
    fast, slow = auditor(run, "--samples", "8", bundled=True), auditor(run, "--samples", "8", "--no-numpy")
    assert fast["numpy"] is True and slow["numpy"] is False
    assert all(not s["problems"] for s in fast["samples"]), [s["problems"] for s in fast["samples"]]
    assert {s["storage"] for s in fast["samples"]} == {"fp8_e4m3_rowscale"}
    assert fast["norm"]["verdict"] == slow["norm"]["verdict"] == "post-norm"
    assert fast["norm"]["match"] == fast["norm"]["checked"] == 8
    tokens = [s["token"] for s in fast["samples"]]
    assert all(t["fp8_allowance"] > 0 for t in tokens if t["argmax"] != t["generated"])
    assert _strip(fast) == _strip(slow)


def test_fp8_dumps_with_pre_norm_finals_or_a_nan_code_fail_the_audit(tmp_path):
    pre = auditor(local_run(tmp_path / "pre", 8, pre=True, storage="fp8_e4m3"))
    assert pre["norm"]["verdict"] == "pre-norm" and pre["norm"]["prenorm"] >= 4
    assert all("PRE-norm final state" in p for p in problems(pre, "token"))
    for extra in ((), ("--no-numpy",)):
        nan = auditor(local_run(tmp_path / ("nan" + "".join(extra)), 4, nan_index=2, storage="fp8_e4m3"), *extra)
        bad = [s for s in nan["samples"] if s["problems"]]
        assert len(bad) == 1 and bad[0]["id"] == "s2"
        assert bad[0]["nonfinite"] == {"hidden_states": {"nan": 1, "inf": 0}}
        assert (
            "1 NaN, 0 Inf in hidden_states (first at token %d)" % (bad[0]["tokens"] // 2)
            in bad[0]["problems"]["finite"]
        )


def test_an_fp8_dump_whose_scales_do_not_fit_fails_its_sample(tmp_path):
    run = local_run(tmp_path, 2, storage="fp8_e4m3")
    path = next((run / "dumps" / "rank0").glob("*.safetensors"))
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    header["aux_hidden_states_scale"]["shape"] = [header["aux_hidden_states_scale"]["shape"][0] * 3, 1]
    text = json.dumps(header, separators=(",", ":")).encode().ljust(length)
    path.write_bytes(raw[:8] + text + raw[8 + length :])
    doc = auditor(run)
    assert any(
        "FP8 storage with aux_hidden_states_scale F32 [%d, 1], want F32 [%d, 3]" % (3 * s["tokens"], s["tokens"]) in p
        for s in doc["samples"]
        for p in s["problems"].values()
    ), doc["samples"]


def test_the_fp8_rounding_bound_holds_and_sizes_the_token_allowance():
    """half_ulps bounds what e4m3 rounding did to each value; the allowance is FP8_SIGMAS standard
    deviations of the gap that rounding moves, and only that much of a gap is forgiven."""
    torch = pytest.importorskip("torch")
    from remote_ops.dumper import fp8, fp8read

    g = torch.Generator().manual_seed(1)
    x = (torch.randn(16, 256, generator=g) * torch.logspace(-3, 2, 256)).float()
    q, scale = fp8.encode_rows(x)
    got = fp8.decode_rows(q, scale, torch.float32)
    raw = q.view(torch.uint8).numpy().tobytes()
    for r in range(16):
        bound = torch.tensor(fp8read.half_ulps(raw[r * 256 : (r + 1) * 256], float(scale[r, 0])))
        assert bool(((x[r] - got[r]).abs() <= bound * (1 + 1e-6)).all()), r
    w_best, w_gen, err = [1.0, -2.0, 0.5], [0.0, 1.0, 0.5], [0.3, 0.1, 9.0]
    allowance = onhost_audit.fp8_allowance(w_best, w_gen, err)
    assert allowance == pytest.approx(onhost_audit.FP8_SIGMAS * ((0.09 + 0.09) / 3) ** 0.5)
    assert onhost_audit.fp8_allowance(None, w_gen, err) == 0.0
    verdict = onhost_audit.token_verdict
    assert verdict(5, 1.0, 7, 1.0 - 0.9 * allowance, allowance)[0] == "match"  # NEAR_TIE alone: 0.01 at 1.0
    assert verdict(5, 1.0, 7, 1.0 - 0.9 * allowance)[0] == "mismatch"  # bf16: no allowance
    assert verdict(5, 1.0, 7, 1.0 - 1.1 * allowance, allowance)[0] == "mismatch"
    assert verdict(5, 100.0, 7, 100.0 - 0.9, 0.5)[0] == "match"  # the larger of the two tolerances


def test_half_float_nan_and_inf_counts_match_numpy():
    import numpy as np

    sys.path.insert(0, str(AUDITOR.parent))
    import audit_onhost as a

    rng = np.random.default_rng(0)
    for dtype, nan_bits, inf_bits in (("BF16", 0x7FC1, 0xFF80), ("F16", 0x7E01, 0xFC00)):
        bits = rng.integers(0, 0x7000, size=4096, dtype=np.uint16)
        bits[[5, 900, 4000]] = nan_bits
        bits[[17, 3000]] = inf_bits
        data = bits.astype("<u2").tobytes()
        assert a._nonfinite_half(data, dtype, 64) == a.Floats(True).nonfinite(data, dtype, 64) == (3, 2, 0)


def test_the_draw_is_one_sample_per_stratum_and_seeded():
    sys.path.insert(0, str(AUDITOR.parent))
    import audit_onhost as a

    draw = a.stratified(1000, 64, seed=7)
    assert draw == a.stratified(1000, 64, seed=7) != a.stratified(1000, 64, seed=8)
    assert [p * 64 // 1000 for p in draw] == list(range(64))  # one in each 1/64th of the run
    assert a.stratified(10, 64, 0) == list(range(10))


def test_samples_that_give_the_token_both_ways_do_not_outvote_pre_norm_ones():
    """A pre-norm dump whose argmax the final norm does not move matches too: no evidence."""
    sys.path.insert(0, str(AUDITOR.parent))
    import audit_onhost as a

    def sample(status, tells=True):
        s = a.Sample(0, "k", {})
        s.doc["token"] = {"status": status, "tells_norm": tells}
        return s

    four_pre_four_both = [sample("prenorm")] * 4 + [sample("match", tells=False)] * 4
    verdict = a.norm_verdict(four_pre_four_both)
    assert verdict["verdict"] == "pre-norm" and verdict["ambiguous"] == 4 and verdict["checked"] == 8
    assert a.norm_verdict([sample("match", tells=False)] * 3)["verdict"] == "indistinct"  # right, but no evidence
    assert a.norm_verdict([sample("match", tells=False)] * 3 + [sample("match")])["verdict"] == "post-norm"
    assert a.norm_verdict([sample("prenorm")] * 2 + [sample("match")] * 2)["verdict"] == "mixed"
    assert a.norm_verdict([sample("prenorm")] * 2 + [sample("mismatch")] * 3)["verdict"] == "mixed"


def test_the_verdicts_of_a_report():
    report = {"sampled": 2, "population": 9, "seed": 0, "model": {"hidden_size": 64}, "layers": []}
    report["samples"] = [
        {"key": "k1", "id": "a", "position": 1, "problems": {}},
        {"key": "k2", "id": "b", "position": 5, "problems": {}},
    ]
    report["norm"] = {"checked": 0, "verdict": "unknown"}
    checks = {c.name: c for c in evaluate(report, [], [])}
    assert checks["token"].status == "fail" and "no generated_token" in checks["token"].reason
    assert [checks[n].status for n in ("sampled", "shape", "finite", "alignment")] == ["ok"] * 4
    assert evaluate({"sampled": 0}, [], [])[0].status == "fail"


def test_the_audit_runs_in_a_throwaway_container_of_the_served_image(lab):
    spec = lab.spec("lab2")
    cmd = DumpAudit(spec, f"{spec.logs.dir}/extract/dataset.jsonl", 64, 0).command()
    assert "--network none" in cmd and "--pull=never" in cmd and "--entrypoint python3" in cmd and " -i " in cmd
    assert f"inspect -f '{{{{.Config.Image}}}}' {spec.container.name}" in cmd
    for path in (spec.dump.dir, spec.model.path, f"{spec.logs.dir}/extract"):
        assert f"{path}:{path}:ro" in cmd
    assert audit_mounts(["/d", "/d/x", "/m/", "/m", ""]) == ("/d:/d:ro", "/m:/m:ro")


def test_a_bad_draft_config_is_refused_before_connecting(tmp_path):
    inv = tmp_path / "inv.yaml"
    inv.write_text("hosts:\n  nowhere:\n    address: 127.0.0.1\n    port: 1\n")
    bad = tmp_path / "draft.json"
    bad.write_text("{not json")
    env = {**os.environ, "REMOTE_OPS_INVENTORY": str(inv), "REMOTE_OPS_STATE_DIR": str(tmp_path / "state")}
    rc, out, err = run_cli(env, "dumps", "audit", "--host", "nowhere", "--draft-config", str(bad), "--json")
    assert rc == 3 and "the draft config is not JSON" in json.loads(out)["message"], err


# --------------------------------------------------------------------------- on the lab: the computing stand-in


@pytest.fixture
def run_of(lab, _sglang_installed, standin_base):
    """run_of(faults) -> a finished 16-sample extraction on lab2 serving the stand-in with them."""
    from standin_runs import extraction

    return lambda faults=None: extraction(lab, standin_base, faults)


def audit_cli(lab_env, *args: str) -> tuple[int, dict]:
    t0 = time.monotonic()
    rc, out, err = run_cli(lab_env, "dumps", "audit", "--host", "lab2", "--samples", "16", "--json", *args, timeout=300)
    doc = json.loads(out) if out.strip() else {}
    doc["_seconds"], doc["_stderr"] = round(time.monotonic() - t0, 1), err
    return rc, doc


def checks_of(doc: dict) -> dict[str, dict]:
    return {c["check"]: c for c in doc["checks"]}


@pytest.mark.docker
def test_a_16_sample_extraction_on_the_computing_standin_passes_the_audit(run_of, lab_env):
    run = run_of()
    rc, doc = audit_cli(lab_env)
    assert rc == 0, doc
    checks = checks_of(doc)
    assert list(checks) == ["sampled", "shape", "finite", "alignment", "token", "layer_ids"]
    assert all(c["status"] == "ok" for c in checks.values()), doc["checks"]
    assert 0 <= doc["norm"]["ambiguous"] <= 16
    assert {k: v for k, v in doc["norm"].items() if k != "ambiguous"} | {"checked": 16} == {
        "checked": 16,
        "match": 16,
        "prenorm": 0,
        "mismatch": 0,
        "no_token": 0,
        "verdict": "post-norm",
    }
    report = doc["report"]
    assert report["population"] == report["sampled"] == 16 and report["numpy"] is True  # the served image's numpy
    assert {s["key"] for s in report["samples"]} == set(run.rows())
    assert doc["serving"] | {"source": None} == {
        "version": "0.5.9",
        "model": "deepseek-v2",
        "rule": "plus_one",
        "since": "0",
        "source": None,
        "how": "lab2's deployed SGLang (sglang.version)",
    }
    # the server's token, reproduced from the dump: every sample's argmax is the client's generated_token
    rows = run.rows()
    assert all(s["token"]["argmax"] == rows[s["key"]]["generated_token"] for s in report["samples"])


@pytest.mark.docker
def test_a_nan_written_into_a_dump_fails_the_audit_naming_the_sample(run_of, lab_env):
    run = run_of()
    victim = sorted((run.dump_dir / "rank0").glob("*.safetensors"))[3]
    manifest = run.dump_dir / "rank0" / "manifest.jsonl"
    original, original_manifest = victim.read_bytes(), manifest.read_text()
    try:
        header = dumpfile.read_header(str(victim))
        info = header.tensors["hidden_states"]
        changed = bytearray(original)
        at = header.data_start + info.start + 2 * 5  # token 0, value 5 of the final state: a bf16 NaN
        changed[at : at + 2] = struct.pack("<H", 0x7FC0)
        victim.write_bytes(bytes(changed))
        sha = hashlib.sha256(changed).hexdigest()
        lines = [json.loads(l) for l in original_manifest.splitlines()]
        for rec in lines:
            if rec["file"].endswith(victim.name):
                rec["sha256"] = sha
        manifest.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in lines))
        rc, out, _ = run_cli(lab_env, "dumps", "verify", "--host", "lab2", "--sha", "--json")
        assert rc == 0, out  # the sha256 matches: only the audit sees the NaN
        rc, doc = audit_cli(lab_env)
        assert rc == 10 and doc["error"] == "verify_failed" and "finite" in doc["message"], doc
        finite = checks_of(doc)["finite"]
        key = victim.name[: -len(".safetensors")]
        assert [s["key"] for s in finite["samples"]] == [key] and (finite["nan"], finite["inf"]) == (1, 0)
        assert "1 NaN, 0 Inf in hidden_states (first at token 0)" in finite["samples"][0]["message"]
        assert "SpecForge would skip them silently" in finite["reason"]
        assert key in doc["_stderr"]  # the table names the sample
    finally:
        victim.write_bytes(original)
        manifest.write_text(original_manifest)


@pytest.mark.docker
def test_a_draft_config_whose_layer_ids_are_off_by_one_fails_the_audit(run_of, lab_env, tmp_path):
    run_of()
    off, right = tmp_path / "off.json", tmp_path / "right.json"
    off.write_text(json.dumps({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 5]}, "hidden_size": 64}))
    right.write_text(json.dumps({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}, "hidden_size": 64}))
    rc, doc = audit_cli(lab_env, "--draft-config", str(off))
    assert rc == 10 and "layer_ids" in doc["message"], doc
    layer = checks_of(doc)["layer_ids"]
    assert layer["failures"] == [
        "the drafter's eagle_config.eagle_aux_hidden_state_layer_ids [2, 4, 5] would make SGLang 0.5.9 "
        "(plus_one (every id + 1)) capture layers [3, 5, 6]; the dumps hold layers [2, 4, 5] "
        "(a drafter served there needs [1, 3, 4])"
    ]
    assert [n for n, c in checks_of(doc).items() if c["status"] == "fail"] == ["layer_ids"]
    assert audit_cli(lab_env, "--draft-config", str(right))[0] == 0
    # DeepSeek from 0.5.13 on takes ids not starting at 1 as given: there [2, 4, 5] is served right
    rc, doc = audit_cli(lab_env, "--draft-config", str(off), "--serving-sglang", "0.5.13")
    assert rc == 0 and doc["serving"]["rule"] == "plus_one_if_first_is_1", doc


@pytest.mark.docker
def test_a_dropped_aux_layer_fails_the_audit(run_of, lab_env):
    run_of({"STANDIN_DROP_AUX": "1"})
    rc, doc = audit_cli(lab_env)
    assert rc == 10 and "shape" in doc["message"], doc
    shape = checks_of(doc)["shape"]
    assert (
        len(shape["samples"]) == 16
        and "holds 2 aux states" in shape["reason"]
        and "an aux layer was dropped" in shape["reason"]
    )
    assert [n for n, c in checks_of(doc).items() if c["status"] == "fail"] == ["shape"]


@pytest.mark.docker
def test_pre_norm_final_states_fail_the_audit(run_of, lab_env):
    """Last here: tests/test_contract_guards.py's export test takes over this deployment."""
    run_of({"STANDIN_FINAL_NORM": "pre"})
    rc, doc = audit_cli(lab_env)
    assert rc == 10 and "token" in doc["message"], doc
    token = checks_of(doc)["token"]
    assert token["reason"].startswith("the dumps hold PRE-norm final states") and doc["norm"]["verdict"] == "pre-norm"
    assert token["samples"] and all("PRE-norm final state" in s["message"] for s in token["samples"])
    assert [n for n, c in checks_of(doc).items() if c["status"] == "fail"] == ["token"]
