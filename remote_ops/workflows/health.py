"""Tiered, read-only health checks, cheap first, in one SSH round trip.

Each check is a pure evaluator over captured probe output, returning
`Check(tier, name, status, reason)` with status ok / warn / fail / skip.  The
probes are built here with `remote_ops.core.shell` and run concurrently on the host
via `shell.parallel_sections`, so a health run costs one connection and one
command (the SSH tier is the connection itself), and its wall time is the
slowest probe's, not the sum.  The only thing written on the host is that
command's private temp dir, removed when it exits.

Why tiers: SGLang 0.5.x's `/health` runs a one-token generation (20 s timeout)
and piled-up probes have crashed servers, so the HTTP tier polls only cheap
endpoints (`/model_info`, `/server_info`, `/v1/models`, each with its older
`/get_*` alias), and a generation probe runs at most once, only with `--deep`.
Nothing here writes to the host: the dump-growth baseline is kept locally.

The engine's questions (version, container + image, the container's id and
PID, `exec` where the container's root cannot be read) come from the engine
seam as shell sections (`engine.probe`: over the engine's socket with curl
when it can, the docker CLI otherwise), read back into its typed records; no
docker command line is written here.

"Healthy" means what deploy's wait means: a running container whose docker
health check is still `starting` is ok once every cheap endpoint answers
(`starting_but_answering`), so `health` right after a deploy that reported
healthy exits 0.  `dumps/growth` warns about standing dumps only while the
extraction client runs (`extraction_probe`: its PID file, `remote_ops.core.extractplan`).

Deadlines: the round trip runs under the run's command deadline
(`--command-timeout`); each probe in it is bounded by `facts.probe_deadline`
of that on the host (`facts.bounded`), and the HTTP probe's own calls share
that budget.  So a hung probe (a frozen dockerd) fails only its own checks,
and the others are still reported.

Exit codes: a host that cannot be connected to is listed as the failing
`ssh/connect` check, and the run exits with that error's own code (4
unreachable, 5 auth, 6 host key) rather than 12, as every other command does.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..core import patchspec, shell
from ..core.inventory import HostSpec
from ..engine import labels, probe as engine_probe
from ..engine.types import ContainerInfo, ImageInfo
from ..errors import ExitCode, RemoteOpsError
from . import facts

ORDER = {"ok": 0, "skip": 0, "warn": 1, "fail": 2}
#: The engine's sections in the health probe (commands and parsing live in `remote_ops.engine.probe`).
ENGINE_SECTIONS = engine_probe.SectionNames(version="docker", objects="container", runtimes=None)


@dataclass(frozen=True)
class Check:
    tier: str
    name: str
    status: str  # ok | warn | fail | skip
    reason: str
    data: dict = field(default_factory=dict)


@dataclass
class HostHealth:
    host: str
    checks: list[Check]
    duration_s: float = 0.0
    round_trips: int = 0
    error_exit: int | None = None  # the exit code of a connection/SSH error, if one ended the run

    @property
    def worst(self) -> str:
        return max((c.status for c in self.checks), key=lambda s: ORDER[s], default="ok")

    @property
    def verdict(self) -> str:
        """This host's own result for a fleet summary: `ok`, or its worst status and the first
        check that has it (`fail: ssh/connect: connection to … refused`)."""
        first = next((c for c in self.checks if c.status == self.worst), None)
        if ORDER[self.worst] == 0 or first is None:
            return "ok"
        return f"{self.worst}: {first.tier}/{first.name}: {first.reason}"

    def to_dict(self) -> dict:
        """`exit_code` is this host's own (an integer: `exit_code([self])`), never the run's worst."""
        return {
            "host": self.host,
            "worst": self.worst,
            "duration_s": round(self.duration_s, 3),
            "round_trips": self.round_trips,
            "exit_code": exit_code([self]),
            "checks": [asdict(c) for c in self.checks],
        }


def exit_code(results: list[HostHealth]) -> int:
    """0 when all ok, 11 when the worst is warn, 12 when anything failed; but a host that
    could not be reached or trusted gives that error's own code (6 host key > 5 auth >
    4 unreachable > 8 timeout), the same as every other command."""
    errors = [r.error_exit for r in results if r.error_exit]
    if errors:
        rank = {ExitCode.HOST_KEY: 4, ExitCode.AUTH: 3, ExitCode.UNREACHABLE: 2, ExitCode.TIMEOUT: 1}
        return max(errors, key=lambda c: rank.get(c, 0))
    worst = max((ORDER[r.worst] for r in results), default=0)
    return {0: ExitCode.OK, 1: ExitCode.HEALTH_WARN, 2: ExitCode.HEALTH_FAIL}[worst]


# -- probes (command builders, pure) ------------------------------------------

ENDPOINTS = [["/model_info", "/get_model_info"], ["/server_info", "/get_server_info"], ["/v1/models"]]

HTTP_PROBE = r"""
import json, sys, time, urllib.error, urllib.request
base, groups, deep = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "1"
call_s, generate_s = float(sys.argv[4]), float(sys.argv[5])
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
def call(path, data=None, timeout=None):
    timeout = timeout or call_s
    t = time.monotonic()
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with opener.open(req, timeout=timeout) as r:
            return {"path": path, "status": r.status, "ms": round((time.monotonic() - t) * 1000, 1),
                    "body": r.read(65536).decode("utf-8", "replace")}
    except urllib.error.HTTPError as e:
        return {"path": path, "status": e.code, "ms": round((time.monotonic() - t) * 1000, 1), "body": ""}
    except Exception as e:
        return {"path": path, "error": "%s: %s" % (type(e).__name__, e)}
