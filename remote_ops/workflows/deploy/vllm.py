"""deploy for a vLLM host (`serving.engine: vllm`): no source patch; render, build, start, wait.

The same run as SGLang's `Deploy` (one read-only probe, the lock taken in a second probe when
something must change, records and the audit line, the same failure states), with what
differs chosen here from `remote_ops.serving.vllm`:

- `push`, `patch` and `verify` are skipped, and the plan says why (vLLM's own
  `extract_hidden_states` method needs no patch);
- build when the image is missing or its `context-hash` label differs from the hash of
  Dockerfile.vllm.j2, its variables (the pinned vLLM release, the base image) and the
  project's connector (`remote_ops/dumper/vllm_connector.py`);
- start when the container is missing, stopped, runs another image, was started with other
  settings (`run-config` of `serving.vllm.run_spec`: the speculative and KV-transfer configs),
  or mounts a dump dir that was removed (and made again) since it started (`plan.needs_start`);
  the connector's output dir is made in the same round trip that reads the dump dir's identity
  for the new container's label;
- wait on vLLM's own endpoints (`/health`, `/v1/models`, `/version`) through `health`.
"""

from __future__ import annotations

import time
from typing import Any

from ...core import secrets, shell
from ...core.inventory import HostSpec
from ...engine import labels
from ...errors import Refused
from ...remote import Remote
from ...serving import vllm as serving
from .. import container
from .context import context_tar, staging_dir
from .plan import Plan, Probe, needs_start, start_reason
from .workflow import BUILD_TIMEOUT_S, Deploy, DeployResult, Events, build_on_host


def make_plan(host: HostSpec, p: Probe, ref: str) -> Plan:
    """What is out of date on a vLLM host, from the probe alone (pure)."""
    img, ctr = p.image, p.container
    reasons = {"patch": serving.NO_PATCH}
    build = img is None or img.labels.get(labels.CONTEXT_HASH) != serving.context_hash(host)
    if build:
        reasons["build"] = "image missing" if img is None else "build inputs changed"
    start = needs_start(host, ref, img, ctr, build, p.dump_dir)
    if start:
        reasons["start"] = start_reason(host, ref, ctr, img, build, p.dump_dir)
    wait = start or (ctr is not None and ctr.health not in ("healthy", None))
    return Plan(patch=False, build=build, start=start, wait=wait, reasons=reasons)


def build_context(host: HostSpec) -> dict[str, bytes]:
    """Dockerfile + the project's connector; refused when this install has no connector."""
    files = serving.context_files()
    if "vllm_connector.py" not in files:
        raise Refused(
            "build: this install has no remote_ops/dumper/vllm_connector.py, the connector vLLM loads to write "
            "hidden states",
            host=host.name,
            hint="install a remote-ops release that ships it (docs/vllm.md)",
        )
    return {**files, "Dockerfile": serving.render_dockerfile(host).encode()}


def diffs(host: HostSpec, plan: Plan, ref: str, dump_dir_id: str | None = None) -> dict[str, str]:
    out: dict[str, str] = {}
    if plan.build:
        out["Dockerfile"] = serving.render_dockerfile(host)
    if plan.start:
        out[f"{host.engine} run"] = shell.join(secrets.mask_argv(container.run_argv(host, ref, dump_dir_id)))
    return out


class VllmDeploy(Deploy):
    """`Deploy` for a vLLM host: the steps that differ (see the module docstring)."""

    def __init__(self, remote: Remote, host: HostSpec, **kwargs: Any) -> None:
        self.ref = serving.image_ref(host)
        super().__init__(remote, host, patch=None, ref=self.ref, **kwargs)

    def _plan(self, p: Probe) -> Plan:
        from dataclasses import asdict

        plan = make_plan(self.host, p, self.ref)
        self.result.plan = {**asdict(plan), "up_to_date": plan.up_to_date}
        self.result.up_to_date = plan.up_to_date
        return plan

    def _versions(self) -> dict[str, Any]:
        return {"serving": serving.NAME, "vllm": self.host.vllm.version, "base_image": self.host.vllm.base_image}

    def _act(self, p: Probe, plan: Plan) -> None:
        self.current = "check"
        self._step(
            "check", "ok", "up to date" if plan.up_to_date else "; ".join(f"{k}: {v}" for k, v in plan.reasons.items())
        )
        for name in ("push", "patch", "verify"):
            self._step(name, "skipped", serving.NO_PATCH)
        image_id = self._build_vllm(plan, p)
        self._start(plan, image_id, p)
        self._wait_vllm(plan)

    def _build_vllm(self, plan: Plan, p: Probe) -> str:
        t, self.current = time.monotonic(), "build"
        if not plan.build:
            assert p.image is not None, "the plan builds when there is no image"
            self._step("build", "ok", f"{self.ref} up to date ({p.image.id[:19]})")
            return p.image.id
        files = build_context(self.host)
        stage = staging_dir(self.host)
        self.remote.run(
            shell.and_then(["rm", "-rf", stage], ["mkdir", "-p", stage], ["tar", "-x", "-f", "-", "-C", stage]),
            input=context_tar(files),
        )
        builder = container.detect_builder(self.remote, self.host.engine)
        self.result.versions["builder"] = builder
        image_id = build_on_host(
            self.remote,
            self.host,
            stage,
            self.ref,
            builder,
            self.events,
            self.build_timeout,
            "the old container was not touched",
        )
        self.result.image_id = image_id
        self._step("build", "changed", f"{self.ref} {image_id[:19]} (vLLM {self.host.vllm.version})", t)
        return image_id

    def _dirs_before_start(self) -> tuple[str, ...]:
        """The connector's output dir exists before vLLM starts writing into it."""
        return (serving.connector_dir(self.host),)

    def _wait_vllm(self, plan: Plan) -> None:
        t = time.monotonic()
        checks = self._healthy(plan)
        if checks is None:
            return
        ok = sum(1 for c in checks if c.status == "ok")
        self._step("wait", "ok", f"healthy on vLLM's endpoints ({ok} checks ok)", t)

    def _dry_run(self, p: Probe, plan: Plan) -> DeployResult:
        self._step(
            "check", "ok", "up to date" if plan.up_to_date else "; ".join(f"{k}: {v}" for k, v in plan.reasons.items())
        )
        self._step("lock", "skipped", "dry run")
        self._step("patch", "skipped", serving.NO_PATCH)
        for name in ("build", "start"):
            self._step(name, "planned" if getattr(plan, name) else "ok", plan.reasons.get(name, "up to date"))
        self.result.diffs = diffs(self.host, plan, self.ref, p.dump_dir.identity if p.dump_dir else None)
        self.result.round_trips = self.remote.round_trips - self.rt0
        self.result.wall_s = round(time.monotonic() - self.t0, 3)
        return self.result


__all__ = ["BUILD_TIMEOUT_S", "VllmDeploy", "build_context", "diffs", "make_plan", "Events"]
