"""Compact finished dump files ON THE HOST: `<key>.safetensors` -> `<key>.hsz` (lossless, FORMAT.md).

Shipped on stdin with the packed-dump codec before it (`remote_ops.onhost.bundled`), run by the
host's own python3 (stdlib only), under `nice` and the command's deadline:

    python3 - compact DUMP_DIR [--jobs N] [--limit N] [--dry-run] [--no-fsync]

A file is finished when the LAST manifest line of its key names it (the dumper and the vLLM
extraction client append that line only after the file's fsync and rename; the readers use the
same rule) and its size and sha256 are the line's.  Nothing else is touched: `.tmp-*` files
being written, files not (yet) in the manifest, files a newer line has replaced.

Per file (steps in this order, each durable before the next):
 1. pack to `.tmp-compact-<key>.<pid>` (the source's sha256 computed while it is read: it must
    be the manifest's), fsync;
 2. decode that temp file from disk: its sha256 must be the source's (bit-exact);
 3. the source must still be the file that was read (same inode, size, mtime): else it was
    rewritten meanwhile and the temp file is dropped;
 4. rename the temp file to `<key>.hsz`, fsync the dir;
 5. append the key's new manifest line (the packed file, its sha256, `packed.source_sha256`),
    fsync the manifest;
 6. remove `<key>.safetensors` (same-file check again), fsync the dir.
A kill at any moment leaves the key readable through its last manifest line: before 5 the
original (an `.hsz` not yet listed is redone), after 5 the packed file (an original left beside
it is removed by the next run when it is byte for byte the packed file's source).  One run per
rank dir at a time (`flock` on `rank<R>/.compact.lock`); a run removes the temp files of killed
runs.  Packing runs in `--jobs` worker processes; the renames and manifest lines are made by the
main process only.  The last stdout line is the JSON report (lists capped at `LIST_CAP`).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import multiprocessing
import os
import stat
import sys
import time
from concurrent.futures import ProcessPoolExecutor

SUFFIX = ".safetensors"
PACKED_SUFFIX = ".hsz"
MANIFEST = "manifest.jsonl"
TMP_PREFIX = ".tmp-compact-"
LOCK_NAME = ".compact.lock"
LIST_CAP = 50
CHUNK = 16 << 20
CRASH_POINTS = ("packed", "renamed", "appended", "removed")


packed = sys.modules.get("rops_packed")  # the packed-dump codec, bundled before this program (onhost.with_codec)


def fsync_dir(path):
    """fsync a directory so a rename inside it survives a crash (best effort on odd filesystems)."""
    fd = os.open(path, os.O_RDONLY)
    with contextlib.suppress(OSError):
        os.fsync(fd)
    os.close(fd)


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def latest(manifest_path):
    """key -> last manifest record (a torn or garbled line is passed over, as every reader does)."""
    out = {}
    if not os.path.isfile(manifest_path):
        return out
    with open(manifest_path, "rb") as fh:
        for raw in fh:
            if not raw.endswith(b"\n"):
                continue
            try:
                rec = json.loads(raw.decode("utf-8"))
            except ValueError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("key"), str) and isinstance(rec.get("file"), str):
                out[rec["key"]] = rec
    return out


def append_line(manifest_path, rec, fsync=True):
    """One JSON line in one write to the manifest (opened O_APPEND, unbuffered)."""
    with open(manifest_path, "ab", buffering=0) as f:
        f.write((json.dumps(rec, sort_keys=True, separators=(",", ":")) + "\n").encode("utf-8"))
        if fsync:
            os.fsync(f.fileno())


def identity(path):
    """(inode, size, mtime_ns) of a regular file, None when it is absent or not regular."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns) if stat.S_ISREG(st.st_mode) else None


def crash(point, args):
    """Test hook (`--crash-at`): the process ends as a `kill -9` would end it."""
    if args.crash_at == point:
        os.kill(os.getpid(), 9)


# --------------------------------------------------------------------------- one file (a worker)


