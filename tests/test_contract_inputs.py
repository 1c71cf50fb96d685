"""Issue 9, bad input: Dockerfile injection (5), inventory/ssh_config robustness (8),
checkout paths with a backslash or newline (9), secrets in output and records (13).

Pure tests first, then the same contract over real lab hosts (sshd + dockerd).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from remote_ops.core import rendering, secrets, shell
from remote_ops.core.inventory import adhoc_host, load_inventory, load_yaml, parse_inventory_data
from remote_ops.errors import CommandFailed, ConfigError, ExitCode
from remote_ops.remote.sshconfig import load_ssh_config, resolve_target
from remote_ops.workflows import container, deploy

TOKEN = "hf_s3cr3tTOKENvalue42"
INJECTED = "lmsysorg/sglang:v0.5.9-cu129\nRUN touch /tmp/remote-ops-pwned"


def cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "remote_ops", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def write_inventory(path: Path, hosts: dict) -> Path:
    path.write_text(yaml.safe_dump({"hosts": hosts}))
    return path


def instructions(dockerfile: str) -> list[str]:
    """The instruction keywords of a Dockerfile, continuation lines joined (how docker reads it)."""
    joined = re.sub(r"\\\n", " ", dockerfile)
    return [ln.split()[0].upper() for ln in joined.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


# ---------------------------------------------------------------- 5: Dockerfile injection (pure)
@pytest.mark.parametrize(
    "field,value",
    [
        ("base_image", INJECTED),
        ("base_image", "Ubuntu:22.04"),
        ("base_image", "ubuntu:bad tag"),
        ("base_image", "ubuntu:" + "t" * 129),
        ("image_checkout", "/sgl-workspace/sglang\nRUN id"),
        ("image_checkout", "relative/path"),
        ("checkout", "/root/sg\0lang"),
        ("version", "0.5.9\nRUN id"),
    ],
)
def test_bad_sglang_values_are_config_errors_naming_file_and_field(tmp_path, field, value):
    inv = write_inventory(tmp_path / "hosts.yaml", {"gpu": {"sglang": {field: value}}})
    with pytest.raises(ConfigError) as exc:
        load_inventory([inv])
    assert f"{inv}:hosts.gpu.sglang.{field}:" in str(exc.value)
    assert exc.value.exit_code == ExitCode.CONFIG and exc.value.details["line"] == 4


@pytest.mark.parametrize(
    "ref",
    [
        "ubuntu",
        "lmsysorg/sglang:v0.5.9-cu129",
        "localhost:5000/a/b_c:1.0",
        "registry.example.com:443/x/y@sha256:" + "a" * 64,
        "[::1]:5000/img:t",
        "remote-ops/base-python:bookworm",
    ],
)
def test_valid_image_references_load(ref):
    assert parse_inventory_data({"hosts": {"h": {"sglang": {"base_image": ref}}}}, "f")[0].sglang.base_image == ref


@pytest.mark.parametrize(
    "section,field,value",
    [
        ("dump", "dir", "/data/x\ny"),
        ("logs", "dir", "logs"),
        ("model", "path", "/m\r"),
        ("container", "name", "bad name"),
        ("container", "image", "Remote/Ops"),
        ("container", "tag", "a:b"),
        ("container", "volumes", ["/a:/b\nRUN x"]),
        ("container", "env", {"A=B": "x"}),
    ],
)
def test_other_paths_and_names_are_validated(section, field, value):
    with pytest.raises(ConfigError, match=rf"f\.yaml:hosts\.h\.{section}\.{field}"):
        parse_inventory_data({"hosts": {"h": {section: {field: value}}}}, "f.yaml")


def test_audit_log_and_lock_dir_must_be_absolute():
    with pytest.raises(ConfigError, match=r"hosts\.h\.lock_dir: must be an absolute path"):
        parse_inventory_data({"hosts": {"h": {"lock_dir": "lock"}}}, "f.yaml")


def test_render_filters_escape_values_that_bypassed_validation():
    """model_copy skips validation: the template itself must still keep every value on its line."""
    host = parse_inventory_data({"hosts": {"gpu-node": {"sglang": {"patch": "deepseek-v2"}}}}, "t.yaml")[0]
    evil = host.model_copy(
        update={
            "sglang": host.sglang.model_copy(
                update={"image_checkout": "/sgl-workspace/sglang\nRUN touch /tmp/pwned", "version": "0.5.9\nRUN id"}
            )
        }
    )
    patch = deploy.load_patch(host)
    good = deploy.render_dockerfile(host, patch, "a" * 64, "b" * 64)
    text = deploy.render_dockerfile(evil, patch, "a" * 64, "b" * 64)
    assert instructions(text) == instructions(good), "no value may add an instruction"
    assert not any(ln.startswith("RUN touch") or ln.startswith("RUN id") for ln in text.splitlines())
    copy = next(ln for ln in text.splitlines() if ln.startswith('COPY ["sglang/"'))
    assert json.loads(copy[len("COPY ") :]) == ["sglang/", "/sgl-workspace/sglang\nRUN touch /tmp/pwned/python/sglang/"]
    assert 'org.remote-ops.sglang.version="0.5.9\\nRUN id"' in text


def test_render_refuses_an_unquotable_from():
    host = parse_inventory_data({"hosts": {"gpu-node": {"sglang": {"patch": "deepseek-v2"}}}}, "t.yaml")[0]
    evil = host.model_copy(update={"sglang": host.sglang.model_copy(update={"base_image": INJECTED})})
    with pytest.raises(ConfigError, match="base_image"):
        deploy.render_dockerfile(evil, deploy.load_patch(host), "a" * 64, "b" * 64)


@pytest.mark.parametrize(
    "value,want",
    [
        ('a"b', r'"a\"b"'),
        ("$HOME", r'"\$HOME"'),
        ("a\\b", r'"a\\b"'),
        ("x\ny\0", r'"x\ny\u0000"'),
    ],
)
def test_quoted_filter(value, want):
    assert rendering.dockerfile_quoted(value) == want


def test_json_filter_and_net():
    assert rendering.dockerfile_json(["a\nb", "é"]) == '["a\\nb", "\\u00e9"]'
    with pytest.raises(ConfigError, match="spans lines"):  # the net: an unfiltered value
        rendering.environment().from_string("FROM {{ x }}").render(x="a\nRUN b")
    with pytest.raises(ConfigError):
        rendering.dockerfile_shell("a\nb")


def test_render_and_deploy_dry_run_refuse_an_injected_base_image(tmp_path):
    """Through the CLI: exit 3 naming file and field, before any connection (render needs no SSH)."""
    inv = write_inventory(tmp_path / "hosts.yaml", {"X": {"address": "127.0.0.1", "sglang": {"base_image": INJECTED}}})
    env = {"REMOTE_OPS_INVENTORY": str(inv), "REMOTE_OPS_STATE_DIR": str(tmp_path / "state"), "PATH": "/usr/bin:/bin"}
    for args in (["render", "--host", "X"], ["deploy", "--host", "X", "--dry-run"]):
        p = cli(*args, env=env, timeout=60)
        assert p.returncode == ExitCode.CONFIG, p.stderr
        assert f"{inv}:hosts.X.sglang.base_image:" in p.stderr and "Traceback" not in p.stderr
        assert "RUN touch" not in p.stdout


# ----------------------------------------------------- 8: inventory and ssh_config robustness (pure)
@pytest.mark.parametrize(
    "text,field,line,words",
    [
        ("hosts:\n  h1: just-a-string\n", "hosts.h1", 2, "not a string"),
        ("hosts:\n  h1: [a, b]\n", "hosts.h1", 2, "not a list"),
        ("hosts: [h1, h2]\n", "hosts", 1, "not a list"),
        ("defaults: 3\nhosts: {}\n", "defaults", 1, "not a number"),
        ("hosts:\n  h1:\n    adress: 10.0.0.1\n", "hosts.h1.adress", 3, "did you mean 'address'?"),
        ("hosts:\n  h1:\n    server:\n      prot: 1\n", "hosts.h1.server.prot", 4, "did you mean 'port'?"),
        ("host:\n  h1: {}\n", "host", 1, "did you mean 'hosts'?"),
        ("hosts:\n  h1:\n    address: 10.0.0.1\n  h1:\n    address: 10.0.0.2\n", "hosts.h1", 4, "duplicate key 'h1'"),
        ("hosts:\n  h1:\n    port: 22\n    port: 2222\n", "hosts.h1.port", 4, "duplicate key 'port'"),
    ],
)
def test_inventory_shape_errors_name_file_line_and_field(tmp_path, text, field, line, words):
    f = tmp_path / "inv.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_inventory([f])
    msg = str(exc.value)
    assert msg.startswith(f"{f}:{field}:") and words in msg and f"line {line}" in msg, msg


def test_non_utf8_inventory_names_file_and_line(tmp_path):
    f = tmp_path / "inv.yaml"
    f.write_bytes(b"hosts:\n  h1:\n    user: r\xf6ot\n")
    with pytest.raises(ConfigError, match=rf"{re.escape(str(f))}: not UTF-8 text: byte 0xf6 at line 3"):
        load_inventory([f])


def test_yaml_aliases_and_merge_keys_still_load():
    data, lines = load_yaml(b"defaults: &d {user: ops}\nhosts:\n  a: {<<: *d, address: 10.0.0.1}\n  b: *d\n", "f")
    hosts = parse_inventory_data(data, "f", lines)
    assert [(h.name, h.user) for h in hosts] == [("a", "ops"), ("b", "ops")]


def test_bad_adhoc_host_is_a_config_error():
    with pytest.raises(ConfigError, match="--host"):
        adhoc_host("a\nb")


@pytest.mark.parametrize(
    "text,line,option",
    [
        ("Host a\n  HostName 127.0.0.9\nHost b\n  Port abc\n", 4, "Port"),
        ("Host b\n  Port = 70000\n", 2, "Port"),
        ("Host *\n  ConnectTimeout soon\n", 2, "ConnectTimeout"),
    ],
)
def test_ssh_config_bad_numbers_name_file_line_and_option(tmp_path, text, line, option):
    f = tmp_path / "ssh_config"
    f.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_ssh_config(f)
    assert str(exc.value).startswith(f"{f}:{line}:{option}:"), str(exc.value)


def test_ssh_config_non_utf8_and_bad_jump_port(tmp_path):
    f = tmp_path / "ssh_config"
    f.write_bytes(b"Host a\n  User r\xf6ot\n")
    with pytest.raises(ConfigError, match=rf"{re.escape(str(f))}:2: not UTF-8"):
        load_ssh_config(f)
    f.write_text("Host a\n  ProxyJump j:abc\n")
    with pytest.raises(ConfigError, match="ProxyJump"):
        resolve_target(adhoc_host("a"), load_ssh_config(f))


def test_cli_exit_3_without_traceback(tmp_path):
    f = tmp_path / "inv.yaml"
    f.write_text("hosts:\n  h1: [1]\n")
    ssh = tmp_path / "ssh_config"
    ssh.write_text("Host h2\n  Port abc\n")
    env = {"REMOTE_OPS_STATE_DIR": str(tmp_path / "s"), "PATH": "/usr/bin:/bin"}
    p = cli("hosts", "--inventory", str(f), env=env, timeout=60)
    assert p.returncode == 3 and "Traceback" not in p.stderr and f"{f}:hosts.h1:" in p.stderr
    f.write_text("hosts:\n  h2: {address: 127.0.0.1}\n")
    p = cli("facts", "--host", "h2", "--inventory", str(f), "--ssh-config", str(ssh), env=env, timeout=60)
    assert p.returncode == 3 and "Traceback" not in p.stderr and f"{ssh}:2:Port:" in p.stderr


# ------------------------------------------------------------------ 9: hashing builder (pure)
def test_sha256_of_handles_any_name(tmp_path):
    weird = tmp_path / "a\\b\nc d'e"
    weird.write_bytes(b"hello\n")
    out = subprocess.run(["sh", "-c", shell.sha256_of(str(weird))], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout == hashlib.sha256(b"hello\n").hexdigest() + "\n"
    gone = subprocess.run(
        ["sh", "-c", shell.sha256_of(str(tmp_path / "absent"))], capture_output=True, text=True, timeout=30
    )
    assert gone.returncode != 0 and gone.stdout == ""


def test_no_module_hashes_by_file_name():
    """`sha256sum PATH` (which escapes odd names) appears nowhere; shell.sha256_of is the builder."""
    root = Path(__file__).resolve().parent.parent / "remote_ops"
    offenders = [
        str(p)
        for p in root.rglob("*.py")
        if p.name != "shell.py"  # the builder (and its docstring)
        and re.search(r"sha256sum['\"]?,? +['\"]?[^<|'\" ]", p.read_text())
    ]
    assert offenders == []


# ------------------------------------------------------------------ 13: secret masking (pure)
@pytest.mark.parametrize(
    "name,secret",
    [
        ("HF_TOKEN", True),
        ("HUGGING_FACE_HUB_TOKEN", True),
        ("OPENAI_API_KEY", True),
        ("dbPassword", True),
        ("AWS_SECRET_ACCESS_KEY", True),
        ("DB_PASSWD", True),
        ("GIT_CREDENTIALS", True),
        ("--api-key", True),
        ("BASIC_AUTH", True),
        ("TOKENIZER_PATH", False),
        ("MAX_TOKENS", False),
        ("KEYBOARD", False),
        ("AUTHOR", False),
        ("SGLANG_HS_DUMP_DIR", False),
        ("MONKEY", False),
        ("PWD", False),
    ],
)
def test_secret_names_are_word_boundary_aware(name, secret):
    assert secrets.is_secret_name(name) is secret


def test_mask_argv_text_and_data():
    argv = [
        "docker",
        "run",
        "-e",
        f"HF_TOKEN={TOKEN}",
        "-e",
        "SGLANG_PORT=1",
        "img",
        "--api-key",
        "sk-1",
        "--api-key=sk-2",
        "--tokenizer-path",
        "/t",
    ]
    masked = secrets.mask_argv(argv)
    assert masked == [
        "docker",
        "run",
        "-e",
        "HF_TOKEN=***",
        "-e",
        "SGLANG_PORT=1",
        "img",
        "--api-key",
        "***",
        "--api-key=***",
        "--tokenizer-path",
        "/t",
    ]
    line = shell.join(argv[:4] + ["-e", f"MY_SECRET={TOKEN} x"])
    assert TOKEN not in secrets.mask_text(line) and "MY_SECRET=***" in secrets.mask_text(line)
    doc = secrets.mask_data(
        {"env": {"HF_TOKEN": TOKEN, "A": "b"}, "host_key_fingerprint": "SHA256:x", "error": {"command": line}}
    )
    assert TOKEN not in json.dumps(doc) and doc["env"]["A"] == "b" and doc["host_key_fingerprint"] == "SHA256:x"


class FailingRemote:
    """A Remote whose every command fails the way FabricRemote reports it (command in the error)."""

    name = "h"

    def run(self, command, **kw):
        raise CommandFailed(
            "command exited 125",
            host="h",
            command=shell.cmd(command),
            exit_status=125,
            stderr_tail="docker: Error response from daemon",
        )


def test_a_failed_docker_run_shows_the_command_masked():
    host = parse_inventory_data({"hosts": {"h": {"container": {"env": {"HF_TOKEN": TOKEN}}}}}, "f")[0]
    with pytest.raises(CommandFailed) as exc:
        container._run_masked(FailingRemote(), container.run_argv(host, "img:t"), timeout=5)
    assert TOKEN not in json.dumps(exc.value.to_dict()) and "HF_TOKEN=***" in exc.value.command
    plan = container.lifecycle_plan("start", host, None, "img:t")
    shown = [shell.join(secrets.mask_argv(c)) if isinstance(c, list) else c for c in plan]
    assert TOKEN not in " ".join(shown)


def test_hosts_json_masks_env(tmp_path):
    inv = write_inventory(tmp_path / "h.yaml", {"h": {"container": {"env": {"HF_TOKEN": TOKEN, "A": "b"}}}})
    p = cli(
        "hosts",
        "--json",
        "--inventory",
        str(inv),
        env={"PATH": "/usr/bin:/bin", "REMOTE_OPS_STATE_DIR": str(tmp_path / "s")},
        timeout=60,
    )
    assert p.returncode == 0 and TOKEN not in p.stdout + p.stderr
    assert json.loads(p.stdout)["hosts"][0]["container"]["env"] == {"HF_TOKEN": "***", "A": "b"}


# =============================================================== over real lab hosts
WEIRD = "co\\ut\nwith newline"


@pytest.fixture
def weird_checkout(sglang_host):
    """A copy of the SGLang 0.5.9 files remote-ops reads, under a checkout whose name holds a
    backslash and a newline (on lab2's filesystem, under its root)."""
    src = Path(sglang_host.paths.checkout)
    root = Path(sglang_host.paths.root) / WEIRD
    shutil.rmtree(root, ignore_errors=True)
    for rel in ("python/sglang/srt/models/deepseek_v2.py", "python/sglang/version.py", "python/sglang/_version.py"):
        if (src / rel).exists():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / rel, root / rel)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_backslash_newline_checkout_reads_patches_and_reverts_over_ssh(sglang_host, weird_checkout, lab_env):
    """inspect-source, patch check/apply/verify/revert with --file naming such a path, through the CLI."""
    target = weird_checkout / "python/sglang/srt/models/deepseek_v2.py"
    pristine = hashlib.sha256(target.read_bytes()).hexdigest()
    base = ["--host", sglang_host.name, "--file", str(target)]
    p = cli("inspect-source", *base, "--lines", "1:3", "--json", env=lab_env)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["sha256"] == pristine and "corrupted" not in p.stderr
    for args in (["patch", "check"], ["patch", "apply"], ["patch", "verify"]):
        p = cli(*args, *base, env=lab_env)
        assert p.returncode == 0 and "corrupted" not in p.stderr, (args, p.stderr)
    assert hashlib.sha256(target.read_bytes()).hexdigest() != pristine
    p = cli("patch", "revert", *base, env=lab_env)
    assert p.returncode == 0, p.stderr
    assert hashlib.sha256(target.read_bytes()).hexdigest() == pristine
    assert not list(target.parent.glob(".*remote-ops-tmp*"))


