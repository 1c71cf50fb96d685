"""Dumps of a group merged into one local tree: real CPU-dumper output on 3 lab hosts, duplicates
(the same key on two hosts) detected, reported and pulled once - from the copy that verifies."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from remote_ops.core import dumpcheck
from remote_ops.workflows import dumps

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_dumps_host import _flip, write_real_dumps  # noqa: E402


def test_merge_orders_copies_known_bad_last_and_names_conflicts():
    def recon(recs, missing=()):
        return dumpcheck.Reconciliation("d", records=recs, missing_files=list(missing))

    rec = lambda k, sha="s": {"key": k, "file": f"rank0/{k}.safetensors", "bytes": 10, "sha256": sha}  # noqa: E731
    merged = dumpcheck.merge_hosts(
        {
            "a": recon([rec("k1"), rec("k2")]),
            "b": recon([rec("k1"), rec("k2", "other")]),
            "c": recon([rec("k3")], missing=["rank0/k3.safetensors"]),
        },
        bad={"a": {"rank0/k1.safetensors"}},
    )
    assert [h for h, _ in merged.copies["k1"]] == ["b", "a"]  # a's copy failed its check: b's first
    assert merged.conflicts == ["k2"] and "k3" not in merged.copies  # no file on c: nothing to pull
    items = dumps.merged_items(merged, Path("/x"), {"k1": 1})
    assert [i.remote for i in items["a"]] == ["rank0/k1.safetensors", "rank0/k2.safetensors"]


def _subset(src: Path, dst: Path, keys: list[str]) -> None:
    """A dump dir holding only `keys` of `src` (files + their manifest lines)."""
    (dst / "rank0").mkdir(parents=True)
    lines = [
        l
        for l in (src / "rank0" / "manifest.jsonl").read_text().splitlines()
        if l.strip() and json.loads(l).get("key") in keys
    ]
    (dst / "rank0" / "manifest.jsonl").write_text("".join(l + "\n" for l in lines))
    for key in keys:
        (dst / "rank0" / f"{key}.safetensors").write_bytes((src / "rank0" / f"{key}.safetensors").read_bytes())


def _keys(src: Path) -> list[str]:
    latest, _ = dumpcheck.latest_records((src / "rank0" / "manifest.jsonl").read_text())
    return sorted(latest)


def _place(host, src: Path) -> None:
    subprocess.run(["rm", "-rf", str(host.paths.dump_dir)], check=True, timeout=30)
    subprocess.run(["cp", "-a", str(src), str(host.paths.dump_dir)], check=True, timeout=30)


@pytest.fixture
def spread(lab, host, spare_host, tmp_path):
    """6 real spans; lab1 holds 0-3, lab2 holds 2-5 (2 and 3 twice), lab3 holds 2 spans of its own."""
    write_real_dumps(tmp_path / "a", [5, 7, 3, 9, 4, 6])
    write_real_dumps(tmp_path / "b", [8, 2], seed=1)
    a, b = _keys(tmp_path / "a"), _keys(tmp_path / "b")
    _subset(tmp_path / "a", tmp_path / "h1", a[:4])
    _subset(tmp_path / "a", tmp_path / "h2", a[2:])
    hosts = [lab.host("lab1"), lab.host("lab2"), spare_host]
    for h, src in zip(hosts, [tmp_path / "h1", tmp_path / "h2", tmp_path / "b"]):
        _place(h, src)
    return hosts, a, b


def cli(env, *args):
    p = subprocess.run(
        [sys.executable, "-m", "remote_ops", *args, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        stdin=subprocess.DEVNULL,
    )
    return p.returncode, json.loads(p.stdout) if p.stdout.strip() else None, p.stderr


def test_status_merges_by_key_and_names_duplicates(spread, lab_env):
    _, a, b = spread
    rc, doc, err = cli(lab_env, "dumps", "status", "--host", "lab1,lab2,lab3")
    assert rc == 0, err
    assert doc["merged"]["keys"] == 8 and set(doc["merged"]["duplicates"]) == {a[2], a[3]}
    assert doc["merged"]["duplicates"][a[2]] == ["lab1", "lab2"] and doc["merged"]["conflicts"] == []


def test_pull_makes_one_tree_one_manifest_and_keeps_the_copy_that_verifies(spread, lab_env, tmp_path):
    hosts, a, b = spread
    bad = hosts[0].paths.dump_dir / "rank0" / f"{a[2]}.safetensors"
    _flip(bad, bad.stat().st_size - 200)  # lab1's copy of a[2]: a flipped bit in the data
    rc, doc, err = cli(lab_env, "dumps", "verify", "--host", "lab1,lab2,lab3", "--sha")
    assert rc == 0, err
    assert doc["rescued"] == [a[2]] and doc["broken"] == []
    dest = tmp_path / "merged"
    rc, doc, err = cli(lab_env, "dumps", "pull", "--host", "lab1,lab2,lab3", "--dest", str(dest))
    assert rc == 0, err
    assert doc["kept_from"][a[2]] == "lab2" and doc["kept_from"][a[3]] == "lab1"  # failed on arrival: next copy
    assert doc["no_good_copy"] == [] and set(doc["merged"]["duplicates"]) == {a[2], a[3]}
    manifest = [json.loads(l) for l in (dest / "rank0" / "manifest.jsonl").read_text().splitlines()]
    assert sorted(r["key"] for r in manifest) == sorted(a + b)  # one line per key
    assert {r["host"] for r in manifest if r["key"] in b} == {"lab3"}
    for rec in manifest:
        data = (dest / rec["file"]).read_bytes()
        assert len(data) == rec["bytes"] and hashlib.sha256(data).hexdigest() == rec["sha256"]
    assert not list(dest.rglob("*.part"))
    rc, again, err = cli(lab_env, "dumps", "pull", "--host", "lab1,lab2,lab3", "--dest", str(dest))
    assert rc == 0 and again["bytes"] == 0, err  # re-run: nothing fetched
