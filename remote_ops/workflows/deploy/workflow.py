"""`deploy`: preflight, lock, check, push, patch, verify, build, start, wait, record, unlock.

The workflow decides from one batched probe (one SSH round trip: host facts,
the target file's sha256, the image's labels, the container's image id, state
and run-config label, the lock) what is out of date, and does only that:

- patch   when the spec's target file is not the patched file the image was built from;
- build   when the image is missing or its `context-hash` label differs from the
          hash of what would be built now (Dockerfile, dumper, verifier, patch);
- start   when the container is missing, stopped, runs another image id, was
          started with other settings (`run-config` label), or mounts a dump dir
          that was removed, or removed and made again, since it started (a stale
          mount: `probes.dumpdir.mount_of`, from the dump dir's `device:inode`
          and the container's `dump-dir.id` label);
- wait    until the container answers the cheap endpoints (deadline, progress).

The first probe only reads.  A re-run with nothing changed stops there: one
round trip (two when the engine's health check is still `starting`: the wait),
nothing written on the host (no lock, no audit line; the local run record says
it was up to date), no engine channel.  When something must change, the probe
runs again taking the lock (`hostlock`, atomic) and the plan is made again from
what it read under the lock, so a concurrent run's changes are never missed.  `dry_run` stops
after the probe and returns the plan plus every diff (the patch's unified
diff, the Dockerfile, the run command line).

Start and wait go through the engine seam on one channel (`engine.remove` +
`engine.run(for_host(...))`, then polling `engine.container`), opened only
when the container must change.  Right before it, one round trip makes the
dump dir when it is missing and reads its `device:inode`
(`container.dump_dir_for_create`): the new container's `dump-dir.id` label,
so the next deploy finds it current.

Failure state (documented, tested): a failed *build* leaves the host's checkout
patched (the patch is verified and correct; only the image is missing) and the
old container untouched.  A failed *start* leaves the new image and the patched
checkout; the old container has been replaced, so nothing serves.  Either way
the error names the step (`build:` / `start:` / `wait:`), the run record has
that step as `failed`, and the lock is released.  The same holds for SIGINT,
SIGTERM and SIGHUP (`remote_ops.signals`).  When the lock cannot be released
(connection lost, host frozen) the error says so and how to recover
(`remote-ops unlock`).  `remote-ops patch revert` undoes the checkout patch.

Deadlines: every remote command uses the run's command deadline
(`--command-timeout`, default 120 s) except the two long steps, which have
their own: `build` (`--build-timeout`) and `wait` (`--healthy-timeout`, else
the inventory's `server.healthy_timeout_s`).  A wait whose host stops
answering fails at once with the SSH error, not at the end of the wait.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from ... import __version__
from ...core import secrets, shell
from ...core.inventory import HostSpec
from ...engine import cli_for, labels
from ...errors import CommandFailed, CommandTimedOut, Interrupted, Refused, RemoteOpsError, VerifyFailed
from ...remote import Remote
from ...serving import KINDS
from .. import container, hostlock
from .context import (
    context_files,
    context_hash,
    context_tar,
    copy_tree_cmd,
    image_tag,
    load_patch,
    render_dockerfile,
    staging_dir,
)
from .plan import Plan, Probe, is_current, make_plan, preflight_problems, probe
from .records import _audit_line, _error_doc, _failed_step, write_record

BUILD_TIMEOUT_S = 3600.0  # default of `deploy --build-timeout`


@dataclass
class StepResult:
    """One step's outcome: ok (nothing to do) | changed | planned | skipped | failed."""

    name: str
    status: str
    detail: str = ""
    duration_s: float = 0.0


@dataclass
class DeployResult:
    host: str
    dry_run: bool
    up_to_date: bool
    image: str
    image_id: str | None = None
    container_id: str | None = None
    fingerprint: str = ""
    steps: list[StepResult] = field(default_factory=list)
    plan: dict[str, Any] = field(default_factory=dict)
    diffs: dict[str, str] = field(default_factory=dict)
    shas: dict[str, str | None] = field(default_factory=dict)
    versions: dict[str, Any] = field(default_factory=dict)
    record: str | None = None
    round_trips: int = 0
    wall_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Events:
    """Live reporting hooks; the command implements them with the console.  No-ops here."""

    def step(self, result: StepResult) -> None: ...
    def line(self, stream: str, text: str) -> None: ...
    def progress(self, text: str) -> None: ...


