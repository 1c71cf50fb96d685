"""The capture contract guards the later steps, on lab hosts through the real CLI.

- `train start` refuses a draft config whose layer ids (under the numbering of the host's SGLang
  release) or hidden size do not fit what the dumps record: exit 9, `contract_mismatch`, nothing
  started; `--force` starts it and the host's audit log says what was forced past (lab1, dumps
  written by the dump contract's writer with the stand-in network's states, the training stand-in).
- `spec deploy` refuses a drafter whose config.json ids do not give the dumps' layers on the host's
  release (0.5.9: + 1; 0.5.14 DeepSeek: + 1 only when the first id is 1), before any change.
- `dumps export` refuses pre-norm finals (the computing stand-in with STANDIN_FINAL_NORM=pre on
  lab2) unless `--accept-prenorm` (exported as dumped) or `--convert-prenorm` (the model's final
  RMSNorm applied: checked against torch from the checkpoint, and the converted final state gives
  the server's own token); `--convert-prenorm` of post-norm finals is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import run_cli

from remote_ops.dumper import dumpfile
from remote_ops.onhost.audit_onhost import NEAR_TIE

torch = pytest.importorskip("torch")


def draft_file(path: Path, ids, hidden: int | None = 64) -> Path:
    doc = {"architectures": ["LlamaForCausalLMEagle3"], "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids}}
    path.write_text(json.dumps(doc | ({"hidden_size": hidden} if hidden else {})))
    return path


def audit_lines(host) -> list[dict]:
    return (
        [json.loads(l) for l in host.paths.audit_log.read_text().splitlines()] if host.paths.audit_log.exists() else []
    )


@pytest.fixture
def lab1_dumps(host, tmp_path):
    """Three dumps of the stand-in network in lab1's dump dir (layers [2, 4, 5], hidden 64)."""
    from test_audit import local_run

    run = local_run(tmp_path / "run", 3)
    dump_dir = host.paths.dump_dir
    subprocess.run(["rm", "-rf", str(dump_dir)], check=True, timeout=30)
    shutil.copytree(run / "dumps", dump_dir)
    yield dump_dir
    subprocess.run(["rm", "-rf", str(dump_dir)], check=True, timeout=30)


def test_train_start_refuses_a_draft_config_that_does_not_fit_the_dumps_and_force_is_audited(
    lab_env, host, lab1_dumps, tmp_path
):
    off = draft_file(tmp_path / "off.json", [2, 4, 5])
    start = ("train", "start", "--host", host.name, "--json")
    before = len(audit_lines(host))
    rc, out, err = run_cli(lab_env, *start, "--draft-config", str(off))
    doc = json.loads(out)
    assert rc == 9 and doc["error"] == "contract_mismatch" and doc["reason"] == "contract_mismatch", err
    assert doc["message"].startswith("contract: the draft config") and "capture layers [3, 5, 6]" in doc["message"]
    assert doc["contract"]["layers_to_capture"] == [2, 4, 5] and doc["from"] == f"the dumps in {host.paths.dump_dir}"
    line = audit_lines(host)[before]
    assert (line["action"], line["ok"], line["forced"], line["failed_step"]) == (
        "train start",
        False,
        False,
        "contract",
    )
    assert "capture layers [3, 5, 6]" in line["contract"][0]
    rc, out, _ = run_cli(lab_env, "train", "status", "--host", host.name, "--json")
    assert rc == 0 and json.loads(out)["running"] is False  # nothing was started

    wide = draft_file(tmp_path / "wide.json", [1, 3, 4], hidden=128)
    rc, out, _ = run_cli(lab_env, *start, "--draft-config", str(wide))
    assert rc == 9 and "hidden size is 128; the dumps' hidden states are 64" in json.loads(out)["message"]

    # forced: the contract step lets it through and the audit line says so; this lab has no
    # SpecForge image, so the launch then fails (the real trainer started: test_train_real.py)
    rc, out, err = run_cli(lab_env, *start, "--draft-config", str(off), "--force", timeout=300)
    try:
        doc = json.loads(out)
        assert rc == 7 and doc["step"] == "launch", err
        line = audit_lines(host)[-1]
        assert (line["action"], line["ok"], line["forced"], line["failed_step"]) == (
            "train start",
            False,
            True,
            "launch",
        )
        assert "capture layers [3, 5, 6]" in line["contract"][0]
    finally:
        run_cli(lab_env, "train", "stop", "--host", host.name)

    right = draft_file(tmp_path / "right.json", [1, 3, 4])
    rc, out, err = run_cli(lab_env, *start, "--draft-config", str(right), "--dry-run")
    steps = {s["name"]: s for s in json.loads(out)["steps"]}
    assert rc == 0 and steps["contract"]["status"] == "ok", err


