"""`train start|status|stop|export`: pure parsing and lifecycle decisions, run.yaml checked by SpecForge
0.2.0's own config schema (GPU and CPU), status from a captured real SpecForge 0.2.0 CPU log whose lines
SpecForge's own console logger re-prints byte for byte, the checkpoint export chooses, and the
lifecycle's lock and failed-step records on a real lab host through the CLI.  The real trainer on
the CPU (start, status, stop, no-op and refused re-runs, export) is tests/test_train_real.py."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from remote_ops.core import logparse, shell, specforge_run as sfr
from remote_ops.core.inventory import HostSpec
from remote_ops.workflows import hostlock, train as t

LOGS = Path(__file__).resolve().parent / "data" / "logs"
CPU_LOG = LOGS / "specforge_0_2_0_cpu_eval.log"  # `specforge train` on the CPU: 16 samples x 2 epochs, eval
DRAFT = {"architectures": ["LlamaForCausalLMEagle3"], "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}}


def test_tau_eta_and_latest_checkpoint():
    assert t.tau_estimate({0: 0.5, 1: 0.5}) == 1.75 and t.tau_estimate({}) is None
    line = "Training Epoch 1:  40%|####      | 8/20 [00:03<01:05, 2.5it/s, loss=1.2, acc=0.4, time=0.1s]"
    assert t.parse_eta("junk\r" + line) == 65.0
    assert t.latest_checkpoint("eagle3-step9\neagle3-step10\neagle3-latest\nx.best_meta.json") == "eagle3-step10"


def inspect(running: bool, code: int = 0) -> str:
    return json.dumps([{"State": {"Running": running, "ExitCode": code, "Status": "running" if running else "exited"}}])


def status_text(log: str, run: dict | None, ckpt: str = "", container: str = "", best: str = "") -> str:
    out = shell.sections(
        [
            ("container", f"printf %s {shell.quote(container)}"),
            ("run", f"printf %s {shell.quote(json.dumps(run))}" if run else "false"),
            ("log", f"printf %s {shell.quote(log)}"),
            ("ckpt", f"printf %s {shell.quote(ckpt)}"),
            ("best", f"printf %s {shell.quote(best)}"),
        ]
    )
    return subprocess.run(["bash", "-c", out], capture_output=True, text=True, timeout=30).stdout


def test_status_of_an_older_specforge_log_and_listing():
    log = (
        "Training Epoch 0: 100%|##########| 4/4 [00:01<00:00, 4.0it/s, loss=1.5, acc=0.3, time=0.25s]\r\n"
        "Train Epoch [1/2], position 0,  Acc: 0.60\nTrain Epoch [1/2], position 1,  Acc: 0.50\n"
    )
    st = t.parse_status("h", status_text(log, None, "eagle3-step4\neagle3-latest\n", inspect(False)))
    assert not st.running and st.state == "finished"
    assert (st.epoch, st.epochs, st.acc) == (1, 2, {0: 0.6, 1: 0.5}) and st.tau_estimate == 1.9
    assert st.latest_checkpoint == "eagle3-step4" and st.eta_s == 0.0
    failed = t.parse_status("h", status_text(log, None, "", inspect(False, 1)))
    assert failed.state == "failed" and failed.exit_code == 1
    assert t.parse_status("h", status_text("", None)).state == "not started"


def plan_for(spec, **kw):
    return t.real_plan(spec, t.paths_for(spec), "draft.json", "eagle3", kw.pop("epochs", 10), 8, **kw)


def test_run_yaml_is_accepted_by_specforge_0_2_0s_config_schema_and_dockerfile_pins_it():
    pytest.importorskip("specforge")
    from specforge.config import Config

    spec = HostSpec(name="gpu-node")
    p = t.paths_for(spec)
    plan = plan_for(spec)
    cfg = Config.model_validate(json.loads(t.run_yaml(spec, p, plan)))
    assert cfg.model.draft_model_config == t.IMAGE_DRAFT_CONFIG  # the image's copy, wherever it came from
    assert cfg.data.hidden_states_path == "/data/eagle3-dumps-specforge" and cfg.training.num_epochs == 10
    assert cfg.training.fsdp_sharding == "SHARD_GRAD_OP" and cfg.deployment.trainer.nproc_per_node == 8  # CUDA: as is
    text = t.dockerfile(spec, plan)
    assert text.splitlines()[2] == "FROM lmsysorg/sglang:v0.5.14" and '"specforge==0.2.0"' in text
    assert "CPU" not in text.split("FROM", 1)[1].split("COPY", 1)[0].upper().replace("CPU TRAINING", "")
    build, _, run, _ = t.real_commands(spec, p, plan)
    assert (
        "--pull=false" in build
        and "--pull=never" in run
        and "/data/eagle3-dumps-specforge:/data/eagle3-dumps-specforge:ro" in run
        and "--gpus all" in run
        and "SPECFORGE_DEVICE" not in run
    )


def test_on_a_host_without_gpus_run_yaml_is_specforges_cpu_setup():
    pytest.importorskip("specforge")
    from specforge.config import Config

    spec = HostSpec(name="sandbox", container={"gpus": "none"})
    p = t.paths_for(spec)
    plan = t.with_samples(_Counted("16\n"), plan_for(spec, epochs=2, eval_data="/data/eval-specforge"))
    assert (plan.device, plan.nproc, plan.samples, plan.total_steps, plan.base_image) == (
        "cpu",
        1,
        16,
        32,
        "remote-ops/specforge-cpu:0.2.0",
    )
    cfg = Config.model_validate(json.loads(t.run_yaml(spec, p, plan)))
    assert (cfg.training.fsdp_sharding, cfg.training.attention_backend, cfg.data.dataloader_num_workers) == (
        "NO_SHARD",
        "sdpa",
        0,
    )
    assert cfg.training.save_interval == 16 and cfg.training.eval_interval == 16  # once per epoch
    assert cfg.data.eval_hidden_states_path == "/data/eval-specforge" and cfg.deployment.trainer.nproc_per_node == 1
    text = t.dockerfile(spec, plan)
    assert text.splitlines()[2] == "FROM remote-ops/specforge-cpu:0.2.0" and "pip install" not in text
    run = t.real_commands(spec, p, plan)[2]
    assert (
        "SPECFORGE_DEVICE=cpu" in run
        and "TORCHDYNAMO_DISABLE=1" in run
        and "--gpus" not in run
        and "/data/eval-specforge:/data/eval-specforge:ro" in run
    )


class _Counted:
    def __init__(self, out: str) -> None:
        self.out = out

    def run(self, cmd, check=True, timeout=None):
        from types import SimpleNamespace

        assert "find " in cmd and ".ckpt" in cmd
        return SimpleNamespace(stdout=self.out, exit_status=0)


def test_status_of_a_real_specforge_cpu_log_shows_its_own_metrics_eval_checkpoints_and_eta():
    log = CPU_LOG.read_text()
    spec = HostSpec(name="h", container={"gpus": "none"})
    plan = t.with_samples(_Counted("16"), plan_for(spec, epochs=2))
    run = json.loads(plan.run_json())
    best = (LOGS / "specforge_0_2_0_cpu_eval.best_meta.json").read_text()
    ckpt = (LOGS / "specforge_0_2_0_cpu_eval.ls").read_text()
    # mid-run: the log up to step 20 (of 32), the container running
    upto = log[: log.index("step 24: ")]
    st = t.parse_status("h", status_text(upto, run, "eagle3-step16\n", inspect(True)))
    assert st.running and st.state == "running" and st.fingerprint == plan.fingerprint
    assert (st.step, st.steps, st.epoch, st.epochs) == (20, 32, 2, 2)
    rec = [r for r in logparse.parse_training(upto).records if r.phase == "train"][-1]
    step_s = rec.metrics["perf/optimizer_step_time_s"]
    assert st.eta_s == round(step_s * 12, 1) and st.acc == rec.acc and len(st.acc) == 7 and len(st.ploss) == 7
    assert len(st.acceptance_rate) == 7 and st.acceptance_rate[0] == rec.metrics["acceptance_rate_0"]
    assert st.eval["step"] == 16 and st.eval["simulated_acc_len"] == pytest.approx(0.0576795991687)
    assert len(st.eval["acc"]) == 7 and st.best is None  # SpecForge wrote no best meta in this listing
    # finished: every line, both checkpoints, exit 0
    done = t.parse_status("h", status_text(log, run, ckpt, inspect(False, 0), best))
    assert done.state == "finished" and done.eta_s == 0.0 and done.step == 32 and done.checkpoints == [16, 32]
    assert done.latest_checkpoint == "eagle3-step32" and done.eval["step"] == 32
    assert done.best == {"step": 32, "score": done.eval["simulated_acc_len"], "metric": sfr.BEST_METRIC}


def test_the_captured_lines_are_what_specforge_0_2_0s_logger_prints():
    """The captured train and eval lines, re-printed byte for byte by SpecForge 0.2.0's own console logger."""
    lines = [x for x in CPU_LOG.read_text().splitlines() if x.startswith("step ")]
    summary = logparse.parse_training("\n".join(lines))
    assert {r.phase for r in summary.records} == {"train", "eval"}
    pytest.importorskip("specforge")
    from specforge.training.assembly import _logger

    for line in lines:
        step, _, text = line.partition(": ")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            _logger(logparse.step_metrics(text), int(step.split()[1]))
        assert out.getvalue() == line + "\n"