def unlock_and_audit_cmd(host: HostSpec, audit: dict, token: str | None = None) -> str:
    """Append the audit line and release our lock (`token`) in one round trip."""
    return hostlock.release_cmd(host.lock_dir, token, host.audit_log, audit)


def push(remote: Remote, host: HostSpec, patch, events: Events) -> str:
    """Stage the build context on the host in one round trip: a tar of the shipped files on stdin."""
    stage = staging_dir(host)
    files = context_files(patch)
    remote.run(
        shell.and_then(["rm", "-rf", stage], ["mkdir", "-p", stage], ["tar", "-x", "-f", "-", "-C", stage]),
        input=context_tar(files),
    )
    events.progress(f"staged {len(files)} files in {stage}")
    return stage


def apply_patch(remote: Remote, host: HostSpec) -> dict:
    """Apply the anchored patch with `remote_ops.workflows.patching` (deploy already holds the host lock)."""
    from .. import patching

    try:
        return patching.apply(remote, host, lock=False).to_dict()
    except (Refused, VerifyFailed) as exc:
        raise type(exc)(f"patch: {exc.message}", host=host.name, hint=exc.hint, details=exc.details) from None


def verify_on_host(remote: Remote, host: HostSpec) -> dict:
    """Re-read the checkout's file (with py_compile) and prove each block's placement."""
    from .. import patching

    result = patching.verify(remote, host)
    if not result.ok:
        try:
            result.raise_if_failed()
        except VerifyFailed as exc:
            raise VerifyFailed(f"verify: {exc.message}", host=host.name, details=exc.details) from None
    return {
        "status": result.status,
        "sha256": result.sha256,
        "pristine_sha256": result.report.pristine_sha256,
        "compile_ok": result.compile_ok,
    }


def build_image(
    remote: Remote,
    host: HostSpec,
    patch,
    stage: str,
    ref: str,
    builder: str,
    shas: dict,
    events: Events,
    timeout: float = BUILD_TIMEOUT_S,
) -> str:
    """Render the Dockerfile into the context and build it on the host, streaming output."""
    text = render_dockerfile(host, patch, shas["before"], shas["after"])
    remote.put(text.encode(), f"{stage}/Dockerfile")
    remote.run(copy_tree_cmd(host, stage))
    return build_on_host(
        remote,
        host,
        stage,
        ref,
        builder,
        events,
        timeout,
        "the checkout stays patched and verified; the old container was not touched",
    )


def build_on_host(remote, host, stage: str, ref: str, builder: str, events: Events, timeout: float, hint: str) -> str:
    """Build the context at `stage` on the host, streaming its output; a failed build is one
    CommandFailed naming the engine and the image, with `hint` (what was left as it was)."""
    events.progress(f"building {ref} with {builder}")
    try:
        return container.build(remote, stage, ref, builder, on_line=events.line, timeout=timeout, kind=host.engine)
    except CommandFailed as exc:
        raise CommandFailed(
            f"build: {host.engine} build of {ref} failed (exit {exc.exit_status})",
            host=host.name,
            command=exc.command,
            exit_status=exc.exit_status,
            stderr_tail=exc.stderr_tail,
            hint=hint,
        ) from None


#: Seconds between state polls on the engine channel (one API request, ~3 ms on a warm channel).
POLL_S = 0.5
#: Seconds between full checks (one shell round trip with every probe) while the engine says "starting".
FULL_CHECK_S = 2.0


