#!/usr/bin/env python3
"""`dumps sync` on the hosts: runs ON a source or the destination (stdlib, Python 3.8+).

Shipped on stdin (`python3 - COMMAND ...`) like `dumper/dumpfile.py`; nothing is
installed.  The laptop only orchestrates: every dump byte moves from a source's
sshd to the destination's `rsync`, and is checked here, on the destination.

Commands (each prints JSON; `transfer` prints JSON Lines):

- `source-check --dir D`: on a source: the file its own sshd reads for
  authorized keys (`sshd -T` of the listener this session runs under: the
  `-f` file it was started with, else its default), `rrsync`, `rsync`.
- `grant --file AK --mark M --line L` / `revoke --file AK --mark M`: on a
  source, under an exclusive flock of `AK.remote-ops.lock` beside it (waited
  for at most `--lock-timeout` s, then exit 9 naming the file): read AK again,
  drop every line holding M (the marks of this destination's transfer keys:
  what a killed run left), then (grant) append L; written atomically (temp
  file + fsync + rename, mode and owner kept; a symlinked AK keeps its link and
  its target is edited), then read back under the same lock: `revoked` (or
  `granted`) is printed only when the file read back shows it; else exit 10
  naming the file.
- `keygen --work W --comment C --bind ADDR --known-host LINE...`: on the
  destination: rsync, ssh and ssh-keygen looked up, and whether ADDR is one of
  its addresses (then ssh binds to it, so the sources' `from=` sees it); with
  the tools there, a new ed25519 key for this sync in W (mode 700; any earlier
  key there removed first) and W/known_hosts holding exactly the LINEs.
- `transfer PLAN`: on the destination: one source's files (the plan, written
  by the laptop) into the dump dir.  A file already in place with the
  manifest's sha256 (a run killed between its rename and its manifest line)
  is only recorded; one whose line is there already (written by a killed run
  after the laptop planned, read again under the lock) is left alone.  The
  rest go through `rsync` into a staging dir beside the dump dir (same
  filesystem: the final rename is atomic), resumable
  (`--partial-dir`, mtimes kept).  Each file rsync finishes (its late
  `--out-format` line, which also gives the bytes it sent: the compression ratio) is checked against
  the source manifest's size and sha256 while rsync moves the next one; a good
  one is renamed into `rank<R>/`, then its manifest line (the source's record
  plus `host`) appended with one O_APPEND write and fsync.  A bad one is
  deleted and fetched again (up to 3 rsync passes); it is never counted done.
  Progress (`{"event": "progress", "bytes": N}`) at most every 0.5 s.
  rsync dies with this process (PR_SET_PDEATHSIG), and one transfer per
  staging dir runs at a time (flock).  However it ends (short of SIGKILL) it
  removes its plan and the staging dir's lock and file list; the staging dir
  itself goes when every file arrived, else only rsync's partial files stay
  (the next run resumes them).
- `cleanup --work W`: on the destination, at the end of every sync (success or
  not): the key and known_hosts deleted, and every plan and staging dir that
  no transfer holds tidied as above (what a SIGKILLed transfer left).
"""

import argparse
import ctypes
import fcntl
import hashlib
import json
import os
import pwd
import queue
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

CHUNK = 1 << 20
PASSES = 3
CONNECTION_RC = {5, 10, 12, 30, 35, 255}  # rsync: no daemon, socket I/O, protocol stream, timeouts, ssh
#: Beside a source's authorized_keys: the lock every grant and revoke takes (`_edit`).
LOCK_SUFFIX = ".remote-ops.lock"


def emit(doc):
    sys.stdout.write(json.dumps(doc, sort_keys=True) + "\n")
    sys.stdout.flush()


# --------------------------------------------------------------------------- a source


def _ppid(pid):
    with open("/proc/%d/stat" % pid, "rb") as fh:
        stat = fh.read()
    return int(stat[stat.rindex(b")") + 2 :].split()[1])


