"""`facts`, `hosts` and `health` over real lab hosts (real sshd + dockerd)."""

import json

from conftest import run_cli

from remote_ops.cli.main import main
from remote_ops.errors import ExitCode
from remote_ops.workflows import facts

cli = run_cli  # (rc, stdout, stderr) of `python -m remote_ops ARGS` (tests/conftest.py)


def test_facts_reports_real_host(lab, host, remote):
    f = facts.gather(remote, lab.spec(host.name))
    assert "Debian" in f.os and f.cpus and f.mem_total_bytes > 0
    assert f.gpu_error == "no NVIDIA driver" and f.gpus == []
    assert f.docker.get("server"), f.docker  # the lab dockerd answered over SSH
    assert "nvidia" in f.docker_runtimes and f.nvidia_runtime
    assert f.dump_dir_free_bytes and f.dump_dir_free_bytes > 0


def test_facts_cli_json_with_sglang_tree(lab, sglang_host, lab_env):
    rc, out, err = cli(lab_env, "facts", "--host", sglang_host.name, "--json")
    assert rc == 0, err
    data = json.loads(out)
    assert data["sglang_version"] == "0.5.9" and data["target_lines"] == 2986
    assert len(data["target_sha256"]) == 64
    assert data["host_key_fingerprint"].startswith("SHA256:")


def test_hosts_lists_lab_inventory(lab, lab_env):
    rc, out, _ = cli(lab_env, "hosts", "--json")
    assert rc == 0
    assert {"lab1", "lab2", "lab3"} <= {h["name"] for h in json.loads(out)["hosts"]}


def test_health_without_container_fails_container_tier(lab, host, lab_env):
    rc, out, err = cli(lab_env, "health", "--host", host.name, "--json")
    assert rc == ExitCode.HEALTH_FAIL, err
    checks = {f"{c['tier']}/{c['name']}": c for c in json.loads(out)["hosts"][0]["checks"]}
    assert checks["ssh/connect"]["status"] == "ok"
    assert checks["engine/docker"]["status"] == "ok"
    assert checks["container/state"]["status"] == "fail"
    assert checks["sglang/model_info"]["status"] == "fail"


def test_health_all_reports_unreachable_host_and_others(lab, faults, spare_host, lab_env):
    faults.crash(spare_host)
    rc, out, _ = cli(lab_env, "health", "--all", "--json", "--connect-timeout", "3")
    hosts = {h["host"]: h for h in json.loads(out)["hosts"]}
    assert hosts[spare_host.name]["checks"][0]["status"] == "fail"
    assert hosts["lab1"]["checks"][0]["status"] == "ok"
    # issue 9 (defect 12): an unreachable host exits 4 like every other command (was 12)
    assert rc == ExitCode.UNREACHABLE


def test_health_usage_error():
    assert main(["health"]) == ExitCode.USAGE


def test_unknown_host_key_exit_code(lab, host, lab_env, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    inv = tmp_path / "inv.yaml"
    spec = lab.spec(host.name)
    inv.write_text(
        f"hosts:\n  x:\n    address: {spec.address}\n    port: {spec.port}\n"
        f"    identity_file: {spec.identity_file}\n    known_hosts: {empty}\n"
    )
    rc, _, err = cli({**lab_env, "REMOTE_OPS_INVENTORY": str(inv)}, "facts", "--host", "x")
    assert rc == ExitCode.HOST_KEY and "not in" in err
    rc, _, _ = cli(
        {**lab_env, "REMOTE_OPS_INVENTORY": str(inv)}, "facts", "--host", "x", "--host-key-policy", "accept-new"
    )
    assert rc == 0 and spec.address in empty.read_text()


def test_inventory_paths_with_spaces_and_semicolons_stay_one_argument(lab, host, lab_env, tmp_path):
    """Inventory values reach the remote shell quoted: a checkout and dump dir named with spaces and `;`."""
    import shutil

    import yaml

    from remote_ops.wheels import sglang_source

    checkout = host.paths.root / "sg lang; touch /tmp/remote-ops-INJECTED $(id)"
    target = checkout / "python/sglang/srt/models/deepseek_v2.py"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(sglang_source("0.5.9", "python/sglang/srt/models/deepseek_v2.py"))
    (checkout / "python/sglang/_version.py").write_text("__version__ = version = '0.5.9'\n")
    spec = lab.spec(host.name).model_dump(mode="json", exclude={"name", "source", "groups"})
    spec["sglang"]["checkout"] = str(checkout)
    spec["dump"]["dir"] = str(host.paths.root / "dumps; echo pwned")
    inv = tmp_path / "inv.yaml"
    inv.write_text(yaml.safe_dump({"hosts": {"awkward": spec}}))
    try:
        rc, out, err = cli({**lab_env, "REMOTE_OPS_INVENTORY": str(inv)}, "facts", "--host", "awkward", "--json")
        assert rc == 0, err
        data = json.loads(out)
        assert data["target_lines"] == 2986 and data["sglang_version"] == "0.5.9"
        assert data["dump_dir_free_bytes"] > 0
        rc, out, _ = cli(
            {**lab_env, "REMOTE_OPS_INVENTORY": str(inv)}, "inspect-source", "--host", "awkward", "--lines", "2837:2837"
        )
        assert rc == 0 and "self.capture_aux_hidden_states = False" in out
        assert not __import__("os").path.exists("/tmp/remote-ops-INJECTED")
    finally:
        shutil.rmtree(checkout, ignore_errors=True)