def test_the_checkpoint_exported_is_the_best_by_eval_else_the_newest():
    metrics = sfr.run_metrics(CPU_LOG.read_text())
    assert metrics.evals and [s for s, _ in metrics.evals] == [16, 32]
    steps = sfr.checkpoint_steps((LOGS / "specforge_0_2_0_cpu_eval.ls").read_text(), "eagle3")
    best = sfr.best_meta((LOGS / "specforge_0_2_0_cpu_eval.best_meta.json").read_text(), "eagle3")
    assert best["step"] == 32 and sfr.choose_checkpoint(steps, best, metrics).step == 32
    at16 = {**best, "step": 16, "score": dict(metrics.evals)[16]}  # SpecForge's meta when step 16 was the best
    choice = sfr.choose_checkpoint(steps, at16, metrics)
    assert (choice.step, choice.name) == (16, "eagle3-step16") and "best eval/simulated_acc_len" in choice.reason
    by_log = sfr.choose_checkpoint(steps, None, metrics)  # no best meta: the best eval line with a checkpoint
    assert by_log.step == max(metrics.evals, key=lambda e: e[1])[0] == 32 and "(log)" in by_log.reason
    assert sfr.choose_checkpoint({16: "eagle3-step16"}, None, metrics).step == 16  # step 32 not saved
    plain = sfr.choose_checkpoint(steps, None, sfr.run_metrics("step 5: {'acc_0': 0.5}"))
    assert plain.step == 32 and plain.reason.startswith("newest")
    assert sfr.choose_checkpoint({}, best, metrics) is None
    assert sfr.best_meta(json.dumps(best), "other-run") is None and sfr.best_meta("junk\n", None) is None
    assert sfr.exported_drafter_dir("/data/d-drafter/", "eagle3") == "/data/d-drafter/eagle3-drafter-hf"
    assert sfr.checkpoint_steps("eagle3-drafter-hf\neagle3-step3\nx-step4\n", "eagle3") == {3: "eagle3-step3"}


