"""Every script in bench/ runs: a CPU smoke run with tiny sizes, so a move or rename breaks a test.

Each script runs as its operator runs it (a new process from the repository
root) with the smallest sizes it takes: on CPU torch for the GPU scripts, on
real lab hosts (their own HostLab, gated by the `lab` fixture) for the lab
scripts.  The figures mean nothing here; what is asserted is that the script
gets through its whole path and writes its result.  deploy_noop.py and
fleet_wan.py deploy a host before they time anything (a BuildKit build, tens of
seconds), so their smoke run stops short of that: arguments, imports, and the
helpers they borrow from each other and from startup.py.
bench/dumper_tp2.py's CPU run is tests/test_dump_capture.py's gloo test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"

# every bench script -> the test that runs it (a new script needs a smoke run here)
SMOKED = {
    "dumper_gpu.py": "test_dumper_gpu_runs_every_phase_on_cpu",
    "dumper_sweep.py": "test_dumper_sweep_runs_both_step_kinds_on_cpu",
    "dumper_paired.py": "test_dumper_paired_runs_blocks_and_the_interleave_on_cpu",
    "dumper_probe.py": "test_dumper_probe_says_it_needs_a_gpu",
    "dumper_tp2.py": "test_dump_capture.py::test_two_processes_over_gloo_gate_ranks_and_write_bit_identical_spans",
    "export_specforge.py": "test_export_specforge_runs_the_exporter_against_its_copy_anchor",
    "startup.py": "test_startup_times_the_cli_and_health_on_a_lab_host",
    "health_fanout.py": "test_health_fanout_checks_two_lab_hosts",
    "pull.py": "test_pull_moves_both_data_sets_with_two_methods",
    "sync.py": "test_sync_bench_runs_every_method_on_tiny_shards",
    "engine_calls.py": "test_engine_calls_measures_every_variant_once",
    "deploy_noop.py": "test_deploy_noop_and_fleet_wan_parse_import_and_share_their_helpers",
    "fleet_wan.py": "test_deploy_noop_and_fleet_wan_parse_import_and_share_their_helpers",
    "vllm_extract.py": "test_vllm_real.py::test_vllm_extract_bench_runs_one_tiny_round",  # scripts/test-vllm only
    "specforge_gpu.py": "test_specforge_gpu_renders_train_starts_run_yaml_and_reads_a_captured_log",
    "compress.py": "test_compact.py::test_compress_bench_runs_on_tiny_inputs",
    "drafter_quality.py": "test_drafter_quality_derives_the_planted_faults_and_reads_vllms_counters",
}


def run_bench(script: str, *args: str, timeout: float = 120, codes=(0,)) -> subprocess.CompletedProcess:
    """`python bench/SCRIPT ARGS` from the repository root; fails with the script's output tail unless it
    exits with one of `codes` (pull.py exits 1 when its goal is not met, which tiny sizes may not be)."""
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode in codes, f"{script} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_every_bench_script_has_a_smoke_run():
    scripts = {p.name for p in BENCH.glob("*.py")}
    assert scripts == set(SMOKED), "bench scripts without a smoke run here: %s" % sorted(scripts - set(SMOKED))
    here = {name for name in globals() if name.startswith("test_")}
    assert {t for t in SMOKED.values() if "::" not in t} <= here


@pytest.mark.parametrize("storage", ["bf16", "fp8_e4m3"])
def test_dumper_gpu_runs_every_phase_on_cpu(tmp_path, storage):
    """Both storages (`--storage fp8_e4m3`: the cast in the timed loop, "bit-exact" = the files equal
    fp8.encode_rows of the source and decode to fp8.roundtrip of it)."""
    pytest.importorskip("torch")
    out = tmp_path / "gpu.json"
    run_bench(
        "dumper_gpu.py", "--device", "cpu", "--tokens", "64", "--hidden", "64", "--target-ms", "1",
        "--steps", "2", "--naive-steps", "1", "--sustained-steps", "2", "--sustained-writers", "2",
        "--buffers", "2", "--writers", "2", "--exact-samples", "2", "--raw-bytes", str(1 << 20),
        "--probe-bytes", str(1 << 20), "--dir", str(tmp_path / "work"), "--out", str(out), "--storage", storage,
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["summary"]["bit_exact"] and result["bit_exact"]["spans_checked"] > 0
    assert result["summary"]["storage"] == result["bit_exact"]["storage"] == storage
    assert result["bit_exact"]["bytes_per_token"] == (4 * 64 * 2 if storage == "bf16" else 4 * 64 + 16)
    assert result["sustained"]["file_bytes"] > 0 and result["bit_exact"]["copy_mode"] is None  # CPU: no driver


def test_dumper_sweep_runs_both_step_kinds_on_cpu(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "sweep.json"
    run_bench(
        "dumper_sweep.py", "--device", "cpu", "--hidden", "64", "--sizes", "64", "--kinds", "compute,launch",
        "--reps", "1", "--writers", "2", "--min-loop-s", "0.01", "--dir", str(tmp_path / "work"), "--out", str(out),
    )  # fmt: skip
    points = json.loads(out.read_text())["points"]
    assert [(p["kind"], p["tokens"]) for p in points] == [("compute", 64), ("launch", 64)]


def test_dumper_paired_runs_blocks_and_the_interleave_on_cpu(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "paired.json"
    run_bench(
        "dumper_paired.py", "--device", "cpu", "--hidden", "64", "--points", "compute:64", "--alt", "compute:64",
        "--alt-captures", "2", "--variants", "default,aa", "--block-s", "0.01", "--min-steps", "2",
        "--max-steps", "2", "--rounds-min", "2", "--rounds-max", "2", "--point-s", "0", "--settle-s", "0",
        "--writers", "2", "--dir", str(tmp_path / "work"), "--out", str(out),
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["points"] and result["alt"]


def test_dumper_probe_says_it_needs_a_gpu(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the probe would run for real")
    out = tmp_path / "probe.json"
    run_bench("dumper_probe.py", "--out", str(out))
    assert json.loads(out.read_text())["skipped"] == "needs a CUDA GPU and libcuda.so.1"


def test_export_specforge_runs_the_exporter_against_its_copy_anchor(tmp_path):
    out = tmp_path / "export.json"
    run_bench(
        "export_specforge.py", "--dir", str(tmp_path), "--files", "2", "--tokens", "16", "--hidden", "64",
        "--jobs", "1,2", "--probe-mb", "1", "--json", str(out),
    )  # fmt: skip
    results = json.loads(out.read_text())["results"]
    assert [r["jobs"] for r in results] == [1, 2] and all(r["files"] == 2 and r["ratio"] > 0 for r in results)


def test_startup_times_the_cli_and_health_on_a_lab_host(lab, tmp_path):
    out = tmp_path / "startup.json"
    run_bench("startup.py", "--repeat", "1", "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert {"python -c pass", "remote-ops --help", "remote-ops hosts", "remote-ops health --host lab1"} <= set(rows)
    assert all(r["wall_s"] > 0 for r in rows.values())


def test_startup_without_health_times_the_cli_in_process_and_through_a_fork_server(tmp_path):
    """`--no-health` needs no lab host; `--daemon` adds each row handed to a warm fork server."""
    out = tmp_path / "startup.json"
    run_bench("startup.py", "--no-health", "--daemon", "--repeat", "1", "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {
        "python -c pass",
        "remote-ops --help",
        "remote-ops hosts",
        "daemon: remote-ops --help",
        "daemon: remote-ops hosts",
    }
    assert all(r["wall_s"] > 0 for r in rows.values())


def test_health_fanout_checks_two_lab_hosts(lab, tmp_path):
    out = tmp_path / "health.json"
    run_bench("health_fanout.py", "--hosts", "2", "--repeat", "1", "--json", str(out))
    result = json.loads(out.read_text())
    assert result["hosts"] == 2 and result["one_host_s"] > 0 and result["ratio_parallel_vs_one"] > 0


def test_pull_moves_both_data_sets_with_two_methods(lab, tmp_path):
    out = tmp_path / "pull.json"
    run_bench(
        "pull.py", "--reps", "1", "--big-mib", "1", "--small", "4", "--methods", "rsync,remote-ops",
        "--dest-dir", str(tmp_path), "--json", str(out), codes=(0, 1),
    )  # fmt: skip
    median = json.loads(out.read_text())["median"]
    assert all(median[s]["remote-ops"]["x_rsync"] > 0 for s in ("big", "small")), median


def test_sync_bench_runs_every_method_on_tiny_shards(lab, tmp_path):
    out = tmp_path / "sync.json"
    run_bench(
        "sync.py", "--mib", "1", "--tokens", "8", "--rate-mbit", "400", "--methods",
        "sync,hand-rsync,relay,sync-packed", "--json", str(out), codes=(0, 1),
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert set(result["mb_s"]) == {"sync", "hand-rsync", "relay", "sync-packed"}
    assert all(v > 0 for v in result["mb_s"].values())
    assert set(result["x"]) == {"sync_vs_hand_rsync", "sync_vs_relay", "sync-packed_vs_sync"}
    assert result["engine_mb_s"]["rsync-gcm"] > 0
    assert 0 < result["packed_at_rest"]["bytes"] < result["bytes"] and result["compact"]["kept"] < 1


def test_engine_calls_measures_every_variant_once(lab, tmp_path):
    out = tmp_path / "engine.json"
    run_bench("engine_calls.py", "--reps", "1", "--json", str(out))
    result = json.loads(out.read_text())
    assert len(result["times"]) == 16 and all(len(runs) == 1 for runs in result["times"].values())
    assert result["counts"]["channels_opened_by_warm_engine"] == 1


def test_deploy_noop_and_fleet_wan_parse_import_and_share_their_helpers():
    for script in ("deploy_noop.py", "fleet_wan.py"):
        assert "usage:" in run_bench(script, "--help").stdout
    check = (
        "import sys, yaml; sys.path.insert(0, 'bench'); import deploy_noop, fleet_wan, startup\n"
        "fields = dict.fromkeys(['name', 'target', 'ref', 'dump_parent', 'container', 'version_py', 'lock'], 'x')\n"
        "assert isinstance(yaml.safe_load(deploy_noop.PLAYBOOK.format(audit='x', **fields)), list)\n"
        "assert callable(deploy_noop.bench_openssh) and callable(deploy_noop.bench_ansible)\n"
        "env = startup.as_installed_env()\n"
        "with startup._no_server() as server: assert server is None\n"
        "print('ok', sorted(env)[:1])\n"
    )
    proc = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stderr[-3000:]


def test_specforge_gpu_renders_train_starts_run_yaml_and_reads_a_captured_log(tmp_path):
    """`render` writes the CUDA run.yaml of `train start` beside copies of its inputs; `run`'s path
    mapping touches only the paths; `parse` reads SpecForge's metrics from a captured CPU log."""
    export, target = tmp_path / "export", tmp_path / "target"
    (export / "rows").mkdir(parents=True)
    target.mkdir()
    for i in range(3):
        (export / "rows" / f"{i}.ckpt").write_bytes(b"x")
    (target / "config.json").write_text("{}")
    draft = tmp_path / "draft.json"
    draft.write_text("{}")
    dest = tmp_path / "sf"
    run_bench("specforge_gpu.py", "render", "--export", str(export), "--target", str(target),
              "--draft-config", str(draft), "--epochs", "2", "--dest", str(dest))  # fmt: skip
    doc = json.loads((dest / "run.yaml").read_text())
    assert doc["training"]["num_epochs"] == 2 and "fsdp_sharding" not in doc["training"]  # the CUDA path as is
    assert sorted(p.name for p in dest.iterdir()) == ["data", "draft_config.json", "run.yaml", "target"]
    sys.path.insert(0, str(BENCH))
    import specforge_gpu

    local = specforge_gpu.localize(doc, dest)
    assert local["data"]["hidden_states_path"] == str(dest / "data") and local["training"] == doc["training"]
    out = run_bench("specforge_gpu.py", "parse", "--log", str(REPO / "tests/data/logs/specforge_0_2_0_cpu_eval.log"))
    parsed = json.loads(out.stdout)
    assert parsed["step"] and parsed["acc"] and parsed["eval_simulated_acc_len"] is not None


