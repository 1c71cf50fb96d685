"""`dumps audit` and the contract guards of the later steps, over a `Remote`.

`audit` asks the on-host auditor (`remote_ops/onhost/audit_onhost.py`) in a throwaway
container of the served image (`probes.audit.DumpAudit`): the dumps are read where they
lie, never pulled.  The extraction's run.json says which dataset the run used (it is
mounted read-only beside the dump, model and work dirs).  The report is judged here with
the pure evaluators of `remote_ops.probes.audit`, and the layer ids against the numbering
of the SGLang release that will serve the drafter (`remote_ops.core.layerids`; the table
per release is spec data: `patchspec.layer_convention`), on a vLLM host its vLLM release's
own (`layerids.vllm_convention`).

The dump dir is resolved once on the host (it may be a symlink to a big disk:
`probes.dumps.DumpDirResolved`) and the resolved path is mounted, audited and reported
(`report["dump_dir"]`).  The run is bounded by `audit_deadline` (the run's
`--command-timeout` when set, else `AUDIT_TIMEOUT_S`) on the host too: the auditor's own
alarm inside the container, the engine client's `timeout` on the host, and the container,
named `remote-ops-audit-<hex>`, removed by the host shell's trap however it ends and by an
`rm -f` from here when the local wait ends first (deadline, Ctrl-C).  Past the deadline the
audit is a CommandTimedOut (exit 8) naming the container as removed.

The guards read the dumps' recorded contract with the host's python3 (headers only,
`probes.audit.DumpContract`) and compare a drafter's config with it:
`train_problems` (`train start`: refused unless `--force`, which the audit line records)
and `drafter_guard` (`spec deploy`: refused).  `norm_check` is what `dumps export` asks
before it refuses or converts pre-norm final states.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import onhost, signals
from ..core import jsonload, layerids, patchspec
from ..core.inventory import HostSpec
from ..errors import CommandFailed, CommandTimedOut, ContractMismatch, Interrupted, NotFound, RemoteOpsError
from ..probes import batch
from ..probes.audit import (
    DumpAudit,
    DumpContract,
    ExtractRun,
    contract_of,
    contract_problems,
    drafter_problems,
    evaluate,
    recorded_layers,
)
from ..probes.base import Check
from ..probes.dumps import DumpDirResolved
from ..remote import Remote
from ..remote.base import DEFAULT_COMMAND_S, command_deadline
from ..remote.smallfile import read_small_file

SCRIPT = "audit_onhost.py"
#: Seconds the audit may take on the host (reading lm_head once: ~2.3 GB for Kimi-K2.5).
AUDIT_TIMEOUT_S = 3600.0


def script() -> bytes:
    return onhost.bundled(SCRIPT)  # with the packed-dump codec: it reads compacted dumps too


# --------------------------------------------------------------------------- drafter configs


#: The drafter config fields that must be positive integers (a float passed the contract).
SIZE_FIELDS = ("target_hidden_size", "hidden_size")


def draft_from_doc(doc: Any, source: str = "the draft config") -> layerids.DraftConfig:
    """The contract fields of a draft config document; ConfigError (exit 3) naming `source` and
    the field when a hidden size is not a positive integer."""
    jsonload.positive_ints(doc, SIZE_FIELDS, source)
    return layerids.read_draft_config(doc)


def load_draft_config(path: Path) -> layerids.DraftConfig:
    """A local drafter config.json, read before any host is contacted (`core.jsonload`: size and
    nesting bounded); ConfigError (exit 3) when it cannot be read or is not JSON."""
    return draft_from_doc(jsonload.load_json(path, what="draft config"), str(path))


def host_draft_doc(remote: Remote, path: str) -> Any | None:
    """The JSON document of a drafter config on the host (bounded: `remote.smallfile`; exit 9
    for a FIFO, a device or a file past the cap), None when there is no such file; ConfigError
    naming `host:path` when it is not JSON or nests too deep."""
    text = read_small_file(remote, path, missing_ok=True)
    return None if text is None else jsonload.loads_json(text, f"{remote.name}:{path}", what="draft config")


def read_draft_config(remote: Remote, path: str, on_host: bool | None = None) -> layerids.DraftConfig:
    """A drafter config: the local file (`on_host` False), the file at `path` on the host (True);
    with `on_host` None, the local file when there is one, else the host's."""
    local = Path(path).expanduser().is_file() if on_host is None else not on_host
    if local:
        return load_draft_config(Path(path))
    doc = host_draft_doc(remote, path)
    if doc is None:
        raise NotFound(f"draft config {path} is neither a local file nor a file on the host", host=remote.name)
    return draft_from_doc(doc, f"{remote.name}:{path}")