def wait_until_healthy(
    remote: Remote, host: HostSpec, ref: str, timeout_s: float, progress: Callable[[str], None], engine: Any = None
) -> list:
    """Wait until the container serves: its state on the engine channel, then one full check.

    The container's state is polled every `POLL_S` on the engine channel (a
    dead container ends the wait within that).  A full check
    (`health.probe_checks`: container, patch, cheap endpoints) runs as soon as
    the engine's own health check says `healthy`, and every `FULL_CHECK_S`
    while it says `starting` or the image has none (docker's first probe runs
    one interval, 15 s, after the start; the endpoints usually answer before;
    podman builds carry no health check, docs/ENGINES.md).  Ready = no `fail` in the container,
    patch and sglang tiers of a full check: what `health` calls ok (it treats
    "starting" with answering endpoints as ok), so `health` right after agrees.
    Each call runs under the run's command deadline; one the host does not
    answer (timeout, connection lost) ends the wait at once with that error.
    """
    what = f"container {host.container.name} to be healthy"
    deadline, last_full, reasons = time.monotonic() + timeout_s, float("-inf"), "no check ran yet"
    with container.engine_for(remote, engine, host.engine) as e:
        while True:
            info = _answer(lambda: e.container(host.container.name), what)
            if info is None or info.status in ("exited", "dead"):
                raise VerifyFailed(
                    "wait: container stopped while starting: " + _stopped(host, info),
                    host=host.name,
                    hint=f"see `{cli_for(host).logs_hint(host.container.name)}` on the host",
                )
            due = info.health == "healthy" or time.monotonic() - last_full >= FULL_CHECK_S
            if info.running and due:
                checks, last_full = _full_check(remote, host, ref, what), time.monotonic()
                failing = [c for c in checks if c.tier in ("container", "patch", *KINDS) and c.status == "fail"]
                if not failing:
                    return checks
                reasons = "; ".join(f"{c.tier}/{c.name}: {c.reason}" for c in failing[:3])
            if time.monotonic() >= deadline:
                raise CommandTimedOut(
                    f"wait: not healthy after {timeout_s:g}s waiting for {what}: {reasons}",
                    host=host.name,
                    timeout=timeout_s,
                    hint="raise --healthy-timeout or inventory server.healthy_timeout_s if the "
                    "model needs longer; `remote-ops health` shows the checks",
                )
            progress(f"waiting for health: {reasons}")
            time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))


def _answer(call: Callable[[], Any], what: str) -> Any:
    """One call during the wait; a host that does not answer ends the wait with that error."""
    try:
        return call()
    except RemoteOpsError as exc:
        raise _named(exc, "wait", f"the host stopped answering while waiting for {what}") from None


def _full_check(remote: Remote, host: HostSpec, ref: str, what: str) -> list:
    from .. import health

    return _answer(lambda: health.probe_checks(remote, host, expected_image=ref), what)


def _stopped(host: HostSpec, info: Any) -> str:
    if info is None:
        return f"container {host.container.name} does not exist"
    return f"container {host.container.name} is {info.status} (exit code {info.exit_code})" + (
        ", OOM-killed" if info.oom_killed else ""
    )


def _named(exc: RemoteOpsError, step: str, context: str = "") -> RemoteOpsError:
    """`exc` with its message prefixed by the step (and what it was doing); same type and code."""
    if not exc.message.startswith(f"{step}:"):
        exc.message = f"{step}: " + (f"{context}: " if context else "") + exc.message
        exc.args = (exc.message,)
    exc.details.setdefault("step", step)
    return exc