def test_backslash_newline_checkout_facts_over_ssh(lab, sglang_host, sglang_remote, weird_checkout):
    """facts hashes such a checkout's deepseek_v2.py (the inventory refuses the name; the hashing
    must not depend on that: the spec here bypasses validation with model_copy)."""
    from remote_ops.workflows import facts

    spec = lab.spec(sglang_host.name)
    spec = spec.model_copy(update={"sglang": spec.sglang.model_copy(update={"checkout": str(weird_checkout)})})
    target = weird_checkout / "python/sglang/srt/models/deepseek_v2.py"
    f = facts.gather(sglang_remote, spec)
    assert f.target_error is None
    assert f.target_sha256 == hashlib.sha256(target.read_bytes()).hexdigest()
    assert f.target_lines == target.read_bytes().count(b"\n")
    assert f.sglang_version == "0.5.9"


def test_upload_if_changed_with_an_odd_name(sglang_host, sglang_remote, weird_checkout):
    from remote_ops.workflows import extract

    path = str(weird_checkout / "client.py")
    assert extract.upload_if_changed(sglang_remote, b"print(1)\n", path) is True
    assert extract.upload_if_changed(sglang_remote, b"print(1)\n", path) is False


def _secret_spec(spec):
    return spec.model_copy(
        update={"container": spec.container.model_copy(update={"env": {**spec.container.env, "HF_TOKEN": TOKEN}})}
    )


