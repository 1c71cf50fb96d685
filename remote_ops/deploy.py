"""`deploy`: preflight, lock, check, push, patch, verify, build, start, wait, record, unlock.

The workflow decides from one batched probe (one SSH round trip: host facts,
the target file's sha256, the image's labels, the container's image id, state
and run-config label, the lock) what is out of date, and does only that:

- patch   when the spec's target file is not the patched file the image was built from;
- build   when the image is missing or its `context-hash` label differs from the
          hash of what would be built now (Dockerfile, dumper, verifier, patch);
- start   when the container is missing, stopped, runs another image id, or
          was started with other settings (`run-config` label);
- wait    until the container answers the cheap endpoints (deadline, progress).

So a re-run with nothing changed costs one probe plus the lock/record round
trips, and changes nothing.  `dry_run` stops after the probe and returns the
plan plus every diff (the patch's unified diff, the Dockerfile, the run argv).

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

import getpass
import hashlib
import io
import tarfile
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from . import __version__, container, facts, hostlock, shell
from .errors import CommandFailed, CommandTimedOut, Interrupted, Refused, RemoteOpsError, VerifyFailed
from .inventory import HostSpec
from .paths import host_dir, repo_resource
from .remote import Remote, command_deadline
from . import secrets

STEPS = ("preflight", "lock", "check", "push", "patch", "verify", "build", "start", "wait", "record", "unlock")
LABELS = {
    "patch_id": "org.remote-ops.patch.id",
    "patch_hash": "org.remote-ops.patch.hash",
    "sha_before": "org.remote-ops.source.sha256.before",
    "sha_after": "org.remote-ops.source.sha256.after",
    "version": "org.remote-ops.version",
    "sglang": "org.remote-ops.sglang.version",
    "base": "org.remote-ops.base-image",
    "context": container.CONTEXT_LABEL,
}
HEALTHCHECK_PATH = "/get_model_info"
BUILD_TIMEOUT_S = 3600.0    # default of `deploy --build-timeout`


# -- results ------------------------------------------------------------------------------------
@dataclass
class StepResult:
    """One step's outcome: ok (nothing to do) | changed | planned | skipped | failed."""

    name: str
    status: str
    detail: str = ""
    duration_s: float = 0.0


@dataclass
class Plan:
    """What is out of date, and why (from the probe)."""

    patch: bool
    build: bool
    start: bool
    wait: bool
    reasons: dict[str, str] = field(default_factory=dict)

    @property
    def up_to_date(self) -> bool:
        return not (self.patch or self.build or self.start)


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


# -- the patch and the build context (pure, local) ----------------------------------------------
def patch_spec_path(host: HostSpec) -> Path:
    """The host's bound patch spec as the one JSON file `anchors.py --spec` reads (in the cache dir)."""
    from . import patchspec
    from .paths import cache_dir

    spec = load_patch(host)
    path = cache_dir() / "patch-specs" / f"{spec.name}-{spec.hash}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(patchspec.bundled_json(spec))
    return path


def load_patch(host: HostSpec):
    """The host's patch spec (anchors.PatchSpec: file + class); its id and hash label the image.
    A host whose inventory names no spec is bound first (`patching.bind_host`)."""
    from . import patchspec

    return patchspec.for_host(host)


def image_tag(host: HostSpec, patch) -> str:
    """`image:tag`; the tag defaults to `<sglang version>-<patch hash[:12]>`."""
    return container.image_ref(host, host.container.tag or f"{host.sglang.version}-{patch.hash[:12]}")


def image_ref(host: HostSpec) -> str:
    """The image ref deploy builds for `host` (used by `health` to check the running image)."""
    return image_tag(host, load_patch(host))


