"""`dataset prepare --on-host`: tokenize a local chat JSONL in a throwaway container on the host.

The host's SGLang image has transformers and the model's tokenizer can be read
there, so the laptop needs neither: the source file is uploaded to
`<logs.dir>/dataset/`, and `remote_ops/onhost/dataset.py` runs on its stdin
with the image's python3 in a throwaway container of the image the server
container was created from (`--rm`, no network, never pulls; the command line
is the host engine's, `engine.cli_for(host).throwaway_command`).  The script
prints one JSON report line; `prepare_on_host` returns it, or raises
`CommandFailed` with the script's complaint.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import Any

from .. import onhost
from ..core.inventory import HostSpec
from ..engine import cli_for
from ..errors import CommandFailed
from ..remote import Remote

#: Seconds the on-host tokenization may take (a large dataset with a large vocabulary).
PREPARE_TIMEOUT_S = 3600.0


def host_workdir(spec: HostSpec) -> str:
    """Where the upload and (by default) the output live on the host."""
    return str(PurePosixPath(spec.logs.dir) / "dataset")


def on_host_command(
    spec: HostSpec,
    workdir: str,
    tok_dir: str,
    src: str,
    dest: str,
    max_length: int | None,
    overflow: str,
    trust_remote_code: bool,
) -> str:
    """A throwaway container of the running container's image, dataset.py on stdin (pure)."""
    cli = cli_for(spec)
    image = f'"$({cli.container_image_command(spec.container.name)})"'
    argv = ["-", "prepare", "--tokenizer", tok_dir, "--input", src, "--output", dest, "--overflow", overflow]
    argv += ["--max-length", str(max_length)] if max_length else []
    argv += ["--trust-remote-code"] if trust_remote_code else []
    mounts = (f"{tok_dir}:{tok_dir}:ro", f"{workdir}:{workdir}")
    return cli.throwaway_command(image, argv, entrypoint="python3", mounts=mounts, stdin=True)


def prepare_on_host(
    remote: Remote,
    spec: HostSpec,
    source: Path,
    output: str | None,
    tokenizer: str | None,
    max_length: int | None,
    overflow: str,
    trust_remote_code: bool,
) -> tuple[str, dict[str, Any]]:
    """Upload `source`, tokenize it on the host; (the output path on the host, the script's report)."""
    workdir = host_workdir(spec)
    src, dest = f"{workdir}/source.jsonl", output or f"{workdir}/prepared.jsonl"
    remote.run(["mkdir", "-p", workdir])
    remote.put(source, src)
    cmd = on_host_command(
        spec, workdir, tokenizer or spec.model.path, src, dest, max_length, overflow, trust_remote_code
    )
    result = remote.run(cmd, input=onhost.source("dataset.py"), check=False, timeout=PREPARE_TIMEOUT_S)
    return dest, host_report(result, remote.name)


def host_report(result: Any, host: str) -> dict[str, Any]:
    """The script's last line as its report; a failed run or an `error` in it is CommandFailed."""
    try:
        report = json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        report = None
    if result.exit_status != 0 or not isinstance(report, dict) or "error" in report:
        why = report.get("error") if isinstance(report, dict) else "no report"
        raise CommandFailed.of(f"dataset prepare on the host failed: {why}", result, host)
    return report