def test_start_decision_and_run_json_diff():
    spec = HostSpec(name="h")
    plan, other = plan_for(spec, epochs=2), plan_for(spec, epochs=3)
    assert plan.fingerprint != other.fingerprint and plan.fingerprint == t.RunPlan(**{**plan.__dict__}).fingerprint
    running = t.TrainStatus("h", True, fingerprint=plan.fingerprint)
    assert t.start_decision(running, plan) == "noop" and t.start_decision(running, other) == "refuse"
    assert t.start_decision(t.TrainStatus("h", False, fingerprint=plan.fingerprint), plan) == "start"
    diff = t.run_json_diff(plan.run_json(), other.run_json())
    assert '- "epochs": 2,' in diff and '+ "epochs": 3,' in diff and "started" not in diff
    assert t.run_json_diff(plan.run_json(), plan.run_json()) == ""


# --------------------------------------------------------------------------- the lifecycle on a lab host


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


def draft(host) -> str:
    path = Path(str(host.paths.logs_dir) + "-draft.json")
    path.write_text(json.dumps(DRAFT))
    return str(path)


def fresh(host):
    subprocess.run(["rm", "-rf", str(host.paths.logs_dir), str(host.paths.dump_dir) + "-drafter"], timeout=30)


def test_start_is_refused_while_the_host_lock_is_held_and_a_dry_run_only_reads(lab, lab_env, host, remote):
    fresh(host)
    spec = lab.spec(host.name)
    token = hostlock.take(remote, spec, "deploy: held by the test")
    try:
        dry, err = cli(lab_env, "start", "--host", host.name, "--dry-run", "--diff")
        assert dry["steps"][0]["name"] == "lock" and "HELD" in dry["steps"][0]["detail"]
        assert dry["status"]["state"] == "not started" and dry["status"]["lock"]["what"] == "deploy: held by the test"
        assert '+ "run_id": "eagle3",' in dry["diff"] and not Path(spec.logs.training).exists()
        _, err = cli(lab_env, "start", "--host", host.name, "--draft-config", draft(host), rc=9)
        assert "held by" in err and "held by the test" in err
        rec = train_records(lab_env, host.name)[-1]
        assert rec["failed_step"] == "lock" and rec["lock"] == "not taken" and not rec["ok"]
        assert not Path(spec.logs.training).exists()
    finally:
        hostlock.release(remote, spec, token)