def dockerfile_variables(host: HostSpec, patch, sha_before: str, sha_after: str,
                         context_hash: str | None) -> dict[str, Any]:
    """Everything Dockerfile.j2 needs; labels tie the image to the patch and the file shas."""
    labels = {LABELS["patch_id"]: patch.id, LABELS["patch_hash"]: patch.hash,
              LABELS["sha_before"]: sha_before, LABELS["sha_after"]: sha_after,
              LABELS["version"]: __version__, LABELS["sglang"]: host.sglang.version,
              LABELS["base"]: host.sglang.base_image}
    if context_hash:
        labels[LABELS["context"]] = context_hash
    return {"host_name": host.name, "remote_ops_version": __version__, "base_image": host.sglang.base_image,
            "sglang_version": host.sglang.version, "image_checkout": host.sglang.image_checkout.rstrip("/"),
            "tool_dir": container.TOOL_DIR, "port": host.server.port, "target_sha256_after": sha_after,
            "labels": labels,
            "healthcheck": {"path": HEALTHCHECK_PATH, "interval_s": 15, "timeout_s": 5, "retries": 3,
                            "start_period_s": host.container.healthcheck_start_period_s}}


def render_dockerfile(host: HostSpec, patch, sha_before: str, sha_after: str) -> str:
    """The Dockerfile as it will be built, with its context-hash label."""
    from . import templates

    return templates.render(templates.DOCKERFILE,
                            dockerfile_variables(host, patch, sha_before, sha_after, context_hash(host, patch, sha_before, sha_after)))


