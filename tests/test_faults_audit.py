"""Issue 36 (scenarios 1, 7 and 10, and the dump dir rule): the dump audit and the dump-file
listings are bounded by what the host holds.

- Every file the on-host auditor opens is checked first: a FIFO named like a sampled dump, a
  symlink to /dev/zero, a header of 100,000 nested `[`, `data_offsets` of `[-100, 1e15]` each fail
  THAT sample by name; the run goes on to the other samples (exit 10 for the run, never 7).
- The audit's deadline ends the remote process too: its throwaway container is named, bounded by
  `timeout` on the host and by the auditor's own alarm inside, and removed however the run ends.
- `dumps status` and `dumps verify` name such an entry "not a regular file", not missing.
- The configured dump dir may itself be a symlink: it is resolved once on the host and the
  resolved path is used and reported; entries inside it are never followed.
- A dataset without `loss_mask` is a warning of the audit naming `--mask-all`, not a failure.

The hostile files are made on a real lab host (lab1) through the SSH seam; the audit runs in a
throwaway container of the image of lab1's server container (the lab's python3 + numpy image),
and `dockerd.docker('ps', '-a')` is what says no container was left.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import run_cli_process
from test_audit import AUDITOR, local_run

from remote_ops.core import dumpcheck, shell
from remote_ops.core.extractplan import paths_for
from remote_ops.hostlab.images import docker_client
from remote_ops.probes.audit import DumpAudit, evaluate
from remote_ops.probes.dumps import parse_listing

AUDIT_PREFIX = "remote-ops-audit-"


# --------------------------------------------------------------------------- hostile dumps


def _nested_header(path: Path, depth: int = 100_000) -> None:
    """A safetensors file whose header is `depth` nested `[` (json.loads: RecursionError)."""
    head = b"[" * depth
    path.unlink(missing_ok=True)
    path.write_bytes(struct.pack("<Q", len(head)) + head)


def _bad_offsets(path: Path, offsets: list) -> None:
    """The file's own header with hidden_states' data_offsets replaced by `offsets`."""
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    header["hidden_states"]["data_offsets"] = offsets
    new = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + size :])


def _dump_files(dump_dir: Path) -> list[Path]:
    """The dump files in the client manifest's order (the audit's sample positions)."""
    rows = [json.loads(l) for l in (dump_dir / "rank0" / "manifest.jsonl").read_text().splitlines()]
    return [dump_dir / r["file"] for r in rows]


def _audit_local(run: Path, *extra: str, timeout: float = 60) -> tuple[int, dict, float]:
    argv = [sys.executable, str(AUDITOR), "audit", "--dump-dir", str(run / "dumps"), "--model-dir", str(run / "model")]
    argv += ["--workdir", str(run / "extract"), *extra]
    t0 = time.monotonic()
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    doc = json.loads(p.stdout.strip().splitlines()[-1]) if p.stdout.strip() else {"stderr": p.stderr}
    return p.returncode, doc, time.monotonic() - t0


def _shape_problems(doc: dict) -> dict[int, str]:
    return {s["position"]: s["problems"]["shape"] for s in doc["samples"] if "shape" in s["problems"]}


@pytest.mark.parametrize(
    "case, said",
    [
        ("fifo", "not a regular file (a FIFO)"),
        ("devzero", "not a regular file (a symlink"),
        ("nested", "nested too deeply"),
        ("offsets-int", "data_offsets [-100, 1000000000000000]"),
        ("offsets-float", "data_offsets [-100, 1000000000000000.0]: not whole numbers"),
    ],
)
def test_one_hostile_dump_fails_its_own_sample_and_the_others_are_checked(tmp_path, case, said):
    run = local_run(tmp_path, 4)
    victim = _dump_files(run / "dumps")[1]
    if case == "fifo":
        victim.unlink()
        os.mkfifo(victim)
    elif case == "devzero":
        victim.unlink()
        victim.symlink_to("/dev/zero")
    elif case == "nested":
        _nested_header(victim)
    else:
        _bad_offsets(victim, [-100, 10**15] if case == "offsets-int" else [-100, 1e15])
    rc, doc, seconds = _audit_local(run, "--samples", "4", timeout=30)
    assert rc == 0 and doc.get("event") == "audit", doc
    bad = _shape_problems(doc)
    assert list(bad) == [1] and said in bad[1] and victim.name in bad[1], bad
    assert seconds < 20
    assert [s["position"] for s in doc["samples"] if not s["problems"]] == [0, 2, 3]


def test_read_range_never_allocates_more_than_the_file(tmp_path):
    sys.path.insert(0, str(AUDITOR.parent))
    import audit_onhost as a

    path = tmp_path / "f"
    path.write_bytes(b"\0" * 64)
    for offsets, said in (
        ([-100, 10**15], "negative"),
        ([0, 10**15], "past the end"),
        ([8, 4], "ends before it starts"),
        ([0, 1.5], "not whole numbers"),
        ([True, 8], "not whole numbers"),
        ("x", "not two offsets"),
    ):
        with pytest.raises(ValueError, match=said):
            a.read_range(str(path), 8, {"data_offsets": offsets})
    assert a.read_range(str(path), 8, {"data_offsets": [0, 56]}) == b"\0" * 56


def test_a_dataset_without_loss_mask_is_a_warning_naming_mask_all(tmp_path):
    run = local_run(tmp_path, 3)
    ds = tmp_path / "ds.jsonl"
    lines = [json.loads(l) for l in ds.read_text().splitlines()]
    ds.write_text("".join(json.dumps({"id": r["id"], "input_ids": r["input_ids"]}) + "\n" for r in lines))
    rc, doc, _ = _audit_local(run, "--samples", "3")
    assert rc == 0 and all(not s["problems"] for s in doc["samples"]), doc
    assert all("--mask-all" in s["warnings"]["alignment"] for s in doc["samples"])
    check = {c.name: c for c in evaluate(doc, [], [])}["alignment"]
    assert check.status == "warn" and "no loss_mask" in check.reason and "--mask-all" in check.reason
    # the token ids are still joined and checked: a changed id fails alignment
    lines[0]["input_ids"][0] += 1
    ds.write_text("".join(json.dumps({"id": r["id"], "input_ids": r["input_ids"]}) + "\n" for r in lines))
    rc, doc, _ = _audit_local(run, "--samples", "3")
    check = {c.name: c for c in evaluate(doc, [], [])}["alignment"]
    assert check.status == "fail" and "other token ids" in check.reason


# --------------------------------------------------------------------------- the listing (pure)


def _listing(*entries: tuple[str, int, str]) -> str:
    import base64

    raw = b"".join(f"{n}\0{s}\0{t}\0".encode() for n, s, t in entries)
    return base64.b64encode(raw).decode()


def test_the_listing_names_a_fifo_and_a_symlink_not_a_regular_file():
    text = _listing(
        ("rank0/a-p0.safetensors", 10, "f"),
        ("rank0/b-p0.safetensors", 0, "p"),
        ("rank0/c-p0.safetensors", 9, "l"),
        ("rank1", 7, "l"),
    )
    files, unsafe, irregular = parse_listing(text)
    assert files == {"rank0/a-p0.safetensors": 10} and not unsafe
    assert irregular == {"rank0/b-p0.safetensors": "p", "rank0/c-p0.safetensors": "l", "rank1": "l"}
    manifest = "".join(
        json.dumps({"key": k, "file": f"rank{r}/{k}.safetensors", "bytes": 10, "tokens": 1}) + "\n"
        for r, k in ((0, "a-p0"), (0, "b-p0"), (0, "c-p0"), (1, "d-p0"))
    )
    r = dumpcheck.reconcile("/d", files, manifest, irregular=irregular)
    assert r.missing_files == [] and not r.ok
    assert r.not_regular == [
        "rank0/b-p0.safetensors: not a regular file (a FIFO)",
        "rank0/c-p0.safetensors: not a regular file (a symlink: entries of the dump dir are never followed)",
        "rank1: not a regular file (a symlink: entries of the dump dir are never followed)",
        "rank1/d-p0.safetensors: not a regular file (its rank dir rank1 is a symlink, never followed)",
    ]
    assert r.unusable == {"rank0/b-p0.safetensors", "rank0/c-p0.safetensors", "rank1/d-p0.safetensors"}


def test_the_audit_container_is_named_bounded_and_removed_however_it_ends(lab):
    spec = lab.spec("lab1")
    probe = DumpAudit(spec, None, 8, 0, dump_dir="/real/dumps", name=AUDIT_PREFIX + "abc", deadline_s=15)
    cmd = probe.command()
    assert f"--name {AUDIT_PREFIX}abc" in cmd and "/real/dumps:/real/dumps:ro" in cmd
    assert "--deadline 12" in cmd  # the auditor's own alarm, inside the container
    assert "timeout -k 2 14 " in cmd  # the engine client on the host
    assert f"trap 'docker rm -f {AUDIT_PREFIX}abc" in cmd  # removed on the host however the shell ends


# --------------------------------------------------------------------------- on a lab host


def _audit_containers(dockerd) -> list[str]:
    out = dockerd.docker("ps", "-a", "--format", "{{.Names}}").stdout.decode()
    return [n for n in out.split() if n.startswith(AUDIT_PREFIX)]


@pytest.fixture
def audit_host(lab, host, remote, dockerd, base_image, tmp_path):
    """lab1 holding a finished 6-sample run: dumps, model, client manifest, dataset, and a server
    container (created, never started) of the lab's python3 + numpy image.  Returns (spec, files)."""
    spec = lab.spec(host.name)
    dump_dir, model_dir, workdir = Path(spec.dump.dir), Path(spec.model.path), Path(paths_for(spec).workdir)
    for d in (dump_dir, workdir):
        if d.is_symlink():
            d.unlink()
        shutil.rmtree(d, ignore_errors=True)
    run = local_run(tmp_path / "run", 6)
    shutil.copytree(run / "dumps", dump_dir)
    shutil.copytree(run / "extract", workdir)
    model_dir.mkdir(parents=True, exist_ok=True)
    for f in (run / "model").iterdir():
        shutil.copy(f, model_dir / f.name)
    shutil.copy(run / "ds.jsonl", workdir / "dataset.jsonl")
    (workdir / "run.json").write_text(json.dumps({"dataset": str(workdir / "dataset.jsonl"), "dataset_id": "x"}))
    name = spec.container.name
    dockerd.docker("rm", "-f", name, check=False)
    dockerd.docker("create", "--name", name, "--network", "none", "--pull=never", base_image, "python3")
    try:
        yield spec, _dump_files(dump_dir)
    finally:
        for leaked in _audit_containers(dockerd):  # only when a test failed: the fix leaves none
            dockerd.docker("rm", "-f", leaked, check=False)
        for leaked in dockerd.docker("ps", "-aq", "--filter", f"ancestor={base_image}").stdout.decode().split():
            dockerd.docker("rm", "-f", leaked, check=False)  # an unnamed throwaway (the code before the fix)
        dockerd.docker("rm", "-f", name, check=False)
        for d in (dump_dir, workdir):
            if d.is_symlink():
                d.unlink()
            shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(Path(spec.dump.dir + ".real"), ignore_errors=True)


