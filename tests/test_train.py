"""`train start|status|stop`: pure parsing and lifecycle decisions, the run.yaml checked by SpecForge
0.2.0's own config schema, the STAND-IN's lines re-printed by SpecForge 0.2.0's own console logger, and
the labelled training STAND-IN run detached on a real lab host through the CLI: lock, audit line, run
record, no-op re-runs, --dry-run/--diff."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from remote_ops.core import logparse, shell
from remote_ops.core.inventory import HostSpec
from remote_ops.workflows import hostlock, train as t

STANDIN = Path(__file__).resolve().parents[1] / "docker" / "standin" / "specforge_standin_train.py"


def standin_module():
    spec = importlib.util.spec_from_file_location("specforge_standin_train", STANDIN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tau_eta_and_latest_checkpoint():
    assert t.tau_estimate({0: 0.5, 1: 0.5}) == 1.75 and t.tau_estimate({}) is None
    line = "Training Epoch 1:  40%|####      | 8/20 [00:03<01:05, 2.5it/s, loss=1.2, acc=0.4, time=0.1s]"
    assert t.parse_eta("junk\r" + line) == 65.0
    assert t.latest_checkpoint("eagle3-step9\neagle3-step10\neagle3-latest\nx.best_meta.json") == "eagle3-step10"


def test_status_parses_a_standin_log_and_listing():
    log = (
        "SPECFORGE STAND-IN (remote-ops): ...\n"
        "Training Epoch 0: 100%|##########| 4/4 [00:01<00:00, 4.0it/s, loss=1.5, acc=0.3, time=0.25s]\r\n"
        "Train Epoch [1/2], position 0,  Acc: 0.60\nTrain Epoch [1/2], position 1,  Acc: 0.50\n"
    )
    out = shell.sections(
        [
            ("alive", "false"),
            ("container", "echo"),
            ("log", f"printf %s {shell.quote(log)}"),
            ("ckpt", "printf 'eagle3-step4\\neagle3-latest\\n'"),
        ]
    )
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
    cfg = Config.model_validate(json.loads(t.run_yaml(spec, p, "eagle3", 10, 8)))
    assert cfg.model.draft_model_config == t.IMAGE_DRAFT_CONFIG  # the image's copy, wherever it came from
    assert cfg.data.hidden_states_path == "/data/eagle3-dumps-specforge" and cfg.training.num_epochs == 10
    text = t.dockerfile(spec)
    assert text.splitlines()[2] == "FROM lmsysorg/sglang:v0.5.9-cu129" and '"specforge==0.2.0"' in text
    build, _, run, _ = t.real_commands(spec, p)
    assert (
        "--pull=false" in build
        and "--pull=never" in run
        and "/data/eagle3-dumps-specforge:/data/eagle3-dumps-specforge:ro" in run
    )


def status_text(log: str, run: dict | None, ckpt: str = "", alive: bool = False) -> str:
    out = shell.sections(
        [
            ("alive", "true" if alive else "false"),
            ("container", "echo"),
            ("run", f"printf %s {shell.quote(json.dumps(run))}" if run else "false"),
            ("log", f"printf %s {shell.quote(log)}"),
            ("ckpt", f"printf %s {shell.quote(ckpt)}"),
        ]
    )
    return subprocess.run(["bash", "-c", out], capture_output=True, text=True, timeout=30).stdout


def test_status_of_a_0_2_0_log_takes_epoch_and_eta_from_run_json_and_perf_step_time():
    sf = standin_module()
    log = sf.BANNER + "\n" + "".join(sf.metrics_line(n, n / 5, 7, 1e-4, 0.5) + "\n" for n in range(1, 8))
    plan = t.RunPlan("eagle3", True, 2, "/d", "/o", steps_per_epoch=5, step_s=0.5)
    st = t.parse_status("h", status_text(log, json.loads(plan.run_json()), "eagle3-step5\n", alive=True))
    assert st.standin and st.running and st.state == "running" and st.fingerprint == plan.fingerprint
    assert (st.step, st.steps, st.epoch, st.epochs) == (7, 10, 2, 2) and st.eta_s == 1.5  # 3 steps x 0.5 s
    assert len(st.acc) == 7 and st.tau_estimate > 1 and st.latest_checkpoint == "eagle3-step5"
    real = t.parse_status("h", status_text(log.replace(sf.BANNER, ""), {"run_id": "r", "epochs": 2}))
    assert (real.step, real.steps, real.epoch, real.eta_s) == (7, None, None, None)  # steps per epoch unknown


def test_standin_lines_are_what_specforge_0_2_0_prints_and_say_stand_in():
    """The stand-in's metrics and eval lines, re-printed by SpecForge 0.2.0's own console logger."""
    sf = standin_module()
    lines = [sf.metrics_line(3, 0.6, 7, 1e-4, 0.1), sf.eval_line(5, 1.0, 7)]
    summary = logparse.parse_training("\n".join(lines))
    assert [(r.phase, r.index, len(r.acc)) for r in summary.records] == [("train", 3, 7), ("eval", 5, 7)]
    assert all("'STAND-IN/synthetic': 1.0" in line for line in lines) and summary.standin
    assert summary.to_dict()["label"].startswith("STAND-IN")
    pytest.importorskip("specforge")
    from specforge.training.assembly import _logger

    for line in lines:
        step, _, text = line.partition(": ")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            _logger(logparse.step_metrics(text), int(step.split()[1]))
        assert out.getvalue() == line + "\n"


def test_start_decision_and_run_json_diff():
    plan = t.RunPlan("eagle3", True, 2, "/d", "/o", steps_per_epoch=5, step_s=0.1)
    other = t.RunPlan("eagle3", True, 3, "/d", "/o", steps_per_epoch=5, step_s=0.1)
    assert plan.fingerprint != other.fingerprint and plan.fingerprint == t.RunPlan(**{**plan.__dict__}).fingerprint
    running = t.TrainStatus("h", True, True, fingerprint=plan.fingerprint)
    assert t.start_decision(running, plan) == "noop" and t.start_decision(running, other) == "refuse"
    assert t.start_decision(t.TrainStatus("h", False, True, fingerprint=plan.fingerprint), plan) == "start"
    diff = t.run_json_diff(plan.run_json(), other.run_json())
    assert '- "epochs": 2,' in diff and '+ "epochs": 3,' in diff and "started" not in diff
    assert t.run_json_diff(plan.run_json(), plan.run_json()) == ""


# --------------------------------------------------------------------------- the stand-in on a lab host


def cli(lab_env, *args, timeout=120, rc=0):
    proc = subprocess.run(
        [sys.executable, "-m", "remote_ops", "train", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=lab_env,
    )
    assert proc.returncode == rc, proc.stderr
    return (json.loads(proc.stdout) if proc.stdout.strip() else None), proc.stderr


def train_records(lab_env, host_name: str) -> list[dict]:
    runs = Path(lab_env["REMOTE_OPS_STATE_DIR"]) / "hosts" / host_name / "runs"
    return [json.loads(p.read_text()) for p in sorted(runs.glob("*-train.json"))]


def audit_lines(spec) -> list[dict]:
    p = Path(spec.audit_log)
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []


def fresh(host):
    subprocess.run(["rm", "-rf", str(host.paths.logs_dir), str(host.paths.dump_dir) + "-drafter"], timeout=30)


def test_standin_training_start_status_finish_then_stop(lab, lab_env, host):
    fresh(host)
    spec = lab.spec(host.name)
    audit0 = len(audit_lines(spec))
    r, err = cli(
        lab_env, "start", "--host", host.name, "--standin", "--epochs", "2", "--steps", "5", "--step-s", "0.05"
    )
    assert r["standin"] and not r["noop"] and "STAND-IN" in err
    assert [s["name"] for s in r["steps"]] == ["lock", "check", "upload", "launch", "wait"]
    st = r["status"]
    deadline = time.monotonic() + 60
    while st["state"] != "finished":
        assert time.monotonic() < deadline, st
        time.sleep(0.5)
        st, err = cli(lab_env, "status", "--host", host.name)
    assert (st["epoch"], st["epochs"], st["step"], st["steps"]) == (2, 2, 10, 10) and len(st["acc"]) == 7
    assert st["tau_estimate"] > 1 and st["eta_s"] == 0.0 and st["lock"] is None
    assert st["latest_checkpoint"] == "eagle3-step10" and "not measured" in err and "STAND-IN" in err
    assert st["latest_checkpoint_path"].endswith("-drafter/eagle3-step10")
    ckpt = host.paths.dump_dir.parent / (host.paths.dump_dir.name + "-drafter") / "eagle3-step10"
    assert json.loads((ckpt / "config.json").read_text())["standin"] is True
    assert "STAND-IN" in (ckpt / "STANDIN.txt").read_text()
    log = Path(spec.logs.training).read_text()
    assert log.startswith("SPECFORGE STAND-IN") and "step 10: {'STAND-IN/synthetic': 1.0, 'acc_0'" in log
    rec = train_records(lab_env, host.name)
    assert rec[-1]["ok"] and rec[-1]["lock"] == "released" and rec[-1]["failed_step"] is None
    audit = audit_lines(spec)[audit0:]
    assert [a["action"] for a in audit] == ["train start"] and audit[0]["ok"] and audit[0]["standin"]
    assert not Path(spec.lock_dir).exists()
    r, _ = cli(lab_env, "stop", "--host", host.name)  # nothing runs: a no-op
    assert r["noop"] and [s["name"] for s in r["steps"]] == ["lock", "check"]


def test_rerun_is_a_noop_another_plan_is_refused_and_stop_dry_run_changes_nothing(lab, lab_env, host):
    fresh(host)
    spec = lab.spec(host.name)
    args = ["start", "--host", host.name, "--standin", "--epochs", "5", "--steps", "100"]
    r, _ = cli(lab_env, *args)
    try:
        assert r["status"]["running"] and not r["noop"]
        again, err = cli(lab_env, *args)
        assert again["noop"] and "nothing to do" in err and [s["name"] for s in again["steps"]] == ["lock", "check"]
        dry, err = cli(lab_env, *args, "--dry-run", "--diff")
        assert dry["dry_run"] and dry["noop"] and dry["commands"] == [] and "unchanged" in err
        other, err = cli(lab_env, "start", "--host", host.name, "--standin", "--epochs", "6", "--dry-run", "--diff")
        assert other["steps"][1]["status"] == "failed" and "another run is running" in err
        _, err = cli(lab_env, "start", "--host", host.name, "--standin", "--epochs", "6", rc=9)
        assert "another training run is running" in err and "check" in err
        assert train_records(lab_env, host.name)[-1]["failed_step"] == "check"
        dry, err = cli(lab_env, "stop", "--host", host.name, "--dry-run", "--diff")
        assert dry["dry_run"] and dry["commands"] and "+++ after train stop: stopped (not run)" in err
        assert cli(lab_env, "status", "--host", host.name)[0]["running"]
    finally:
        r, _ = cli(lab_env, "stop", "--host", host.name)
    assert not r["status"]["running"] and r["status"]["state"] == "stopped" and not r["noop"]
    assert [s["name"] for s in r["steps"]] == ["lock", "check", "stop", "verify"]
    actions = [(a["action"], a["ok"], a["noop"]) for a in audit_lines(spec)[-4:]]
    assert actions == [
        ("train start", True, False),
        ("train start", True, True),
        ("train start", False, False),
        ("train stop", True, False),
    ]


def test_start_is_refused_while_the_host_lock_is_held_and_a_dry_run_only_reads(lab, lab_env, host, remote):
    fresh(host)
    spec = lab.spec(host.name)
    token = hostlock.take(remote, spec, "deploy: held by the test")
    try:
        dry, err = cli(lab_env, "start", "--host", host.name, "--standin", "--dry-run", "--diff")
        assert dry["steps"][0]["name"] == "lock" and "HELD" in dry["steps"][0]["detail"]
        assert dry["status"]["state"] == "not started" and dry["status"]["lock"]["what"] == "deploy: held by the test"
        assert '+ "run_id": "eagle3",' in dry["diff"] and not Path(spec.logs.training).exists()
        _, err = cli(lab_env, "start", "--host", host.name, "--standin", rc=9)
        assert "held by" in err and "held by the test" in err
        rec = train_records(lab_env, host.name)[-1]
        assert rec["failed_step"] == "lock" and rec["lock"] == "not taken" and not rec["ok"]
        assert not Path(spec.logs.training).exists()
    finally:
        hostlock.release(remote, spec, token)


def test_a_failed_start_names_its_step_in_the_record_and_releases_the_lock(lab, lab_env, host):
    fresh(host)
    spec = lab.spec(host.name)
    _, err = cli(lab_env, "start", "--host", host.name, "--standin", "--output", "/proc/remote-ops-no/drafter", rc=7)
    rec = train_records(lab_env, host.name)[-1]
    assert rec["failed_step"] == "upload" and not rec["ok"] and rec["lock"] == "released", rec
    assert "upload:" in err and not Path(spec.lock_dir).exists()
    assert audit_lines(spec)[-1]["failed_step"] == "upload"


def test_logs_summary_of_a_standin_log_says_stand_in_on_screen_and_in_the_json(tmp_path):
    """`logs summary --no-pull` over a pulled stand-in log (no host contacted)."""
    sf = standin_module()
    inv = tmp_path / "inv.yaml"
    inv.write_text("hosts:\n  h:\n    address: 127.0.0.1\n    port: 9\n")
    state = tmp_path / "state"
    (state / "hosts" / "h" / "logs").mkdir(parents=True)
    (state / "hosts" / "h" / "logs" / "training.log").write_text(
        sf.BANNER + "\n" + sf.metrics_line(1, 0.1, 7, 1e-4, 0.1) + "\n"
    )
    env = {**os.environ, "REMOTE_OPS_INVENTORY": str(inv), "REMOTE_OPS_STATE_DIR": str(state), "COLUMNS": "200"}
    proc = subprocess.run(
        [sys.executable, "-m", "remote_ops", "logs", "summary", "--host", "h", "--no-pull", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "STAND-IN" in proc.stderr and json.loads(proc.stdout)["training"]["standin"] is True