def test_deploy_dry_run_and_json_never_show_the_token(lab, spec, lab_env, tmp_path):
    secret = _secret_spec(spec)
    inv = write_inventory(
        tmp_path / "inv.yaml", {secret.name: secret.model_dump(mode="json", exclude={"name", "source", "groups"})}
    )
    env = {**lab_env, "REMOTE_OPS_INVENTORY": str(inv)}
    human = cli("deploy", "--host", secret.name, "--dry-run", env=env)
    assert human.returncode == 0, human.stderr
    assert "HF_TOKEN=***" in human.stdout and TOKEN not in human.stdout + human.stderr  # the plan: stdout
    machine = cli("deploy", "--host", secret.name, "--dry-run", "--json", env=env)
    assert machine.returncode == 0, machine.stderr
    doc = json.loads(machine.stdout)
    assert "HF_TOKEN=***" in doc["diffs"]["docker run"] and TOKEN not in machine.stdout + machine.stderr


def test_run_record_and_audit_line_never_hold_the_token(sglang_remote, spec, lab_env, tmp_path):
    """A real deploy: the container gets the value (docker inspect shows it); the record, the
    audit line and the read commands' JSON (health, container status) do not."""
    secret = _secret_spec(spec)
    try:
        result = deploy.deploy(sglang_remote, secret, why="test")
        record = Path(result.record).read_text()
        assert TOKEN not in record and "fingerprint" in record
        assert TOKEN not in Path(secret.audit_log).read_text()
        inspect = sglang_remote.run(["docker", "inspect", "-f", "{{json .Config.Env}}", secret.container.name])
        assert f"HF_TOKEN={TOKEN}" in json.loads(inspect.stdout), "the env must reach the container"
        sglang_remote.run(["docker", "rm", "-f", secret.container.name])
        shown, _, _ = container.lifecycle(sglang_remote, secret, "start", image=result.image, dry_run=True)
        assert any("docker run" in c for c in shown) and TOKEN not in " ".join(shown)
        container.run(sglang_remote, secret, result.image)
        inv = write_inventory(
            tmp_path / "inv.yaml", {secret.name: secret.model_dump(mode="json", exclude={"name", "source", "groups"})}
        )
        env = {**lab_env, "REMOTE_OPS_INVENTORY": str(inv)}
        for args in (
            ["health", "--host", secret.name, "--json"],
            ["container", "status", "--host", secret.name, "--json"],
        ):
            p = cli(*args, env=env, timeout=120)
            assert p.stdout.startswith("{") and TOKEN not in p.stdout + p.stderr, (args, p.stderr)
    finally:
        sglang_remote.run(["docker", "rm", "-f", spec.container.name], check=False)