def pack_one(job):
    """Steps 1-2 in a worker: (key, temp path, pack info, None) or (key, None, None, why)."""
    key, src, tmp, want_sha, block_bytes, fsync = job
    try:
        before = identity(src)
        info = packed.pack_file(src, tmp, block_bytes=block_bytes, fsync=fsync)
        if info["source_sha256"] != want_sha:
            os.unlink(tmp)
            return key, None, None, "sha256 differs from the manifest line (rewritten or corrupt): left as it is"
        got, n = packed.decoded_sha256(tmp)
        if got != want_sha or n != info["source_bytes"]:
            os.unlink(tmp)
            return key, None, None, "the packed file did not decode to the original: left as it is"
        info["identity"] = before
        return key, tmp, info, None
    except (OSError, ValueError) as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        return key, None, None, "%s: %s" % (type(exc).__name__, exc)


# --------------------------------------------------------------------------- one rank dir


class Rank:
    def __init__(self, root, name, args, report):
        self.root, self.name, self.args, self.report = root, name, args, report
        self.dir = os.path.join(root, name)
        self.manifest = os.path.join(self.dir, MANIFEST)

    def note(self, kind, key, why):
        self.report["counts"][kind] = self.report["counts"].get(kind, 0) + 1
        if len(self.report[kind]) < LIST_CAP:
            self.report[kind].append({"file": "%s/%s" % (self.name, key), "why": why})

    def tidy(self):
        """Temp files of killed runs go (the lock is held: no run of ours writes them now)."""
        for entry in os.listdir(self.dir):
            if entry.startswith(TMP_PREFIX):
                if not self.args.dry_run:
                    os.unlink(os.path.join(self.dir, entry))
                self.report["counts"]["temp_removed"] += 1

    def todo(self):
        """The finished plain files to pack, and the originals left beside their packed file."""
        jobs, leftovers = [], []
        for key, rec in sorted(latest(self.manifest).items()):
            base = os.path.basename(rec["file"])
            if rec["file"] != "%s/%s" % (self.name, base) or packed.key_of_name(base) != key:
                continue  # a line naming a file elsewhere: not this pass's to touch
            if base.endswith(PACKED_SUFFIX):
                orig = os.path.join(self.dir, key + SUFFIX)
                if identity(orig) is not None:
                    leftovers.append((key, rec, orig))
                continue
            if not base.endswith(SUFFIX):
                continue
            path = os.path.join(self.dir, base)
            ident = identity(path)
            if ident is None or ident[1] != rec.get("bytes"):
                self.note("skipped", key, "not a regular file of the manifest's size")
                continue
            jobs.append((key, rec, path, ident))
        return jobs, leftovers

    def finish_leftover(self, key, rec, orig):
        """Step 6 of a killed run: remove the original when it is the packed file's source."""
        info = rec.get("packed") or {}
        ident = identity(orig)
        if ident is None or ident[1] != info.get("source_bytes") or sha256_of(orig) != info.get("source_sha256"):
            self.note("skipped", key, "a file beside the packed one that is not its source (a newer write?)")
            return
        if self.args.dry_run:
            self.report["counts"]["leftovers_removed"] += 1
            return
        if identity(orig) == ident:
            os.unlink(orig)
            fsync_dir(self.dir)
            self.report["counts"]["leftovers_removed"] += 1

    def commit(self, key, rec, src, tmp, info):
        """Steps 3-6 (main process only)."""
        args = self.args
        crash("packed", args)
        if identity(src) != info["identity"]:
            os.unlink(tmp)
            return self.note("skipped", key, "rewritten while it was packed: left as it is")
        dest = os.path.join(self.dir, key + PACKED_SUFFIX)
        os.replace(tmp, dest)
        if args.fsync:
            fsync_dir(self.dir)
        crash("renamed", args)
        line = dict(rec)
        line.update(
            {
                "file": "%s/%s" % (self.name, key + PACKED_SUFFIX),
                "bytes": info["packed_bytes"],
                "sha256": info["packed_sha256"],
                "packed": {
                    "format": packed.FORMAT,
                    "version": packed.VERSION,
                    "source_bytes": info["source_bytes"],
                    "source_sha256": info["source_sha256"],
                },
                "time": round(time.time(), 3),
            }
        )
        if identity(src) != info["identity"]:
            os.unlink(dest)
            return self.note("skipped", key, "rewritten while it was packed: left as it is")
        append_line(self.manifest, line, args.fsync)
        crash("appended", args)
        if identity(src) == info["identity"]:
            os.unlink(src)
            if args.fsync:
                fsync_dir(self.dir)
        crash("removed", args)
        c = self.report["counts"]
        c["compacted"] += 1
        self.report["bytes_before"] += info["source_bytes"]
        self.report["bytes_after"] += info["packed_bytes"]

    def run(self, pool, budget):
        lock = os.open(os.path.join(self.dir, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                self.note("failed", "*", "another compaction holds this rank dir's lock")
                return budget
            self.tidy()
            jobs, leftovers = self.todo()
            for key, rec, orig in leftovers:
                self.finish_leftover(key, rec, orig)
            if budget is not None:
                jobs = jobs[: max(0, budget)]
                budget -= len(jobs)
            if self.args.dry_run:
                c = self.report["counts"]
                c["would_compact"] = c.get("would_compact", 0) + len(jobs)
                self.report["bytes_before"] += sum(j[1]["bytes"] for j in jobs)
                return budget
            work = [
                (key, path, os.path.join(self.dir, "%s%s.%d" % (TMP_PREFIX, key, os.getpid())), rec["sha256"])
                for key, rec, path, _ident in jobs
            ]
            recs = {key: (rec, path) for key, rec, path, _ident in jobs}
            args = self.args
            results = (
                pool.map(pack_one, [w + (args.block_bytes, args.fsync) for w in work], chunksize=1)
                if pool is not None
                else map(pack_one, [w + (args.block_bytes, args.fsync) for w in work])
            )
            for key, tmp, info, why in results:
                rec, path = recs[key]
                if tmp is None:
                    self.note(
                        "failed" if why.startswith(("OSError", "ValueError", "PackError")) else "skipped", key, why
                    )
                    continue
                self.commit(key, rec, path, tmp, info)
                emit({"event": "progress", "compacted": self.report["counts"]["compacted"], "total": len(work)})
        finally:
            os.close(lock)
        return budget


def emit(doc):
    sys.stdout.write(json.dumps(doc, sort_keys=True) + "\n")
    sys.stdout.flush()


def rank_dirs(root):
    return sorted(
        (
            n
            for n in os.listdir(root)
            if n.startswith("rank")
            and n[4:].isdigit()
            and os.path.isdir(os.path.join(root, n))
            and not os.path.islink(os.path.join(root, n))
        ),
        key=lambda n: int(n[4:]),
    )


def compact(args):
    report = {
        "dump_dir": args.dump_dir,
        "dry_run": args.dry_run,
        "jobs": args.jobs,
        "codec": {"format": packed.FORMAT, "version": packed.VERSION},
        "counts": {"compacted": 0, "leftovers_removed": 0, "temp_removed": 0},
        "skipped": [],
        "failed": [],
        "bytes_before": 0,
        "bytes_after": 0,
    }
    t0 = time.monotonic()
    budget = args.limit
    fork = multiprocessing.get_context("fork")  # the workers need this program, which came on stdin
    pool = ProcessPoolExecutor(args.jobs, mp_context=fork) if args.jobs > 1 and not args.dry_run else None
    try:
        for name in rank_dirs(args.dump_dir):
            budget = Rank(args.dump_dir, name, args, report).run(pool, budget)
    finally:
        if pool is not None:
            pool.shutdown()
    seconds = time.monotonic() - t0
    report["seconds"] = round(seconds, 3)
    report["mb_per_s"] = round(report["bytes_before"] / seconds / 1e6, 1) if seconds and not args.dry_run else None
    report["kept"] = round(report["bytes_after"] / report["bytes_before"], 4) if report["bytes_after"] else None
    report["ok"] = not report["failed"]
    return report


def main(argv=None):
    p = argparse.ArgumentParser(prog="compact_onhost.py")
    sub = p.add_subparsers(dest="cmd")
    c = sub.add_parser("compact")
    c.add_argument("dump_dir")
    c.add_argument("--jobs", type=int, default=2)
    c.add_argument("--limit", type=int, default=None)
    c.add_argument("--dry-run", action="store_true")
    c.add_argument("--no-fsync", dest="fsync", action="store_false")
    c.add_argument("--block-bytes", type=int, default=4 << 20)
    c.add_argument("--crash-at", choices=CRASH_POINTS, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.cmd != "compact":
        p.print_help()
        return 2
    if packed is None:
        emit({"error": "no packed-dump codec (rops_packed) in this program"})
        return 2
    if not os.path.isdir(args.dump_dir) or os.path.islink(args.dump_dir.rstrip("/") or "/"):
        emit({"error": "dump dir %s is not a directory" % args.dump_dir})
        return 3
    args.jobs = max(1, args.jobs)
    report = compact(args)
    emit(report)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