def test_drafter_quality_derives_the_planted_faults_and_reads_vllms_counters(tmp_path, monkeypatch):
    """The controls made from (a) and (b)'s hidden states on tiny samples; vLLM's counters to an
    acceptance length; the per-variant summary and table (pack, train and count need the sandbox,
    the GPU machine and vLLM: bench/README.md)."""
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("DRAFTER_QUALITY_WORK", str(tmp_path))
    sys.path.insert(0, str(BENCH))
    import importlib

    dq = importlib.reload(importlib.import_module("drafter_quality"))
    h = 128  # the learned target's hidden size: its lm_head judges (b)
    for i in range(2):
        rows = tmp_path / "a" / "rows_0-2000"
        rows.mkdir(parents=True, exist_ok=True)
        (tmp_path / "bh" / "rows_0-2000").mkdir(parents=True, exist_ok=True)
        rec = {
            "input_ids": torch.arange(5),
            "loss_mask": torch.tensor([0, 0, 1, 1, 1]),
            "hidden_state": torch.randn(1, 5, h).to(torch.bfloat16),
            "aux_hidden_state": torch.randn(1, 5, 3 * h).to(torch.bfloat16),
        }
        torch.save(rec, rows / f"data_{i}.ckpt")
        torch.save(
            {"hidden_state": torch.randn(1, 5, h).to(torch.bfloat16)}, tmp_path / "bh/rows_0-2000" / f"data_{i}.ckpt"
        )
    faults = dq.derive(REPO / "docker/vllm/learned-target")
    assert faults["b"]["positions"] == 6 and 0 <= faults["b"]["share"] <= 1
    a = torch.load(tmp_path / "a/rows_0-2000/data_0.ckpt", weights_only=True)
    pre = torch.load(tmp_path / "bh/rows_0-2000/data_0.ckpt", weights_only=True)["hidden_state"]
    b, c, d = (torch.load(tmp_path / k / "rows_0-2000/data_0.ckpt", weights_only=True) for k in "bcd")
    assert torch.equal(b["hidden_state"], pre) and torch.equal(b["aux_hidden_state"], a["aux_hidden_state"])
    assert torch.equal(c["aux_hidden_state"][..., : 2 * h], a["aux_hidden_state"][..., h:])
    assert torch.equal(c["aux_hidden_state"][..., 2 * h :], pre) and torch.equal(c["hidden_state"], a["hidden_state"])
    assert not d["aux_hidden_state"][..., 2 * h :].any()
    assert torch.equal(d["aux_hidden_state"][..., : 2 * h], a["aux_hidden_state"][..., : 2 * h])
    from remote_ops.dumper import fp8

    e = torch.load(tmp_path / "e/rows_0-2000/data_0.ckpt", weights_only=True)  # (e): FP8 storage, read back
    assert torch.equal(e["hidden_state"], fp8.roundtrip(a["hidden_state"], 1))
    assert torch.equal(e["aux_hidden_state"], fp8.roundtrip(a["aux_hidden_state"], 3))
    assert not torch.equal(e["aux_hidden_state"], a["aux_hidden_state"]) and 0 <= faults["e"]["share"] <= 1
    doc = {
        "before": {"vllm:spec_decode_num_drafts": 10, "vllm:spec_decode_num_accepted_tokens": 5,
                   "vllm:spec_decode_num_accepted_tokens_per_pos": [3, 2, 0]},
        "after": {"vllm:spec_decode_num_drafts": 110, "vllm:spec_decode_num_accepted_tokens": 155,
                  "vllm:spec_decode_num_accepted_tokens_per_pos": [73, 52, 30]},
    }  # fmt: skip
    got = dq.acceptance(doc)
    assert got["acceptance_length"] == 2.5 and got["per_position"] == [0.7, 0.5, 0.3]
    runs = {f"a-s{s}": {"variant": "a", "acc_0": 0.5 + s / 10, "acceptance_length": 2 + s / 10} for s in (1, 2, 3)}
    summary = dq.summary(runs)
    assert summary["audited"]["acceptance_length"] == {"median": 2.2, "min": 2.1, "max": 2.3}
    assert "| (a) audited |" in dq.table({"summary": summary, "faults": faults})
    curve = {f"dx6-n9-s{s}": {"variant": "dx6", "acc_0": 0.6, "acceptance_length": 2 + s / 10} for s in (1, 2, 3)}
    curve["ax6-n9-s1"] = {"variant": "ax6", "acc_0": 0.6, "acceptance_length": 2.5}  # one seed: no point yet
    pts = dq.points({**runs, **curve})
    assert list(pts) == ["dx6-n9"] and pts["dx6-n9"]["seeds"] == 3
    assert pts["dx6-n9"]["acceptance_length"] == {"median": 2.2, "min": 2.1, "max": 2.3}
    assert "| dx6-n9 | 3 | 0.60 (0.60–0.60) | 2.20 (2.10–2.30) |" in dq.table({"points": pts})
    # the CPU form of run.yaml is the one `train start` renders where containers get no GPU
    from types import SimpleNamespace

    from remote_ops.workflows import train

    plans = [train.RunPlan("q", 2, "/d", "/o", 1, "c.json", device=dev, samples=4) for dev in ("cuda", "cpu")]
    spec = SimpleNamespace(model=SimpleNamespace(path="/t"))
    cuda, cpu = (json.loads(train.run_yaml(spec, None, plan)) for plan in plans)
    assert dq.for_device(cuda, "cpu") == cpu and dq.for_device(cuda, "cuda") == cuda
