"""`remote-ops facts`: what the host is (OS, CPU, memory, GPUs, docker, disk, SGLang)."""
from __future__ import annotations

import click

from .. import facts as facts_mod
from ._options import host_command


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:,.1f} GiB"


@click.command("facts")
@host_command
def facts_cmd(app, host: str) -> None:
    """Report OS, kernel, CPU, memory, GPUs, container runtime, dump-dir disk and SGLang."""
    spec = app.host(host)
    remote = app.remote(spec)
    f = facts_mod.gather(remote, spec)
    render(app.console, f, remote.target.display, remote.host_key_fingerprint)
    app.console.emit({**f.to_dict(), "ssh": remote.target.display,
                      "host_key_fingerprint": remote.host_key_fingerprint})


def render(console, f: facts_mod.Facts, where: str, fingerprint: str) -> None:
    """Human view of `Facts` on stderr."""
    gpus = (f"{len(f.gpus)} x {f.gpus[0].name} (cc {f.gpus[0].compute_cap}, driver {f.gpus[0].driver})"
            if f.gpus else (f.gpu_error or "none"))
    docker = f.docker.get("server") or f"unavailable: {f.docker.get('error', '?')}"
    target = (f"sha256 {f.target_sha256}, {f.target_lines} lines" if f.target_sha256
              else f"unreadable: {f.target_error}")
    rows = [["ssh", f"{where}  host key {fingerprint}"], ["os", f.os], ["kernel", f.kernel],
            ["cpu", f"{f.cpus} x {f.cpu_model}"],
            ["memory", f"{_gib(f.mem_total_bytes)} total, {_gib(f.mem_available_bytes)} available"],
            ["gpus", gpus], ["docker", f"{docker} (runtimes: {', '.join(f.docker_runtimes) or '-'})"],
            ["nvidia runtime", "present" if f.nvidia_runtime else "absent"],
            ["dump dir", f"{f.dump_dir}: {_gib(f.dump_dir_free_bytes)} free"],
            ["sglang", f.sglang_version or "not found"], ["deepseek_v2.py", f"{f.target_file}: {target}"]]
    console.table(["fact", "value"], rows, title=f"facts: {f.host}")


commands = [facts_cmd]
