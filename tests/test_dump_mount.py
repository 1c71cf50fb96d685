"""A stale mount of the dump dir (pure): the server container still mounts a dump dir that was
removed and made again since it started, so its dumps go into the deleted directory.

The dump dir's `device:inode` and birth time as the probe reads them, the container's
`dump-dir.id` label (recorded at create time, never in the run-config hash), `mount_of`'s
verdict, `health`'s `dumps/mount`, and deploy's plan (SGLang and vLLM) recreating such a
container while a re-run with nothing changed stays a no-op.  The same on a real lab host:
tests/test_health_deployed.py.
"""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import datetime, timezone
from types import SimpleNamespace

import pytest
import test_deploy_plan as sglang_plan
import test_health as health_cases
import test_vllm_deploy as vllm_plan

from remote_ops.core.shell import SECTION
from remote_ops.engine import labels
from remote_ops.engine.spec import for_host
from remote_ops.engine.types import ContainerInfo
from remote_ops.errors import ExitCode, Refused, StaleMount
from remote_ops.probes import dumpdir
from remote_ops.serving import vllm as serving_vllm
from remote_ops.workflows import container, extract, health
from remote_ops.workflows.deploy import vllm as vdeploy

BORN = 1_796_000_000  # the dump dir's birth, unix seconds
OLD, NEW = "64768:1001", "64768:2002"


def state(identity=NEW, born=BORN, path="/data/d", gone=False):
    """The dump dir `path` as the probe reads it (`gone`: it does not exist)."""
    if gone:
        return dumpdir.DumpDir(path)
    return dumpdir.DumpDir(path, path, True, True, identity, born)


def started(offset_s: float) -> str:
    """The container's StartedAt, `offset_s` after the dump dir's birth."""
    return datetime.fromtimestamp(BORN + offset_s, timezone.utc).isoformat().replace("+00:00", "Z")


def ctr(recorded=OLD, at=0.5, running=True):
    tags = {labels.DUMP_DIR_ID: recorded} if recorded else {}
    status = "running" if running else "exited"
    return ContainerInfo("c1", "srv", "sha256:i", "img:t", status, None, started_at=started(at), labels=tags)


def test_the_probe_reads_the_dirs_identity_and_birth_and_tolerates_a_stat_without_them():
    text = "dir=1\nwritable=1\nid=64768:2002 born=1796000000\nresolved=/data/d\n"
    assert dumpdir.parse_state("/data/d", text) == state()
    no_birth = dumpdir.parse_state("/data/d", "dir=1\nwritable=1\nid=64768:2002 born=0\nresolved=/data/d\n")
    assert no_birth.identity == NEW and no_birth.born is None  # 0: the filesystem gives none
    odd = dumpdir.parse_state("/data/d", "dir=1\nwritable=1\nid=? born=-\nresolved=/data/d\n")
    assert odd.identity is None and odd.born is None and odd.problem() is None
    assert dumpdir.parse_state("/data/d", "dir=1\nwritable=1\nresolved=/data/d\n").identity is None  # older form
    command = dumpdir.DumpDirState("/data/my dumps").command()
    assert "realpath -e -- '/data/my dumps'" in command and "stat -c 'id=%d:%i born=%W' -- \"$r\"" in command


def test_the_label_is_no_run_setting():
    """Recorded at create time, left out of the run-config hash: a container from before it keeps
    its run config (no restart on upgrade), and a new dir identity alone is not "run settings"."""
    h = sglang_plan.host()
    plain, labelled = for_host(h, "img:t"), for_host(h, "img:t", NEW)
    assert labels.DUMP_DIR_ID not in plain.labels and labelled.labels[labels.DUMP_DIR_ID] == NEW
    assert plain.labels[labels.RUN_CONFIG] == labelled.labels[labels.RUN_CONFIG]
    assert plain.config_hash() == labelled.config_hash()
    assert f"{labels.DUMP_DIR_ID}={NEW}" in container.run_argv(h, "img:t", NEW)
    v = vllm_plan.host()
    assert serving_vllm.run_spec(v, "img:t", NEW).labels[labels.DUMP_DIR_ID] == NEW
    assert container.expected_run_config(v, "img:t") == serving_vllm.run_spec(v, "img:t", NEW).labels[labels.RUN_CONFIG]