class Deploy:
    """One deploy run over one connected host; `run()` returns a DeployResult."""

    def __init__(
        self,
        remote: Remote,
        host: HostSpec,
        *,
        dry_run: bool = False,
        events: Events | None = None,
        why: str = "deploy",
        healthy_timeout_s: float | None = None,
        build_timeout_s: float | None = None,
        **serving: Any,
    ) -> None:
        """`serving` (a subclass for another serving engine): `patch=None, ref=...` instead of the
        host's patch spec and the image it tags."""
        self.remote, self.host, self.dry_run, self.why = remote, host, dry_run, why
        self.events = events or Events()
        self.timeout = healthy_timeout_s or host.server.healthy_timeout_s
        self.build_timeout = build_timeout_s or BUILD_TIMEOUT_S
        self.patch = serving["patch"] if "patch" in serving else load_patch(host)
        self.ref = serving["ref"] if "ref" in serving else image_tag(host, self.patch)
        self.result = DeployResult(host.name, dry_run, False, self.ref)
        self.t0 = time.monotonic()
        self.rt0 = remote.round_trips
        self.current = "preflight"  # the step running now: what a failure is recorded against
        self.token = None if dry_run else hostlock.new_token()
        self._locked: bool | None = None  # None: unknown (the probe did not come back)
        self._engine: Any = None  # opened when the container must change (start, wait)

    def engine(self) -> Any:
        """The engine channel of this run, opened on first use (a no-op deploy never opens it)."""
        if self._engine is None:
            from ...engine import open_engine

            self._engine = open_engine(self.remote, self.host.engine)
        return self._engine

    def _step(self, name: str, status: str, detail: str = "", since: float | None = None) -> StepResult:
        s = StepResult(name, status, detail, round(time.monotonic() - since, 3) if since else 0.0)
        self.result.steps.append(s)
        self.events.step(s)
        return s

    def run(self) -> DeployResult:
        """Probe, plan; when something must change, probe again taking the lock, and act on what
        is out of date; always record (and unlock what was taken), also after an error or a
        signal (`failure` is then recorded against the current step).  Nothing to change: one
        read-only round trip, no lock, no audit line on the host (the local record says so)."""
        from ... import signals

        t = time.monotonic()
        failure: BaseException | None = None
        try:
            p = probe(self.remote, self.host, self.ref)  # read-only: nothing is written yet
            self._locked = False
            self.result.fingerprint = self.remote.host_key_fingerprint
            self._preflight(p, t)
            self.current = "check"
            plan = self._plan(p)
            if self.dry_run:
                return self._dry_run(p, plan)
            self.current = "lock"
            if plan.up_to_date and p.holder is None:
                self._step("lock", "skipped", "nothing to change")
            else:
                self._locked = None  # unknown until the locking probe comes back
                p = probe(self.remote, self.host, self.ref, self.why, self.token)
                if not p.took_lock and hostlock.take_over_stale(self.remote, self.host, p.holder, "deploy"):
                    p = probe(self.remote, self.host, self.ref, self.why, self.token)  # the holder is gone
                self._locked = p.took_lock
                self._lock(p)
                plan = self._plan(p)  # read again under the lock: another run may have changed the host
            self._act(p, plan)
        except BaseException as exc:
            failure = self._failed(exc)
            raise
        finally:
            if self._engine is not None:
                self._engine.close()
            if not self.dry_run:
                with signals.deferred():
                    self._finish(failure)
        return self.result

    def _plan(self, p: Probe) -> Plan:
        plan = make_plan(self.host, self.patch, p, self.ref)
        self.result.plan = {**asdict(plan), "up_to_date": plan.up_to_date}
        self.result.up_to_date = plan.up_to_date
        return plan

    def _failed(self, exc: BaseException) -> BaseException:
        """Name the step in the error and record that step as failed (once)."""
        step = self.current
        if isinstance(exc, RemoteOpsError):
            _named(exc, step)
            text = exc.message
        elif isinstance(exc, Interrupted):
            exc.args = (f"{step}: interrupted by {exc.signal_name}",)
            text = str(exc)
        else:
            text = f"{step}: {type(exc).__name__}: {exc}"
        if not any(s.name == step and s.status == "failed" for s in self.result.steps):
            self._step(step, "failed", text)
        return exc

    def _versions(self) -> dict[str, Any]:
        """The serving engine's part of the run record's versions."""
        return {"sglang": self.host.sglang.version, "patch": f"{self.patch.id}@{self.patch.hash}"}

    def _preflight(self, p: Probe, t: float) -> None:
        self.result.versions = {
            "remote_ops": __version__,
            "engine": self.host.engine,
            "docker": p.facts.docker,  # the engine's versions (the key predates the engine field)
            **self._versions(),
        }
        problems = preflight_problems(self.host, p)
        if problems:
            self._step("preflight", "failed", "; ".join(problems), t)
            raise Refused("preflight: " + "; ".join(problems), host=self.host.name)
        self._step(
            "preflight",
            "ok",
            f"{self.host.engine} {p.facts.docker.get('server')}, {len(p.facts.gpus)} GPUs, "
            f"{(p.facts.dump_dir_free_bytes or 0) / 1e9:.0f} GB free for dumps",
            t,
        )

    def _lock(self, p: Probe) -> None:
        """The probe took the lock (atomic mkdir) unless someone holds it: then refuse (exit 9)."""
        if not p.took_lock:
            raise hostlock.held_refusal(self.host, p.holder, "deploy")
        self._step("lock", "ok", f"{self.host.lock_dir} (taken in the probe)")

    def _act(self, p: Probe, plan: Plan) -> None:
        """check -> push -> patch -> verify -> build -> start -> wait, skipping what is current."""
        shas = {"before": (p.image.labels.get(labels.SHA_BEFORE) if p.image else None), "after": p.facts.target_sha256}
        self.current = "check"
        self._step(
            "check", "ok", "up to date" if plan.up_to_date else "; ".join(f"{k}: {v}" for k, v in plan.reasons.items())
        )
        stage = staging_dir(self.host)
        if plan.patch or plan.build:
            t, self.current = time.monotonic(), "push"
            stage = push(self.remote, self.host, self.patch, self.events)
            self._step("push", "changed", stage, t)
            shas = self._patch_and_verify(stage)
        else:
            for name in ("push", "patch", "verify"):
                self._step(name, "ok", "unchanged")
        self.result.shas = shas
        image_id = self._build(plan, stage, shas, p)
        self._start(plan, image_id, p)
        self._wait(plan)

    def _patch_and_verify(self, stage: str) -> dict:
        t, self.current = time.monotonic(), "patch"
        try:
            doc = apply_patch(self.remote, self.host)
        except (Refused, VerifyFailed) as exc:
            self._step("patch", "failed", exc.message, t)
            raise
        changed = doc.get("action") in ("applied", "replaced")
        self._step(
            "patch",
            "changed" if changed else "ok",
            f"{doc.get('action')} (backup {doc.get('backup_path') or '-'})" if changed else "already applied",
            t,
        )
        t, self.current = time.monotonic(), "verify"
        report = verify_on_host(self.remote, self.host)
        self._step("verify", "ok", f"{report.get('status')} (sha {report.get('sha256', '')[:12]})", t)
        return {"before": report.get("pristine_sha256"), "after": report.get("sha256")}

    def _build(self, plan: Plan, stage: str, shas: dict, p: Probe) -> str:
        t, self.current = time.monotonic(), "build"
        current = p.image is not None and p.image.labels.get(labels.CONTEXT_HASH) == context_hash(
            self.host, self.patch, shas["before"] or "", shas["after"] or ""
        )
        if not plan.build or current:
            assert p.image is not None, "the plan builds when there is no image"
            self._step("build", "ok", f"{self.ref} up to date ({p.image.id[:19]})")
            return p.image.id
        builder = container.detect_builder(self.remote, self.host.engine)
        self.result.versions["builder"] = builder
        image_id = build_image(
            self.remote, self.host, self.patch, stage, self.ref, builder, shas, self.events, timeout=self.build_timeout
        )
        verification = container.require_ok(
            container.verify_patch(self.remote, image=image_id, expected_sha256=shas["after"], kind=self.host.engine),
            self.host.name,
        )
        self.result.image_id = image_id
        self._step(
            "build",
            "changed",
            f"{self.ref} {image_id[:19]}; patch verified in image (sha {(verification.sha256 or '')[:12]} = label)",
            t,
        )
        return image_id

    def _start(self, plan: Plan, image_id: str, p: Probe) -> None:
        t, self.current = time.monotonic(), "start"
        self.result.image_id = image_id
        c = p.container
        if not plan.start or is_current(self.host, self.ref, c, image_id, p.dump_dir):
            plan.start = False
            assert c is not None, "the plan starts when there is no container"
            plan.wait = c.health not in ("healthy", None)
            self.result.container_id = c.id
            self._step("start", "ok", f"{self.host.container.name} running {image_id[:19]}")
            return
        dump_dir_id = container.dump_dir_for_create(self.remote, self.host, self._dirs_before_start())
        try:
            self.result.container_id = container.run(
                self.remote, self.host, self.ref, engine=self.engine(), dump_dir_id=dump_dir_id
            )
        except CommandFailed as exc:
            self._step("start", "failed", exc.stderr_tail.splitlines()[-1] if exc.stderr_tail else exc.message, t)
            raise CommandFailed(
                f"start: the engine could not run {self.ref}: {exc.message}",
                host=self.host.name,
                command=exc.command,
                exit_status=exc.exit_status,
                stderr_tail=exc.stderr_tail,
                hint="the image is built and the checkout patched; fix the run settings and re-run deploy",
            ) from None
        self._step("start", "changed", f"{self.host.container.name} {self.result.container_id[:12]}", t)

    def _dirs_before_start(self) -> tuple[str, ...]:
        """Dirs on the host that must exist before the container starts (none for SGLang: its dump
        dir is made when it can be, `container.dump_dir_for_create`)."""
        return ()

    def _healthy(self, plan: Plan) -> list | None:
        """The wait step: the engine's health checks once they pass; None (the step said so) when
        the plan does not wait."""
        self.current = "wait"
        if not plan.wait:
            self._step("wait", "ok", f"container running; its {self.host.engine} health check healthy or none")
            return None
        return wait_until_healthy(
            self.remote, self.host, self.ref, self.timeout, self.events.progress, engine=self.engine()
        )

    def _wait(self, plan: Plan) -> None:
        t = time.monotonic()
        checks = self._healthy(plan)
        if checks is None:
            return
        verified = (
            container.require_ok(
                container.verify_patch(
                    self.remote,
                    container_name=self.host.container.name,
                    expected_sha256=self.result.shas.get("after"),
                    kind=self.host.engine,
                ),
                self.host.name,
            )
            if plan.start
            else None
        )
        ok = sum(1 for c in checks if c.status == "ok")
        self._step("wait", "ok", f"healthy ({ok} checks ok)" + ("; patch verified in container" if verified else ""), t)

    def _finish(self, failure: BaseException | None) -> None:
        """Unlock + audit line on the host (one round trip; none when the lock was never taken: a
        no-op, a refusal before the locking probe), then the local run record.

        A lock that cannot be released (connection lost, host frozen) is said
        so in the record and in the error, with how to recover."""
        self.current = "record"
        from ...core.jsonable import to_jsonable

        doc = secrets.mask_data(
            to_jsonable(
                {
                    **self.result.to_dict(),
                    "time": time.time(),
                    "ok": failure is None,
                    "error": _error_doc(failure),
                    "failed_step": _failed_step(self.result.steps),
                }
            )
        )
        doc["lock"], unlock_error = self._unlock(doc, failure)
        if unlock_error is not None and failure is None:
            doc.update(ok=False, error=_error_doc(unlock_error), failed_step="unlock")
        record = StepResult("record", "ok", "")
        self.result.steps.append(record)
        doc["steps"] = [asdict(s) for s in self.result.steps]
        self.result.round_trips = self.remote.round_trips - self.rt0
        self.result.wall_s = doc["wall_s"] = round(time.monotonic() - self.t0, 3)
        self.result.record = record.detail = str(write_record(self.host.name, doc))
        self.events.step(record)
        if unlock_error is not None and failure is None:
            raise unlock_error

    def _unlock(self, doc: dict, failure: BaseException | None) -> tuple[str, RemoteOpsError | None]:
        """Release our lock (token-checked) and append the audit line: (lock state, error)."""
        if self._locked is False:
            return "not taken", None
        try:
            self.remote.run(unlock_and_audit_cmd(self.host, _audit_line(doc), self.token))
        except RemoteOpsError as exc:
            hint = hostlock.recovery_hint(self.host)
            self._step("unlock", "failed", f"{exc}")
            doc["lock_hint"] = hint
            target = failure if failure is not None else _named(exc, "unlock")
            setattr(target, "hint", "; ".join(x for x in (getattr(target, "hint", None), hint) if x))  # noqa: B010
            return "maybe held", exc
        if self._locked:
            self._step("unlock", "ok", self.host.lock_dir)
        return "released", None

    def _dry_run(self, p: Probe, plan: Plan) -> DeployResult:
        """Plan + diffs; nothing on the host is changed (not even the lock)."""
        self._step(
            "check", "ok", "up to date" if plan.up_to_date else "; ".join(f"{k}: {v}" for k, v in plan.reasons.items())
        )
        self._step("lock", "skipped", "dry run" + (f"; HELD: {json.dumps(p.lock)}" if p.lock else ""))
        for name in ("patch", "build", "start"):
            if getattr(plan, name):
                self._step(name, "planned", plan.reasons.get(name, ""))
            else:
                self._step(name, "ok", "up to date")
        dump_dir_id = p.dump_dir.identity if p.dump_dir else None
        self.result.diffs = dry_run_diffs(self.remote, self.host, self.patch, plan, self.ref, dump_dir_id)
        self.result.round_trips = self.remote.round_trips - self.rt0
        self.result.wall_s = round(time.monotonic() - self.t0, 3)
        return self.result


def dry_run_diffs(
    remote: Remote, host: HostSpec, patch, plan: Plan, ref: str, dump_dir_id: str | None = None
) -> dict[str, str]:
    """The exact changes: patch diff of the spec's target file (computed locally), Dockerfile, run argv
    (its dump-dir label as the probe read the dir: a missing one is made, and read, at the start)."""
    from ...core import anchors
    from .. import patching

    diffs: dict[str, str] = {}
    text = ""
    if plan.patch or plan.build:
        try:
            preview = patching.apply(remote, host, dry_run=True, lock=False)
        except (Refused, VerifyFailed) as exc:
            raise type(exc)(f"patch: {exc.message}", host=host.name, hint=exc.hint, details=exc.details) from None
        if preview.diff:
            diffs[host.sglang.target_file] = preview.diff
        text = preview.check.plan.new_text
    if plan.build:
        before = anchors.verify_placement(text, patch).pristine_sha256
        after = hashlib.sha256(text.encode()).hexdigest()
        diffs["Dockerfile"] = render_dockerfile(host, patch, before, after)
    if plan.start:
        diffs[f"{host.engine} run"] = shell.join(secrets.mask_argv(container.run_argv(host, ref, dump_dir_id)))
    return diffs