def context_files(patch) -> dict[str, bytes]:
    """Build-context files shipped from here (name in context -> bytes); the sglang tree comes from the host."""
    from . import anchors

    files = {"anchors.py": Path(anchors.__file__).read_bytes(),
             "patch-spec.json": json.dumps(anchors.spec_to_dict(patch), indent=1, sort_keys=True).encode(),
             "verify_patch.py": repo_resource("docker", "verify_patch.py").read_bytes(),
             "entrypoint.sh": repo_resource("docker", "entrypoint.sh").read_bytes()}
    dump_dir = Path(__file__).resolve().parent / "dump"
    for path in sorted(dump_dir.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix in (".py", ".md"):
            files[f"remote_ops_dump/{path.relative_to(dump_dir).as_posix()}"] = path.read_bytes()
    return files


def context_hash(host: HostSpec, patch, sha_before: str, sha_after: str) -> str:
    """Hash of every build input: the template's text and its variables (without this label),
    the shipped files, the patched file's sha.  Hashing the inputs instead of the rendered
    text keeps Jinja2 out of a no-op deploy (its import alone is ~40 ms)."""
    variables = dockerfile_variables(host, patch, sha_before, sha_after, None)
    h = hashlib.sha256(json.dumps(variables, sort_keys=True).encode())
    h.update(hashlib.sha256((repo_resource("templates", "Dockerfile.j2")).read_bytes()).digest())
    for name, data in sorted(context_files(patch).items()):
        h.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return h.hexdigest()[:24]


def staging_dir(host: HostSpec) -> str:
    """Where the build context is assembled on the host: per container name and checkout,
    so two inventories sharing one machine (test labs) never share a context."""
    key = hashlib.sha256(f"{host.container.name}\0{host.sglang.checkout}".encode()).hexdigest()[:10]
    return f"/var/tmp/remote-ops/build-{host.container.name}-{key}"


# -- probe (one round trip) ---------------------------------------------------------------------
@dataclass
class Probe:
    """What the one batched probe found."""

    facts: facts.Facts
    builder: str
    image: container.ImageInfo | None
    container: container.ContainerInfo | None
    lock: dict | None
    raw: dict[str, tuple[int, str]] = field(default_factory=dict)
    took_lock: bool = False
    holder: hostlock.Holder | None = None


#: facts probes a deploy does not need to decide anything (reported by `facts` and `health`).
SKIPPED_FACTS = {"runtimes", "nvidia_ctk"}


def probe_commands(host: HostSpec, ref: str, lock_why: str | None = None, token: str | None = None,
                   probe_s: float | None = None) -> list[tuple[str, str]]:
    """Preflight facts, the lock, then the state under the lock: target sha, container + image (pure).

    One `docker inspect NAME REF` answers for both objects (each docker CLI call
    costs ~0.1-0.25 s on the host).  With `lock_why`, a section takes the host
    lock (`hostlock.take_cmd`, atomic mkdir) before the state is read, so a
    no-op deploy needs no separate lock round trip; otherwise (dry run) it
    only reads the lock (`hostlock.read_cmd`).  With `probe_s`, each docker
    probe is bounded on the host (a frozen dockerd is that probe's failure).
    """
    lock = (hostlock.take_cmd(host.lock_dir, hostlock.info_text(f"deploy: {lock_why}", token)) if lock_why
            else hostlock.read_cmd(host.lock_dir))
    found = [(n, c) for n, c in facts.probes(host) if n not in SKIPPED_FACTS]
    preflight = [(n, c) for n, c in found if n != "target"]
    objects = shell.join(["docker", "inspect", host.container.name, ref])
    if probe_s:
        preflight = facts.bounded(preflight, probe_s)
        objects = facts.bounded([("objects", objects)], probe_s)[0][1]
    return [*preflight, ("lock", lock), *[(n, c) for n, c in found if n == "target"], ("objects", objects)]


def parse_probe(host: HostSpec, sec: dict[str, tuple[int, str]], locking: bool = False) -> Probe:
    """Turn the probe's sections into a `Probe` (pure).

    When `locking`, `lock` is None if this probe took the lock, else the holder;
    otherwise (dry run) it is the holder, if any."""
    f = facts.parse(host, sec)
    image, ctr = split_inspect(sec.get("objects", (1, ""))[1])
    lock_status, lock_text = sec.get("lock", (1, ""))
    if locking:
        took = lock_status == 0
        holder = None if took else (hostlock.parse_info(lock_text) if lock_text.strip() else None)
    else:
        took, holder = False, hostlock.parse_read(lock_status, lock_text)
    lock = holder.to_dict() if holder else (None if took or not locking else {"info": "none"})
    return Probe(f, "", image, ctr, lock, sec, took_lock=took, holder=holder)


def split_inspect(text: str) -> tuple[container.ImageInfo | None, container.ContainerInfo | None]:
    """`docker inspect CONTAINER IMAGE` -> (image, container); either may be absent (pure)."""
    items = container._json_array(text)
    ctr = next((i for i in items if "State" in i), None)
    img = next((i for i in items if "RepoTags" in i), None)
    return (container.parse_image_inspect(0, json.dumps([img])) if img else None,
            container.parse_container_inspect(0, json.dumps([ctr])) if ctr else None)


def probe(remote: Remote, host: HostSpec, ref: str, lock_why: str | None = None,
          token: str | None = None) -> Probe:
    """One round trip under the run's command deadline: facts, container + image, and
    (unless a dry run) the lock, taken with `token`."""
    probe_s = facts.probe_deadline(command_deadline(remote)) / 2   # its two docker probes run one after the other
    out = remote.run(shell.sections(probe_commands(host, ref, lock_why, token, probe_s)), check=False).stdout
    return parse_probe(host, shell.split_sections(out), locking=lock_why is not None)


# -- preflight and plan (pure) ------------------------------------------------------------------
def preflight_problems(host: HostSpec, p: Probe) -> list[str]:
    """Reasons not to deploy: no engine, wrong GPU count, no disk, no target file."""
    f, problems = p.facts, []
    if f.docker.get("error") or not f.docker.get("server"):
        problems.append(f"docker engine not usable: {f.docker.get('error', 'no server version')}")
    if host.gpus.count and len(f.gpus) != host.gpus.count:
        problems.append(f"inventory expects {host.gpus.count} GPUs, nvidia-smi shows {len(f.gpus)}"
                        + (f" ({f.gpu_error})" if f.gpu_error else ""))
    free_gb = (f.dump_dir_free_bytes or 0) / 1e9
    if f.dump_dir_free_bytes is not None and free_gb < host.dump.min_free_gb:
        problems.append(f"{free_gb:.1f} GB free under {host.dump.dir}, inventory wants {host.dump.min_free_gb:g} GB")
    if f.target_error or not f.target_sha256:
        problems.append(f"cannot read {host.sglang.target_file}: {f.target_error or 'no sha'}")
    return problems


def make_plan(host: HostSpec, patch, p: Probe, ref: str) -> Plan:
    """Decide what to do from the probe alone (pure)."""
    img, ctr, reasons = p.image, p.container, {}
    patched = bool(img and img.labels.get(LABELS["sha_after"]) == p.facts.target_sha256
                   and img.labels.get(LABELS["patch_hash"]) == patch.hash)
    if not patched:
        reasons["patch"] = f"{PurePosixPath(patch.target).name} is not the patched file of the current image"
    want_ctx = context_hash(host, patch, (img.labels.get(LABELS["sha_before"], "") if img else ""),
                            p.facts.target_sha256 or "") if patched else None
    build = not patched or img is None or img.labels.get(LABELS["context"]) != want_ctx
    if build:
        reasons["build"] = "image missing" if img is None else "build inputs changed"
    start = build or ctr is None or not ctr.running or ctr.image_id != img.id \
        or ctr.labels.get(container.RUN_CONFIG_LABEL) != container.expected_run_config(host, ref)
    if start:
        reasons["start"] = _start_reason(host, ctr, img, ref, build)
    wait = start or (ctr is not None and ctr.health not in ("healthy", None))
    return Plan(patch=not patched, build=build, start=start, wait=wait, reasons=reasons)


def _start_reason(host: HostSpec, ctr, img, ref: str, build: bool) -> str:
    if build:
        return "new image"
    if ctr is None:
        return "no container"
    if not ctr.running:
        return f"container is {ctr.status}"
    if img is None or ctr.image_id != img.id:
        return "container runs another image"
    return "run settings changed"


# -- the remote steps ---------------------------------------------------------------------------
def lock_info(why: str) -> str:
    """The lock's `info` for a deploy (`hostlock.info_text`): no `pid=`, the lock is held by
    this client across many commands, so its `client`+`client_pid` prove it stale."""
    return hostlock.info_text(f"deploy: {why}")


def parse_lock(status: int, text: str) -> dict | None:
    """`cat LOCK/info` -> {key: value}, or None when the lock is free (pure)."""
    if status != 0:
        return None
    pairs = [l.split("=", 1) for l in text.splitlines() if "=" in l]
    return {k: v for k, v in pairs} or {"raw": text.strip()}


def unlock_and_audit_cmd(host: HostSpec, audit: dict, token: str | None = None) -> str:
    """Append the audit line and release our lock (`token`) in one round trip."""
    return hostlock.release_cmd(host.lock_dir, token, host.audit_log, audit)


def push(remote: Remote, host: HostSpec, patch, events: Events) -> str:
    """Stage the build context on the host in one round trip: a tar of the shipped files on stdin."""
    stage = staging_dir(host)
    files = context_files(patch)
    remote.run(shell.and_then(["rm", "-rf", stage], ["mkdir", "-p", stage], ["tar", "-x", "-f", "-", "-C", stage]),
               input=context_tar(files))
    events.progress(f"staged {len(files)} files in {stage}")
    return stage


def context_tar(files: dict[str, bytes]) -> bytes:
    """An uncompressed tar of the context files (executables get mode 755)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 0
            info.mode = 0o755 if name.endswith((".sh", "verify_patch.py")) else 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def copy_tree_cmd(host: HostSpec, stage: str) -> str:
    """Copy the (patched) checkout's python/sglang into the context, without bytecode."""
    src = host.sglang.checkout.rstrip("/") + "/python/sglang"
    return shell.and_then(["rm", "-rf", f"{stage}/sglang"], ["cp", "-a", src, f"{stage}/sglang"],
                          f"find {shell.quote(stage + '/sglang')} -name __pycache__ -prune -exec rm -rf {{}} +")


def apply_patch(remote: Remote, host: HostSpec) -> dict:
    """Apply the anchored patch with `remote_ops.patching` (deploy already holds the host lock)."""
    from . import patching

    try:
        return patching.apply(remote, host, lock=False).to_dict()
    except (Refused, VerifyFailed) as exc:
        raise type(exc)(f"patch: {exc.message}", host=host.name, hint=exc.hint, details=exc.details) from None


def verify_on_host(remote: Remote, host: HostSpec) -> dict:
    """Re-read the checkout's file (with py_compile) and prove each block's placement."""
    from . import patching

    result = patching.verify(remote, host)
    if not result.ok:
        try:
            result.raise_if_failed()
        except VerifyFailed as exc:
            raise VerifyFailed(f"verify: {exc.message}", host=host.name, details=exc.details) from None
    return {"status": result.status, "sha256": result.sha256,
            "pristine_sha256": result.report.pristine_sha256, "compile_ok": result.compile_ok}


def _last_json(text: str) -> dict:
    """The JSON document a standalone tool printed (indented or one line)."""
    start = text.find("{")
    try:
        doc = json.loads(text[start:]) if start >= 0 else {}
    except json.JSONDecodeError:
        doc = {}
    return doc if isinstance(doc, dict) else {}


def build_image(remote: Remote, host: HostSpec, patch, stage: str, ref: str, builder: str,
                shas: dict, events: Events, timeout: float = BUILD_TIMEOUT_S) -> str:
    """Render the Dockerfile into the context and build it on the host, streaming output."""
    text = render_dockerfile(host, patch, shas["before"], shas["after"])
    remote.put(text.encode(), f"{stage}/Dockerfile")
    remote.run(copy_tree_cmd(host, stage))
    events.progress(f"building {ref} with {builder}")
    try:
        return container.build(remote, stage, ref, builder, on_line=events.line, timeout=timeout)
    except CommandFailed as exc:
        raise CommandFailed(f"build: docker build of {ref} failed (exit {exc.exit_status})", host=host.name,
                            command=exc.command, exit_status=exc.exit_status, stderr_tail=exc.stderr_tail,
                            hint="the checkout stays patched and verified; the old container was not touched") from None


# -- wait until healthy -------------------------------------------------------------------------
def wait_until_healthy(remote: Remote, host: HostSpec, ref: str, timeout_s: float,
                       progress: Callable[[str], None]) -> list:
    """Poll `remote_ops.health` until the container, patch and cheap endpoints pass, or the deadline.

    Ready = no `fail` in the container, patch and sglang tiers (docker's own
    health may still say `starting`: its first probe runs one interval after start).
    Each poll runs under the run's command deadline; a poll the host does not
    answer (timeout, connection lost) ends the wait at once with that error.
    """
    from . import health

    deadline, what = time.monotonic() + timeout_s, f"container {host.container.name} to be healthy"
    while True:
        try:
            checks = health.probe_checks(remote, host, expected_image=ref)
        except RemoteOpsError as exc:
            raise _named(exc, "wait", f"the host stopped answering while waiting for {what}") from None
        gating = [c for c in checks if c.tier in ("container", "patch", "sglang")]
        last = [c for c in gating if c.status == "fail"]
        if gating and not last:
            return checks
        if _container_dead(checks):
            raise VerifyFailed(f"wait: container stopped while starting: {last[0].reason}", host=host.name,
                               hint=f"see `docker logs {host.container.name}` on the host")
        reasons = "; ".join(f"{c.tier}/{c.name}: {c.reason}" for c in last[:3]) or "no container check ran"
        if time.monotonic() >= deadline:
            raise CommandTimedOut(f"wait: not healthy after {timeout_s:g}s waiting for {what}: {reasons}",
                                  host=host.name, timeout=timeout_s,
                                  hint="raise --healthy-timeout or inventory server.healthy_timeout_s if the "
                                       "model needs longer; `remote-ops health` shows the checks")
        progress(f"waiting for health: {reasons}")
        time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))