out = {}
for group in groups:
    for path in group:
        out[group[0]] = res = call(path)
        if res.get("status") != 404:
            break
if deep:
    body = json.dumps({"text": "ping", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}).encode()
    out["/generate"] = call("/generate", body, timeout=generate_s)
print(json.dumps(out))
"""


def gpu_process_probe(host: HostSpec) -> str:
    """GPU compute processes, each marked `ours` when its cgroup names our container."""
    return (
        "command -v nvidia-smi >/dev/null || exit 127; "
        f"cid=$({engine_probe.container_id_command(host.container.name, api=True)}); "
        "nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits | "
        "while IFS=', ' read -r pid mem; do [ -n \"$pid\" ] || continue; "
        'if [ -n "$cid" ] && grep -q "$cid" /proc/$pid/cgroup 2>/dev/null; '
        'then echo "$pid $mem ours"; else echo "$pid $mem stray"; fi; done'
    )


def patch_probe(host: HostSpec) -> str:
    """sha256 + marker count of the patched file the container's Python imports.

    Read through the container's root on the host (`/proc/PID/root`, no
    process started) when this user may (root; ~5 ms), at the path deploy
    copied it to (`image_checkout`/target: the build's verify_patch.py proved
    that is the file `sglang` imports); otherwise `docker exec` inside the
    container finds the file the way Python would (~0.1 s: a process in the
    container plus a python3 start)."""
    sha = shell.sha256_of_word('"$f"')
    count = "grep -c '>>> remote-ops' \"$f\""
    try:
        in_image = patchspec.target_path(host.sglang.image_checkout, patchspec.for_host(host))
    except RemoteOpsError:  # no local spec for this host's patch: ask inside the container only
        return _exec_patch_probe(host, sha, count)
    fast = (
        f"pid=$({engine_probe.container_pid_command(host.container.name, api=True)}); f=/proc/$pid/root{shell.quote(in_image)}; "
        f'if [ "${{pid:-0}}" -gt 0 ] 2>/dev/null && [ -r "$f" ]; then {sha} && {count}; else '
    )
    return fast + _exec_patch_probe(host, sha, count) + "; fi"


def _exec_patch_probe(host: HostSpec, sha: str, count: str) -> str:
    """The patch probe inside the container: the target named by the patch spec shipped in the
    image ($REMOTE_OPS_TOOL_DIR/patch-spec.json), located with the image's own python3."""
    locate = (
        "import importlib.util,json,os; s=importlib.util.find_spec('sglang'); "
        "t=json.load(open(os.environ['REMOTE_OPS_TOOL_DIR'] + '/patch-spec.json'))['target']; "
        "print(s.submodule_search_locations[0] + '/' + t.split('sglang/', 1)[1])"
    )
    inner = f"f=$(python3 -c {shell.quote(locate)}) && {sha} && {count}"
    return engine_probe.exec_command(host.container.name, ["sh", "-c", inner])