def test_mount_of_judges_the_recorded_identity_and_the_start_against_the_birth():
    m = dumpdir.mount_of
    assert m(state(), ctr(recorded=NEW)) == dumpdir.FRESH
    assert m(state(), ctr(recorded=OLD, at=0.5)) == dumpdir.REPLACED  # made again in the second it started
    assert m(state(), ctr(recorded=OLD, at=-30)) == dumpdir.REPLACED
    assert m(state(), ctr(recorded=OLD, at=5)) == dumpdir.FRESH  # restarted since: it mounts the new dir
    assert m(state(born=None), ctr(recorded=OLD, at=5)) == dumpdir.REPLACED  # no birth time: the label speaks
    # a container from before the label: only the birth time can tell
    assert m(state(), ctr(recorded=None, at=-30)) == dumpdir.REPLACED
    assert m(state(), ctr(recorded=None, at=5)) == dumpdir.FRESH
    assert m(state(born=None), ctr(recorded=None)) is None
    assert m(state(), ctr(recorded=None, at=0.5)) is None  # the engine made the dir as it started
    # gone: stale only where the identity was recorded (the SSH user could read the dir then)
    assert m(state(gone=True), ctr()) == dumpdir.MISSING
    assert m(state(gone=True), ctr(recorded=None)) is None
    assert m(state(identity=None), ctr()) is None  # stat gave nothing: unknown
    assert m(state(), ctr(running=False)) is None and m(state(), None) is None  # a start mounts it anew


def dump_dir_section(text="dir=1\nwritable=1\nid=64768:2002 born=1796000000\nresolved=/data/d\n"):
    return {"dump_dir": (0, text)}


def inspected(recorded, at):
    doc = health_cases.container()
    doc["Config"]["Labels"] = {labels.DUMP_DIR_ID: recorded}
    doc["State"]["StartedAt"] = started(at)
    return doc


def test_health_fails_dumps_mount_on_a_stale_mount_naming_the_remedy():
    s = health_cases.sections(inspected(OLD, 0.5), health_cases.image())
    checks = health_cases.by_name(health.evaluate(health_cases.HOST, {**s, **dump_dir_section()}))
    mount = checks["dumps/mount"]
    assert mount.status == "fail" and mount.data["cause"] == dumpdir.REPLACED
    assert "removed and made again" in mount.reason and "`remote-ops deploy` recreates the container" in mount.reason
    assert OLD in mount.reason and NEW in mount.reason
    assert health.exit_code([health.HostHealth("h", list(checks.values()))]) == health.ExitCode.HEALTH_FAIL
    s = health_cases.sections(inspected(NEW, 0.5), health_cases.image())
    checks = health_cases.by_name(health.evaluate(health_cases.HOST, {**s, **dump_dir_section()}))
    assert checks["dumps/mount"].status == "ok"
    assert not [c for c in checks.values() if c.status == "fail"]


def test_health_leaves_a_gone_dump_dir_to_dumps_dir_and_an_unknown_mount_unjudged():
    s = health_cases.sections(inspected(OLD, 0.5), health_cases.image())
    gone = health_cases.by_name(health.evaluate(health_cases.HOST, {**s, **dump_dir_section("dir=0\nresolved=\n")}))
    assert "dumps/mount" not in gone and gone["dumps/dir"].status == "fail"
    s = health_cases.sections(health_cases.container(), health_cases.image())  # no label, no start time
    assert "dumps/mount" not in health_cases.by_name(health.evaluate(health_cases.HOST, {**s, **dump_dir_section()}))


def with_mount(p, recorded, at=0.5, dump_dir=None):
    """The probe `p` with its container started `at` s after the dump dir's birth and recording
    `recorded` (None: no label), and the dump dir read as `dump_dir`."""
    c = p.container
    tags = {k: v for k, v in c.labels.items() if k != labels.DUMP_DIR_ID}
    tags.update({labels.DUMP_DIR_ID: recorded} if recorded else {})
    p.container = replace(c, started_at=started(at), labels=tags)
    p.dump_dir = dump_dir or state()
    return p