def _named(exc: RemoteOpsError, step: str, context: str = "") -> RemoteOpsError:
    """`exc` with its message prefixed by the step (and what it was doing); same type and code."""
    if not exc.message.startswith(f"{step}:"):
        exc.message = f"{step}: " + (f"{context}: " if context else "") + exc.message
        exc.args = (exc.message,)
    exc.details.setdefault("step", step)
    return exc


def _error_doc(failure: BaseException | None) -> dict | None:
    """The run record's `error`: the typed error's dict, a signal, or a bug's repr."""
    if failure is None:
        return None
    if hasattr(failure, "to_dict"):
        return failure.to_dict()
    return {"error": "internal", "exit_code": 1, "message": f"{type(failure).__name__}: {failure}"}


def _failed_step(steps: list[StepResult]) -> str | None:
    return next((s.name for s in steps if s.status == "failed"), None)


def _container_dead(checks) -> bool:
    state = next((c for c in checks if c.tier == "container" and c.name == "state"), None)
    return bool(state and state.status == "fail" and ("exited" in state.reason or "dead" in state.reason))


# -- the workflow -------------------------------------------------------------------------------
class Deploy:
    """One deploy run over one connected host; `run()` returns a DeployResult."""

    def __init__(self, remote: Remote, host: HostSpec, *, dry_run: bool = False, events: Events | None = None,
                 why: str = "deploy", healthy_timeout_s: float | None = None,
                 build_timeout_s: float | None = None) -> None:
        self.remote, self.host, self.dry_run, self.why = remote, host, dry_run, why
        self.events = events or Events()
        self.timeout = healthy_timeout_s or host.server.healthy_timeout_s
        self.build_timeout = build_timeout_s or BUILD_TIMEOUT_S
        self.patch = load_patch(host)
        self.ref = image_tag(host, self.patch)
        self.result = DeployResult(host.name, dry_run, False, self.ref)
        self.t0 = time.monotonic()
        self.rt0 = remote.round_trips
        self.current = "preflight"     # the step running now: what a failure is recorded against
        self.token = None if dry_run else hostlock.new_token()
        self._locked: bool | None = None   # None: unknown (the probe did not come back)

    def _step(self, name: str, status: str, detail: str = "", since: float | None = None) -> StepResult:
        s = StepResult(name, status, detail, round(time.monotonic() - since, 3) if since else 0.0)
        self.result.steps.append(s)
        self.events.step(s)
        return s

    def run(self) -> DeployResult:
        """Probe (taking the lock), plan, act on what is out of date; always record and unlock,
        also after an error or a signal (`failure` is then recorded against the current step)."""
        from . import signals

        t = time.monotonic()
        failure: BaseException | None = None
        try:
            p = probe(self.remote, self.host, self.ref, None if self.dry_run else self.why, self.token)
            self._locked = p.took_lock
            self.result.fingerprint = self.remote.host_key_fingerprint
            self._preflight(p, t)
            self.current = "check"
            plan = make_plan(self.host, self.patch, p, self.ref)
            self.result.plan = {**asdict(plan), "up_to_date": plan.up_to_date}
            self.result.up_to_date = plan.up_to_date
            if self.dry_run:
                return self._dry_run(p, plan)
            self.current = "lock"
            self._lock(p)
            self._act(p, plan)
        except BaseException as exc:
            failure = self._failed(exc)
            raise
        finally:
            if not self.dry_run:
                with signals.deferred():
                    self._finish(failure)
        return self.result

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

    def _preflight(self, p: Probe, t: float) -> None:
        self.result.versions = {"remote_ops": __version__, "docker": p.facts.docker,
                                "sglang": self.host.sglang.version, "patch": f"{self.patch.id}@{self.patch.hash}"}
        problems = preflight_problems(self.host, p)
        if problems:
            self._step("preflight", "failed", "; ".join(problems), t)
            raise Refused("preflight: " + "; ".join(problems), host=self.host.name)
        self._step("preflight", "ok", f"docker {p.facts.docker.get('server')}, {len(p.facts.gpus)} GPUs, "
                   f"{(p.facts.dump_dir_free_bytes or 0) / 1e9:.0f} GB free for dumps", t)

    def _lock(self, p: Probe) -> None:
        """The probe took the lock (atomic mkdir) unless someone holds it: then refuse (exit 9)."""
        if not p.took_lock:
            raise hostlock.held_refusal(self.host, p.holder, "deploy")
        self._step("lock", "ok", f"{self.host.lock_dir} (taken in the probe)")

    def _act(self, p: Probe, plan: Plan) -> None:
        """check -> push -> patch -> verify -> build -> start -> wait, skipping what is current."""
        shas = {"before": (p.image.labels.get(LABELS["sha_before"]) if p.image else None),
                "after": p.facts.target_sha256}
        self.current = "check"
        self._step("check", "ok", "up to date" if plan.up_to_date else
                   "; ".join(f"{k}: {v}" for k, v in plan.reasons.items()))
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
        self._step("patch", "changed" if changed else "ok",
                   f"{doc.get('action')} (backup {doc.get('backup_path') or '-'})" if changed else "already applied", t)
        t, self.current = time.monotonic(), "verify"
        report = verify_on_host(self.remote, self.host)
        self._step("verify", "ok", f"{report.get('status')} (sha {report.get('sha256', '')[:12]})", t)
        return {"before": report.get("pristine_sha256"), "after": report.get("sha256")}

    def _build(self, plan: Plan, stage: str, shas: dict, p: Probe) -> str:
        t, self.current = time.monotonic(), "build"
        current = p.image is not None and p.image.labels.get(LABELS["context"]) == context_hash(
            self.host, self.patch, shas["before"] or "", shas["after"] or "")
        if not plan.build or current:
            self._step("build", "ok", f"{self.ref} up to date ({p.image.id[:19]})")
            return p.image.id
        builder = container.detect_builder(self.remote)
        self.result.versions["builder"] = builder
        image_id = build_image(self.remote, self.host, self.patch, stage, self.ref, builder, shas, self.events,
                               timeout=self.build_timeout)
        verification = container.require_ok(container.verify_patch(
            self.remote, image=image_id, expected_sha256=shas["after"]), self.host.name)
        self.result.image_id = image_id
        self._step("build", "changed", f"{self.ref} {image_id[:19]}; patch verified in image "
                   f"(sha {verification.sha256[:12]} = label)", t)
        return image_id

    def _start(self, plan: Plan, image_id: str, p: Probe) -> None:
        t, self.current = time.monotonic(), "start"
        self.result.image_id = image_id
        c = p.container
        current = bool(c and c.running and c.image_id == image_id and c.labels.get(container.RUN_CONFIG_LABEL)
                       == container.expected_run_config(self.host, self.ref))
        if not plan.start or current:
            plan.start = False
            plan.wait = c is not None and c.health not in ("healthy", None)
            self.result.container_id = p.container.id
            self._step("start", "ok", f"{self.host.container.name} running {image_id[:19]}")
            return
        try:
            self.result.container_id = container.run(self.remote, self.host, self.ref)
        except CommandFailed as exc:
            self._step("start", "failed", exc.stderr_tail.splitlines()[-1] if exc.stderr_tail else "", t)
            raise CommandFailed(f"start: docker run of {self.ref} failed (exit {exc.exit_status})",
                                host=self.host.name, command=exc.command, exit_status=exc.exit_status,
                                stderr_tail=exc.stderr_tail,
                                hint="the image is built and the checkout patched; fix the run settings "
                                     "and re-run deploy") from None
        self._step("start", "changed", f"{self.host.container.name} {self.result.container_id[:12]}", t)

    def _wait(self, plan: Plan) -> None:
        t, self.current = time.monotonic(), "wait"
        if not plan.wait:
            self._step("wait", "ok", "container healthy (docker health check)")
            return
        checks = wait_until_healthy(self.remote, self.host, self.ref, self.timeout, self.events.progress)
        verified = container.require_ok(container.verify_patch(
            self.remote, container_name=self.host.container.name,
            expected_sha256=self.result.shas.get("after")), self.host.name) if plan.start else None
        ok = sum(1 for c in checks if c.status == "ok")
        self._step("wait", "ok", f"healthy ({ok} checks ok)" + ("; patch verified in container" if verified else ""), t)

    def _finish(self, failure: BaseException | None) -> None:
        """Unlock + audit line on the host (one round trip), then the local run record.

        A lock that cannot be released (connection lost, host frozen) is said
        so in the record and in the error, with how to recover."""
        self.current = "record"
        from .console import to_jsonable

        doc = secrets.mask_data(to_jsonable({**self.result.to_dict(), "time": time.time(), "ok": failure is None,
                                             "error": _error_doc(failure),
                                             "failed_step": _failed_step(self.result.steps)}))
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
            target.hint = "; ".join(x for x in (getattr(target, "hint", None), hint) if x)
            return "maybe held", exc
        if self._locked:
            self._step("unlock", "ok", self.host.lock_dir)
        return "released", None

    def _dry_run(self, p: Probe, plan: Plan) -> DeployResult:
        """Plan + diffs; nothing on the host is changed (not even the lock)."""
        self._step("check", "ok", "up to date" if plan.up_to_date else
                   "; ".join(f"{k}: {v}" for k, v in plan.reasons.items()))
        self._step("lock", "skipped", "dry run" + (f"; HELD: {json.dumps(p.lock)}" if p.lock else ""))
        for name in ("patch", "build", "start"):
            if getattr(plan, name):
                self._step(name, "planned", plan.reasons.get(name, ""))
            else:
                self._step(name, "ok", "up to date")
        self.result.diffs = dry_run_diffs(self.remote, self.host, self.patch, plan, self.ref)
        self.result.round_trips = self.remote.round_trips - self.rt0
        self.result.wall_s = round(time.monotonic() - self.t0, 3)
        return self.result


