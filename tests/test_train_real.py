"""`train start|status|stop|export` with the REAL SpecForge 0.2.0 on the CPU, in the sandbox's training image.

Marked `vllm`: run it with `bash scripts/test-vllm tests/test_train_real.py` (which builds the vLLM image;
the training image, FROM it, is built here on first use and saved, remote_ops/hostlab/train.py).
Skipped when the images cannot be built, failed instead under REMOTE_OPS_REQUIRE_VLLM=1.

The host is the lab's lab2 with the inventory entry `sandbox up --engine vllm` writes (containers get
no GPU: the CPU path).  The export is 16 training and 8 eval samples in SpecForge's offline format
(`dumps export`'s: input_ids, loss_mask, post-norm hidden_state [1,T,H], aux_hidden_state [1,T,3H] of
layers 1..3) made from a transformers forward of the served tiny Llama.  Everything else is the CLI as
an operator runs it: the real trainer container, SpecForge's own log lines and checkpoints, and
`specforge export` on the host.  Wall times are printed (`-s`).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from conftest import run_cli

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

HOST = "trainhost"
# The target's sizes come from its config.json (the sandbox's model may change); the draft vocabulary is
# the target's, the case in which SpecForge's export still writes d2t/t2d.
DRAFT = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "model_type": "llama",
    "num_hidden_layers": 1,
    "max_position_embeddings": 2048,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]},
}
FROM_TARGET = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")
FROM_TARGET += ("vocab_size", "rms_norm_eps")


def draft_config(model_dir: Path) -> dict:
    target = json.loads((model_dir / "config.json").read_text())
    doc = {**DRAFT, **{k: target[k] for k in FROM_TARGET if k in target}}
    rope = (target.get("rope_parameters") or {}).get("rope_theta") or target.get("rope_theta") or 10000.0
    return {**doc, "draft_vocab_size": doc["vocab_size"], "target_hidden_size": doc["hidden_size"], "rope_theta": rope}


def _require_images():
    """The saved vLLM image and the SpecForge wheels (the training image is built from them on first use)."""
    from remote_ops.hostlab import train as labtrain

    reason = labtrain.vllm.image_built() or (
        None if labtrain.wheels_ready() else f"no SpecForge wheels in {labtrain.wheels_dir()}: scripts/setup --vllm"
    )
    if reason is None:
        return labtrain
    if os.environ.get("REMOTE_OPS_REQUIRE_VLLM") == "1":
        pytest.fail(f"REMOTE_OPS_REQUIRE_VLLM=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def make_export(out: Path, model_dir: Path, first: int, n: int) -> None:
    """`n` samples in SpecForge's offline format from a transformers forward of the target."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    rows = out / "rows_0-2000"
    rows.mkdir(parents=True, exist_ok=True)
    for i in range(first, first + n):
        ids = tok(f"Sample {i}: the operator extracts hidden states from the served model, {i} times over.")[
            "input_ids"
        ]
        with torch.no_grad():
            hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        k = len(ids)
        torch.save(
            {
                "input_ids": torch.tensor(ids),
                "loss_mask": torch.tensor([0] * (k // 2) + [1] * (k - k // 2)),
                "hidden_state": hs[4].to(torch.bfloat16),  # transformers' last state is post-norm
                "aux_hidden_state": torch.cat([hs[1], hs[2], hs[3]], -1).to(torch.bfloat16),
            },
            rows / f"data_{i}.ckpt",
        )


def images_and_entry(lab, host_name: str, container: str) -> tuple[dict, Path, float]:
    """The vLLM and training images in the lab's dockerd (built on first use, else loaded), and lab
    host `host_name`'s inventory entry as `sandbox up --engine vllm` writes it, its server container
    named `container`; also the model dir and the seconds the images took."""
    from remote_ops.workflows import sandbox

    labtrain = _require_images()
    t0 = time.monotonic()
    image = labtrain.vllm.vllm_image(lab.dockerd.socket)
    labtrain.train_image(lab.dockerd.socket)
    images_s = time.monotonic() - t0
    model_dir = labtrain.vllm.tiny_model_dir()
    h = lab.host(host_name)
    entry = sandbox.vllm_overrides(h.inventory_entry(lab, image), image, str(model_dir), labtrain.vllm.SERVED_NAME)
    entry["container"]["name"] = container
    return entry, model_dir, images_s


@pytest.fixture(scope="module")
def train_env(lab, tmp_path_factory):
    import yaml

    entry, model_dir, images_s = images_and_entry(lab, "lab2", "vllm-eagle3-train")
    tmp = tmp_path_factory.mktemp("train-real")
    (tmp / "inv.yaml").write_text(yaml.safe_dump({"hosts": {HOST: entry}}))
    env = {**os.environ, "REMOTE_OPS_INVENTORY": str(tmp / "inv.yaml"), "REMOTE_OPS_STATE_DIR": str(tmp / "state")}
    dump_dir = Path(entry["dump"]["dir"])
    for d in (Path(str(dump_dir) + "-specforge"), Path(str(dump_dir) + "-eval"), Path(str(dump_dir) + "-drafter")):
        subprocess.run(["rm", "-rf", str(d)], check=True, timeout=60)
    make_export(Path(str(dump_dir) + "-specforge"), model_dir, 0, 16)
    make_export(Path(str(dump_dir) + "-eval"), model_dir, 100, 8)
    (tmp / "draft.json").write_text(json.dumps(draft_config(model_dir)))
    print(f"\n[train-real] images ready in {images_s:.0f}s")
    yield env, tmp, entry, dump_dir
    lab.dockerd.docker("rm", "-f", "vllm-eagle3-train-train", check=False)


def cli(env, *args, timeout=1200):
    rc, out, err = run_cli(env, *args, "--json", timeout=timeout)
    return rc, (json.loads(out) if out.strip().startswith(("{", "[")) else out), err


def test_train_start_runs_the_real_specforge_then_status_then_export_a_drafter(train_env):
    env, tmp, entry, dump_dir = train_env
    draft = str(tmp / "draft.json")
    args = ["train", "start", "--host", HOST, "--draft-config", draft, "--epochs", "2", "--log-interval", "4"]
    args += ["--eval-data", str(dump_dir) + "-eval", "--force"]
    t0 = time.monotonic()
    rc, r, err = cli(env, *args)
    start_s = time.monotonic() - t0
    assert rc == 0, err
    steps = {s["name"]: s for s in r["steps"]}
    assert list(steps) == ["lock", "check", "contract", "upload", "launch", "wait"], r["steps"]
    assert steps["contract"]["status"] in ("ok", "forced") and r["plan"]["device"] == "cpu"
    assert r["plan"]["samples"] == 16 and r["status"]["state"] in ("running", "finished")
    audit = [json.loads(x) for x in Path(entry["audit_log"]).read_text().splitlines() if x.strip()]
    line = audit[-1]
    assert (line["action"], line["ok"]) == ("train start", True)
    assert line["forced"] == (steps["contract"]["status"] == "forced")  # a forced start is audited as forced

    if r["status"]["running"]:  # a re-run of the same plan is a no-op, another plan is refused
        rc, again, err = cli(env, *args)
        assert rc == 0 and again["noop"], err
        rc, _, err = cli(env, *[a if a != "2" else "3" for a in args])
        assert rc == 9 and "another training run is running" in err

    deadline, st = time.monotonic() + 1500, r["status"]
    seen_running_metrics = None
    while st["state"] == "running":
        assert time.monotonic() < deadline, st
        time.sleep(5)
        rc, st, err = cli(env, "train", "status", "--host", HOST)
        assert rc == 0, err
        if st["acc"] and seen_running_metrics is None:
            seen_running_metrics = (st["step"], st["eta_s"], err)
    train_s = time.monotonic() - t0
    assert st["state"] == "finished", (st, Path(entry["logs"]["training"]).read_text()[-4000:])
    assert (st["step"], st["steps"], st["epochs"], st["eta_s"]) == (32, 32, 2, 0.0)
    assert sorted(st["acc"]) == [str(k) for k in range(7)] or sorted(st["acc"]) == list(range(7))
    assert len(st["ploss"]) == 7 and len(st["acceptance_rate"]) == 7
    assert st["eval"]["step"] == 32 and st["eval"]["simulated_acc_len"] is not None
    assert st["checkpoints"] == [16, 32] and st["latest_checkpoint"] == "eagle3-step32" and st["best"]
    rc, text, err = run_cli(env, "train", "status", "--host", HOST)
    assert rc == 0 and "acc_k (SpecForge, newest line)" in err and "simulated_acc_len" in err, err
    log = Path(entry["logs"]["training"]).read_text()
    assert "remote-ops CPU SHIM" in log and "step 32: {'acc_0': " in log and "STAND-IN" not in log

    t1 = time.monotonic()
    rc, ex, err = cli(env, "train", "export", "--host", HOST)
    export_s = time.monotonic() - t1
    assert rc == 0, err
    out = Path(ex["out"])
    assert out.name == "eagle3-drafter-hf" and {"config.json", "model.safetensors", "provenance.json"} <= set(
        ex["files"]
    )
    prov = json.loads((out / "provenance.json").read_text())
    assert (
        prov["step"] == st["best"]["step"]
        and prov["run_id"] == "eagle3"
        and prov["checkpoint"].endswith(f"eagle3-step{prov['step']}")
    )
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert ex["vocab_mapping_dropped"] and not {"d2t", "t2d"} & keys, keys  # draft vocab = target vocab
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    rc, stop, err = cli(env, "train", "stop", "--host", HOST)
    assert rc == 0 and stop["noop"], err
    metrics = {
        "start_s": round(start_s, 1),
        "start_to_finished_s": round(train_s, 1),
        "export_s": round(export_s, 1),
        "acc": st["acc"],
        "ploss_0": st["ploss"].get("0", st["ploss"].get(0)),
        "eval": st["eval"],
        "best": st["best"],
        "mid_run_status": seen_running_metrics[:2] if seen_running_metrics else None,
    }
    print(f"\n[train-real] {json.dumps(metrics)}")
    (Path(os.environ.get("REMOTE_OPS_TRAIN_REAL_OUT", tmp)) / "train-real.json").write_text(json.dumps(metrics))


def test_train_stop_stops_a_running_real_trainer(train_env):
    env, tmp, entry, dump_dir = train_env
    args = ["train", "start", "--host", HOST, "--draft-config", str(tmp / "draft.json"), "--epochs", "50"]
    args += ["--run-id", "long", "--force"]
    rc, r, err = cli(env, *args)
    assert rc == 0 and r["status"]["running"], err
    rc, dry, err = cli(env, "train", "stop", "--host", HOST, "--dry-run", "--diff")
    assert rc == 0 and dry["dry_run"] and dry["commands"] and "+++ after train stop: stopped (not run)" in err
    t0 = time.monotonic()
    rc, stop, err = cli(env, "train", "stop", "--host", HOST)
    assert rc == 0 and not stop["noop"], err
    assert [s["name"] for s in stop["steps"]] == ["lock", "check", "stop", "verify"]
    assert stop["status"]["state"] == "stopped" and not stop["status"]["running"], stop["status"]
    print(f"\n[train-real] stop took {time.monotonic() - t0:.1f}s")
