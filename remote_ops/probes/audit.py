"""The dump audit on the host: what `dumps audit` asks and how its answer is judged, and the
recorded dump contract that `train start` and `spec deploy` compare a drafter with.

- `DumpAudit`: `remote_ops/onhost/audit_onhost.py` on stdin to the python of the served
  image, in a throwaway container of it (no network, never pulls, the engine's command
  line: `engine.cli_for(host).bounded_throwaway_command`: named, ended on the host before
  the deadline, removed however it ends) with the dump dir (as the host resolved it), the
  model dir, the extraction work dir and the dataset mounted read-only.  Its JSON report.
- `DumpContract`: the same program's `contract` on the host's own python3 (headers only):
  the layers, eagle ids, hidden size, aux states and dtype a few dumps record.
- `ExtractRun`: the extraction's run.json (which dataset it used; a small regular file).
- `evaluate`: the report -> one `Check` per audit check (ok / warn / fail), the failed
  samples named in `data["samples"]` (pure); samples with only a warning (a dataset line
  without loss_mask: `dumps export` needs --mask-all) make their check a warning.  `drafter_problems`: a drafter's config
  against a recorded contract and the serving release's numbering (pure).
"""

from __future__ import annotations

import json
from pathlib import PurePosixPath
from typing import Any

from ..core import layerids, shell
from ..core.extractplan import paths_for
from ..core.inventory import HostSpec
from .base import Check, Probe

#: The audit's checks, in the order they are reported.
CHECKS = ("sampled", "shape", "finite", "alignment", "token", "layer_ids")
NO_CONTAINER = "no server container {name}: deploy first (the audit runs in the image it serves)"


def _last_json(text: str) -> dict[str, Any] | None:
    """The last line of `text` that is a JSON object (the on-host programs print one)."""
    for line in reversed(text.strip().splitlines()):
        try:
            doc = json.loads(line)
        except (ValueError, RecursionError):  # a line nested too deeply is no document either
            continue
        return doc if isinstance(doc, dict) else None
    return None


class ExtractRun(Probe[dict[str, Any]]):
    """The extraction's `run.json` ({} when there is none, or it is not a JSON object in a
    regular file of at most 1 MiB: `shell.read_small_file`): which dataset the run used."""

    name = "run"

    def __init__(self, host: HostSpec) -> None:
        self.path = paths_for(host).file("run.json")

    def command(self) -> str:
        return shell.read_small_file(self.path)

    def parse(self, status: int, text: str) -> dict[str, Any]:
        return (_last_json(text) or {}) if status == 0 else {}


