"""`remote-ops facts`: what the host is (OS, CPU, memory, GPUs, docker, disk, python3, SGLang)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import click

from ...workflows import facts as facts_mod
from ._fleet import run_on_hosts
from ._options import hosts_command


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:,.1f} GiB"


@dataclass
class FactsReport:
    """One host's facts plus how it was reached (the command's JSON document)."""

    facts: facts_mod.Facts
    ssh: str
    host_key_fingerprint: str
    derivation: Any = None  # how the patch spec was chosen (or why it could not be)
    patch_spec: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            **self.facts.to_dict(),
            "patch_spec": self.patch_spec,
            "ssh": self.ssh,
            "host_key_fingerprint": self.host_key_fingerprint,
        }


@click.command("facts")
@hosts_command(speculate=True)
def facts_cmd(app, hosts, forks) -> int:
    """Report OS, kernel, CPU, memory, GPUs, container runtime, dump-dir disk and SGLang."""
    from ...errors import Refused
    from ...workflows import patching

    def work(spec):
        remote = app.remote(spec)
        try:
            spec, derivation = patching.bind_host(remote, spec)
            shown = derivation.to_dict()
        except Refused as exc:  # facts still reports the rest of the host
            derivation, shown = f"not derived: {exc.message}", {"error": exc.message}
        return 0, FactsReport(
            facts_mod.gather(remote, spec), remote.target.display, remote.host_key_fingerprint, derivation, shown
        )

    return run_on_hosts(
        app,
        hosts,
        work,
        lambda console, _spec, r: render(console, r.facts, r.ssh, r.host_key_fingerprint, r.derivation),
        forks=forks,
    )


def render(console, f: facts_mod.Facts, where: str, fingerprint: str, derivation=None) -> None:
    """Human view of `Facts` on stderr."""
    gpus = (
        f"{len(f.gpus)} x {f.gpus[0].name} (cc {f.gpus[0].compute_cap}, driver {f.gpus[0].driver})"
        if f.gpus
        else (f.gpu_error or "none")
    )
    docker = f.docker.get("server") or f"unavailable: {f.docker.get('error', '?')}"
    target = f"sha256 {f.target_sha256}, {f.target_lines} lines" if f.target_sha256 else f"unreadable: {f.target_error}"
    rows = [
        ["ssh", f"{where}  host key {fingerprint}"],
        ["os", f.os],
        ["kernel", f.kernel],
        ["cpu", f"{f.cpus} x {f.cpu_model}"],
        ["memory", f"{_gib(f.mem_total_bytes)} total, {_gib(f.mem_available_bytes)} available"],
        ["gpus", gpus],
        ["docker", f"{docker} (runtimes: {', '.join(f.docker_runtimes) or '-'})"],
        ["nvidia runtime", "present" if f.nvidia_runtime else "absent"],
        ["dump dir", f"{f.dump_dir}: {_gib(f.dump_dir_free_bytes)} free"],
        ["python3", f.python3_problem or f.python3 or "-"],
        ["sglang", f.sglang_version or "not found"],
        ["patch spec", str(derivation) if derivation else "-"],
        ["patch target", f"{f.target_file}: {target}"],
    ]
    console.table(["fact", "value"], rows, title=f"facts: {f.host}")


commands = [facts_cmd]