def test_deploy_recreates_a_container_with_a_stale_mount_and_a_re_run_is_a_no_op():
    h = sglang_plan.host()
    p, patch, ref = sglang_plan.probe(h)
    stale = sglang_plan.deploy.make_plan(h, patch, with_mount(p, OLD), ref)
    assert stale.start and stale.wait and not stale.build and not stale.patch
    assert (
        stale.reasons["start"]
        == "stale mount: dump dir /data/d was removed and made again after container sglang-eagle3 started"
    )
    p, patch, ref = sglang_plan.probe(h)
    assert sglang_plan.deploy.make_plan(h, patch, with_mount(p, NEW), ref).up_to_date
    p, patch, ref = sglang_plan.probe(h)  # no answer from the dump dir probe: not judged
    assert sglang_plan.deploy.make_plan(h, patch, p, ref).up_to_date


def test_deploy_after_a_first_deploy_that_made_the_dump_dir_is_a_no_op():
    """First deploy: no dump dir; the start makes it and records it (or, where the SSH user may
    not, the engine makes it as the container starts and nothing is recorded).  The next deploy
    reads the same dir: nothing to do either way."""
    h = sglang_plan.host()
    for recorded in (NEW, None):
        p, patch, ref = sglang_plan.probe(h)
        assert sglang_plan.deploy.make_plan(h, patch, with_mount(p, recorded, at=0.2), ref).up_to_date


def test_deploy_recreates_when_the_recorded_dump_dir_is_gone():
    h = sglang_plan.host()
    p, patch, ref = sglang_plan.probe(h)
    gone = state(gone=True)
    plan = sglang_plan.deploy.make_plan(h, patch, with_mount(p, OLD, dump_dir=gone), ref)
    assert (
        plan.start
        and plan.reasons["start"] == "stale mount: dump dir /data/d is gone since container sglang-eagle3 was created"
    )


def test_vllm_deploy_recreates_a_container_with_a_stale_mount_and_its_dry_run_shows_the_label():
    h = vllm_plan.host()
    p, ref = vllm_plan.probe(h)
    plan = vdeploy.make_plan(h, with_mount(p, OLD, dump_dir=state(path="/data/dumps")), ref)
    assert plan.start and not plan.build and plan.reasons["start"].startswith("stale mount: dump dir /data/dumps")
    run = vdeploy.diffs(h, plan, ref, NEW)[f"{h.engine} run"]
    assert f"{labels.DUMP_DIR_ID}={NEW}" in run
    p, ref = vllm_plan.probe(h)
    assert vdeploy.make_plan(h, with_mount(p, NEW, dump_dir=state(path="/data/dumps")), ref).up_to_date


def test_deploy_asks_the_dump_dir_in_its_one_probe():
    h = sglang_plan.host()
    asked = [type(x).__name__ for x in sglang_plan.deploy.probes_for(h, "img:t")]
    assert "DumpDirState" in asked
    sec = {"dump_dir": (0, "dir=1\nwritable=1\nid=64768:2002 born=1796000000\nresolved=/data/d\n"), "lock": (0, "")}
    assert sglang_plan.deploy.parse_probe(h, sec).dump_dir.identity == NEW
    assert sglang_plan.deploy.parse_probe(h, {"lock": (0, "")}).dump_dir is None  # did not answer


# --------------------------------------------------------------------------- extract start: the refusal


def test_extract_start_refuses_a_stale_mount_naming_the_host_both_identities_and_the_remedy():
    err = extract.stale_mount_error("gpu-node", state(), ctr(recorded=OLD, at=0.5))
    assert isinstance(err, StaleMount) and err.exit_code == ExitCode.REFUSED == 9 and err.kind == "stale_mount"
    assert err.host == "gpu-node" and str(err).startswith("gpu-node: preflight: dump dir /data/d was removed")
    assert OLD in err.message and NEW in err.message and err.message.endswith("; nothing started")
    assert err.hint and "`remote-ops deploy --host gpu-node` recreates the container" in err.hint
    doc = err.to_dict()
    assert doc["error"] == "stale_mount" and doc["exit_code"] == 9 and doc["host"] == "gpu-node"
    assert (doc["reason"], doc["dump_dir"], doc["container"], doc["recorded"], doc["now"]) == (
        dumpdir.REPLACED,
        "/data/d",
        "srv",
        OLD,
        NEW,
    )
    # health says the same sentence (one rule, one wording)
    assert dumpdir.replaced_mount(state(), ctr(recorded=OLD)) in dumpdir.check_dump_mount(state(), ctr()).reason
    # no label: judged by the start against the dir's birth, "not recorded" named
    assert (
        "device:inode not recorded, now" in extract.stale_mount_error("h", state(), ctr(recorded=None, at=-30)).message
    )