def audit_mounts(paths: list[str]) -> tuple[str, ...]:
    """Read-only bind mounts for `paths` (each at its own path): duplicates and paths inside
    another one left out (pure)."""
    clean = sorted({str(PurePosixPath(p)) for p in paths if p})
    kept: list[str] = []
    for p in clean:
        if not any(p == k or p.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(p)
    return tuple(f"{p}:{p}:ro" for p in kept)


def audit_deadlines(seconds: float) -> tuple[float, float]:
    """(the auditor's own alarm inside the container, the engine client's `timeout` on the host)
    for a run whose local wait ends after `seconds`: 3 s and 1 s before it, so the auditor's
    error document, else the host's exit 124 and its `rm -f`, come back before the wait ends (pure)."""
    return max(1.0, float(int(seconds) - 3)), max(1.0, float(int(seconds) - 1))


class DumpAudit(Probe[dict[str, Any] | None]):
    """The audit in a throwaway container of the served image (the script on stdin).  Its JSON
    report, an `{"event": "error", ...}` document, or None when nothing readable came back.

    `dump_dir`: the dump dir as the host resolved it (`probes.dumps.DumpDirResolved`; default the
    configured one), mounted and audited.  With `name` and `deadline_s` the container is named,
    ended by the auditor's own alarm and the host's `timeout` before `deadline_s`, and removed
    on the host however the shell ends (`DockerCLI.bounded_throwaway_command`)."""

    name = "audit"
    bounded = False  # one long command, run alone with its own deadline

    def __init__(
        self,
        host: HostSpec,
        dataset: str | None,
        samples: int,
        seed: int,
        action: str = "audit",
        *,
        dump_dir: str | None = None,
        name: str | None = None,
        deadline_s: float | None = None,
    ) -> None:
        self.host, self.dataset, self.samples, self.seed, self.action = host, dataset, samples, seed, action
        self.dump_dir = dump_dir or host.dump.dir
        self.container, self.deadline_s = name, deadline_s

    def argv(self) -> list[str]:
        workdir = paths_for(self.host).workdir
        argv = ["-", self.action, "--dump-dir", self.dump_dir, "--model-dir", self.host.model.path]
        argv += ["--workdir", workdir, "--samples", str(self.samples), "--seed", str(self.seed)]
        if self.deadline_s:
            argv += ["--deadline", f"{audit_deadlines(self.deadline_s)[0]:g}"]
        return argv + (["--dataset", self.dataset] if self.dataset else [])

    def command(self) -> str:
        from ..engine import cli_for

        cli = cli_for(self.host)
        mounts = audit_mounts(
            [
                self.dump_dir,
                self.host.model.path,
                paths_for(self.host).workdir,
                str(PurePosixPath(self.dataset).parent) if self.dataset else "",
            ]
        )
        if self.container and self.deadline_s:
            run = cli.bounded_throwaway_command(
                '"$img"',
                self.argv(),
                name=self.container,
                seconds=audit_deadlines(self.deadline_s)[1],
                entrypoint="python3",
                mounts=mounts,
                stdin=True,
            )
        else:
            run = cli.throwaway_command('"$img"', self.argv(), entrypoint="python3", mounts=mounts, stdin=True)
        missing = shell.quote(
            json.dumps({"event": "error", "error": NO_CONTAINER.format(name=self.host.container.name)})
        )
        return (
            f"img=$({cli.container_image_command(self.host.container.name)} 2>/dev/null); "
            f'if [ -z "$img" ]; then echo {missing}; exit 3; fi; {run}'
        )

    def parse(self, status: int, text: str) -> dict[str, Any] | None:
        return _last_json(text)


class DumpContract(Probe[dict[str, Any] | None]):
    """`audit_onhost.py contract` with the host's python3 (the script on stdin): what up to
    `files` dumps spread over the manifest record.  Its JSON document, or None."""

    name = "contract"

    def __init__(self, dump_dir: str, files: int = 8) -> None:
        self.dump_dir, self.files = dump_dir, files

    def command(self) -> str:
        return shell.join(["python3", "-", "contract", "--dump-dir", self.dump_dir, "--files", str(self.files)])

    def parse(self, status: int, text: str) -> dict[str, Any] | None:
        return _last_json(text)


# -- judging the audit (pure) ---------------------------------------------------------------------


def _named(samples: list[dict[str, Any]], check: str) -> list[dict[str, Any]]:
    return [
        {"key": s.get("key"), "id": s.get("id"), "position": s.get("position"), "message": s["problems"][check]}
        for s in samples
        if check in (s.get("problems") or {})
    ]


def _warned(samples: list[dict[str, Any]], check: str) -> list[dict[str, Any]]:
    return [
        {"key": s.get("key"), "id": s.get("id"), "position": s.get("position"), "message": s["warnings"][check]}
        for s in samples
        if check in (s.get("warnings") or {})
    ]


def _sample_check(report: dict[str, Any], check: str, what: str) -> Check:
    """Failed samples fail the check; samples with only a warning (a dataset without loss_mask:
    a property of the dataset, not of the capture) make it a warning naming them."""
    samples = report.get("samples") or []
    bad = _named(samples, check)
    if not bad:
        warned = _warned(samples, check)
        if warned:
            return Check(
                "audit",
                check,
                "warn",
                f"{len(warned)} of {len(samples)} samples: {warned[0]['message']}",
                {"samples": warned},
            )
        return Check("audit", check, "ok", f"{len(samples)} of {len(samples)} samples: {what}")
    return Check(
        "audit",
        check,
        "fail",
        f"{len(bad)} of {len(samples)} samples: {bad[0]['message']}",
        {"samples": bad},
    )


def _finite_check(report: dict[str, Any]) -> Check:
    check = _sample_check(report, "finite", "no NaN, no Inf")
    if check.status == "ok":
        return check
    totals = {"nan": 0, "inf": 0}
    for s in report.get("samples") or []:
        for counts in (s.get("nonfinite") or {}).values():
            totals["nan"] += int(counts.get("nan", 0))
            totals["inf"] += int(counts.get("inf", 0))
    reason = (
        f"{len(check.data['samples'])} of {len(report.get('samples') or [])} samples hold NaN/Inf "
        f"({totals['nan']} NaN, {totals['inf']} Inf; SpecForge would skip them silently): "
        f"{check.data['samples'][0]['message']}"
    )
    return Check("audit", "finite", "fail", reason, {**check.data, **totals})


def _token_check(report: dict[str, Any]) -> Check:
    norm = report.get("norm") or {}
    verdict, checked = norm.get("verdict", "unknown"), int(norm.get("checked", 0))
    data = {"norm": norm}
    if checked == 0:
        return Check(
            "audit",
            "token",
            "fail",
            "no sampled dump could be checked against the server's token (no generated_token on the client's "
            "ok lines: re-run the extraction with this client, or every final state was unreadable)",
            data,
        )
    bad = _named(report.get("samples") or [], "token")
    data["samples"] = bad
    if verdict == "post-norm" and not bad:
        return Check(
            "audit",
            "token",
            "ok",
            f"{norm.get('match')} of {checked} final states give the server's token: post-norm finals",
            data,
        )
    if verdict == "indistinct" and not bad:
        vllm = int(norm.get("vllm", 0)) == checked
        return Check(
            "audit",
            "token",
            "ok" if vllm else "warn",
            f"{norm.get('match')} of {checked} final states give the server's token both as stored and after the "
            "model's final RMSNorm, which does not move the argmax on these samples: the check cannot tell post- "
            "from pre-norm finals"
            + (
                "; vLLM's layer L is captured before that norm (its model files), and export applies it"
                if vllm
                else "; `dumps export` exports them as they are"
            ),
            data,
        )
    if verdict == "pre-norm" and not bad and int(norm.get("vllm", 0)) == checked:
        return Check(
            "audit",
            "token",
            "ok",
            f"{int(norm.get('prenorm', 0)) + int(norm.get('ambiguous', 0))} of {checked} final states give the "
            f"server's token after the model's final RMSNorm ({norm.get('prenorm')} only after it, "
            f"{norm.get('ambiguous', 0)} with or without it): vLLM's layer L, captured before that norm, as its "
            "model files do (export applies the norm)",
            data,
        )
    if verdict == "pre-norm":
        reason = (
            f"the dumps hold PRE-norm final states: {norm.get('prenorm')} of {checked} give the server's token "
            "only after the model's final RMSNorm (SpecForge's TargetHead applies lm_head alone)"
        )
    else:
        reason = f"{len(bad)} of {checked} final states do not give the server's token: {bad[0]['message'] if bad else verdict}"
    return Check("audit", "token", "fail", reason, data)


def _layers_check(report: dict[str, Any], layer_fails: list[str], layer_notes: list[str]) -> Check:
    sets = report.get("layers") or []
    data: dict[str, Any] = {"recorded": sets, "failures": layer_fails, "notes": layer_notes}
    if len(sets) > 1:
        return Check("audit", "layer_ids", "fail", f"the sampled dumps record {len(sets)} different layer sets", data)
    if layer_fails:
        return Check("audit", "layer_ids", "fail", "; ".join(layer_fails), data)
    head = sets[0] if sets else {}
    said = (
        f"layers_to_capture {head.get('layers_to_capture')}, eagle ids {head.get('eagle_aux_hidden_state_layer_ids')}"
    )
    if layer_notes:
        return Check("audit", "layer_ids", "warn", f"{said}; " + "; ".join(layer_notes), data)
    return Check("audit", "layer_ids", "ok", said, data)


def evaluate(report: dict[str, Any], layer_fails: list[str], layer_notes: list[str]) -> list[Check]:
    """The audit report -> one Check per audit check, in `CHECKS` order (pure)."""
    sampled, population = int(report.get("sampled", 0)), int(report.get("population", 0))
    if not sampled:
        return [Check("audit", "sampled", "fail", "no sample to audit: the extraction has no ok sample", {})]
    seed = report.get("seed")
    checks = [
        Check(
            "audit", "sampled", "ok", f"{sampled} of {population} samples (seed {seed}, stratified over the run)", {}
        ),
        _sample_check(report, "shape", f"{AUX_WORDS}, hidden size {(report.get('model') or {}).get('hidden_size')}"),
        _finite_check(report),
        _sample_check(report, "alignment", "token ids equal the dataset's; the loss mask joins by key"),
        _token_check(report),
        _layers_check(report, layer_fails, layer_notes),
    ]
    return checks


AUX_WORDS = "3 aux states + the final state, the sample's token count"


def recorded_layers(report: dict[str, Any]) -> tuple[list[int] | None, list[int] | None]:
    """(layers_to_capture, eagle ids) the sampled dumps record (the first set; None when none)."""
    sets = report.get("layers") or []
    if not sets:
        return None, None
    return sets[0].get("layers_to_capture"), sets[0].get("eagle_aux_hidden_state_layer_ids")


# -- a drafter against the recorded contract (pure) ----------------------------------------------


def contract_of(doc: dict[str, Any] | None) -> dict[str, Any] | None:
    """The one contract a `DumpContract` answer holds (None: no dumps, or they disagree: see
    `contract_problems`)."""
    contracts = (doc or {}).get("contracts") or []
    return contracts[0] if len(contracts) == 1 else None


def contract_problems(doc: dict[str, Any] | None) -> list[str]:
    """What makes a `DumpContract` answer unusable: none read, several, unreadable files."""
    if doc is None or doc.get("event") == "error":
        return [f"cannot read the dumps' contract: {(doc or {}).get('error', 'no answer')}"]
    contracts = doc.get("contracts") or []
    if len(contracts) > 1:
        return [f"the dumps record {len(contracts)} different contracts: {contracts}"]
    return [str(p) for p in doc.get("problems") or []]


def drafter_problems(
    contract: dict[str, Any],
    draft: layerids.DraftConfig,
    convention: layerids.Convention | None,
    serving_version: str,
    num_layers: int | None,
) -> list[str]:
    """What keeps a drafter from being trained on / served with these dumps: its ids under the
    serving release's numbering against the recorded layers, its hidden size against theirs."""
    problems: list[str] = []
    layers = contract.get("layers_to_capture")
    if layers:
        fails, _ = layerids.layer_problems(
            layers,
            contract.get("eagle_aux_hidden_state_layer_ids"),
            convention,
            serving_version,
            contract.get("num_hidden_layers") or num_layers,
            draft,
        )
        problems += fails
    else:
        problems.append("the dumps record no layers_to_capture")
    hidden = contract.get("hidden_size")
    if draft.hidden_size is not None and hidden is not None and draft.hidden_size != hidden:
        problems.append(f"the draft config's hidden size is {draft.hidden_size}; the dumps' hidden states are {hidden}")
    if contract.get("aux_states") not in (None, 3):
        problems.append(f"the dumps hold {contract.get('aux_states')} aux states, not 3")
    return problems
