"""Engine calls: the Docker SDK over `docker system dial-stdio` vs the docker CLI per call.

Brings up a one-host HostLab (real sshd on 127.x, the lab dockerd), puts the
deploy's objects there (an image tagged with the deploy ref and labelled like
a deploy build, from the lab busybox; a running container with the host's
container name), then, over one strict `FabricRemote` connection, times:

  1. one container inspect: `docker inspect NAME` through `remote.run` (a CLI
     process per call) vs `DockerEngine.container(NAME)`: first call on a new
     engine (channel open + dial process start + /version + the inspect) and
     later calls on the kept-alive channel;
  2. the deploy probe's objects (container + image): `docker inspect NAME REF`
     (one CLI call, as deploy does) vs `engine.objects(NAME, REF)` (two API
     requests), cold and warm;
  3. `container start` of a running container (check, empty plan, verify):
     `container.lifecycle` (two CLI inspects) vs a cold engine (two requests);
  4. whole probes: deploy's batched probe (sequential sections, read-only
     form) and health's parallel probe, as they are; without their docker
     engine sections; and that remainder run concurrently with a cold engine
     answering version + container + image (what a switched no-op deploy or
     health would do; each CLI run is a new connection, so its engine is cold).

The variants are interleaved, rep by rep, so drift from other work on the
machine hits all of them alike; medians and p90 are reported.  Nothing
outside 127.0.0.0/8 is contacted; no image is pulled.

    .venv/bin/python bench/engine_calls.py [--reps 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from remote_ops.engine import labels  # noqa: E402
from remote_ops.engine.docker import DockerEngine  # noqa: E402
from remote_ops.hostlab import HostLab, busybox_image  # noqa: E402
from remote_ops.hostlab.images import docker as lab_docker  # noqa: E402
from remote_ops.probes import batch  # noqa: E402
from remote_ops.probes.engine import EngineObjects, EngineVersion  # noqa: E402
from remote_ops.remote import FabricRemote  # noqa: E402
from remote_ops.workflows import container, deploy, health  # noqa: E402

NAME = "bench"
ENGINE_PROBES = (EngineVersion, EngineObjects)  # the engine's part of deploy's / health's probe


def setup(tmp: Path):
    """Lab host, a labelled image under the deploy ref, a running container under the host's name."""
    lab = HostLab(tmp / "lab", names=[NAME]).start()
    sock = lab.dockerd.socket
    spec = lab.spec(NAME)
    ref = deploy.image_tag(spec, deploy.load_patch(spec))
    dockerfile = (
        f"FROM {busybox_image(sock)}\nLABEL {labels.PATCH_HASH}=bench {labels.SHA_AFTER}=bench "
        f"{labels.CONTEXT_HASH}=bench\n"
    ).encode()
    lab_docker(sock, "build", "--pull=false", "-q", "-t", ref, "-", input=dockerfile)
    lab_docker(
        sock, "run", "-d", "--pull=never", "--init", "--name", spec.container.name, ref, "sh", "-c", "exec sleep 3600"
    )
    return lab, spec, ref


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def cold_engine(remote, fn):
    """A new engine on the existing connection (what each CLI run would have), `fn(engine)`, closed."""
    e = DockerEngine(remote)
    try:
        return fn(e)
    finally:
        e.close()


def variants(remote, spec, ref, warm: DockerEngine) -> dict:
    name = spec.container.name
    deploy_probe = batch.script(deploy.probes_for(spec, ref))  # read-only form (no lock taken)
    deploy_rest = batch.script([p for p in deploy.probes_for(spec, ref) if not isinstance(p, ENGINE_PROBES)])
    health_units = health.probes(spec, expected_image=ref)
    health_probe = batch.script(health_units, parallel=True, probe_s=96.0)
    health_rest = batch.script(
        [p for p in health_units if not isinstance(p, ENGINE_PROBES)], parallel=True, probe_s=96.0
    )
    api_objects = lambda e: (e.version(), e.objects(name, ref))  # noqa: E731

    def split(script: str):
        with ThreadPoolExecutor(2) as pool:
            shell_part = pool.submit(remote.run, script, check=False, timeout=60)
            engine_part = pool.submit(cold_engine, remote, api_objects)
            shell_part.result(), engine_part.result()

    return {
        "ssh round trip: `true` (shell start-up only)": lambda: remote.run("true", timeout=30),
        "API: new channel + /version only": lambda: cold_engine(remote, lambda e: e.version()),
        "inspect: CLI per call (docker inspect NAME)": lambda: remote.run(["docker", "inspect", name], timeout=30),
        "inspect: API, first call on a new engine": lambda: cold_engine(remote, lambda e: e.container(name)),
        "inspect: API, later call (kept-alive channel)": lambda: warm.container(name),
        "probe objects: CLI (docker inspect NAME REF)": lambda: remote.run(
            ["docker", "inspect", name, ref], timeout=30
        ),
        "probe objects: API cold (version + container + image)": lambda: cold_engine(remote, api_objects),
        "probe objects: API warm (container + image)": lambda: warm.objects(name, ref),
        "deploy probe: as now (sections, docker CLI inside)": lambda: remote.run(deploy_probe, check=False, timeout=60),
        "deploy probe: without its docker sections": lambda: remote.run(deploy_rest, check=False, timeout=60),
        "deploy probe: without docker sections || API cold": lambda: split(deploy_rest),
        "container start, no-op (check+verify): CLI, container.lifecycle": lambda: container.lifecycle(
            remote, spec, "start"
        ),
        "container start, no-op (check+verify): API cold": lambda: cold_engine(
            remote, lambda e: (e.container(name), e.container(name))
        ),
        "health probe: as now (parallel, docker CLI inside)": lambda: remote.run(health_probe, check=False, timeout=90),
        "health probe: without its docker sections": lambda: remote.run(health_rest, check=False, timeout=90),
        "health probe: without docker sections || API cold": lambda: split(health_rest),
    }


def measure(remote, spec, ref, reps: int) -> dict:
    warm = DockerEngine(remote)
    warm.version()
    runs = variants(remote, spec, ref, warm)
    for fn in runs.values():  # one untimed warm-up each
        fn()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(reps):
        for label, fn in runs.items():
            times[label].append(timed(fn))
    counts = {
        "channels_opened_by_warm_engine": warm.adapter.channels_opened,
        "requests_on_warm_engine": warm.adapter.requests,
    }
    warm.close()
    return {"times": times, "counts": counts}


def p90(xs: list[float]) -> float:
    return sorted(xs)[max(0, int(round(0.9 * len(xs))) - 1)]


def report(res: dict) -> None:
    times = res["times"]
    anchor = statistics.median(times["inspect: CLI per call (docker inspect NAME)"])
    print("| what | median ms | min ms | p90 ms | median vs CLI inspect |")
    print("|---|---|---|---|---|")
    for label, xs in times.items():
        med = statistics.median(xs)
        print(f"| {label} | {med * 1e3:.1f} | {min(xs) * 1e3:.1f} | {p90(xs) * 1e3:.1f} | {med / anchor:.2f}x |")
    print(json.dumps(res["counts"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ro-bench-engine-") as d:
        lab, spec, ref = setup(Path(d))
        try:
            with FabricRemote(lab.target(NAME)).connect() as remote:
                res = measure(remote, spec, ref, args.reps)
        finally:
            lab.stop()
    report(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