def _argv(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as fh:
            return [a.decode("utf-8", "replace") for a in fh.read().split(b"\0") if a]
    except OSError:
        return []


def _sshd_words(argv):
    """(sshd binary, config) from an sshd's command line, or None when it is not sshd's.  OpenSSH
    rewrites its title into one string (`sshd: /usr/sbin/sshd -D -f CFG [listener] ...`)."""
    words = " ".join(argv).split()
    if words[:1] == ["sshd:"]:
        words = words[1:]
    if not words or not words[0].startswith("/") or not os.path.basename(words[0]).startswith("sshd"):
        return None
    cfg = words[words.index("-f") + 1] if "-f" in words[:-1] else "/etc/ssh/sshd_config"
    return words[0], cfg


def sshd_listener():
    """(sshd binary, config file) of the outermost sshd above this process, or (None, None)."""
    found = (None, None)
    pid = os.getpid()
    while pid > 1:
        try:
            pid = _ppid(pid)
        except (OSError, ValueError, IndexError):
            break
        words = _sshd_words(_argv(pid))
        if words:
            found = words
    return found


def _expand(path, user):
    home = user.pw_dir
    out = path.replace("%%", "\0").replace("%h", home).replace("%u", user.pw_name).replace("%U", str(user.pw_uid))
    out = out.replace("\0", "%")
    return out if out.startswith("/") else os.path.join(home, out)


def authorized_keys_file():
    """The first AuthorizedKeysFile of this session's sshd (`sshd -T`), else ~/.ssh/authorized_keys."""
    user = pwd.getpwuid(os.getuid())
    default = os.path.join(user.pw_dir, ".ssh", "authorized_keys")
    sshd, cfg = sshd_listener()
    if not sshd:
        return default, "default (no sshd above this session)"
    try:
        out = subprocess.run(
            [sshd, "-T", "-f", cfg], capture_output=True, text=True, timeout=20, stdin=subprocess.DEVNULL
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return default, "default (sshd -T failed)"
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0].lower() == "authorizedkeysfile" and parts[1] != "none":
            return _expand(parts[1], user), "sshd -T -f " + cfg
    return default, "default (sshd -T named none)"


def source_check(a):
    path, how = authorized_keys_file()
    emit(
        {
            "authorized_keys": path,
            "how": how,
            "rrsync": shutil.which("rrsync"),
            "rsync": shutil.which("rsync"),
            "dir_exists": os.path.isdir(a.dir),
            "user": pwd.getpwuid(os.getuid()).pw_name,
        }
    )


def _lock_path(real):
    return os.path.join(os.path.dirname(real), os.path.basename(real) + LOCK_SUFFIX)


def _take_lock(lock_path, timeout):
    """An exclusive flock on `lock_path` (created, never removed: removing a lock file races its
    waiters), waited for at most `timeout` seconds; the open fd, or None at the deadline."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except OSError:
            if time.monotonic() >= deadline:
                os.close(fd)
                return None
            time.sleep(0.02)


def _read_lines(path):
    try:
        with open(path, "rb") as fh:
            return fh.read().splitlines(), os.fstat(fh.fileno())
    except FileNotFoundError:
        return [], None


def _write_atomic(real, lines, st):
    """`lines` into `real`: a temp file beside it, fsync, mode and owner of the old file, rename,
    fsync of the directory."""
    folder = os.path.dirname(real)
    tmp = os.path.join(folder, ".%s.remote-ops-%d" % (os.path.basename(real), os.getpid()))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, b"".join(x + b"\n" for x in lines))
        if st is not None:
            os.fchmod(fd, st.st_mode & 0o7777)
            os.fchown(fd, st.st_uid, st.st_gid)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, real)
    dfd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _edit(a, line):
    try:
        return _edit_locked(a, line)
    except OSError as exc:
        emit({"error": "os_error", "file": a.file, "reason": "%s: %s" % (exc.filename or a.file, exc.strerror)})
        return 7


def _edit_locked(a, line):
    """Under the source's lock: drop every line holding `a.mark`, append `line` (grant), write
    atomically, then read the file back.  Prints the report; 0, or 9 (lock not had by the
    deadline) / 10 (the file read back is not what was written), each naming the file."""
    mark = a.mark.encode()
    real = os.path.realpath(a.file)  # a symlinked authorized_keys stays a symlink: its target is edited
    os.makedirs(os.path.dirname(real), mode=0o700, exist_ok=True)
    lock = _lock_path(real)
    t0 = time.monotonic()
    fd = _take_lock(lock, a.lock_timeout)
    if fd is None:
        emit({"error": "locked", "file": a.file, "lock": lock, "waited": round(time.monotonic() - t0, 1)})
        return 9
    try:
        old, st = _read_lines(real)  # read again under the lock: what another edit wrote counts
        keep = [x for x in old if mark not in x]
        removed = len(old) - len(keep)
        if line is not None or removed:
            _write_atomic(real, keep + ([line.encode()] if line is not None else []), st)
        back, _ = _read_lines(real)
        left = sum(1 for x in back if mark in x)
    finally:
        os.close(fd)  # the lock goes with the fd
    if line is None:
        if left:
            emit({"error": "still_there", "file": a.file, "left": left, "removed": removed})
            return 10
        emit({"file": a.file, "removed": removed, "revoked": True})
        return 0
    if line.encode() not in back or left != 1:
        emit({"error": "not_granted", "file": a.file, "left": left, "removed": removed})
        return 10
    emit({"file": a.file, "removed": removed, "granted": True})
    return 0


def grant(a):
    return _edit(a, a.line)


def revoke(a):
    return _edit(a, None)


# --------------------------------------------------------------------------- the destination


def _tools(bind):
    bind_ok = False
    if bind:
        try:
            s = socket.socket(socket.AF_INET6 if ":" in bind else socket.AF_INET)
            s.bind((bind, 0))
            s.close()
            bind_ok = True
        except OSError:
            bind_ok = False
    return {"rsync": shutil.which("rsync"), "ssh": shutil.which("ssh"), "bind_ok": bind_ok}


def keygen(a):
    tools = _tools(a.bind)
    if not (tools["rsync"] and tools["ssh"] and shutil.which("ssh-keygen")):
        emit(dict(tools, public=None))
        return 0
    os.makedirs(a.work, mode=0o700, exist_ok=True)
    os.chmod(a.work, 0o700)
    key = os.path.join(a.work, "key")
    for p in (key, key + ".pub"):
        if os.path.exists(p):
            os.unlink(p)
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", a.comment, "-f", key],
        check=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
    )
    fd = os.open(os.path.join(a.work, "known_hosts"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write("".join(line + "\n" for line in a.known_host))
    with open(key + ".pub") as fh:
        emit(dict(tools, public=fh.read().strip(), key=key))


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while True:
            b = fh.read(CHUNK)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def _die_with_parent():
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    os.setpgrp()


class Transfer:
    """One source's files into the dump dir (see the module doc)."""

    def __init__(self, plan):
        self.plan = plan
        self.dest = plan["dest_dir"]
        self.stage = plan["stage"]
        self.files = {f["file"]: f for f in plan["files"]}
        self.done, self.failed, self.refetched, self.recorded = [], {}, [], []
        self.bytes = 0
        self.wire = 0  # bytes rsync sent for the files it moved (compressed, with --compress)
        self.checked = queue.Queue()

    # -- the final place --------------------------------------------------------
    def _final(self, name):
        return os.path.join(self.dest, *name.split("/"))

    def _record(self, f):
        """Append the manifest line (source record + host): one O_APPEND write, then fsync."""
        rec = dict(f["record"])
        rec["host"] = self.plan["source"]
        rank_dir = os.path.dirname(self._final(f["file"]))
        line = (json.dumps(rec, sort_keys=True) + "\n").encode()
        fd = os.open(os.path.join(rank_dir, "manifest.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)

    def _place(self, f, staged):
        final = self._final(f["file"])
        os.makedirs(os.path.dirname(final), exist_ok=True)
        os.replace(staged, final)
        dfd = os.open(os.path.dirname(final), os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        self._record(f)

    def _good(self, path, f):
        try:
            return os.path.getsize(path) == int(f["bytes"]) and sha256_of(path) == f["sha256"]
        except OSError:
            return False

    # -- the run --------------------------------------------------------------
    def _listed(self):
        """(key, sha256) of every line of the destination's manifests, read under the lock: a
        run killed after the laptop's plan may have recorded a file since."""
        seen = set()
        ranks = {os.path.dirname(self._final(n)) for n in self.files}
        for rank_dir in ranks:
            try:
                with open(os.path.join(rank_dir, "manifest.jsonl"), "rb") as fh:
                    lines = fh.read().splitlines()
            except OSError:
                continue
            for line in lines:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict):
                    seen.add((rec.get("key"), rec.get("sha256")))
        return seen

    def run(self):
        t0 = time.monotonic()
        pending = []
        listed = self._listed()
        for name, f in sorted(self.files.items()):
            final = self._final(name)
            if (f["record"].get("key"), f["sha256"]) in listed and os.path.isfile(final):
                self.recorded.append(name)  # recorded meanwhile by a run killed after the plan
            elif os.path.isfile(final) and self._good(final, f):
                self._record(f)  # renamed by a run killed before its manifest line
                self.recorded.append(name)
            else:
                pending.append(name)
        rc = 0
        for _ in range(PASSES):
            if not pending:
                break
            rc, bad = self._pass(pending)
            pending = bad
            if rc != 0:
                break
            self.refetched += bad
        for name in pending:
            self.failed.setdefault(name, "rsync exited %d" % rc if rc else "sha256 differs from the source manifest")
        emit(
            {
                "event": "done",
                "moved": len(self.done),
                "recorded": len(self.recorded),
                "bytes": self.bytes,
                "wire_bytes": self.wire,
                "failed": self.failed,
                "refetched": sorted(set(self.refetched)),
                "rsync_rc": rc,
                "connection_lost": rc in CONNECTION_RC,
                "seconds": round(time.monotonic() - t0, 3),
            }
        )
        return 0 if not self.failed else 3

    def _pass(self, names):
        """One rsync over `names`; each finished file verified meanwhile; (rsync rc, names still bad)."""
        listing = os.path.join(self.stage, ".files-from")
        os.makedirs(self.stage, exist_ok=True)
        with open(listing, "wb") as fh:
            fh.write(b"".join(n.encode() + b"\0" for n in names))
        todo, bad = set(names), []
        verifier = threading.Thread(target=self._verify_loop, args=(todo, bad), daemon=True)
        verifier.start()
        rc = self._rsync(listing, todo)
        for name in sorted(todo):  # rsync did not name them (already staged, or it stopped)
            self.checked.put(name)
        self.checked.put(None)
        verifier.join()
        return rc, sorted(bad)

    def _verify_loop(self, todo, bad):
        later = []  # named by rsync before its rename landed: checked once rsync has exited
        while True:
            name = self.checked.get()
            if name is None:
                for name in later:
                    self._verify(name, bad)
                return
            staged = os.path.join(self.stage, *name.split("/"))
            if os.path.isfile(staged):
                self._verify(name, bad)
            else:
                later.append(name)

    def _verify(self, name, bad):
        f = self.files[name]
        staged = os.path.join(self.stage, *name.split("/"))
        if os.path.isfile(staged) and self._good(staged, f):
            self._place(f, staged)
            self.done.append(name)
            self.bytes += int(f["bytes"])
            emit({"event": "file", "file": name, "bytes": int(f["bytes"])})
        else:
            if os.path.exists(staged):
                os.unlink(staged)  # torn or corrupt: never counted, fetched again
            bad.append(name)

    def _rsync(self, listing, todo):
        p = self.plan
        ssh = [
            "ssh", "-F", "/dev/null", "-i", p["key"], "-p", str(p["port"]), "-l", p["user"],
            "-o", "IdentitiesOnly=yes", "-o", "IdentityAgent=none", "-o", "BatchMode=yes",
            "-o", "StrictHostKeyChecking=yes", "-o", "UserKnownHostsFile=" + p["known_hosts"],
            "-o", "GlobalKnownHostsFile=/dev/null", "-o", "ForwardAgent=no", "-o", "ForwardX11=no",
            "-o", "ClearAllForwardings=yes", "-o", "ControlMaster=no", "-o", "ControlPath=none",
            "-o", "ConnectTimeout=10", "-o", "ServerAliveInterval=10", "-o", "ServerAliveCountMax=3",
            "-o", "Ciphers=aes128-gcm@openssh.com,aes256-gcm@openssh.com,chacha20-poly1305@openssh.com",
        ]  # fmt: skip
        if p.get("bind"):
            ssh += ["-o", "BindAddress=" + p["bind"]]
        argv = [
            "rsync", "-t", "--from0", "--files-from=" + listing, "--partial-dir=.rsync-partial",
            "--info=progress2", "--out-format=@@done %b %n", "--timeout=%d" % int(p.get("stall_timeout", 60)),
            "-e", " ".join(shlex.quote(x) for x in ssh),
        ]  # fmt: skip
        if p.get("compress") == "zstd":
            argv += ["--compress", "--compress-choice=zstd", "--compress-level=1"]
        if p.get("bwlimit_kbps"):
            argv.append("--bwlimit=%d" % int(p["bwlimit_kbps"]))
        host = "[%s]" % p["address"] if ":" in p["address"] else p["address"]  # IPv6
        argv += ["%s:." % host, self.stage + "/"]
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent
        )
        emit({"event": "rsync", "pid": proc.pid})
        err = []
        t = threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True)
        t.start()
        self._read_progress(proc, todo)
        rc = proc.wait()
        t.join(10)
        if rc != 0:
            emit({"event": "rsync_failed", "rc": rc, "stderr": b"".join(err).decode("utf-8", "replace")[-2000:]})
        return rc

    def _read_progress(self, proc, todo):
        buf, last, sent = b"", 0.0, -1
        while True:
            chunk = proc.stdout.read1(65536) if hasattr(proc.stdout, "read1") else proc.stdout.read(4096)
            if not chunk:
                break
            buf += chunk
            *lines, buf = buf.replace(b"\r", b"\n").split(b"\n")
            now = time.monotonic()
            for line in lines:
                text = line.decode("utf-8", "replace")
                if text.startswith("@@done "):
                    _, wire, name = (text.split(" ", 2) + ["", ""])[:3]
                    self.wire += int(wire) if wire.isdigit() else 0
                    if name in todo:
                        todo.discard(name)
                        self.checked.put(name)
                    continue
                first = text.split()[:1]
                if first and first[0].replace(",", "").isdigit() and now - last >= 0.5:
                    n = int(first[0].replace(",", ""))
                    if n != sent:
                        emit({"event": "progress", "bytes": n})
                        last, sent = now, n


def _stage_lock(stage, timeout):
    """The flock of `stage/.lock`, waited for at most `timeout` s; the fd, or None.  The lock file
    is removed by whoever holds it when a transfer ends, so the fd must still be the file at that
    path once locked (else it was removed meanwhile: try again)."""
    path = os.path.join(stage, ".lock")
    deadline = time.monotonic() + timeout
    while True:
        os.makedirs(stage, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.2)
            continue
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def _prune(top):
    """Remove the empty directories under `top` and `top` itself when empty (bottom up)."""
    for root, dirs, _ in os.walk(top, topdown=False):
        for d in dirs:
            try:
                os.rmdir(os.path.join(root, d))
            except OSError:
                pass
    try:
        os.rmdir(top)
    except OSError:
        pass


def _tidy_stage(stage, complete):
    """While its lock is held: a complete stage goes; a failed one keeps only rsync's partial
    files (the next run resumes them): its lock, file list and empty dirs go."""
    if complete:
        shutil.rmtree(stage, ignore_errors=True)
        return
    for name in (".files-from", ".lock"):
        try:
            os.unlink(os.path.join(stage, name))
        except FileNotFoundError:
            pass
    _prune(stage)


def transfer(a):
    with open(a.plan) as fh:
        plan = json.load(fh)
    fd = _stage_lock(plan["stage"], 30)
    if fd is None:
        emit({"event": "busy", "stage": plan["stage"]})
        return 4
    rc = 7
    try:
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # the laptop gone: stop (rsync dies with us)
        rc = Transfer(plan).run()
    finally:  # however it ends here (a SIGKILL skips this: the laptop's `cleanup` does it then)
        _tidy_stage(plan["stage"], rc == 0)
        try:
            os.unlink(a.plan)
        except FileNotFoundError:
            pass
        os.close(fd)
    return rc


def cleanup(a):
    """On the destination, at the end of every sync: the key and known_hosts deleted; every
    plan and staging dir no transfer holds is tidied (`_tidy_stage`: partial files kept); empty
    work dirs removed."""
    removed, busy, failed = [], [], {}
    for name in ("key", "key.pub", "known_hosts"):
        path = os.path.join(a.work, name)
        try:
            os.unlink(path)
            removed.append(name)
        except FileNotFoundError:
            pass
        except OSError as exc:
            failed[name] = exc.strerror
    stage_root = os.path.join(a.work, "stage")
    try:
        sources = sorted(os.listdir(stage_root))
    except OSError:
        sources = []
    try:
        plans = [
            n[len("plan-") : -len(".json")] for n in os.listdir(a.work) if n.startswith("plan-") and n.endswith(".json")
        ]
    except OSError:
        plans = []
    for source in sorted(set(sources) | set(plans)):
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", source):
            continue  # not a name a sync gave (core.syncplan.check_name)
        stage = os.path.join(stage_root, source)
        fd = _stage_lock(stage, 0) if os.path.isdir(stage) or source in plans else None
        if fd is None:
            busy.append(source)
            continue
        try:
            _tidy_stage(stage, False)
            try:
                os.unlink(os.path.join(a.work, "plan-%s.json" % source))
                removed.append("plan-%s.json" % source)
            except FileNotFoundError:
                pass
        finally:
            os.close(fd)
    for d in (stage_root, a.work):
        try:
            os.rmdir(d)
        except OSError:
            pass
    emit({"removed": removed, "busy": busy, "failed": failed})
    return 0 if not failed else 7


def main(argv=None):
    ap = argparse.ArgumentParser(prog="sync_onhost")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("source-check")
    p.add_argument("--dir", required=True)
    for name in ("grant", "revoke"):
        p = sub.add_parser(name)
        p.add_argument("--file", required=True)
        p.add_argument("--mark", required=True)
        p.add_argument("--lock-timeout", type=float, default=30.0)
        if name == "grant":
            p.add_argument("--line", required=True)
    p = sub.add_parser("keygen")
    p.add_argument("--work", required=True)
    p.add_argument("--comment", required=True)
    p.add_argument("--bind", default="")
    p.add_argument("--known-host", action="append", default=[])
    p = sub.add_parser("transfer")
    p.add_argument("plan")
    p = sub.add_parser("cleanup")
    p.add_argument("--work", required=True)
    a = ap.parse_args(argv)
    handler = {
        "source-check": source_check,
        "grant": grant,
        "revoke": revoke,
        "keygen": keygen,
        "transfer": transfer,
        "cleanup": cleanup,
    }[a.cmd]
    return handler(a) or 0


if __name__ == "__main__":
    sys.exit(main())
