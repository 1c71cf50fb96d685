"""vLLM's per-request hidden-state files through the product: the extraction client's adoption,
the dump audit (shapes, finiteness, token ids, the N-1 layer fault, the final state's norm) and
the SpecForge export.

The files are written with torch + safetensors in the format from vLLM's source / part 1's
connector (docs/vllm.md): `token_ids` int64 [S], `hidden_states` bf16 [S, L, H] for the layer
ids asked (the aux layers, then L for the final state), metadata `layer_ids` (JSON),
`engine`=`vllm`, `vllm_version`, `format`=`vllm-hidden-states/1`.  The states are a real
computation: the 8-layer network of docker/standin/standin_model.py run on the prompt (its
residual stream entering each layer, its final state before and after the final RMSNorm).
"""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from remote_ops.workflows import sandbox

REPO = Path(__file__).resolve().parents[1]
AUDITOR = REPO / "remote_ops" / "onhost" / "audit_onhost.py"
AUX = [2, 4, 5]  # the 8-layer network's [2, L//2, L-3]
FINAL = 8  # its layer count: the id of the final state


def onhost(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "remote_ops" / "onhost" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


extract_onhost = onhost("extract_onhost")


def write_vllm_file(path: Path, ids: list[int], layers: list, layer_ids: list[int], storage: str = "bf16") -> None:
    """One file as vLLM's connector writes it (torch + safetensors); `storage="fp8_e4m3"`: its FP8
    form, e4m3 `hidden_states` [S, L, H] and `hidden_states_scale` [S, L] (`fp8.encode_rows`)."""
    import torch
    from safetensors.torch import save_file

    hidden = torch.stack([torch.tensor(x, dtype=torch.float32) for x in layers], dim=1).to(torch.bfloat16)
    meta = {
        "layer_ids": json.dumps(layer_ids),
        "engine": "vllm",
        "vllm_version": "0.32.0",
        "format": "vllm-hidden-states/1",
    }
    tensors = {"token_ids": torch.tensor(ids, dtype=torch.int64), "hidden_states": hidden}
    if storage == "fp8_e4m3":
        from remote_ops.dumper import fp8

        s, count, h = hidden.shape
        q, scale = fp8.encode_rows(hidden.reshape(s, count * h), count)
        tensors |= {"hidden_states": q.view(s, count, h), "hidden_states_scale": scale}
        meta |= {"format": "vllm-hidden-states/2", "storage": fp8.STORAGE, "dtype": "bfloat16"}
    save_file(tensors, str(path), metadata=meta)


def vllm_run(
    tmp: Path, n: int = 6, *, final: str = "pre", drop_last: bool = False, seed: int = 5, storage: str = "bf16"
) -> Path:
    """A host's layout after a vLLM extraction: the connector's files adopted by the client's own
    function into rank0/<key>.safetensors + manifest, the client manifest, run.json, dataset."""
    import numpy as np

    sandbox.write_model_config(tmp / "model")
    model = sandbox.standin_model_module()
    net, _ = model.Network.load(str(tmp / "model"))
    rng = random.Random(seed)
    out, dumps, work = tmp / "dumps" / "vllm-out", tmp / "dumps", tmp / "extract"
    out.mkdir(parents=True)
    work.mkdir()
    lock = threading.Lock()
    lines, samples = [], []
    for i in range(n):
        ids = [rng.randrange(32000) for _ in range(rng.randint(2, 120))]
        states, pre_f, post_f, _ = net.forward(ids, AUX)
        layers = [states[k] for k in AUX] + [pre_f if final == "pre" else post_f]
        if drop_last:
            layers = layers[:-1]
        path = out / f"cmpl-{i:04d}-0.safetensors"
        write_vllm_file(path, ids, layers, [*AUX, FINAL], storage)
        key = extract_onhost.dump_key(ids)
        rec = extract_onhost.adopt_vllm_file(str(path), str(dumps), key, ids, lock)
        assert not path.exists() and rec["file"] == f"rank0/{key}.safetensors"
        token = net.next_token(np.asarray(post_f[-1]))  # the server's answer: the post-norm state's argmax
        lines.append({"id": f"s{i}", "key": key, "status": "ok", "tokens": len(ids), "generated_token": token})
        samples.append({"id": f"s{i}", "input_ids": ids, "loss_mask": [1] * len(ids)})
    (tmp / "ds.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    (work / "manifest.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (work / "dataset.keys").write_text("".join(x["key"] + "\n" for x in lines))
    (work / "run.json").write_text(json.dumps({"dataset": str(tmp / "ds.jsonl"), "dataset_id": "x"}))
    return tmp


def auditor(tmp: Path, *extra: str, action: str = "audit") -> dict:
    argv = [sys.executable, str(AUDITOR), action, "--dump-dir", str(tmp / "dumps")]
    if action != "contract":
        argv += ["--model-dir", str(tmp / "model"), "--workdir", str(tmp / "extract")]
    p = subprocess.run([*argv, *extra], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(p.stdout)


def problems(doc: dict, check: str) -> list[str]:
    return [s["problems"][check] for s in doc["samples"] if check in s["problems"]]


# --------------------------------------------------------------------------- the client's side


def test_a_completion_answer_gives_the_file_path_and_the_token():
    answer = {
        "choices": [{"text": "x", "token_ids": [17]}],
        "kv_transfer_params": {"hidden_states_path": "/data/dumps/vllm-out/cmpl-1.safetensors"},
    }
    assert extract_onhost.completion_result(answer) == ("/data/dumps/vllm-out/cmpl-1.safetensors", 17)
    nested = {"choices": [{"kv_transfer_params": {"hidden_states_path": "/p"}}]}
    assert extract_onhost.completion_result(nested) == ("/p", None)
    with pytest.raises(ValueError, match="hidden_states_path"):
        extract_onhost.completion_result({"choices": [{"text": "x"}]})


def test_adoption_refuses_a_file_of_other_token_ids(tmp_path):
    ids = [5, 6, 7]
    path = tmp_path / "f.safetensors"
    write_vllm_file(path, [5, 6, 8], [[[0.0] * 4] * 3] * 4, [1, 2, 3, 4])
    with pytest.raises(ValueError, match="other token ids"):
        extract_onhost.adopt_vllm_file(
            str(path), str(tmp_path / "d"), extract_onhost.dump_key(ids), ids, threading.Lock()
        )
    assert path.exists()


def test_adopted_files_resume_by_content_key(tmp_path):
    run = vllm_run(tmp_path, 3)
    records = extract_onhost.manifest_records(str(run / "extract" / "manifest.jsonl"))
    samples = [(s["id"], s["input_ids"]) for s in map(json.loads, (run / "ds.jsonl").read_text().splitlines())]
    pending, done, _, _ = extract_onhost.plan_samples(samples, records)
    assert not pending and len(done) == 3
    rows = [json.loads(x) for x in (run / "dumps" / "rank0" / "manifest.jsonl").read_text().splitlines()]
    assert {r["engine"] for r in rows} == {"vllm"} and all(r["layers"] == 4 and r["prefix_len"] == 0 for r in rows)


# --------------------------------------------------------------------------- the audit


def test_vllm_dumps_with_pre_norm_finals_pass_and_are_judged_pre_norm_as_vllm_captures_them(tmp_path):
    """vLLM's model files append layer L before the final RMSNorm: pre-norm is what its files hold."""
    from remote_ops.probes.audit import evaluate

    doc = auditor(vllm_run(tmp_path, 8, final="pre"), "--samples", "8")
    assert all(not s["problems"] for s in doc["samples"])
    assert doc["norm"]["verdict"] == "pre-norm" and doc["norm"]["vllm"] == 8 and doc["norm"]["prenorm"] >= 5
    checks = {c.name: c for c in evaluate(doc, [], [])}
    assert all(c.status == "ok" for c in checks.values()), checks
    assert "vLLM's layer L, captured before that norm" in checks["token"].reason
    # every sample gives the token after the norm: those the norm does not move are counted too
    after = doc["norm"]["prenorm"] + doc["norm"]["ambiguous"]
    assert after == 8 and checks["token"].reason.startswith("8 of 8 final states give the server's token after")
    assert (
        f"({doc['norm']['prenorm']} only after it, {doc['norm']['ambiguous']} with or without it)"
        in checks["token"].reason
    )
    assert doc["vllm_versions"] == ["0.32.0"]
    assert doc["layers"] == [{"layers_to_capture": AUX, "eagle_aux_hidden_state_layer_ids": [1, 3, 4], "samples": 8}]


def test_vllm_dumps_with_post_norm_finals_pass_every_check(tmp_path):
    doc = auditor(vllm_run(tmp_path, 6, final="post"), "--samples", "6")
    assert all(not s["problems"] for s in doc["samples"])
    assert doc["norm"]["verdict"] == "post-norm"


def test_vllm_fp8_files_are_audited_decoded_and_judged_as_vllm_captures_them(tmp_path):
    """FP8 storage (REMOTE_OPS_DUMP_DTYPE=fp8_e4m3): the layers decoded to bf16, then every check as for bf16."""
    for extra in ((), ("--no-numpy",)):
        doc = auditor(
            vllm_run(tmp_path / str(len(extra)), 6, final="pre", storage="fp8_e4m3"), "--samples", "6", *extra
        )
        assert all(not s["problems"] for s in doc["samples"]), [s["problems"] for s in doc["samples"]]
        assert {s["storage"] for s in doc["samples"]} == {"fp8_e4m3_rowscale"}
        assert doc["norm"]["verdict"] == "pre-norm" and doc["norm"]["vllm"] == 6


def test_the_n_minus_1_file_fails_the_audit_naming_the_fault(tmp_path):
    """vLLM's bug on DeepSeek-V2 models before PR #46973: the last asked layer silently missing."""
    doc = auditor(vllm_run(tmp_path, 3, drop_last=True), "--samples", "3")
    found = problems(doc, "shape")
    assert len(found) == 3
    for p, s in zip(found, doc["samples"]):
        assert f"hidden_states [{s['tokens']}, 3, 64] holds 3 captured layers, the drafter needs 4" in p
        assert "a layer was dropped" in p and "N-1" in p and "#46973" in p


def test_the_contract_of_vllm_dumps(tmp_path):
    doc = auditor(vllm_run(tmp_path, 2), action="contract")
    (c,) = doc["contracts"]
    assert c["layers_to_capture"] == AUX and c["aux_states"] == 3 and c["hidden_size"] == 64
    assert c["num_hidden_layers"] == FINAL and c["vllm_version"] == "0.32.0" and c["files"] == 2


# --------------------------------------------------------------------------- the SpecForge export

specforge_export = onhost("specforge_export")


def specforge_offline():
    """SpecForge 0.2.0's reader, file store and EAGLE-3 sample normaliser (as tests/test_export.py)."""
    pytest.importorskip("specforge")
    import types

    sys.modules.setdefault("datasets", types.SimpleNamespace(Dataset=object))  # type annotation only
    from specforge.data.preprocessing import process_offline_eagle3_sample
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore, load_feature_file
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader

    return OfflineManifestReader, LocalFeatureStore, load_feature_file, process_offline_eagle3_sample


def export(run: Path, *extra: str) -> list[dict]:
    argv = [sys.executable, str(REPO / "remote_ops" / "onhost" / "specforge_export.py"), "export"]
    argv += ["--dump-dir", str(run / "dumps"), "--dataset", str(run / "ds.jsonl"), "--out", str(run / "sf")]
    p = subprocess.run([*argv, "--no-fsync", "--probe-mb", "0", *extra], capture_output=True, text=True, timeout=300)
    return [json.loads(x) for x in p.stdout.splitlines()]


def test_vllm_dumps_export_to_what_specforges_own_reader_loads(tmp_path):
    import torch
    from safetensors import safe_open

    Reader, Store, load_feature_file, process = specforge_offline()
    run = vllm_run(tmp_path, 4, final="post")
    events = export(run)
    assert events[-1]["event"] not in ("error",) and not events[-1].get("failed"), events[-1]
    refs = Reader(str(run / "sf")).read()
    assert len(refs) == 4
    store = Store()
    for i, line in enumerate((run / "ds.jsonl").read_text().splitlines()):
        s = json.loads(line)
        path = run / "sf" / specforge_export.out_name(i)
        got = load_feature_file(str(path))
        tensors, handle = next(store.get(r) for r in refs if r.feature_store_uri.endswith(str(path)))
        store.release(handle)
        assert tensors["input_ids"].tolist() == s["input_ids"] and tensors["loss_mask"].tolist() == s["loss_mask"]
        key = extract_onhost.dump_key(s["input_ids"])
        with safe_open(str(run / "dumps" / "rank0" / f"{key}.safetensors"), framework="pt") as f:
            hs = f.get_tensor("hidden_states")  # [S, 4, H]
        n = len(s["input_ids"])
        assert torch.equal(got["hidden_state"][0], hs[:, 3, :])
        assert torch.equal(got["aux_hidden_state"][0], hs[:, :3, :].reshape(n, 3 * 64))
        norm = process(got, max_len=2048)
        assert norm["target"].shape == (1, n, 64) and norm["hidden_state"].shape == (1, n, 3 * 64)


def test_pre_norm_vllm_finals_convert_through_the_final_rmsnorm(tmp_path):
    import torch

    pre, post = vllm_run(tmp_path / "pre", 2, final="pre"), vllm_run(tmp_path / "post", 2, final="post")
    export(pre, "--convert-prenorm", str(pre / "model"))
    export(post)
    _, _, load_feature_file, _ = specforge_offline()
    for i in range(2):
        a = load_feature_file(str(pre / "sf" / specforge_export.out_name(i)))["hidden_state"].float()
        b = load_feature_file(str(post / "sf" / specforge_export.out_name(i)))["hidden_state"].float()
        assert torch.allclose(a, b, rtol=0.02, atol=0.02)  # bf16 of the same post-norm state


def test_the_n_minus_1_file_is_refused_by_the_export_naming_the_fault(tmp_path):
    events = export(vllm_run(tmp_path, 2, drop_last=True))
    failed = events[-1]["failed"]
    assert len(failed) == 2 and all("3 captured layers" in f["reason"] and "N-1" in f["reason"] for f in failed)
    assert not list((tmp_path / "sf").rglob("*.ckpt"))


# --------------------------------------------------------------------------- dumps verify, status


def verify(run: Path) -> dict:
    argv = [sys.executable, str(REPO / "remote_ops" / "dumper" / "dumpfile.py"), "verify", str(run / "dumps")]
    p = subprocess.run([*argv, "--json"], capture_output=True, text=True, timeout=120)
    return json.loads(p.stdout)


def test_dumps_verify_accepts_adopted_vllm_files_and_names_the_n_minus_1_fault(tmp_path):
    good = verify(vllm_run(tmp_path / "good", 3))
    assert not [p for p in good["problems"] if p["level"] == "error"], good["problems"]
    assert good["files"] == 3 and good["hidden_size"] == 64 and good["bytes_per_token"] == 4 * 64 * 2
    bad = verify(vllm_run(tmp_path / "bad", 2, drop_last=True))
    errors = [p["message"] for p in bad["problems"] if p["level"] == "error"]
    assert len(errors) == 2 and all("3 captured layers, want 4" in e and "N-1" in e for e in errors)


def test_dumps_status_reconciles_vllm_files_by_the_dump_manifest(tmp_path):
    from remote_ops.core import dumpcheck

    run = vllm_run(tmp_path, 3)
    rank0 = run / "dumps" / "rank0"
    files = {f"rank0/{p.name}": p.stat().st_size for p in rank0.glob("*.safetensors")}
    r = dumpcheck.reconcile(str(run / "dumps"), files, (rank0 / "manifest.jsonl").read_text(), 64)
    assert r.ok and r.files_present == 3 and r.manifest_rows == 3 and not r.unlisted_files
    assert r.hidden_size == 64 and r.tokens == sum(len(json.loads(x)["input_ids"]) for x in (run / "ds.jsonl").open())


def test_the_client_waits_for_the_file_vllm_writes_after_answering(tmp_path):
    path = tmp_path / "late.safetensors"
    timer = threading.Timer(0.2, path.write_bytes, args=(b"x",))
    timer.start()
    try:
        assert extract_onhost.wait_for_file(str(path), 30.0)
    finally:
        timer.join()
    assert not extract_onhost.wait_for_file(str(tmp_path / "never"), 0.1)


def test_export_converts_vllm_pre_norm_finals_and_still_refuses_sglang_ones(monkeypatch):
    from remote_ops.core.inventory import HostSpec
    from remote_ops.errors import ContractMismatch
    from remote_ops.workflows import audit, export

    host = HostSpec(name="h")
    vllm = {"verdict": "pre-norm", "checked": 8, "prenorm": 8, "match": 0, "vllm": 8}
    monkeypatch.setattr(audit, "norm_check", lambda remote, spec: dict(vllm))
    assert export.final_norm_decision(None, host)["action"] == "convert"
    assert export.final_norm_decision(None, host, accept=True)["action"] == "accept"
    monkeypatch.setattr(audit, "norm_check", lambda remote, spec: {k: v for k, v in vllm.items() if k != "vllm"})
    with pytest.raises(ContractMismatch, match="PRE-norm"):
        export.final_norm_decision(None, host)


def test_a_final_norm_that_does_not_move_the_argmax_is_indistinct_and_vllm_files_are_still_converted(monkeypatch):
    """A model whose final norm weights are all equal (transformers' initial ones, as the sandbox's
    tiny Llama has) gives the server's token with and without the norm on every sample: the audit
    says `indistinct`, never post-norm, and the export still converts vLLM's pre-norm layer L."""
    from remote_ops.core.inventory import HostSpec
    from remote_ops.probes.audit import evaluate
    from remote_ops.workflows import audit, export

    audit_onhost = onhost("audit_onhost")
    both = {"status": "match", "tells_norm": False}
    samples = []
    for _ in range(8):
        s = audit_onhost.Sample(0, "k", {})
        s.doc["token"], s.vllm = dict(both), True
        samples.append(s)
    norm = audit_onhost.norm_verdict(samples)
    assert norm["verdict"] == "indistinct" and norm["ambiguous"] == norm["checked"] == norm["vllm"] == 8
    report = {"sampled": 8, "population": 8, "samples": [], "norm": norm, "layers": []}
    token = {c.name: c for c in evaluate(report, [], [])}["token"]
    assert token.status == "ok" and "cannot tell post- from pre-norm" in token.reason and "vLLM" in token.reason
    sglang = dict(norm)
    sglang.pop("vllm")
    token = {c.name: c for c in evaluate(dict(report, norm=sglang), [], [])}["token"]
    assert token.status == "warn" and "as they are" in token.reason

    host = HostSpec(name="h")
    monkeypatch.setattr(audit, "norm_check", lambda remote, spec: dict(norm))
    decision = export.final_norm_decision(None, host)
    assert decision["action"] == "convert" and "with or without the final RMSNorm" in decision["said"]
    monkeypatch.setattr(audit, "norm_check", lambda remote, spec: dict(sglang))
    assert export.final_norm_decision(None, host)["action"] == "as_is"