def test_a_failed_start_names_its_step_in_the_record_and_releases_the_lock(lab, lab_env, host):
    fresh(host)
    spec = lab.spec(host.name)
    args = ["--draft-config", draft(host), "--force", "--output", "/proc/remote-ops-no/drafter"]
    _, err = cli(lab_env, "start", "--host", host.name, *args, rc=7)
    rec = train_records(lab_env, host.name)[-1]
    assert rec["failed_step"] == "upload" and not rec["ok"] and rec["lock"] == "released", rec
    assert "upload:" in err and not Path(spec.lock_dir).exists()
    assert audit_lines(spec)[-1]["failed_step"] == "upload"


def test_train_export_lists_only_the_files_on_stdout():
    """SpecForge's export prints to stdout; the command sends it to stderr so that the file
    listing `train export` reports is the `ls` alone (it read 'Set tie_word_embeddings to False')."""
    spec = HostSpec(name="h", container={"gpus": "none"})
    cmd = t.export_command(spec, t.paths_for(spec), "/out/r-step8", "/out/r-drafter-hf", "hf", 60)
    assert ") >&2 && rm -rf /out/r-drafter-hf && mv /out/r-drafter-hf.tmp /out/r-drafter-hf && ls -1" in cmd


def test_seed_and_batch_size_reach_specforges_config_and_the_step_count():
    """--seed and --batch-size: SpecForge's training.seed and batch_size; steps per epoch divide by the batch."""
    pytest.importorskip("specforge")
    from specforge.config import Config

    spec = HostSpec(name="sandbox", container={"gpus": "none"})
    p = t.paths_for(spec)
    plan = t.with_samples(_Counted("100\n"), plan_for(spec, epochs=3, seed=7, batch_size=8))
    assert (plan.steps_per_epoch, plan.total_steps) == (13, 39)
    cfg = Config.model_validate(json.loads(t.run_yaml(spec, p, plan)))
    assert (cfg.training.seed, cfg.training.batch_size) == (7, 8)
    assert plan.fingerprint != plan_for(spec, epochs=3, seed=8, batch_size=8).fingerprint  # another run