def test_extract_start_goes_on_when_the_mount_is_current_gone_or_cannot_be_told():
    fresh = extract.stale_mount_error
    assert fresh("h", state(), ctr(recorded=NEW)) is None
    assert fresh("h", state(), ctr(recorded=OLD, at=5)) is None  # restarted since the dir was made again
    assert fresh("h", state(gone=True), ctr()) is None  # gone: the dump dir check refuses that (dump_dir_missing)
    assert fresh("h", state(identity=None), ctr()) is None and fresh("h", state(born=None), ctr(recorded=None)) is None
    assert fresh("h", state(), None) is None and fresh("h", state(), ctr(running=False)) is None


def test_a_group_start_is_refused_once_naming_every_stale_host():
    errors = [extract.stale_mount_error(n, state(), ctr()) for n in ("gpu-01", "gpu-03")]
    one = extract.group_stale_mount(errors[:1])
    assert one.host == "gpu-01" and one.message.endswith("nothing started on any host of the group")
    both = extract.group_stale_mount(errors)
    assert both.host == "gpu-01" and both.exit_code == 9 and "(also stale on gpu-03)" in both.message
    assert both.details["hosts"] == ["gpu-01", "gpu-03"] and both.details["recorded"] == OLD
    assert "deploy --host gpu-01,gpu-03" in (both.hint or "") and "'GROUP,!gpu-01,!gpu-03'" in (both.hint or "")


class Answering:
    """A remote that answers every command with the same framed sections; it counts round trips."""

    name = "gpu-node"

    def __init__(self, sections: dict[str, tuple[int, str]]) -> None:
        self.sections, self.commands = sections, []

    def run(self, command, check=False, timeout=None, **_kw):
        self.commands.append(command if isinstance(command, str) else " ".join(command))
        out = "".join(f"{SECTION}{n}:begin\n{text}\n{SECTION}{n}:end {rc}\n" for n, (rc, text) in self.sections.items())
        return SimpleNamespace(stdout=out, stderr="", exit_status=0, command=command)

    def put(self, data, path, mode=0o644):
        pass


def answers(recorded, at):
    return {
        "python3": (0, "3.11.2"),
        "extraction": (1, ""),
        "keys": (0, ""),
        **dump_dir_section(),
        "container": (0, json.dumps([inspected(recorded, at)])),
    }


def test_extract_preflight_judges_the_mount_in_its_one_round_trip():
    remote = Answering(answers(OLD, 0.5))
    with pytest.raises(StaleMount) as stale:
        extract._preflight(remote, health_cases.HOST)
    assert len(remote.commands) == 1 and "stat -c" in remote.commands[0] and "inspect" in remote.commands[0]
    assert stale.value.details["recorded"] == OLD and stale.value.details["now"] == NEW
    p, _sec, running = extract._preflight(Answering(answers(NEW, 0.5)), health_cases.HOST)
    assert p.dump_dir == "/data/d" and not running
    gone = Answering({**answers(OLD, 0.5), **dump_dir_section("dir=0\nwritable=0\nresolved=\n")})
    with pytest.raises(Refused) as missing:  # a gone dump dir is refused as before (not a stale mount)
        extract._preflight(gone, health_cases.HOST)
    assert not isinstance(missing.value, StaleMount) and missing.value.details["reason"] == dumpdir.MISSING


def test_a_group_start_reads_the_mount_with_the_done_keys():
    remote = Answering(answers(OLD, 0.5))
    with pytest.raises(StaleMount):
        extract.probe_group_host(remote, health_cases.HOST)
    batch = [c for c in remote.commands if "stat -c" in c]
    assert len(batch) == 1 and "inspect" in batch[0] and "done-keys" in batch[0]  # the done keys' round trip
    assert extract.probe_group_host(Answering(answers(NEW, 0.5)), health_cases.HOST) == (False, set())