def _make_hostile(remote, files: list[Path]) -> dict[int, str]:
    """On the host: dump 1 a FIFO, dump 2 a symlink to /dev/zero, dump 3 a header of nested `[`."""
    fifo, zero, nested = (str(f) for f in files[1:4])
    remote.run(f"rm -f {shell.quote(fifo)} && mkfifo {shell.quote(fifo)}")
    remote.run(f"rm -f {shell.quote(zero)} && ln -s /dev/zero {shell.quote(zero)}")
    write = "import struct,sys; h=b'['*100000; open(sys.argv[1],'wb').write(struct.pack('<Q',len(h))+h)"
    remote.run(shell.join(["python3", "-c", write, nested]))
    return {1: "not a regular file (a FIFO)", 2: "not a regular file (a symlink", 3: "nested too deeply"}


def _cli(lab_env, *args: str, timeout: float = 90) -> tuple[int, dict, str, float]:
    t0 = time.monotonic()
    p = run_cli_process(lab_env, *args, timeout=timeout)
    doc = json.loads(p.stdout) if p.stdout.strip() else {}
    return p.returncode, doc, p.stderr, time.monotonic() - t0


def test_dumps_audit_of_a_fifo_a_devzero_link_and_a_bad_header_is_exit_10_within_its_deadline(
    lab_env, audit_host, remote, dockerd
):
    """The issue's done-when: exit 10 within --command-timeout, each sample named, no container left."""
    spec, files = audit_host
    said = _make_hostile(remote, files)
    rc, doc, err, seconds = _cli(
        lab_env, "dumps", "audit", "--host", spec.name, "--samples", "6", "--command-timeout", "20", "--json"
    )
    assert rc == 10 and doc.get("error") == "verify_failed", (rc, doc, err[-3000:])
    assert seconds < 20, seconds
    shape = {c["check"]: c for c in doc["checks"]}["shape"]
    named = {s["position"]: s["message"] for s in shape["samples"]}
    assert sorted(named) == [1, 2, 3], named
    for position, words in said.items():
        assert words in named[position] and files[position].name in named[position], named
    assert _audit_containers(dockerd) == []
    assert "Traceback" not in err