def dump_probe(host: HostSpec) -> str:
    """File count and bytes of finished dump files (temp files excluded), then free space."""
    d = shell.quote(host.dump.dir)
    return (
        f"if [ -d {d} ]; then find {d} -name '*.safetensors' ! -name '.tmp-*' -printf '%s\\n' "
        "| awk '{n++; s+=$1} END {print n+0, s+0}'; else echo 'absent'; fi; " + facts.existing_parent_df(host.dump.dir)
    )


def http_budget(probe_s: float) -> tuple[float, float]:
    """(seconds per cheap endpoint call, seconds for the --deep generation) within one probe's
    deadline: up to 4 cheap calls run before the generation."""
    call_s = max(0.1, int(min(5.0, probe_s / 5) * 10) / 10)
    return call_s, max(0.1, int((probe_s - 4 * call_s) * 10) / 10)


GENERATE_BODY = json.dumps({"text": "ping", "sampling_params": {"max_new_tokens": 1, "temperature": 0}})

#: The endpoint calls with curl, one `@@http GROUP PATH CURL_EXIT HTTP_CODE SECONDS` line each,
#: then the body (or curl's error), a group's next alias tried only after a 404.  One process
#: per call: the body and curl's `-w` trailer are read from one capture (stderr merged, so a
#: failure's message is the "body"), the body cut at 64 KiB by printf (bodies over 1 MiB are
#: refused by curl itself).
CURL_PROBE = r"""
call() {
  if [ -n "$4" ]; then
    out=$(curl -sS --noproxy '*' -m "$3" --max-filesize 1048576 -w '\n@@end %{http_code} %{time_total}' -H 'Content-Type: application/json' --data-binary "$4" "$BASE$2" 2>&1)
  else
    out=$(curl -sS --noproxy '*' -m "$3" --max-filesize 1048576 -w '\n@@end %{http_code} %{time_total}' "$BASE$2" 2>&1)
  fi
  rc=$?
  case $out in *'@@end '*) w=${out##*@@end }; out=${out%@@end *}; out=${out%?};; *) w='000 0';; esac
  code=${w%% *}
  echo "@@http $1 $2 $rc $w"
  printf '%.65536s\n' "$out"
}
"""


def http_probe(host: HostSpec, deep: bool, probe_s: float = 96.0) -> str:
    """The cheap endpoints (and with `deep` one generation): curl when the host has it (~10 ms),
    else python3's urllib (~50-150 ms of interpreter start); `parse_http` reads either."""
    base = f"http://127.0.0.1:{host.server.port}"
    call_s, generate_s = http_budget(probe_s)
    py = shell.join(
        ["python3", "-c", HTTP_PROBE, base, json.dumps(ENDPOINTS), "1" if deep else "0", str(call_s), str(generate_s)]
    )
    calls = []
    for group in ENDPOINTS:
        tries = [f"call {shell.join([group[0], path, str(call_s)])}" for path in group]
        calls.append('; [ "$code" = 404 ] && '.join(tries))
    if deep:
        calls.append(f"call {shell.join(['/generate', '/generate', str(generate_s), GENERATE_BODY])}")
    curl = f"BASE={shell.quote(base)}; {CURL_PROBE.strip()}\n" + "\n".join(calls)
    return f"if command -v curl >/dev/null 2>&1; then {curl}\nelse {py}; fi"


