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
    from .. import patching
    from ..errors import Refused

    spec = app.host(host)
    remote = app.remote(spec)
    try:
        spec, derivation = patching.bind_host(remote, spec)
        shown = derivation.to_dict()
    except Refused as exc:          # facts still reports the rest of the host
        derivation, shown = f"not derived: {exc.message}", {"error": exc.message}
    f = facts_mod.gather(remote, spec)
    render(app.console, f, remote.target.display, remote.host_key_fingerprint, derivation)
    app.console.emit({**f.to_dict(), "patch_spec": shown, "ssh": remote.target.display,
                      "host_key_fingerprint": remote.host_key_fingerprint})


def render(console, f: facts_mod.Facts, where: str, fingerprint: str, derivation=None) -> None:
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
            ["sglang", f.sglang_version or "not found"],
            ["patch spec", str(derivation) if derivation else "-"], ["patch target", f"{f.target_file}: {target}"]]
    console.table(["fact", "value"], rows, title=f"facts: {f.host}")


commands = [facts_cmd]
