"""`dumps export --format specforge`: run the stdlib exporter on the host, follow it, read its report.

The work is done on the host by `remote_ops/onhost/specforge_export.py` (stdlib only,
sent on stdin to the host's `python3`, like `dumper/dumpfile.py`), so the dumps never
travel. This module builds its command line (pure), parses its JSON-lines
output (pure), and runs it over the `Remote` seam.

The loss mask is joined from the prepared dataset by dump key (sha256 of the
sample's int32 token ids + `-p0`, what the dumper computes), so the extraction
client and the dumps need not carry it. The dataset is the one the extraction
used: by default `<logs.dir>/extract/dataset.jsonl` on the host (where
`extract start` puts an uploaded dataset); a local file is uploaded next to the output.

Before exporting, `final_norm_decision` asks the dump audit's token check (a few
dumps, `workflows.audit.norm_check`) whether the final states are post-norm, which
SpecForge's TargetHead needs.  Pre-norm finals are refused (ContractMismatch, exit
9) unless converted (the exporter applies the model's final RMSNorm, read from the
checkpoint through its safetensors index) or accepted as they are.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from .. import onhost
from ..core import shell
from ..errors import CommandFailed, CommandTimedOut, ContractMismatch, NotFound

SCRIPT = "specforge_export.py"


def script_source() -> bytes:
    return onhost.bundled(SCRIPT)  # with the packed-dump codec: it reads compacted dumps too


def default_out(spec) -> str:
    return spec.dump.dir.rstrip("/") + "-specforge"


def default_dataset(spec) -> str:
    return str(PurePosixPath(spec.logs.dir) / "extract" / "dataset.jsonl")


def export_command(
    dump_dir: str,
    dataset: str,
    out: str,
    *,
    jobs: int = 4,
    limit: int | None = None,
    probe_mb: int = 1024,
    mask_all: bool = False,
    fsync: bool = True,
    rank: int = 0,
    plan_only: bool = False,
    convert_prenorm: str | None = None,
) -> str:
    """`python3 - export ...` (the script comes on stdin); `convert_prenorm`: the model dir whose
    final RMSNorm is applied to each hidden_state."""
    argv = [
        "python3",
        "-u",
        "-",
        "export",
        "--dump-dir",
        dump_dir,
        "--dataset",
        dataset,
        "--out",
        out,
        "--jobs",
        str(jobs),
        "--probe-mb",
        str(probe_mb),
        "--rank",
        str(rank),
    ]
    argv += ["--limit", str(limit)] if limit is not None else []
    argv += ["--mask-all"] if mask_all else []
    argv += [] if fsync else ["--no-fsync"]
    argv += ["--plan-only"] if plan_only else []
    argv += ["--convert-prenorm", convert_prenorm] if convert_prenorm else []
    return shell.join(argv)


def final_norm_decision(remote, spec, *, convert: bool = False, accept: bool = False) -> dict:
    """What the export does with the final states: {verdict, action (as_is | convert | accept),
    said, check}.  vLLM's dumps (every checked sample a vLLM file) hold layer L, the state before
    the final norm: pre-norm is what they are, converted unless `accept`.  Other pre-norm finals
    without `convert` or `accept`, and `convert` of finals not
    found pre-norm, are refused (ContractMismatch, exit 9).  A check that cannot run (no served
    container, no generated tokens on the client's lines) leaves them as they are, and says so."""
    from . import audit

    try:
        check = audit.norm_check(remote, spec)
    except (CommandFailed, CommandTimedOut) as exc:
        check = {"verdict": "unknown", "why": exc.message}
    verdict = check.get("verdict", "unknown")
    counts = f"{check.get('match', 0)} of {check.get('checked', 0)} checked dumps give the server's token"
    # vLLM's layer L is the state before the final norm by design: converted unless the check found
    # them post-norm (pre-norm, or a norm that does not move the argmax: `indistinct`)
    vllm = verdict in ("pre-norm", "indistinct") and int(check.get("vllm", 0)) == int(check.get("checked", -1))
    if vllm and not accept:  # vLLM's layer L is the state before the final norm by design
        return _norm(
            verdict,
            "convert",
            f"PRE-norm as vLLM captures layer L ({counts}"
            + (" only after the final RMSNorm" if verdict == "pre-norm" else ", with or without the final RMSNorm")
            + "): converted",
            check,
        )
    if verdict == "pre-norm":
        if convert:
            return _norm(verdict, "convert", f"PRE-norm ({counts} only after the final RMSNorm): converted", check)
        if accept:
            return _norm(verdict, "accept", f"PRE-norm ({counts}): exported as they are (--accept-prenorm)", check)
        raise ContractMismatch(
            f"the dumps hold PRE-norm final states ({check.get('prenorm')} of {check.get('checked')} checked give "
            "the server's token only after the model's final RMSNorm); SpecForge's TargetHead applies lm_head alone",
            host=spec.name,
            hint="--convert-prenorm applies the final RMSNorm from the checkpoint; --accept-prenorm exports them "
            "as they are; `dumps audit` says more",
            details={"reason": "prenorm_finals", "norm": check},
        )
    if convert:
        raise ContractMismatch(
            f"--convert-prenorm: the final states were not found pre-norm ({verdict}: "
            f"{check.get('why') or counts}); converting would apply the final norm to states that may not need it",
            host=spec.name,
            hint="`dumps audit` says what the dumps hold",
            details={"reason": "not_prenorm", "norm": check},
        )
    if verdict == "unknown":
        return _norm(verdict, "as_is", f"not checked ({check.get('why') or 'no dump could be checked'})", check)
    if verdict == "mixed":
        return _norm(
            verdict,
            "as_is",
            f"mixed ({counts}; {check.get('prenorm', 0)} only after the final RMSNorm, "
            f"{check.get('mismatch', 0)} not at all): exported as they are, `dumps audit` says which",
            check,
        )
    return _norm(verdict, "as_is", f"{verdict} ({counts})", check)


def _norm(verdict: str, action: str, said: str, check: dict) -> dict:
    return {"verdict": verdict, "action": action, "said": said, "check": check}


@dataclass
class ExportRun:
    """Everything the exporter said: progress events and its final report (or its error)."""

    events: list[dict] = field(default_factory=list)
    report: dict | None = None
    error: str | None = None
    noise: list[str] = field(default_factory=list)

    @property
    def final(self) -> dict:
        """The final report: `run_export` raises when the exporter gave none."""
        assert self.report is not None, "run_export returns only runs with a report"
        return self.report

    def take(self, line: str) -> dict | None:
        """Parse one stdout line; returns the event (None for non-JSON noise)."""
        try:
            event = json.loads(line)
        except ValueError:
            self.noise.append(line)
            return None
        if not isinstance(event, dict):
            return None
        self.events.append(event)
        if event.get("event") in ("done", "plan"):
            self.report = event
        elif event.get("event") == "error":
            self.error = event.get("error")
        return event


def parse_output(stdout: str) -> ExportRun:
    run = ExportRun()
    for line in stdout.splitlines():
        if line.strip():
            run.take(line)
    return run


def place_dataset(remote, spec, dataset: str | None, out: str, *, local: bool | None = None) -> str:
    """The dataset path on the host: a local file (`local`; None: when one exists) is uploaded
    beside the output; a host path is checked there."""
    if dataset is None:
        dataset = default_dataset(spec)
    elif Path(dataset).expanduser().is_file() if local is None else local:
        target = str(PurePosixPath(out).parent / (PurePosixPath(out).name + ".dataset.jsonl"))
        remote.run(["mkdir", "-p", str(PurePosixPath(target).parent)])
        remote.put(Path(dataset).expanduser(), target)
        return target
    if remote.run(["test", "-f", dataset], check=False).exit_status != 0:
        raise NotFound(
            f"dataset {dataset} is neither a local file nor a file on the host",
            host=remote.name,
            hint="pass --dataset with the prepared JSONL the extraction used",
        )
    return dataset


def run_export(remote, command: str, on_event=None, timeout: float = 7 * 24 * 3600) -> ExportRun:
    """Run the exporter; `on_event(dict)` sees each progress line as it arrives."""
    run = ExportRun()

    def line(stream: str, text: str) -> None:
        if stream == "stdout" and text.strip():
            event = run.take(text)
            if event and on_event:
                on_event(event)

    result = remote.run(command, input=script_source(), check=False, timeout=timeout, on_line=line)
    if not run.events:  # a Remote that does not stream lines
        run = parse_output(result.stdout)
    if run.report is None:
        raise CommandFailed.of(f"specforge export failed: {run.error or 'no report'}", result, remote.name)
    return run
