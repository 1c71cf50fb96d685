"""`train start|status|stop`: pure parsing, the run.yaml checked by SpecForge 0.2.0's own config schema,
and the labelled training STAND-IN run detached on a real lab host through the CLI."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from remote_ops import shell
from remote_ops import train as t
from remote_ops.inventory import HostSpec


def test_tau_eta_and_latest_checkpoint():
    assert t.tau_estimate({0: 0.5, 1: 0.5}) == 1.75 and t.tau_estimate({}) is None
    line = "Training Epoch 1:  40%|####      | 8/20 [00:03<01:05, 2.5it/s, loss=1.2, acc=0.4, time=0.1s]"
    assert t.parse_eta("junk\r" + line) == 65.0
    assert t.latest_checkpoint("eagle3-step9\neagle3-step10\neagle3-latest\nx.best_meta.json") == "eagle3-step10"


def test_status_parses_a_standin_log_and_listing():
    log = ("SPECFORGE STAND-IN (remote-ops): ...\n"
           "Training Epoch 0: 100%|##########| 4/4 [00:01<00:00, 4.0it/s, loss=1.5, acc=0.3, time=0.25s]\r\n"
           "Train Epoch [1/2], position 0,  Acc: 0.60\nTrain Epoch [1/2], position 1,  Acc: 0.50\n")
    out = shell.sections([("alive", "false"), ("container", "echo"), ("log", f"printf %s {shell.quote(log)}"),
                          ("ckpt", "printf 'eagle3-step4\\neagle3-latest\\n'")])
    text = subprocess.run(["bash", "-c", out], capture_output=True, text=True, timeout=30).stdout
    st = t.parse_status("h", text)
    assert st.standin and not st.running and st.state == "exited"
    assert (st.epoch, st.epochs, st.acc) == (1, 2, {0: 0.6, 1: 0.5}) and st.tau_estimate == 1.9
    assert st.latest_checkpoint == "eagle3-step4" and st.eta_s == 0.0


def test_run_yaml_is_accepted_by_specforge_0_2_0s_config_schema_and_dockerfile_pins_it():
    pytest.importorskip("specforge")
    from specforge.config import Config

    spec = HostSpec(name="gpu-node")
    p = t.paths_for(spec)
    cfg = Config.model_validate(json.loads(t.run_yaml(spec, p, "/data/kimi-eagle3.json", "eagle3", 10, 8)))
    assert cfg.data.hidden_states_path == "/data/eagle3-dumps-specforge" and cfg.training.num_epochs == 10
    text = t.dockerfile(spec)
    assert text.splitlines()[2] == "FROM lmsysorg/sglang:v0.5.9-cu129" and '"specforge==0.2.0"' in text
    build, run, _ = t.real_commands(spec, p)
    assert "--pull=false" in build and "--pull=never" in run and "/data/eagle3-dumps-specforge:/data/eagle3-dumps-specforge:ro" in run


# --------------------------------------------------------------------------- the stand-in on a lab host

def cli(lab_env, *args, timeout=120):
    proc = subprocess.run([sys.executable, "-m", "remote_ops", "train", *args, "--json"], capture_output=True,
                          text=True, timeout=timeout, env=lab_env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), proc.stderr


def test_standin_training_start_status_finish_then_stop(lab_env, host):
    subprocess.run(["rm", "-rf", str(host.paths.logs_dir), str(host.paths.dump_dir) + "-drafter"], timeout=30)
    st, err = cli(lab_env, "start", "--host", host.name, "--standin", "--epochs", "2", "--steps", "5",
                  "--step-s", "0.05")
    assert st["standin"] and "STAND-IN" in err
    deadline = time.monotonic() + 60
    while st["state"] != "finished":
        assert time.monotonic() < deadline, st
        time.sleep(0.5)
        st, err = cli(lab_env, "status", "--host", host.name)
    assert (st["epoch"], st["epochs"]) == (2, 2) and len(st["acc"]) == 7 and st["tau_estimate"] > 1
    assert st["latest_checkpoint"] == "eagle3-step10" and "not measured" in err
    assert st["latest_checkpoint_path"].endswith("-drafter/eagle3-step10")
    ckpt = host.paths.dump_dir.parent / (host.paths.dump_dir.name + "-drafter") / "eagle3-step10"
    assert json.loads((ckpt / "config.json").read_text())["standin"] is True and (ckpt / "STANDIN.txt").exists()
    st, _ = cli(lab_env, "start", "--host", host.name, "--standin", "--epochs", "5", "--steps", "100")
    assert st["running"]
    st, _ = cli(lab_env, "stop", "--host", host.name)
    assert not st["running"] and st["state"] == "stopped"