# --------------------------------------------------------------------------- the serving release


@dataclass(frozen=True)
class Serving:
    """The release that will serve the drafter and how it numbers aux layer ids."""

    version: str
    model: str | None  # the patch spec model whose file sets the layers
    convention: layerids.Convention | None
    how: str  # where version and model came from
    engine: str = "SGLang"  # the serving engine of that release: SGLang | vLLM

    def to_dict(self) -> dict[str, Any]:
        c = self.convention
        return {
            **({"engine": self.engine} if self.engine != "SGLang" else {}),  # absent: SGLang (as before)
            "version": self.version,
            "model": self.model,
            "rule": c.rule if c else None,
            "since": c.since if c else None,
            "source": c.source if c else None,
            "how": self.how,
        }


def serving(spec: HostSpec, version: str | None, architectures: list[str]) -> Serving:
    """`version` (default: the host's deployed SGLang, `sglang.version`) and the spec model
    (`sglang.patch`, else the one serving the model's `architectures`).  A vLLM host
    (`serving.engine: vllm`) without `version` is judged under its vLLM release's own
    numbering (`layerids.vllm_convention`)."""
    if spec.serving.engine == "vllm" and not version:
        vv = spec.vllm.version
        return Serving(vv, None, layerids.vllm_convention(vv), f"{spec.name}'s vLLM (vllm.version)", "vLLM")
    v = version or spec.sglang.version
    how = "--serving-sglang" if version else f"{spec.name}'s deployed SGLang (sglang.version)"
    name = spec.sglang.patch
    if not name and architectures:
        try:
            name = patchspec.for_architectures(architectures).spec
        except RemoteOpsError:
            name = None
    return Serving(v, name, patchspec.layer_convention(name, v) if name else None, how)


# --------------------------------------------------------------------------- dumps audit


@dataclass
class AuditResult:
    """One `dumps audit`: the checks (in order), the host's report, the serving release."""

    host: str
    checks: list[Check]
    report: dict[str, Any]
    serving: Serving
    draft: layerids.DraftConfig | None = None
    dataset: str | None = None

    @property
    def ok(self) -> bool:
        return all(c.status != "fail" for c in self.checks)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == "fail"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "ok": self.ok,
            "checks": [{"check": c.name, "status": c.status, "reason": c.reason, **c.data} for c in self.checks],
            "serving": self.serving.to_dict(),
            "draft_config": None if self.draft is None else vars(self.draft),
            "dataset": self.dataset,
            "norm": self.report.get("norm"),
            "report": self.report,
        }


def audit_deadline(remote: Remote) -> float:
    """Seconds the audit may take: the run's `--command-timeout` when it is set to anything but
    the default (the operator's bound), else `AUDIT_TIMEOUT_S` (a big model's lm_head takes long)."""
    command_s = command_deadline(remote)
    return command_s if command_s != DEFAULT_COMMAND_S else AUDIT_TIMEOUT_S


#: The audit's throwaway containers are named `remote-ops-audit-<12 hex>`.
CONTAINER_PREFIX = "remote-ops-audit-"


