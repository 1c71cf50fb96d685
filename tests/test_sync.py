"""`dumps sync`: the plan and the grant (pure), the on-host key rewrite, and real syncs between lab
hosts (lab1, lab2 -> lab3): every sample once on the destination, verified, the key gone after."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from remote_ops.core import dumpcheck, shell, syncplan
from remote_ops.dumper import dumpfile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import run_cli  # noqa: E402

H = 64  # the lab inventory's hidden size
SOURCES, DEST = ("lab1", "lab2"), "lab3"


# --------------------------------------------------------------------------- pure


def _rec(key, sha="s", size=10):
    return {"key": key, "file": f"rank0/{key}.safetensors", "bytes": size, "sha256": sha}


def _recon(*recs, missing=()):
    return dumpcheck.Reconciliation("d", records=list(recs), missing_files=list(missing))


def test_plan_moves_each_key_once_names_conflicts_and_skips_what_the_destination_has():
    plan = syncplan.plan(
        {
            "a": _recon(_rec("k1"), _rec("k2"), _rec("k4"), _rec("k6", "x"), missing=()),
            "b": _recon(_rec("k2"), _rec("k3"), _rec("k4", "other"), _rec("k5"), missing=["rank0/k5.safetensors"]),
        },
        "d",
        _recon(_rec("k1"), _rec("k6", "y")),
    )
    assert [r["key"] for r in plan.moves["a"]] == ["k2"]  # k1 on d already; k2 from a only
    assert [r["key"] for r in plan.moves["b"]] == ["k3"]  # k5 has no file on b
    assert plan.present == ["k1"] and plan.duplicates == {"k2": ["a", "b"]}
    conflicts = {c["key"]: [(x["host"], x["sha256"]) for x in c["copies"]] for c in plan.conflicts}
    assert conflicts == {"k4": [("a", "s"), ("b", "other")], "k6": [("d", "y"), ("a", "x")]}
    assert plan.to_dict()["per_source"] == {"a": {"files": 1, "bytes": 10}, "b": {"files": 1, "bytes": 10}}


def test_grant_line_is_restricted_to_a_read_of_the_dump_dir_from_the_destination():
    line = syncplan.grant_line(
        "ssh-ed25519 AAAAC3Nza== remote-ops-sync:lab3:x",
        "/usr/bin/rrsync",
        '/data/my "dumps"/',
        "127.5.6.7",
        "lab3",
        "abc",
        expiry="202612031200Z",
    )
    assert line == (
        'restrict,from="127.5.6.7",command="/usr/bin/rrsync -ro \'/data/my \\"dumps\\"\'",expiry-time="202612031200Z" '
        "ssh-ed25519 AAAAC3Nza== remote-ops-sync:lab3:abc"
    )
    for bad in ("a,b", 'x" y', "127.0.0.1\n"):
        with pytest.raises(ValueError):
            syncplan.grant_line("ssh-ed25519 AAAA", "rrsync", "/d", bad, "lab3", "abc")
    with pytest.raises(ValueError):
        syncplan.grant_line("ssh-ed25519 AAAA", "rrsync", "/d\nssh-rsa AAAA", "127.0.0.1", "lab3", "abc")
    with pytest.raises(ValueError):
        syncplan.mark("lab 3")
    with pytest.raises(ValueError):
        shell.authorized_keys_value("a\\")


def _onhost(*args: str, cwd=None) -> dict:
    script = Path(__file__).resolve().parents[1] / "remote_ops" / "onhost" / "sync_onhost.py"
    out = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, check=True, timeout=30)
    return json.loads(out.stdout.splitlines()[-1])


def test_grant_and_revoke_rewrite_authorized_keys_keeping_other_lines_and_the_mode(tmp_path):
    ak = tmp_path / "ssh" / "authorized_keys"
    ak.parent.mkdir()
    ak.write_text("ssh-ed25519 AAAA operator\nrestrict ssh-ed25519 BBBB remote-ops-sync:lab3:old\n")
    ak.chmod(0o640)
    mark = syncplan.mark("lab3")
    assert (
        _onhost("grant", "--file", str(ak), "--mark", mark, "--line", f"restrict ssh-ed25519 CCCC {mark}new")["removed"]
        == 1
    )
    assert ak.read_text() == f"ssh-ed25519 AAAA operator\nrestrict ssh-ed25519 CCCC {mark}new\n"
    assert ak.stat().st_mode & 0o777 == 0o640
    assert _onhost("revoke", "--file", str(ak), "--mark", mark)["removed"] == 1
    assert ak.read_text() == "ssh-ed25519 AAAA operator\n"
    assert _onhost("revoke", "--file", str(ak), "--mark", mark)["removed"] == 0


# --------------------------------------------------------------------------- the lab


def write_dumps(root: Path, n: int, seed: int, tokens: int = 1000, keys_from: int = 0) -> list[dict]:
    """`n` dump files (seeded stand-in data: random bf16 bytes) through the format's own writer."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        ids = b"".join((keys_from + i * 100_003 + t).to_bytes(4, "little") for t in range(tokens))
        pos = b"".join(t.to_bytes(4, "little") for t in range(tokens))
        records.append(
            dumpfile.write_span(
                str(root), 0, ids, pos, rng.randbytes(tokens * H * 2), rng.randbytes(tokens * 3 * H * 2), H, fsync=False
            )
        )
    return records