def test_dumps_status_and_verify_name_a_fifo_and_a_symlink_not_missing(lab_env, audit_host, remote):
    spec, files = audit_host
    _make_hostile(remote, files)
    rc, doc, err, _ = _cli(lab_env, "dumps", "status", "--host", spec.name, "--json")
    recon = doc["reconciliation"]
    assert rc == 10 and recon["missing_files"] == [], (rc, doc, err)
    assert recon["not_regular"] == [
        f"rank0/{files[1].name}: not a regular file (a FIFO)",
        f"rank0/{files[2].name}: not a regular file (a symlink: entries of the dump dir are never followed)",
    ]
    rc, doc, err, _ = _cli(lab_env, "dumps", "verify", "--host", spec.name, "--json", timeout=60)
    assert rc == 10, (rc, doc, err)
    problems = {p["where"]: p["message"] for p in doc["host_check"]["problems"] if p["level"] == "error"}
    assert problems[f"rank0/{files[1].name}"] == "not a regular file (a FIFO)"
    assert problems[f"rank0/{files[2].name}"].startswith("not a regular file (a symlink")
    assert "missing" not in " ".join(problems.values())


def test_a_symlinked_dump_dir_is_resolved_once_and_its_real_path_reported(lab_env, audit_host, dockerd):
    spec, _ = audit_host
    link, real = Path(spec.dump.dir), Path(spec.dump.dir + ".real")
    link.rename(real)
    link.symlink_to(real)
    rc, doc, err, _ = _cli(lab_env, "dumps", "status", "--host", spec.name, "--json")
    assert rc == 0, (rc, doc, err)
    assert doc["reconciliation"]["dump_dir"] == str(real) and doc["reconciliation"]["configured_dir"] == str(link)
    assert doc["reconciliation"]["files_present"] == 6
    rc, doc, err, _ = _cli(lab_env, "dumps", "audit", "--host", spec.name, "--samples", "6", "--json")
    assert rc == 0 and doc["report"]["dump_dir"] == str(real), (rc, doc.get("message"), err[-2000:])
    assert _audit_containers(dockerd) == []