def run_auditor(
    remote: Remote,
    spec: HostSpec,
    samples: int,
    seed: int,
    action: str = "audit",
    timeout: float | None = None,
) -> dict[str, Any]:
    """The on-host auditor's report: one round trip for run.json's dataset and the dump dir as
    the host resolves it (it may be a symlink), then the throwaway container, named and bounded
    by `timeout` (default `audit_deadline`) on the host as well as here, and removed however
    the run ends (`_removed_however_it_ends`)."""
    deadline = audit_deadline(remote) if timeout is None else timeout
    run_probe, real_probe = ExtractRun(spec), DumpDirResolved(spec.dump.dir)
    answers = batch.run(remote, [run_probe, real_probe])
    run, real = run_probe.read(answers), real_probe.read(answers)
    if real is None:
        raise NotFound(
            f"dump dir {spec.dump.dir} does not exist",
            host=remote.name,
            hint="check dump.dir in the inventory, or run an extraction first",
        )
    dataset = run.get("dataset") if isinstance(run.get("dataset"), str) else None
    name = f"{CONTAINER_PREFIX}{secrets.token_hex(6)}"
    probe = DumpAudit(spec, dataset, samples, seed, action, dump_dir=real, name=name, deadline_s=deadline)
    with _removed_however_it_ends(remote, spec, name, deadline):
        result = remote.run(probe.command(), input=script(), check=False, timeout=deadline)
    report = probe.parse(result.exit_status, result.stdout)
    if (report or {}).get("reason") == "deadline" or (report is None and result.exit_status in (124, 137)):
        why = (report or {}).get("error") or f"the audit ran past its deadline of {deadline:g}s"
        raise CommandTimedOut(
            f"dumps audit: {why} on the host; its container {name} was removed",
            host=remote.name,
            command=result.command,
            timeout=deadline,
            hint=RAISE_DEADLINE,
        )
    if report is None or report.get("event") != "audit":
        why = (report or {}).get("error") or "no report (is python3 in the served image?)"
        raise CommandFailed.of(f"the dump audit could not run on the host: {why}", result, remote.name)
    return report


RAISE_DEADLINE = "raise --command-timeout: the audit reads lm_head once and every sampled dump"


@contextmanager
def _removed_however_it_ends(remote: Remote, spec: HostSpec, name: str, deadline: float) -> Iterator[None]:
    """When the local wait ends other than by the command's own end (its deadline, Ctrl-C,
    SIGTERM), remove the throwaway container `name` on the host before the error goes on (the
    host's own `timeout` and trap remove it too when this connection is gone).  A timed-out
    audit becomes a CommandTimedOut (exit 8) saying so."""
    try:
        yield
    except (CommandTimedOut, Interrupted) as exc:
        with signals.deferred():
            removed = _remove(remote, spec, name)
        if isinstance(exc, CommandTimedOut):
            raise CommandTimedOut(
                f"dumps audit: no report within its deadline of {deadline:g}s; its container {name} was "
                + ("removed" if removed else "left to the host's own timeout, which removes it"),
                host=remote.name,
                command=exc.command,
                timeout=deadline,
                hint=RAISE_DEADLINE,
            ) from None
        raise


def _remove(remote: Remote, spec: HostSpec, name: str) -> bool:
    """`rm -f` of the container on the host (bounded); False when the host did not answer."""
    from ..engine import cli_for

    try:
        remote.run(cli_for(spec).remove_cmd(name), check=False, timeout=min(command_deadline(remote), 30.0))
    except RemoteOpsError:
        return False
    return True


def audit(
    remote: Remote,
    spec: HostSpec,
    *,
    samples: int = 64,
    seed: int = 0,
    draft: layerids.DraftConfig | None = None,
    serving_version: str | None = None,
) -> AuditResult:
    """Audit `samples` dumps on the host; judge them, the layer ids against `draft` and the
    serving release's numbering."""
    report = run_auditor(remote, spec, samples, seed)
    model = report.get("model") or {}
    srv = serving(spec, serving_version, list(model.get("architectures") or []))
    layers, eagle = recorded_layers(report)
    fails: list[str] = ["no sampled dump records its layers_to_capture"]
    notes: list[str] = []
    if layers is not None:
        fails, notes = layerids.layer_problems(
            layers, eagle, srv.convention, srv.version, model.get("num_hidden_layers"), draft
        )
    return AuditResult(spec.name, evaluate(report, fails, notes), report, srv, draft, report.get("dataset"))