def _clear(lab) -> None:
    for name in (*SOURCES, DEST):
        d = lab.host(name).paths.dump_dir
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)


@pytest.fixture
def shards(lab):
    """lab1 and lab2 hold 3 samples each plus one both have (same bytes); lab3 holds 2 of its own
    and one of lab1's.  Returns {key: sha256} of every distinct sample."""
    _clear(lab)
    d = {n: lab.host(n).paths.dump_dir for n in (*SOURCES, DEST)}
    recs = write_dumps(d["lab1"], 3, seed=1, keys_from=0)
    recs += write_dumps(d["lab2"], 3, seed=2, keys_from=10)
    recs += write_dumps(d[DEST], 2, seed=3, keys_from=20)
    shared = write_dumps(d["lab1"], 1, seed=4, keys_from=30)
    write_dumps(d["lab2"], 1, seed=4, keys_from=30)
    write_dumps(d[DEST], 1, seed=1, keys_from=0)  # lab1's first sample, already here
    yield {r["key"]: r["sha256"] for r in recs + shared}
    _clear(lab)


def dest_state(lab) -> tuple[dict[str, str], list[str]]:
    """({key: sha256 of the file}, manifest keys in order) on the destination."""
    root = lab.host(DEST).paths.dump_dir / "rank0"
    files = {
        p.name[: -len(".safetensors")]: hashlib.sha256(p.read_bytes()).hexdigest() for p in root.glob("*.safetensors")
    }
    keys = [json.loads(l)["key"] for l in (root / "manifest.jsonl").read_text().splitlines() if l.strip()]
    return files, keys


def grants_left(lab) -> list[str]:
    """Transfer-key lines left in every source's authorized_keys."""
    return [
        f"{n}: {line}"
        for n in SOURCES
        for line in (lab.host(n).sshd.dir / "authorized_keys").read_text().splitlines()
        if syncplan.MARK in line
    ]


def sync(lab_env, *extra: str, timeout: float = 120) -> tuple[int, dict, str]:
    code, out, err = run_cli(
        lab_env, "dumps", "sync", "--from", ",".join(SOURCES), "--to", DEST, "--json", *extra, timeout=timeout
    )
    try:
        doc = json.loads(out) if out.strip() else {}
    except ValueError:
        doc = {}
    return code, doc, err


def assert_complete(lab, expected: dict[str, str]) -> None:
    files, keys = dest_state(lab)
    assert files == expected
    assert sorted(keys) == sorted(set(keys)) == sorted(expected)  # every sample once in the manifest


def test_sync_moves_every_sample_once_verified_and_a_second_run_moves_nothing(lab, lab_env, shards):
    code, doc, err = sync(lab_env, "--dry-run")
    assert code == 0, err
    assert doc["plan"]["files"] == 6 and doc["plan"]["already_on_dest"] == 3 and not doc["plan"]["conflicts"]
    assert not (lab.host(DEST).paths.dump_dir / "rank0" / "manifest.jsonl").read_text().count("host")

    code, doc, err = sync(lab_env)
    assert code == 0, err
    assert doc["moved"] == 6 and not doc["failed"]
    assert_complete(lab, shards)
    manifest = [
        json.loads(l) for l in (lab.host(DEST).paths.dump_dir / "rank0" / "manifest.jsonl").read_text().splitlines()
    ]
    assert {r["host"] for r in manifest if "host" in r} == set(SOURCES)
    assert not grants_left(lab)
    assert {g["file"] for g in doc["grants"].values()} == {
        str(lab.host(n).sshd.dir / "authorized_keys") for n in SOURCES
    }
    audit = [json.loads(l) for l in lab.host("lab1").paths.audit_log.read_text().splitlines()]
    assert [a["action"] for a in audit if a.get("sync_id") == doc["sync_id"]] == ["sync-grant", "sync-revoke"]

    code, doc2, err = sync(lab_env)
    assert code == 0, err
    assert doc2["moved"] == 0 and doc2["plan"]["files"] == 0
    assert_complete(lab, shards)
    code, out, err = run_cli(lab_env, "dumps", "verify", "--host", DEST, "--sha", "--json")
    assert code == 0, err