def _inventory_env(lab, host, tmp_path, version: str) -> dict:
    spec = lab.spec(host.name)
    spec = spec.model_copy(update={"sglang": spec.sglang.model_copy(update={"version": version})})
    inv = tmp_path / f"inv-{version}.yaml"
    inv.write_text(
        yaml.safe_dump({"hosts": {spec.name: spec.model_dump(mode="json", exclude={"name", "source", "groups"})}})
    )
    return {**os.environ, "REMOTE_OPS_INVENTORY": str(inv), "REMOTE_OPS_STATE_DIR": str(tmp_path / "state")}


def test_spec_deploy_refuses_a_drafter_numbered_for_another_release(lab, lab_env, host, lab1_dumps, tmp_path):
    drafters = tmp_path / "drafters"
    for name, ids in (("off", [2, 4, 5]), ("right", [1, 3, 4])):
        (drafters / name).mkdir(parents=True)
        draft_file(drafters / name / "config.json", ids, hidden=None)
    deploy = ("spec", "deploy", "--host", host.name, "--dry-run", "--json", "--draft")
    rc, out, err = run_cli(lab_env, *deploy, str(drafters / "off"))
    doc = json.loads(out)
    assert rc == 9 and doc["error"] == "contract_mismatch", err
    assert "would make SGLang 0.5.9 (plus_one (every id + 1)) capture layers [3, 5, 6]" in doc["message"]
    assert "fix eagle_config.eagle_aux_hidden_state_layer_ids" in doc["hint"]
    rc, out, err = run_cli(lab_env, *deploy, str(drafters / "right"))  # (the dry run then stops at lab1's
    # preflight: it has no SGLang checkout; the guard came first)
    assert (
        json.loads(out).get("error") != "contract_mismatch"
        and "drafter fits the dumps in" in err
        and "under SGLang 0.5.9 (plus_one)" in err
    ), err
    # DeepSeek from 0.5.13 on takes ids that do not start at 1 as given: the same drafter fits there
    env14 = _inventory_env(lab, host, tmp_path, "0.5.14")
    rc, out, err = run_cli(env14, *deploy, str(drafters / "off"))
    assert (
        json.loads(out).get("error") != "contract_mismatch" and "under SGLang 0.5.14 (plus_one_if_first_is_1)" in err
    ), err
    rc, out, err = run_cli(lab_env, *deploy, str(drafters / "missing"))
    assert rc == 9 and "no readable config.json" in json.loads(out)["message"]


def test_spec_deploy_with_no_dumps_on_the_host_checks_the_inventorys_layers(lab_env, host, tmp_path):
    subprocess.run(["rm", "-rf", str(host.paths.dump_dir)], check=True, timeout=30)
    (tmp_path / "d").mkdir()
    draft_file(tmp_path / "d" / "config.json", [2, 4, 5], hidden=None)
    rc, out, err = run_cli(
        lab_env, "spec", "deploy", "--host", host.name, "--dry-run", "--json", "--draft", str(tmp_path / "d")
    )
    doc = json.loads(out)
    assert rc == 9 and doc["error"] == "contract_mismatch" and doc["from"] == "the inventory (no dumps on the host)", (
        err
    )
    assert doc["contract"]["layers_to_capture"] == [2, 4, 5]  # SGLang's default for the inventory's 8 layers


# --------------------------------------------------------------------------- dumps export (lab2, pre-norm finals)


@pytest.fixture
def run_of(lab, _sglang_installed, standin_base):
    from standin_runs import extraction

    return lambda faults=None: extraction(lab, standin_base, faults)


def export(lab_env, *args: str) -> tuple[int, dict, str]:
    rc, out, err = run_cli(
        lab_env, "dumps", "export", "--host", "lab2", "--probe-mb", "0", "--json", *args, timeout=300
    )
    return rc, json.loads(out), err


def ckpt(out: str, index: int) -> dict:
    from remote_ops.onhost import specforge_export as se

    return torch.load(Path(out) / se.out_name(index), weights_only=True)