def dry_run_diffs(remote: Remote, host: HostSpec, patch, plan: Plan, ref: str) -> dict[str, str]:
    """The exact changes: patch diff of the spec's target file (computed locally), Dockerfile, run argv."""
    from . import anchors

    from . import patching

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
        before = anchors.verify(text, patch).pristine_sha256
        after = hashlib.sha256(text.encode()).hexdigest()
        diffs["Dockerfile"] = render_dockerfile(host, patch, before, after)
    if plan.start:
        diffs["docker run"] = shell.join(secrets.mask_argv(container.run_argv(host, ref)))
    return diffs


# -- records ------------------------------------------------------------------------------------
def write_record(host_name: str, doc: dict) -> Path:
    """runs/<UTC time>-deploy.json under the host's state dir (atomic rename)."""
    runs = host_dir(host_name) / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    path = runs / (time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{os.getpid()}-deploy.json")
    tmp = path.with_suffix(".tmp")
    from .console import to_jsonable

    tmp.write_text(json.dumps(to_jsonable(doc), indent=2) + "\n")
    tmp.replace(path)
    return path


def _audit_line(record: dict) -> dict:
    """The short line appended to the host's audit log."""
    return {"time": record["time"], "tool": f"remote-ops {__version__}", "action": "deploy",
            "user": getpass.getuser(), "client": socket.gethostname(), "ok": record["ok"],
            "up_to_date": record["up_to_date"], "image": record["image"], "image_id": record.get("image_id"),
            "steps": {s["name"]: s["status"] for s in record["steps"]},
            "error": (record.get("error") or {}).get("message"), "failed_step": record.get("failed_step")}


def render_for_host(host: HostSpec) -> str:
    """The Dockerfile for `host`, computed locally from the released SGLang file (no SSH).

    The shas are those of the released target file (the host's patch spec) of the inventory's
    SGLang version and of that file with the patch applied: what deploy builds
    when the host's checkout is the pristine release.
    """
    from . import anchors, wheels

    patch = load_patch(host)
    text = wheels.sglang_source(host.sglang.version, patch.target).decode("utf-8")
    try:
        new = anchors.plan(text, patch).new_text
    except anchors.AnchorRefusal as exc:
        raise Refused(f"render: the patch does not apply to SGLang {host.sglang.version}: {exc}",
                      host=host.name) from None
    before = hashlib.sha256(text.encode()).hexdigest()
    return render_dockerfile(host, patch, before, hashlib.sha256(new.encode()).hexdigest())


def last_record(host_name: str) -> dict | None:
    """The newest deploy record of `host_name`, if any (used by container start)."""
    runs = sorted((host_dir(host_name) / "runs").glob("*-deploy.json"))
    return json.loads(runs[-1].read_text()) if runs else None


def deploy(remote: Remote, host: HostSpec, **kwargs) -> DeployResult:
    """Run a deploy (see `Deploy`)."""
    return Deploy(remote, host, **kwargs).run()