def norm_check(remote: Remote, spec: HostSpec, samples: int = 8) -> dict[str, Any]:
    """The norm verdict of `samples` dumps (`post-norm`, `pre-norm`, `mixed`, `unknown`) and the
    counts behind it: what `dumps export` asks before it exports."""
    report = run_auditor(remote, spec, samples, 0, action="norm-check")
    return dict(report.get("norm") or {"verdict": "unknown"}, sampled=report.get("sampled"))


# --------------------------------------------------------------------------- the guards


def dump_contract(remote: Remote, spec: HostSpec, files: int = 8) -> dict[str, Any] | None:
    """What up to `files` dumps record (headers only, the host's python3)."""
    probe = DumpContract(spec.dump.dir, files)
    result = remote.run(probe.command(), input=script(), check=False)
    return probe.parse(result.exit_status, result.stdout)


def _contract_or_inventory(remote: Remote, spec: HostSpec) -> tuple[dict[str, Any], str, list[str]]:
    """(the contract, where it came from, problems): the dumps' when the host has any, else what
    the inventory would capture (dump.layers, or SGLang's default for model.num_layers)."""
    doc = dump_contract(remote, spec)
    if doc is not None and doc.get("event") == "contract" and not doc.get("files"):
        layers = list(spec.dump.layers or layerids.default_layers(spec.model.num_layers))
        inv = {
            "layers_to_capture": layers,
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in layers],
            "hidden_size": spec.model.hidden_size,
            "num_hidden_layers": spec.model.num_layers,
        }
        return inv, "the inventory (no dumps on the host)", []
    problems = contract_problems(doc)
    return contract_of(doc) or {}, f"the dumps in {spec.dump.dir}", problems


def check_drafter(
    remote: Remote, spec: HostSpec, draft: layerids.DraftConfig, serving_version: str | None = None
) -> dict[str, Any]:
    """A drafter against the dumps' contract under the serving release: {problems, contract, from,
    serving} (problems empty: it fits)."""
    contract, source, problems = _contract_or_inventory(remote, spec)
    arch = contract.get("model_arch")
    srv = serving(spec, serving_version, [arch] if arch else [])
    if contract and not problems:
        problems = drafter_problems(contract, draft, srv.convention, srv.version, spec.model.num_layers)
    return {"problems": problems, "contract": contract, "from": source, "serving": srv.to_dict(), "draft": vars(draft)}


def refusal(spec: HostSpec, what: str, found: dict[str, Any], hint: str) -> ContractMismatch:
    """The named error (exit 9) of a guard, its findings in the details."""
    return ContractMismatch(
        f"{what} does not fit the dumps' capture contract: " + "; ".join(found["problems"]),
        host=spec.name,
        hint=hint,
        details={"reason": "contract_mismatch", **found},
    )


def drafter_guard(remote: Remote, spec: HostSpec, draft_dir: str) -> dict[str, Any]:
    """`spec deploy`: the drafter's config.json on the host against the dumps (or the inventory's
    layers) under the host's SGLang release; ContractMismatch (exit 9) when it does not fit."""
    path = draft_dir.rstrip("/") + "/config.json"
    doc = host_draft_doc(remote, path)
    if doc is None:
        raise ContractMismatch(
            f"the drafter has no readable config.json ({path}): SGLang could not load it",
            host=spec.name,
            details={"reason": "contract_mismatch", "problems": [f"no readable {path}"]},
        )
    result = check_drafter(remote, spec, draft_from_doc(doc, f"{remote.name}:{path}"))
    if result["problems"]:
        raise refusal(
            spec,
            f"the drafter {draft_dir}",
            result,
            f"fix {layerids.DRAFT_KEY} in {path} (or serve it with the release it was made for)",
        )
    return result