@pytest.mark.docker
def test_dumps_export_refuses_pre_norm_finals_unless_converted_or_accepted(run_of, lab_env, tmp_path):
    run = run_of({"STANDIN_FINAL_NORM": "pre"})
    rc, doc, err = export(lab_env)
    assert rc == 9 and doc["error"] == "contract_mismatch" and doc["reason"] == "prenorm_finals", err
    assert "PRE-norm final states" in doc["message"] and "--convert-prenorm" in doc["hint"]
    assert doc["norm"]["verdict"] == "pre-norm"

    rc, accepted, err = export(lab_env, "--accept-prenorm", "--out", str(tmp_path / "accepted"))
    assert rc == 0 and accepted["exported"] == 16 and accepted["final_states"]["action"] == "accept", err
    rc, converted, err = export(lab_env, "--convert-prenorm", "--out", str(tmp_path / "converted"))
    assert rc == 0 and converted["exported"] == 16 and converted["final_states"]["action"] == "convert", err
    assert converted["final_states"]["verdict"] == "pre-norm" and converted["final_norm"].startswith(
        "converted from pre-norm with model.norm.weight"
    )
    assert accepted["final_norm"] == "as dumped"

    from test_standin_compute import Reference, bf16, read_dump

    ref = Reference(run.model_dir)
    rows = run.rows()
    for i, sample in enumerate(run.samples):
        key = dumpfile.dump_key(dumpfile.token_ids_bytes(sample["input_ids"]), 0)
        tensors, _ = read_dump(run.dump_dir / "rank0" / f"{key}.safetensors")
        as_dumped, normed = ckpt(accepted["out"], i)["hidden_state"][0], ckpt(converted["out"], i)["hidden_state"][0]
        assert torch.equal(as_dumped, tensors["hidden_states"])
        pre = tensors["hidden_states"].to(torch.float64)
        want = bf16(ref.rms(pre, ref.w["model.norm.weight"]))  # the final RMSNorm, in torch from the checkpoint
        assert torch.equal(normed, want), f"sample {i}"
        # now it gives the server's token: the argmax, or a near tie as the audit counts one (the
        # converted row went through bf16 twice, the server's once)
        logits, gen = ref.lm_head @ normed[-1].to(torch.float64), rows[key]["generated_token"]
        best = float(logits.max())
        assert int(torch.argmax(logits)) == gen or best - float(logits[gen]) <= NEAR_TIE * max(abs(best), 1.0), i


@pytest.mark.docker
def test_dumps_export_refuses_to_convert_post_norm_finals(run_of, lab_env, tmp_path):
    run_of()
    rc, doc, err = export(lab_env, "--convert-prenorm", "--out", str(tmp_path / "x"))
    assert rc == 9 and doc["reason"] == "not_prenorm" and "post-norm" in doc["message"], err
    rc, doc, err = export(lab_env, "--out", str(tmp_path / "plain"))
    assert rc == 0 and doc["final_states"]["verdict"] == "post-norm" and doc["exported"] == 16, err
    assert doc["final_states"]["said"] == "post-norm (8 of 8 checked dumps give the server's token)"


def test_export_and_audit_flags_parse(tmp_path):
    """--convert-prenorm and --accept-prenorm exclude each other (a usage error before connecting)."""
    inv = tmp_path / "inv.yaml"
    inv.write_text("hosts:\n  nowhere:\n    address: 127.0.0.1\n    port: 1\n")
    env = {**os.environ, "REMOTE_OPS_INVENTORY": str(inv), "REMOTE_OPS_STATE_DIR": str(tmp_path / "s")}
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "remote_ops",
            "dumps",
            "export",
            "--host",
            "nowhere",
            "--convert-prenorm",
            "--accept-prenorm",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2 and "exclude each other" in p.stderr


@pytest.mark.docker
def test_a_real_train_start_puts_the_draft_config_in_the_training_image(lab, lab_env, host, lab1_dumps, tmp_path):
    """A local draft config is uploaded, a `host:` one copied on the host, into the build context
    that the image COPYs; run.yaml names the image's copy, never a laptop path.  (No GPU here: the
    build of the SpecForge image fails after the upload, which is what is checked.)"""
    from remote_ops.workflows import train as t

    context = Path(t.paths_for(lab.spec(host.name)).file("context"))
    right = draft_file(tmp_path / "right.json", [1, 3, 4])
    for arg, label in ((str(right), "local"), (f"host:{right}", "on the host")):
        subprocess.run(["rm", "-rf", str(context)], check=True, timeout=30)
        start = ("train", "start", "--host", host.name, "--draft-config", arg, "--json")
        rc, out, err = run_cli(lab_env, *start, timeout=300)
        doc = json.loads(out)
        assert rc == 7 and doc["step"] == "launch" and "docker build" in doc["command"], (label, err)
        assert f"{host.name}: contract ok" in err and f"{host.name}: upload changed" in err, (label, err)
        assert (context / "draft_config.json").read_bytes() == right.read_bytes(), label
        run_yaml = json.loads((context / "run.yaml").read_text())
        assert run_yaml["model"]["draft_model_config"] == t.IMAGE_DRAFT_CONFIG, label
        assert f"COPY draft_config.json {t.IMAGE_DRAFT_CONFIG}" in (context / "Dockerfile").read_text()
    subprocess.run(["rm", "-rf", str(context)], check=True, timeout=30)
