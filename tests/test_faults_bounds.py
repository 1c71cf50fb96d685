"""Fault matrix (issue 36): small host files are read bounded, deadlines end the remote process,
expected input errors keep their documented exit codes, and the CLI's small promises hold.

The hostile files (a FIFO, a symlink to /dev/zero, a file past the cap, nested JSON) are made ON a
real lab host (lab1) over its sshd; the CLI runs as a subprocess against the lab inventory.

- `remote.smallfile.read_small_file`: a regular file only (a FIFO or a symlink to a device is
  refused by name, exit 9 `unsafe_host_file`), at most `cap` bytes (over: refused, naming file
  and cap), missing: NotFound; bounded in time on the host too.
- A remote command past its deadline leaves no process on the host (`ps` there).
- `spec deploy --dry-run` with the drafter's config.json a symlink to /dev/zero or a FIFO: exit 9
  within seconds, no reader left on the host (it was 2.38 GB RSS, then exit 8; a `cat` left).
- Nested JSON (200,000 `[`): exit 3 (`train start --draft-config`, `dumps audit --draft-config`,
  `spec deploy --draft`), never a RecursionError traceback.
- A hidden size that is not an integer (7168.0, "7168", NaN, 1e999, true): exit 3 naming the
  file and field (it passed the contract as "contract ok").
- `--json` usage errors print one JSON document; `--json` before the command name is accepted;
  `train start --dry-run` with a failed contract exits 9; `init --host 'root@$(id)'` exits 2.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from conftest import run_cli

from remote_ops.errors import CommandTimedOut, ConfigError, NotFound, UnsafeHostFile

NESTED = "[" * 200_000


def _host_dir(remote, host, name: str) -> str:
    d = str(host.paths.root / "faults36" / name)
    remote.run(["sh", "-c", 'rm -rf "$1" && mkdir -p "$1"', "sh", d])
    return d


def _ps(remote, marker: str) -> list[str]:
    out = remote.run("ps -eo pid,args", check=False).stdout
    return [line for line in out.splitlines() if marker in line and "ps -eo" not in line]


def _no_process_left(remote, marker: str, within: float = 8.0) -> list[str]:
    deadline = time.monotonic() + within
    left = _ps(remote, marker)
    while left and time.monotonic() < deadline:
        time.sleep(0.25)
        left = _ps(remote, marker)
    return left


# --------------------------------------------------------------------------- the seam


def test_read_small_file_reads_regular_files_only_and_at_most_the_cap(remote, host):
    from remote_ops.remote.smallfile import read_small_file

    d = _host_dir(remote, host, "small")
    remote.run(
        [
            "sh",
            "-c",
            'cd "$1" && printf "{}" > ok.json && ln -s ok.json link.json && mkfifo fifo '
            "&& ln -s /dev/zero zero && ln -s fifo fifolink && head -c 2000 /dev/zero > big",
            "sh",
            d,
        ]
    )
    assert read_small_file(remote, f"{d}/ok.json", 100) == "{}"
    assert read_small_file(remote, f"{d}/link.json", 100) == "{}"  # a symlink to a regular file is fine
    for name in ("fifo", "zero", "fifolink"):
        t = time.monotonic()
        with pytest.raises(UnsafeHostFile) as err:
            read_small_file(remote, f"{d}/{name}", 100, timeout=20)
        assert time.monotonic() - t < 5
        assert err.value.details["reason"] == "not_regular" and f"{d}/{name}" in err.value.message
        assert err.value.exit_code == 9
    with pytest.raises(UnsafeHostFile) as err:
        read_small_file(remote, f"{d}/big", 1000)
    assert err.value.details["reason"] == "too_large" and "1000" in err.value.message and f"{d}/big" in str(err.value)
    with pytest.raises(NotFound):
        read_small_file(remote, f"{d}/absent", 100)
    assert read_small_file(remote, f"{d}/absent", 100, missing_ok=True) is None
    assert read_small_file(remote, f"{d}/big", 2000) == "\0" * 2000


def test_a_command_past_its_deadline_leaves_no_process_on_the_host(remote, host):
    d = _host_dir(remote, host, "deadline")
    remote.run(["mkfifo", f"{d}/pipe"])
    marker = "sleep 4242.25"
    with pytest.raises(CommandTimedOut):
        remote.run(f"{marker}; true", timeout=1)
    assert _no_process_left(remote, "4242.25") == []
    with pytest.raises(CommandTimedOut):
        remote.run(["cat", f"{d}/pipe"], timeout=1)  # blocked at open: what `cat config.json` did
    assert _no_process_left(remote, f"{d}/pipe") == []


# --------------------------------------------------------------------------- spec deploy's drafter config


def _drafter(remote, host, name: str, make: str) -> str:
    d = _host_dir(remote, host, name)
    remote.run(["sh", "-c", f'cd "$1" && {make}', "sh", d])
    return d


@pytest.mark.parametrize("make", ["ln -s /dev/zero config.json", "mkfifo config.json"], ids=["dev-zero", "fifo"])
def test_spec_deploy_refuses_a_drafter_config_that_is_not_a_regular_file(lab_env, remote, host, make):
    d = _drafter(remote, host, "drafter-" + make.split()[0], make)
    t = time.monotonic()
    rc, out, err = run_cli(
        lab_env,
        "spec",
        "deploy",
        "--host",
        host.name,
        "--dry-run",
        "--json",
        "--command-timeout",
        "20",
        "--draft",
        d,
        timeout=60,
    )
    took = time.monotonic() - t
    doc = json.loads(out)
    assert rc == 9 and doc["error"] == "unsafe_host_file" and doc["reason"] == "not_regular", err
    assert f"{d}/config.json" in doc["message"] and took < 15, (took, err)
    assert _no_process_left(remote, f"{d}/config.json") == []


def test_spec_deploy_refuses_a_drafter_config_past_the_cap(lab_env, remote, host):
    d = _drafter(remote, host, "drafter-big", "head -c 3000000 /dev/zero | tr '\\0' ' ' > config.json")
    rc, out, err = run_cli(lab_env, "spec", "deploy", "--host", host.name, "--dry-run", "--json", "--draft", d)
    doc = json.loads(out)
    assert rc == 9 and doc["reason"] == "too_large" and str(doc["cap"]) in doc["message"], err


# --------------------------------------------------------------------------- nested JSON, non-integer sizes


def test_nested_json_draft_configs_are_config_errors_not_tracebacks(lab_env, remote, host, tmp_path):
    nested = tmp_path / "nested.json"
    nested.write_text(NESTED)
    for args in (
        ("train", "start", "--host", host.name, "--dry-run", "--json", "--draft-config", str(nested)),
        ("dumps", "audit", "--host", host.name, "--json", "--draft-config", str(nested)),
    ):
        rc, out, err = run_cli(lab_env, *args)
        assert rc == 3 and "Traceback" not in err, (args, err[-2000:])
        doc = json.loads(out)
        assert doc["error"] == "config" and doc["source"] == str(nested) and "nest" in doc["message"], doc
    d = _host_dir(remote, host, "drafter-nested")
    remote.put(NESTED.encode(), f"{d}/config.json")
    rc, out, err = run_cli(lab_env, "spec", "deploy", "--host", host.name, "--dry-run", "--json", "--draft", d)
    assert rc == 3 and "Traceback" not in err, err[-2000:]
    assert json.loads(out)["source"] == f"{host.name}:{d}/config.json"


def test_the_json_loader_bounds_depth_and_size(tmp_path):
    from remote_ops.core.jsonload import load_json, loads_json

    assert loads_json('{"a": [[1], {"b": "[[[["}]}', "x") == {"a": [[1], {"b": "[[[["}]}
    with pytest.raises(ConfigError, match="nest"):
        loads_json("[" * 101 + "]" * 101, "x.json")
    assert loads_json("[" * 100 + "]" * 100, "x.json")  # the cap itself is fine
    with pytest.raises(ConfigError, match="not JSON"):
        loads_json("{", "x.json")
    big = tmp_path / "big.json"
    big.write_text(" " * 2000 + "{}")
    with pytest.raises(ConfigError, match="2000"):
        load_json(big, cap=2000)
    assert load_json(big, cap=4000) == {}
    with pytest.raises(ConfigError, match="cannot read"):
        load_json(tmp_path / "absent.json")


SIZES = ["7168.0", '"7168"', "NaN", "1e999", "true", "-64"]


@pytest.mark.parametrize("field", ["hidden_size", "target_hidden_size"])
def test_a_hidden_size_that_is_not_an_integer_is_a_config_error(lab_env, host, tmp_path, field):
    for value in SIZES:
        f = tmp_path / f"{field}.json"
        ids = '{"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}'
        f.write_text(f'{{"architectures": ["LlamaForCausalLMEagle3"], "eagle_config": {ids}, "{field}": {value}}}')
        rc, out, err = run_cli(
            lab_env, "train", "start", "--host", host.name, "--dry-run", "--json", "--draft-config", str(f)
        )
        doc = json.loads(out) if out.strip() else {}
        assert rc == 3 and doc.get("field") == field and doc.get("source") == str(f), (value, rc, out, err[-1000:])


def test_spec_deploy_refuses_a_float_hidden_size(lab_env, remote, host):
    d = _host_dir(remote, host, "drafter-float")
    doc = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}, "hidden_size": 7168.0}
    remote.put(json.dumps(doc).encode(), f"{d}/config.json")
    rc, out, err = run_cli(lab_env, "spec", "deploy", "--host", host.name, "--dry-run", "--json", "--draft", d)
    doc = json.loads(out)
    assert rc == 3 and doc["field"] == "hidden_size" and doc["source"] == f"{host.name}:{d}/config.json", err


# --------------------------------------------------------------------------- train start --dry-run


from test_contract_guards import lab1_dumps  # noqa: E402, F401 - three stand-in dumps in lab1's dump dir


def test_train_start_dry_run_with_a_failed_contract_exits_9(lab_env, host, lab1_dumps, tmp_path):  # noqa: F811
    off = tmp_path / "off.json"
    off.write_text(json.dumps({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 5]}, "hidden_size": 64}))
    args = ("train", "start", "--host", host.name, "--dry-run", "--json", "--draft-config", str(off))
    rc, out, err = run_cli(lab_env, *args)
    doc = json.loads(out)
    steps = {s["name"]: s for s in doc["steps"]}
    assert rc == 9 and steps["contract"]["status"] == "failed", err
    rc, out, err = run_cli(lab_env, *args, "--force")
    steps = {s["name"]: s for s in json.loads(out)["steps"]}
    assert rc == 0 and steps["contract"]["status"] == "forced", err


# --------------------------------------------------------------------------- the CLI's small items


def test_json_usage_errors_are_one_json_document(lab_env):
    for args in (("hosts", "--json", "--no-such-option"), ("--json", "hosts", "--no-such-option"), ("--json", "nope")):
        rc, out, err = run_cli(lab_env, *args)
        doc = json.loads(out)
        assert rc == 2 and doc["error"] == "usage" and doc["exit_code"] == 2 and doc["message"], (args, out, err)


def test_json_before_the_command_name_is_accepted(lab_env, lab):
    rc, out, err = run_cli(lab_env, "--json", "hosts")
    assert rc == 0 and isinstance(json.loads(out), (dict, list)), err
    rc2, out2, _ = run_cli(lab_env, "hosts", "--json")
    assert json.loads(out) == json.loads(out2)
    rc, out, err = run_cli(lab_env, "--json", "completion", "bash")
    assert rc == 2 and json.loads(out)["error"] == "usage", err


def test_init_refuses_a_host_with_shell_syntax_before_any_lookup(tmp_path):
    import os

    env = {**os.environ, "REMOTE_OPS_STATE_DIR": str(tmp_path / "state")}
    for ref in ("root@$(id)", "root@a;b", "`id`@host", "root@host:22x", "ro ot@host"):
        rc, out, err = run_cli(env, "init", "--dir", str(tmp_path / "inv"), "--host", ref, "--json")
        assert rc == 2 and json.loads(out)["error"] == "usage", (ref, rc, err)
    assert not (tmp_path / "inv").exists()


def test_cli_docs_name_inits_dir_option():
    text = (Path(__file__).parent.parent / "docs" / "cli.md").read_text()
    assert "`init DIR`" not in text and "`init --dir DIR`" in text


# --------------------------------------------------------------------------- the other small files


def test_the_model_config_that_names_the_patch_spec_is_read_bounded(lab, remote, host):
    from remote_ops.workflows import patching

    d = _drafter(remote, host, "model-zero", "ln -s /dev/zero config.json")
    spec = lab.spec(host.name)
    spec = spec.model_copy(
        update={
            "model": spec.model.model_copy(update={"path": d}),
            "sglang": spec.sglang.model_copy(update={"patch": None}),
        }
    )
    t = time.monotonic()
    with pytest.raises(UnsafeHostFile) as err:
        patching.host_spec(remote, spec)
    assert err.value.details["reason"] == "not_regular" and time.monotonic() - t < 10
    remote.put(NESTED.encode(), f"{d}/config.json.new")
    remote.run(["mv", "-f", f"{d}/config.json.new", f"{d}/config.json"])
    with pytest.raises(ConfigError, match="nests deeper"):
        patching.host_spec(remote, spec)


def test_train_status_reads_a_hostile_run_json_as_none(lab, remote, host):
    from remote_ops.workflows import train

    spec = lab.spec(host.name)
    p = train.paths_for(spec)
    remote.run(["sh", "-c", 'mkdir -p "$(dirname "$1")" && rm -f "$1" && mkfifo "$1"', "sh", p.file("run.json")])
    try:
        t = time.monotonic()
        st = train.status(remote, spec, p)
        assert st.run_id is None and time.monotonic() - t < 10
        with pytest.raises(UnsafeHostFile):
            train.read_run_json(remote, p)
    finally:
        remote.run(["rm", "-f", p.file("run.json")])