def parse_http(text: str) -> dict | None:
    """The endpoint results, {group: {path, status, ms, body} or {path, error}}, from either
    probe's output (curl's `@@http` blocks, or python's one JSON line); None if it did not run."""
    if "@@http " not in text:
        try:
            return json.loads(text.strip().splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            return None
    out: dict = {}
    for block in text.split("@@http ")[1:]:
        head, _, body = block.partition("\n")
        fields = head.split()
        if len(fields) < 4:
            continue
        group, path, rc = fields[0], fields[1], fields[2]
        if rc != "0":
            out[group] = {"path": path, "error": f"curl exit {rc}: {body.strip()[:300]}"}
            continue
        code, secs = int(fields[3]), float(fields[4]) if len(fields) > 4 else 0.0
        ok = 200 <= code < 400
        out[group] = {"path": path, "status": code, "ms": round(secs * 1000, 1), "body": body[:-1] if ok else ""}
    return out


def probes(
    host: HostSpec, deep: bool = False, expected_image: str | None = None, probe_s: float = 96.0
) -> list[tuple[str, str]]:
    """Every probe, each bounded by `probe_s` seconds on the host (pure)."""
    return facts.bounded(_probes(host, deep, expected_image, probe_s), probe_s)


def extraction_probe(host: HostSpec) -> str:
    """Exit 0 while the extraction client runs (its recorded PID is alive and is the client)."""
    from ..core import extractplan

    return extractplan.alive_check(extractplan.paths_for(host))


def _probes(host: HostSpec, deep: bool, expected_image: str | None, probe_s: float) -> list[tuple[str, str]]:
    version, objects = engine_probe.probe_sections(host.container.name, expected_image, names=ENGINE_SECTIONS, api=True)
    return [
        version,
        ("gpus", f"command -v nvidia-smi >/dev/null || exit 127; {facts.gpu_query_cmd()}"),
        ("gpu_procs", gpu_process_probe(host)),
        objects,
        ("patch", patch_probe(host)),
        ("http", http_probe(host, deep, probe_s)),
        ("dumps", dump_probe(host)),
        ("extraction", extraction_probe(host)),
    ]


# -- evaluators (pure) ----------------------------------------------------------


def evaluate(
    host: HostSpec,
    sec: dict[str, tuple[int, str]],
    *,
    expected_image: str | None = None,
    last_dumps: dict | None = None,
    now: float | None = None,
) -> list[Check]:
    """All checks after the SSH tier, from captured probe output."""
    snap = engine_probe.parse_probe(sec, names=ENGINE_SECTIONS)
    container, image = snap.container, snap.image
    checks = [check_engine(snap)]
    checks += check_gpus(host, sec.get("gpus", (127, "")), sec.get("gpu_procs", (127, "")))
    checks.append(check_fusion(host, facts.parse_gpus(*sec.get("gpus", (127, "")))[0]))
    if sec.get("container", (1, ""))[0] == 124:  # the probe ran out of time: not "absent"
        checks.append(Check("container", "state", "fail", f"docker inspect: {_last(sec['container'][1])}"))
    else:
        checks += check_container(host, container, image, expected_image)
    checks.append(check_patch(sec.get("patch", (1, "")), container, image))
    checks += check_http(host, sec.get("http", (1, "")), container)
    checks = starting_but_answering(checks)
    checks += check_dumps(host, sec.get("dumps", (1, "")), last_dumps, now or time.time(), extracting=_extracting(sec))
    return checks


def _extracting(sec: dict[str, tuple[int, str]]) -> bool | None:
    """Is the extraction client running?  None when the probe did not say (then growth may warn)."""
    if "extraction" not in sec:
        return None
    return sec["extraction"][0] == 0


def starting_but_answering(checks: list[Check]) -> list[Check]:
    """A running container whose docker health check has not run yet ("starting") is ok when
    every cheap endpoint answers: that is what deploy's wait calls healthy, and docker's first
    check only runs one interval (15 s) after the start (pure)."""
    endpoints = [c for c in checks if c.tier == "sglang"]
    answering = bool(endpoints) and all(c.status == "ok" for c in endpoints)
    return [
        Check(
            c.tier,
            c.name,
            "ok",
            c.reason.replace("health check still starting", "endpoints answer (docker's first health check pending)"),
            c.data,
        )
        if answering and c.tier == "container" and c.name == "state" and c.status == "warn" and "starting" in c.reason
        else c
        for c in checks
    ]


def check_engine(snap: engine_probe.Snapshot) -> Check:
    if snap.version is not None:
        return Check("engine", "docker", "ok", f"docker engine {snap.version.server} (API {snap.version.api})")
    return Check("engine", "docker", "fail", f"docker engine not reachable: {snap.error}")


def check_gpus(host: HostSpec, probe: tuple[int, str], procs: tuple[int, str]) -> list[Check]:
    gpus, err = facts.parse_gpus(*probe)
    want = host.gpus.count
    if err:
        status = "fail" if want else "skip"
        return [Check("gpus", "count", status, f"{err} (inventory expects {want} GPUs)")]
    checks = [
        Check(
            "gpus",
            "count",
            "ok" if len(gpus) == want or not want else "fail",
            f"{len(gpus)} GPUs visible, inventory expects {want}",
        )
    ]
    bad_ecc = [g.index for g in gpus if g.ecc_uncorrected]
    checks.append(
        Check(
            "gpus",
            "ecc",
            "fail" if bad_ecc else "ok",
            f"uncorrected ECC errors on GPU {bad_ecc}" if bad_ecc else "no uncorrected ECC errors",
        )
    )
    hot = [
        f"GPU{g.index} {g.temperature_c}C"
        for g in gpus
        if g.temperature_c is not None and g.temperature_c > host.gpus.max_temperature_c
    ]
    checks.append(
        Check(
            "gpus",
            "temperature",
            "warn" if hot else "ok",
            f"above {host.gpus.max_temperature_c}C: {', '.join(hot)}"
            if hot
            else f"max {max((g.temperature_c or 0) for g in gpus)}C",
        )
    )
    checks.append(check_gpu_processes(procs))
    return checks


FUSION_WINDOW = ((0, 5, 7), (0, 5, 14))  # releases whose capture reads pre-all-reduce partial sums
FUSION_ARCHS = ("9", "10")  # sm90 / sm100: where SGLang auto-enables the fusion


def check_fusion(host: HostSpec, gpus: list) -> Check:
    """Is this host in SGLang's all-reduce-fusion window (0.5.7-0.5.13, TP>1, sm90/sm100)?

    There the 0.5.x capture would read per-rank partial sums (silently wrong aux
    states).  The dumper handles it at run time (SGLANG_HS_DUMP_FUSION) and logs
    what it did; this check tells the operator beforehand, from the host's real
    GPUs, the inventory's TP size and the patched version.
    """
    nums = tuple(int(n) for n in re.findall(r"\d+", host.sglang.version)[:3])
    if not FUSION_WINDOW[0] <= nums < FUSION_WINDOW[1] or host.server.tp <= 1:
        return Check(
            "capture", "allreduce_fusion", "ok", f"not affected (SGLang {host.sglang.version}, tp {host.server.tp})"
        )
    caps = sorted({g.compute_cap for g in gpus if g.compute_cap})
    if not caps:
        return Check("capture", "allreduce_fusion", "skip", "GPU compute capability unknown")
    if any(c.split(".")[0] in FUSION_ARCHS for c in caps):
        return Check(
            "capture",
            "allreduce_fusion",
            "warn",
            f"SGLang {host.sglang.version} auto-enables all-reduce fusion on sm{caps} with tp "
            f"{host.server.tp}: the dumper must disable it (SGLANG_HS_DUMP_FUSION); check its log line",
        )
    return Check(
        "capture",
        "allreduce_fusion",
        "ok",
        f"compute capability {', '.join(caps)}: SGLang does not auto-enable all-reduce fusion here",
    )


def check_gpu_processes(probe: tuple[int, str]) -> Check:
    status, text = probe
    if status != 0:
        return Check("gpus", "processes", "skip", "cannot list GPU processes")
    stray = [line.split() for line in text.splitlines() if line.endswith(" stray")]
    if stray:
        desc = ", ".join(f"pid {p} ({m} MiB)" for p, m, _ in stray)
        return Check("gpus", "processes", "warn", f"processes outside the container hold GPU memory: {desc}")
    return Check("gpus", "processes", "ok", "no stray processes hold GPU memory")


def check_container(
    host: HostSpec, c: ContainerInfo | None, image: ImageInfo | None, expected_image: str | None
) -> list[Check]:
    name = host.container.name
    if c is None:
        return [Check("container", "state", "fail", f"container {name} does not exist")]
    if not c.running:
        run = Check("container", "state", "fail", f"container {name} is {c.status} (exit code {c.exit_code})")
    elif c.health == "unhealthy":
        run = Check("container", "state", "fail", f"container {name} is running but unhealthy")
    elif c.health == "starting":
        run = Check("container", "state", "warn", f"container {name} is running, health check still starting")
    else:
        run = Check("container", "state", "ok", f"container {name} running" + (f", {c.health}" if c.health else ""))
    return [
        run,
        Check("container", "restarts", "warn" if c.restart_count else "ok", f"restart count {c.restart_count}"),
        Check("container", "oom", "fail" if c.oom_killed else "ok", "OOM-killed" if c.oom_killed else "not OOM-killed"),
        check_image(c, image, expected_image),
    ]


def check_image(c: ContainerInfo, image: ImageInfo | None, expected_image: str | None) -> Check:
    """The container runs the image deploy built: same ref, and that ref still points at it."""
    ref = c.image_ref
    if expected_image and ref != expected_image:
        return Check("container", "image", "fail", f"container runs {ref}, deployed image is {expected_image}")
    if image is None:
        return Check("container", "image", "warn", f"image {ref} is no longer present")
    if image.id != c.image_id:
        return Check("container", "image", "warn", f"{ref} was rebuilt since the container started; restart to use it")
    if labels.PATCH_HASH not in image.labels:
        return Check("container", "image", "fail", f"image {ref} was not built by remote-ops (no patch labels)")
    return Check("container", "image", "ok", f"running {ref} ({c.image_id[:19]})")


def check_patch(probe: tuple[int, str], c: ContainerInfo | None, image: ImageInfo | None) -> Check:
    """The container's importable patch target is the verified patched file of its image."""
    status, text = probe
    if c is None or not c.running:
        return Check("patch", "in_container", "skip", "container not running")
    lines = text.strip().splitlines()
    if status != 0 or len(lines) < 2:
        return Check("patch", "in_container", "fail", f"patch markers not found in the container ({_last(text)})")
    sha, markers = lines[0].split()[0], lines[-1].strip()
    want = image.labels.get(labels.SHA_AFTER) if image else None
    if want and sha != want:
        return Check("patch", "in_container", "fail", f"patched file sha {sha[:12]} != image label {want[:12]}")
    return Check("patch", "in_container", "ok", f"{markers} patch blocks present, sha {sha[:12]}", {"sha256": sha})


def _last(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else "no output"


def check_http(host: HostSpec, probe: tuple[int, str], c: ContainerInfo | None) -> list[Check]:
    status, text = probe
    res = parse_http(text) if status == 0 else None
    if res is None:
        return [Check("sglang", "endpoints", "fail", f"HTTP probe did not run: {_last(text)}")]
    checks = [_endpoint_check(res[g[0]], g[0].strip("/").replace("/", "_")) for g in ENDPOINTS if g[0] in res]
    checks.append(_version_check(host, res.get("/server_info", {})))
    if "/generate" in res:
        checks.append(_endpoint_check(res["/generate"], "generate", tier="generation"))
    return checks


def _endpoint_check(r: dict, name: str, tier: str = "sglang") -> Check:
    if "error" in r:
        return Check(tier, name, "fail", f"{r['path']}: {r['error']}")
    ok = 200 <= r.get("status", 0) < 300
    return Check(tier, name, "ok" if ok else "fail", f"{r['path']} -> HTTP {r.get('status')} in {r.get('ms')} ms")


def _version_check(host: HostSpec, r: dict) -> Check:
    try:
        version = json.loads(r.get("body") or "{}").get("version")
    except json.JSONDecodeError:
        version = None
    if version is None:
        return Check("sglang", "version", "fail", "server_info has no version")
    want = host.sglang.version
    return Check(
        "sglang",
        "version",
        "ok" if version == want else "fail",
        f"server reports SGLang {version}" + ("" if version == want else f", patched tree is {want}"),
    )


def check_dumps(
    host: HostSpec, probe: tuple[int, str], last: dict | None, now: float, extracting: bool | None = None
) -> list[Check]:
    status, text = probe
    lines = text.strip().splitlines()
    free = facts.parse_df_free("\n".join(lines[1:]))
    need = host.dump.min_free_gb * 1e9
    disk = Check("dumps", "free_disk", "skip", "cannot read free space")
    if free is not None:
        level = "fail" if free < need else "warn" if free < 2 * need else "ok"
        disk = Check(
            "dumps",
            "free_disk",
            level,
            f"{free / 1e9:,.1f} GB free on {host.dump.dir} (minimum {host.dump.min_free_gb:g} GB)",
            {"free_bytes": free},
        )
    return [_growth(host, lines[0] if lines else "", last, now, extracting), disk]


def _growth(host: HostSpec, first: str, last: dict | None, now: float, extracting: bool | None = None) -> Check:
    """Dumps must grow while an extraction runs; with none running (`extracting` False) a
    standing dump dir is expected.  Unknown (`None`): warn, as before the probe said."""
    parts = first.split()
    if first == "absent" or len(parts) != 2:
        return Check("dumps", "growth", "skip", f"dump dir {host.dump.dir} does not exist yet")
    files, size = int(parts[0]), int(parts[1])
    data = {"files": files, "bytes": size, "time": now}
    if not last:
        return Check("dumps", "growth", "ok", f"{files} files, {size / 1e9:,.2f} GB (baseline recorded)", data)
    grew, dt = size - last["bytes"], now - last["time"]
    if grew > 0:
        return Check(
            "dumps",
            "growth",
            "ok",
            f"+{files - last['files']} files, +{grew / 1e6:,.1f} MB "
            f"in {dt:,.0f}s ({grew / max(dt, 1e-9) / 1e6:,.1f} MB/s)",
            data,
        )
    if extracting is False:
        return Check("dumps", "growth", "ok", f"{files} files, {size / 1e9:,.2f} GB; no extraction running", data)
    return Check(
        "dumps",
        "growth",
        "warn" if files else "ok",
        f"not growing: {files} files, {size / 1e9:,.2f} GB, unchanged for {dt:,.0f}s",
        data,
    )


# -- the edge ----------------------------------------------------------------


def baseline_file(state_dir: Path) -> Path:
    return state_dir / "health-dumps.json"


def load_baseline(state_dir: Path) -> dict | None:
    try:
        return json.loads(baseline_file(state_dir).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def save_baseline(state_dir: Path, checks: list[Check]) -> None:
    growth = next((c for c in checks if c.name == "growth" and c.data), None)
    if growth:
        state_dir.mkdir(parents=True, exist_ok=True)
        baseline_file(state_dir).write_text(json.dumps(growth.data))


def probe_checks(
    remote, host: HostSpec, *, deep: bool = False, expected_image: str | None = None, last_dumps: dict | None = None
) -> list[Check]:
    """One round trip of every probe under the run's command deadline -> checks after the SSH tier.

    Raises the SSH seam's typed error when the host does not answer at all
    (timeout, connection lost); a single hung probe is only its own failure."""
    from ..remote import command_deadline

    probe_s = facts.probe_deadline(command_deadline(remote))
    out = remote.run(shell.parallel_sections(probes(host, deep, expected_image, probe_s)), check=False).stdout
    return evaluate(host, shell.split_sections(out), expected_image=expected_image, last_dumps=last_dumps)


def check_host(
    connect, host: HostSpec, *, deep: bool = False, expected_image: str | None = None, state_dir: Path | None = None
) -> HostHealth:
    """Run every tier for one host.  `connect(host)` returns a Remote or raises.

    Connection failures become the failing SSH check instead of an exception,
    so `--all` reports every host; the error's exit code is kept (`exit_code`).
    """
    from ..errors import RemoteOpsError

    start = time.monotonic()
    try:
        remote = connect(host)
    except RemoteOpsError as exc:
        return HostHealth(
            host.name,
            [Check("ssh", "connect", "fail", exc.message, {"error": exc.kind, "exit_code": exc.exit_code})],
            time.monotonic() - start,
            error_exit=exc.exit_code,
        )
    ssh = Check("ssh", "connect", "ok", f"{remote.target.display}, host key {remote.host_key_fingerprint}")
    before = remote.round_trips
    last = load_baseline(state_dir) if state_dir else None
    try:
        checks = [ssh, *probe_checks(remote, host, deep=deep, expected_image=expected_image, last_dumps=last)]
    except RemoteOpsError as exc:
        return HostHealth(
            host.name,
            [ssh, Check("ssh", "command", "fail", str(exc), {"error": exc.kind, "exit_code": exc.exit_code})],
            time.monotonic() - start,
            error_exit=exc.exit_code,
        )
    if state_dir:
        save_baseline(state_dir, checks)
    return HostHealth(host.name, checks, time.monotonic() - start, remote.round_trips - before)