def _pause_audit_containers(dockerd, stop: threading.Event, paused: list[str]) -> None:
    """Pause every audit container as soon as it starts (the lab dockerd's own event stream)."""
    events = subprocess.Popen(
        [
            docker_client(),
            "events",
            "--filter",
            "type=container",
            "--filter",
            "event=start",
            "--format",
            "{{.Actor.Attributes.name}}",
        ],
        env={**os.environ, "DOCKER_HOST": dockerd.host},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        while not stop.is_set():
            line = events.stdout.readline().strip()
            if line.startswith(AUDIT_PREFIX):
                dockerd.docker("pause", line, check=False)
                paused.append(line)
                return
    finally:
        events.kill()
        events.wait(10)


@pytest.mark.parametrize("how", ["deadline", "sigkill"])
def test_a_frozen_audit_ends_at_its_deadline_and_its_container_is_removed(lab, lab_env, audit_host, dockerd, how):
    """The container frozen (docker pause): the auditor's alarm cannot fire; the host's `timeout`
    and the trap remove it.  Killed with SIGKILL, the laptop runs no cleanup: the host still does.
    The pause follows the container's start event: an audit that ended before the pause took hold
    (exit 0: on an idle machine the 6-sample audit can end within the ~0.1 s a pause takes) did
    not set the scene: it is set again, up to 6 times, then the test says it could not set it."""
    spec, _ = audit_host
    tries = 6
    for attempt in range(tries):
        stop, paused = threading.Event(), []
        watcher = threading.Thread(target=_pause_audit_containers, args=(dockerd, stop, paused), daemon=True)
        watcher.start()
        time.sleep(0.5)  # the event stream is open
        argv = [sys.executable, "-m", "remote_ops", "dumps", "audit", "--host", spec.name, "--command-timeout", "12"]
        t0 = time.monotonic()
        cli = subprocess.Popen(
            [*argv, "--json"], env=lab_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            if how == "sigkill":
                deadline = time.monotonic() + 30
                while not paused and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert paused, "the audit container never started"
                cli.send_signal(signal.SIGKILL)
                cli.wait(10)
            else:
                out, err = cli.communicate(timeout=40)
                if cli.returncode == 0:
                    if attempt == tries - 1:
                        pytest.skip(f"the audit ended before its container could be paused, {tries} times")
                    continue  # the audit was done before it was frozen: no scene (see the docstring)
                assert time.monotonic() - t0 < 16, time.monotonic() - t0
                doc = json.loads(out)
                assert cli.returncode == 8 and doc["error"] == "timeout", (cli.returncode, doc, err[-2000:])
                assert "deadline" in doc["message"] and "removed" in doc["message"], doc
            assert paused and paused[0].startswith(AUDIT_PREFIX)
            deadline = time.monotonic() + 20  # the host's `timeout` (12 - 1 s) then its trap's `rm -f`
            while _audit_containers(dockerd) and time.monotonic() < deadline:
                time.sleep(0.5)
            assert _audit_containers(dockerd) == []
            assert time.monotonic() - t0 < 25
            break
        finally:
            stop.set()
            if cli.poll() is None:
                cli.kill()
                cli.wait(10)
