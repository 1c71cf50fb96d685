"""Bulk pull of files from a host: resumable, verified, parallel, over the system ssh.

Why this design (measured, see bench/README.md "Bulk pull"):

- The system `ssh` with AES-GCM moves bytes faster than paramiko/Fabric SFTP
  (215-280 MB/s here) and than rsync, which runs its own protocol, a whole-file
  checksum pass and the default cipher.  A plain `cat`/`tail -c +N` stream is
  the cheapest thing sshd can send.
- Files go in batches through one `tar` stream per ssh process (up to 8 GiB
  each, at least one batch per job), so 10,000 dumps of ~95 MiB or 2,000
  small files cost a handful of connections, not one each (a connection plus
  the remote shell's start-up files cost ~0.2 s here).
- A file bigger than a batch streams alone (`cat`).  A file with a partial
  `.part` resumes alone at its size (`tail -c +N`, reading only the missing
  bytes - not `rsync --partial`, which re-reads the whole partial file).
- `jobs` ssh processes run at once (across files; a single file is one stream,
  so its sha256 is computed while it arrives - no second read pass).
- Every file is written to `<name>.part`, checked against the manifest's size and
  sha256 while it arrives, and renamed only when it matches.  A final name
  therefore always holds a verified file; an interrupted pull leaves `.part`
  files that the next pull continues.  A stream never writes past the size the
  manifest gives (a tar member whose header says otherwise is refused unread).
- A lost connection (ssh exits 255: refused, reset, closed by the host, before
  or during the transfer) stops the pull with `Unreachable` (exit 4, "connection
  lost").  Each `.part` keeps its bytes - a cut tar member too, when it is big
  enough to resume (`SMALL_FILE`) - so the next pull continues it alone from its
  size; a resumed file whose completed sha256 differs is fetched once from byte 0.
- The names are the host's: each item's `remote` must pass
  `remote_ops.core.hostpaths.problem`, and its `local` (and `.part`) must resolve
  inside the pull's local root (`dest`).  An item that does not is never opened,
  never counted "already here": it is listed in `PullReport.unsafe`.  Tar members
  are matched against the expected names only; any other member is skipped.
- Local space is checked before the first byte (bytes still to write, block
  rounded, against free space at the destination), and a disk that fills up
  during the pull (another writer) stops it with the same typed error
  (`NoSpace`, exit 14) saying how much is needed and free; `.part` files stay,
  so the pull resumes once space is freed.

Part of the SSH seam (`remote_ops.remote`): the only other place that starts
ssh.  It takes the same resolved `SshTarget` as `FabricRemote`, and the
host-key policy from the same definition (`hostkeys.HostKeyPolicy.ssh_options`:
StrictHostKeyChecking=yes or accept-new, the target's known_hosts files,
BatchMode); plus explicit identity/port/user, `-F /dev/null` unless an
ssh_config was given, connect timeout and keepalives.  `FabricRemote.pull`
runs it for a connected host.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import select
import shlex
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from hashlib import _Hash

from ..core import hostpaths
from ..core.jsonable import fields_of
from ..errors import CommandFailed, CommandTimedOut, NoSpace, Unreachable, VerifyFailed
from .hostkeys import HostKeyPolicy
from .sshconfig import SshTarget

#: Preferred ciphers: AES-GCM is 1.2-1.6x faster than the default chacha20 on AES-NI hosts.
CIPHERS = "aes128-gcm@openssh.com,aes256-gcm@openssh.com,chacha20-poly1305@openssh.com"
SMALL_FILE = 8 << 20  # below this a partial file is fetched again, not resumed
BATCH_BYTES = 8 << 30  # bytes per tar batch (one ssh connection each)
BUF = 4 << 20  # receive buffer
PIPE_SIZE = 1 << 20  # F_SETPIPE_SZ on ssh's stdout (fewer wakeups)
F_SETPIPE_SZ = 1031
BLOCK = 4096  # local files take whole blocks: sizes are rounded up to this
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
SSH_FAILED = 255  # ssh's own exit status: the connection failed or was lost (the command's is 0-254)
#: ssh stderr of a 255 that is not the link: the host key or the login was refused
NOT_THE_LINK = ("Host key verification failed", "HOST IDENTIFICATION HAS CHANGED", "Permission denied")

Advance = Callable[[int], None]


# --------------------------------------------------------------------------- ssh command line


def ssh_argv(target: SshTarget, *, ssh_config: str | None = None, ciphers: str | None = CIPHERS) -> list[str]:
    """`ssh` argv (without the remote command) holding the seam's host-key policy."""
    t = target
    argv = [
        "ssh",
        "-F",
        ssh_config or "/dev/null",
        *HostKeyPolicy.of(t).ssh_options(),
        "-o",
        f"ConnectTimeout={int(max(1, t.timeouts.connect))}",
        "-o",
        f"ServerAliveInterval={int(max(1, t.timeouts.keepalive))}",
        "-o",
        "ServerAliveCountMax=3",
        "-p",
        str(t.port),
        "-l",
        t.user,
    ]
    if ciphers:
        argv += ["-c", ciphers]
    for identity in t.identity_files:
        argv += ["-i", identity, "-o", "IdentitiesOnly=yes"]
    if t.jump:
        argv += ["-o", "ProxyCommand=" + _proxy_command(t.jump, ssh_config)]
    return argv + ["--", t.hostname]


def _proxy_command(hops: tuple[SshTarget, ...], ssh_config: str | None) -> str:
    """ProxyJump as a ProxyCommand whose hop ssh has the same strict options (last hop last)."""
    *before, last = hops
    hop = last if not before else _with_jump(last, tuple(before))
    argv = ssh_argv(hop, ssh_config=ssh_config, ciphers=None)
    return shlex.join(argv[:-2] + ["-W", "%h:%p", "--", hop.hostname])


def _with_jump(target: SshTarget, jump: tuple[SshTarget, ...]) -> SshTarget:
    from dataclasses import replace

    return replace(target, jump=jump)


# --------------------------------------------------------------------------- items and report


@dataclass(frozen=True)
class PullItem:
    """One remote file to fetch, with what the manifest promises about it."""

    remote: str  # path on the host, relative to the pull's root
    local: Path  # final local path
    size: int
    sha256: str | None = None

    @property
    def part(self) -> Path:
        return self.local.with_name(self.local.name + ".part")


@dataclass
class PullReport:
    """What a pull did: counts, bytes moved, and every file that failed verification."""

    files: int = 0
    fetched: int = 0
    skipped: int = 0
    resumed: int = 0
    bytes: int = 0
    seconds: float = 0.0
    failed: list[tuple[str, str]] = field(default_factory=list)
    unsafe: list[tuple[str, str]] = field(default_factory=list)  # (name, why): refused, never opened

    @property
    def mb_per_s(self) -> float:
        return round(self.bytes / 1e6 / self.seconds, 1) if self.seconds else 0.0

    def to_dict(self) -> dict:
        return fields_of(
            self,
            "files fetched skipped resumed bytes seconds mb_per_s failed unsafe",
            seconds=round(self.seconds, 3),
            failed=[{"file": f, "reason": r} for f, r in self.failed],
            unsafe=[{"file": f, "reason": r} for f, r in self.unsafe],
        )


def is_complete(item: PullItem) -> bool:
    """A final name is only ever written after verification: its size is enough here."""
    try:
        return item.local.stat().st_size == item.size
    except FileNotFoundError:
        return False


def has_partial(item: PullItem, resume_from: int = SMALL_FILE) -> bool:
    """A partial `.part` worth resuming (smaller files are simply fetched again)."""
    try:
        return item.size >= resume_from and item.part.stat().st_size > 0
    except FileNotFoundError:
        return False


def plan_jobs(
    items: Iterable[PullItem], batch_bytes: int = BATCH_BYTES, jobs: int = 1, resume_from: int = SMALL_FILE
) -> list[list[PullItem]]:
    """Group pending items into jobs (pure apart from looking for `.part` files).

    - a file with a partial `.part` is its own job: it resumes with `tail -c +N`;
    - a file as big as a batch is its own job (`cat`);
    - everything else goes in `tar` batches of up to `batch_bytes`, at least
      `jobs` of them, so a dump dir of 95 MiB files costs one ssh connection per
      batch, not per file.
    Largest jobs first so the workers finish together.
    """
    items = list(items)
    resumable = [i for i in items if has_partial(i, resume_from)]
    rest = [i for i in items if not has_partial(i, resume_from)]
    batch_bytes = max(1 << 20, min(batch_bytes, -(-sum(i.size for i in rest) // max(jobs, 1))))
    singles = [[i] for i in resumable] + [[i] for i in rest if i.size >= batch_bytes]
    batches, current, current_bytes = [], [], 0
    for item in (i for i in rest if i.size < batch_bytes):
        current.append(item)
        current_bytes += item.size
        if current_bytes >= batch_bytes:
            batches.append(current)
            current, current_bytes = [], 0
    if current:
        batches.append(current)
    return sorted(singles + batches, key=lambda job: -sum(i.size for i in job))


# --------------------------------------------------------------------------- local space


def _blocks(n: int) -> int:
    return -(-max(n, 0) // BLOCK) * BLOCK


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def bytes_to_write(pending: Iterable[PullItem]) -> int:
    """Local bytes the pending items still need: whole blocks, less what their `.part` files hold.

    (A small `.part` is truncated and fetched again, a big one resumes: either
    way the file ends at its size, so the net need is the difference.)
    """
    return sum(max(_blocks(i.size) - _blocks(_size(i.part)), 0) for i in pending)


def free_space(path: Path) -> tuple[Path, int]:
    """(nearest existing folder, its free bytes for us) - where the pull would write."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate, shutil.disk_usage(candidate).free
    return path, 0


def _gb(n: int) -> str:
    return f"{n / 1e9:,.2f} GB" if n >= 1e9 else f"{n / 1e6:,.1f} MB"


def no_space_error(pending: list[PullItem], host: str, during: bool) -> NoSpace:
    """The typed error for a destination without room: how much is needed and how much is free."""
    where, free = free_space(pending[0].local.parent) if pending else (Path("."), 0)
    need = bytes_to_write(i for i in pending if not is_complete(i))
    left = sum(1 for i in pending if not is_complete(i))
    what = "local disk full during the pull" if during else "not enough local disk space for the pull"
    return NoSpace(
        f"{what}: {_gb(need)} ({need:,} bytes) still to write for {left} file(s), "
        f"{_gb(free)} ({free:,} bytes) free on {where}",
        host=host,
        hint="free space there (or pull to a bigger disk with --dest) and re-run: verified "
        "files are kept, partial ones resume",
        details={"needed_bytes": need, "free_bytes": free, "path": str(where), "files_left": left},
    )


class LocalRoot:
    """Answers "does this local path, symlinks resolved, lie inside the root?".

    One `realpath` per folder (cached: 10,000 files in one rank folder cost one),
    plus an `lstat` of the file itself: a final name or `.part` that is a symlink
    is followed too.
    """

    def __init__(self, root: Path) -> None:
        self.top = os.path.realpath(root).rstrip(os.sep) + os.sep
        self._folders: dict[str, str] = {}

    def holds(self, path: Path) -> bool:
        where, name = os.path.split(os.fspath(path))
        if name in ("", ".", ".."):
            return False
        folder = self._folders.get(where)
        if folder is None:
            folder = self._folders[where] = os.path.realpath(where).rstrip(os.sep) + os.sep
        if not folder.startswith(self.top):
            return False
        return not os.path.islink(path) or os.path.realpath(path).startswith(self.top)


def unsafe_reason(item: PullItem, dest: LocalRoot | None) -> str | None:
    """Why `item` may not be written (its host name, or a local path resolving outside `dest`)."""
    reason = hostpaths.problem(item.remote)
    if reason is None and dest is not None and not (dest.holds(item.local) and dest.holds(item.part)):
        reason = "local path outside the destination"
    return reason


def connection_lost(rc: int, stderr: str) -> bool:
    """ssh exited 255 for the link (refused, reset, closed), not for a host key or a login."""
    return rc == SSH_FAILED and not any(m in stderr for m in NOT_THE_LINK)


def lost_error(host: str, stderr: str) -> Unreachable:
    """The typed error of a pull whose connection was lost or refused (exit 4)."""
    said = next((l.strip() for l in reversed(stderr.splitlines()) if l.strip()), "ssh exited 255")
    return Unreachable(
        f"connection lost during the pull ({said[-200:]})",
        host=host,
        hint="re-run when the host answers: verified files are kept and .part files resume",
        details={"reason": "connection_lost", "stderr_tail": stderr.strip()[-2000:]},
    )


def check_space(pending: list[PullItem], host: str) -> None:
    """Refuse before the first byte when the pending files cannot fit (NoSpace, exit 14)."""
    if pending and bytes_to_write(pending) > free_space(pending[0].local.parent)[1]:
        raise no_space_error(pending, host, during=False)


# --------------------------------------------------------------------------- the pull


class Puller:
    """Runs the jobs of one pull over `jobs` concurrent ssh processes."""

    def __init__(
        self,
        target: SshTarget,
        root: str,
        *,
        ssh_config: str | None = None,
        jobs: int = 2,
        stall_timeout: float = 60.0,
        advance: Advance | None = None,
        dest: Path | None = None,
    ) -> None:
        self.argv = ssh_argv(target, ssh_config=ssh_config)
        self.host = target.name
        self.root = root
        self.dest = dest
        self.jobs = max(1, jobs)
        self.stall_timeout = stall_timeout
        self.advance = advance or (lambda n: None)
        self.report = PullReport()
        self._lock = threading.Lock()
        self._procs: set[subprocess.Popen] = set()
        self._stop = threading.Event()
        self._local = threading.local()  # one receive buffer per worker thread
        self._dirs: set[Path] = set()
        self._files_pool = ThreadPoolExecutor(1, thread_name_prefix="ro-pull-files")

    def pull(self, items: list[PullItem]) -> PullReport:
        """Fetch every item not already complete; verify; rename. Interrupt-safe.

        Items with an unsafe name or local path are refused first (`report.unsafe`).
        Too little local space, before or during the pull, is `NoSpace` (exit 14);
        a lost connection is `Unreachable` (exit 4), its details holding the report.
        """
        items = self._refuse_unsafe(items)
        pending = [i for i in items if not is_complete(i)]
        check_space(pending, self.host)
        try:
            return self._pull(items, pending)
        except OSError as exc:
            if exc.errno not in NO_SPACE_ERRNOS:
                raise
            raise no_space_error(pending, self.host, during=True) from None
        except Unreachable as exc:
            exc.details["pull"] = self.report.to_dict()
            raise

    def _refuse_unsafe(self, items: list[PullItem]) -> list[PullItem]:
        """The items that may be written; the others go to `report.unsafe`, untouched."""
        safe, dest = [], LocalRoot(self.dest) if self.dest is not None else None
        for item in items:
            reason = unsafe_reason(item, dest)
            if reason is None:
                safe.append(item)
            else:
                self.report.unsafe.append((item.remote, reason))
        return safe

    def _pull(self, items: list[PullItem], pending: list[PullItem]) -> PullReport:
        start = time.monotonic()
        self.report.files, self.report.skipped = len(items), len(items) - len(pending)
        self.advance(sum(i.size for i in items) - sum(i.size for i in pending))
        pool = ThreadPoolExecutor(self.jobs)
        try:
            for future in [pool.submit(self._run_job, job) for job in plan_jobs(pending, jobs=self.jobs)]:
                future.result()
        except BaseException:
            self._stop.set()  # workers stop at their next block
            self._kill_all()  # and their ssh processes end now
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            self._files_pool.shutdown(wait=True)
            self.report.seconds = time.monotonic() - start
        return self.report

    def _run_job(self, job: list[PullItem]) -> None:
        if self._stop.is_set():
            return
        if len(job) == 1 and (has_partial(job[0]) or job[0].size >= SMALL_FILE):
            self._stream_with_retry(job[0])
        else:
            self._tar_batch(job)

    # -- one large file ------------------------------------------------------
    def _stream_with_retry(self, item: PullItem) -> None:
        """Stream one file; if a *resumed* file fails verification, fetch it once from byte 0.

        (A stale partial file from an older version of the dump is the one case
        where resuming cannot work.)  A broken link keeps the partial file for
        the next pull (a lost connection raises `Unreachable`).
        """
        resumed = item.part.exists() and item.part.stat().st_size > 0
        problem = self._stream(item)
        if problem and resumed and problem.startswith(("size", "sha256")):
            problem = self._stream(item)
        if problem:
            self._fail(item, problem)

    def _stream(self, item: PullItem) -> str | None:
        """`tail -c +N` from the size of the local .part; hash prefix + new bytes; verify.

        At most one byte more than the manifest's size is read (a longer file is
        refused, not written on).  A lost connection keeps the .part and raises.
        """
        self._mkdir(item.local.parent)
        offset = item.part.stat().st_size if item.part.exists() else 0
        if offset > item.size:
            item.part.unlink()
            offset = 0
        digest = _hash_prefix(item.part, offset)
        if offset:
            with self._lock:
                self.report.resumed += 1
            self.advance(offset)
        remote = _remote_path(self.root, item.remote)
        cmd = f"tail -c +{offset + 1} {shlex.quote(remote)}" if offset else f"cat {shlex.quote(remote)}"
        proc = self._spawn(cmd, stdin=subprocess.DEVNULL)
        reader = _StallReader(proc, self.stall_timeout, self.host)
        fd = os.open(item.part, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            got = self._copy_from(reader, fd, digest, item.size - offset + 1)
        finally:
            os.close(fd)
        if got > item.size - offset:
            proc.kill()  # longer than the manifest says: refused below, the rest unread
            self._reap(proc)
            return self._finish(item, offset + got, digest)
        rc, err = self._reap(proc)
        if connection_lost(rc, err):
            if offset + got == 0:
                item.part.unlink(missing_ok=True)
            raise lost_error(self.host, err)
        if rc != 0:
            return "missing on the host" if "No such file" in err else f"ssh exited {rc}: {err.strip()[-200:]}"
        return self._finish(item, offset + got, digest)

    # -- a batch of small files ---------------------------------------------
    def _tar_batch(self, job: list[PullItem]) -> None:
        """One `tar` stream for many files: each member is hashed, verified and renamed.

        Creating a file costs more than writing 256 KiB into it on ext4, so a
        helper thread (`_FileLane`) creates the next files ahead of the stream
        and renames verified ones behind it; this thread only reads, hashes, writes.
        Members are matched by exact name against the job's (checked) names; any
        other member is skipped unread.  A member cut short by a lost connection
        keeps its .part when it can resume (`SMALL_FILE`), and the pull raises.
        """
        names = b"".join(i.remote.encode() + b"\0" for i in job)
        # -b 512: 256 KiB records, so sshd gets big writes instead of tar's default 10 KiB
        proc = self._spawn(f"tar -C {shlex.quote(self.root)} -b 512 -cf - --null -T - --ignore-failed-read")
        stdin = _pipe(proc.stdin)
        stdin.write(names)
        stdin.close()
        reader = _StallReader(proc, self.stall_timeout, self.host)
        lane = _FileLane(job, self._mkdir, self._files_pool)
        cut: list[tuple[PullItem, str]] = []
        try:
            for name, size in _tar_members(reader):
                opened = lane.take(name)
                if opened is None:
                    _skip(reader, size)
                elif problem := self._member(lane, *opened, size, reader):
                    cut.append((opened[0], problem))
                _skip(reader, -size % 512)
            _skip(reader, 1 << 62)  # the record padding after the end marker
        finally:
            unseen = lane.close()
        rc, err = self._reap(proc)
        if connection_lost(rc, err):
            raise lost_error(self.host, err)
        for item, problem in cut:
            self._fail(item, problem)
        for item in unseen:
            reason = "missing on the host" if "No such file" in err else f"tar/ssh exited {rc}: {err.strip()[-200:]}"
            self._fail(item, reason)

    def _member(self, lane: "_FileLane", item: PullItem, fd: int, size: int, reader: "_StallReader") -> str | None:
        """One tar member into its (already created) .part file; verified, then renamed behind.

        Returns the problem of a member cut short (the stream ended inside it: the
        caller decides, once ssh has exited, whether the link was lost); its
        .part stays when it can resume (>= SMALL_FILE: the bytes are the file's
        prefix, checked by sha256 once complete).  Other failures are recorded here.
        """
        digest = hashlib.sha256()
        try:
            got = 0 if size != item.size else self._copy_from(reader, fd, digest, size)
        finally:
            os.close(fd)
        if size != item.size:  # never write past what the manifest promised
            _skip(reader, size)
            self._refuse_member(item, f"size {size}, manifest says {item.size}")
            return None
        if got < size:
            if item.size < SMALL_FILE:
                item.part.unlink(missing_ok=True)
            return f"short read ({got} of {size})"
        if item.sha256 and digest.hexdigest() != item.sha256:
            self._refuse_member(item, "sha256 differs from the manifest")
            return None
        lane.rename(item)
        with self._lock:
            self.report.fetched += 1
        return None

    def _refuse_member(self, item: PullItem, problem: str) -> None:
        item.part.unlink(missing_ok=True)
        self._fail(item, problem)

    # -- shared --------------------------------------------------------------
    def _finish(self, item: PullItem, size: int, digest: _Hash, report_failure: bool = False) -> str | None:
        """Compare size and sha256 with the manifest; rename on success."""
        problem = None
        if size != item.size:
            problem = f"size {size}, manifest says {item.size}"
        elif item.sha256 and digest.hexdigest() != item.sha256:
            problem = "sha256 differs from the manifest"
        if problem:
            item.part.unlink(missing_ok=True)
            if report_failure:
                self._fail(item, problem)
            return problem
        os.replace(item.part, item.local)
        with self._lock:
            self.report.fetched += 1
        return None

    def _fail(self, item: PullItem, reason: str) -> None:
        with self._lock:
            self.report.failed.append((item.remote, reason))

    def _spawn(self, command: str, stdin: int = subprocess.PIPE) -> subprocess.Popen[bytes]:
        """Start one ssh (own session: Ctrl-C reaches us, we stop it by its handle)."""
        if self._stop.is_set():
            raise KeyboardInterrupt
        proc = subprocess.Popen(
            self.argv + [command],
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            bufsize=0,
            start_new_session=True,
        )
        try:
            fcntl.fcntl(_pipe(proc.stdout).fileno(), F_SETPIPE_SZ, PIPE_SIZE)
        except OSError:
            pass
        with self._lock:
            self._procs.add(proc)
        return proc

    def _mkdir(self, folder: Path) -> None:
        """Create a local folder once per pull (not one mkdir syscall per file)."""
        if folder not in self._dirs:
            folder.mkdir(parents=True, exist_ok=True)
            self._dirs.add(folder)

    def _buffer(self) -> memoryview:
        if not hasattr(self._local, "view"):
            self._local.view = memoryview(bytearray(BUF))
        view: memoryview = self._local.view
        return view

    def _copy_from(self, reader: "_StallReader", fd: int, digest: _Hash, limit: int) -> int:
        """Copy up to `limit` bytes (fewer at EOF) from the reader to `fd`, hashing and counting them."""
        view = self._buffer()
        total = 0
        while total < limit:
            n = reader.readinto(view[: min(BUF, limit - total)])
            if not n:
                break
            chunk = view[:n]
            digest.update(chunk)
            while chunk:
                chunk = chunk[os.write(fd, chunk) :]
            total += n
            self._count(n)
        return total

    def _count(self, n: int) -> None:
        self.advance(n)
        with self._lock:
            self.report.bytes += n
        if self._stop.is_set():
            raise KeyboardInterrupt

    def _reap(self, proc: subprocess.Popen[bytes]) -> tuple[int, str]:
        _pipe(proc.stdout).close()
        try:
            err = _pipe(proc.stderr).read().decode("utf-8", "replace")
            rc = proc.wait(timeout=self.stall_timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc, err = proc.wait(), "ssh did not exit"
        with self._lock:
            self._procs.discard(proc)
        return rc, err

    def _kill_all(self) -> None:
        """Stop our own ssh processes (by their Popen handle), leaving .part files to resume."""
        with self._lock:
            procs = list(self._procs)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


class _FileLane:
    """Creates `.part` files ahead of a tar stream and renames verified ones behind it.

    The helper thread is shared by all streams of a pull: creating files in one
    directory serialises in the kernel anyway, and one creator avoids the
    streams spinning on the directory lock.  The stream thread takes the open
    fd of each member as it arrives.  Members the
    host did not send (missing files) are found as gaps in the order and their
    empty `.part` files removed.
    """

    AHEAD = 32

    def __init__(self, items: list[PullItem], mkdir: Callable[[Path], None], pool: ThreadPoolExecutor) -> None:
        self.pool = pool
        self.mkdir = mkdir
        self.queue = list(reversed(items))
        self.names = {i.remote for i in items}
        self.pending: dict[str, tuple[PullItem, Future[int]]] = {}
        self.unseen: list[PullItem] = []
        self.renames: list[Future[None]] = []
        for _ in range(self.AHEAD):
            self._ahead()

    def _ahead(self) -> None:
        if self.queue:
            item = self.queue.pop()
            self.pending[item.remote] = (item, self.pool.submit(self._create, item))

    def _create(self, item: PullItem) -> int:
        self.mkdir(item.local.parent)
        return os.open(item.part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def take(self, name: str) -> tuple[PullItem, int] | None:
        """(item, open fd) for the member `name`; earlier items the stream skipped are unseen."""
        if name not in self.names:
            return None
        while True:
            if not self.pending:
                self._ahead()
            remote, (item, future) = next(iter(self.pending.items()))
            del self.pending[remote]
            self.names.discard(remote)
            self._ahead()
            if remote == name:
                return item, future.result()
            self._discard(item, future)

    def _discard(self, item: PullItem, future: Future[int]) -> None:
        self.unseen.append(item)
        os.close(future.result())
        item.part.unlink(missing_ok=True)

    def rename(self, item: PullItem) -> None:
        self.renames.append(self.pool.submit(os.replace, item.part, item.local))

    def close(self) -> list[PullItem]:
        """Finish the renames, drop files never received; return the items never seen."""
        for item, future in list(self.pending.values()):
            self._discard(item, future)
        self.unseen.extend(reversed(self.queue))
        self.pending.clear()
        self.queue.clear()
        for done in self.renames:
            done.result()
        return self.unseen


def _pipe(stream: IO[bytes] | None) -> IO[bytes]:
    """A pipe of a process started with `subprocess.PIPE` for it (never None then)."""
    assert stream is not None, "the process was started without this pipe"
    return stream


def _remote_path(root: str, rel: str) -> str:
    return rel if rel.startswith("/") else f"{root.rstrip('/')}/{rel}"


def _hash_prefix(part: Path, offset: int) -> _Hash:
    """sha256 of the bytes already on disk (resume), read once in big blocks."""
    digest = hashlib.sha256()
    if offset:
        with open(part, "rb") as fh:
            while block := fh.read(BUF):
                digest.update(block)
    return digest


class _StallReader:
    """Reads an ssh stdout (non-blocking) with a no-progress deadline.

    Small reads (tar headers) are served from an internal buffer, big ones go
    straight into the caller's buffer; select() runs only when the pipe is
    empty, and a stalled link becomes a typed error instead of a hang.
    """

    def __init__(self, proc: subprocess.Popen[bytes], stall_timeout: float, host: str) -> None:
        self.proc, self.fd, self.stall, self.host = proc, _pipe(proc.stdout).fileno(), stall_timeout, host
        os.set_blocking(self.fd, False)
        self.buf = bytearray(1 << 16)
        self.start = self.end = 0

    def _raw(self, view: memoryview) -> int:
        while True:
            try:
                return os.readv(self.fd, [view])
            except BlockingIOError:
                self._wait()

    def _wait(self) -> None:
        ready, _, _ = select.select([self.fd], [], [], self.stall)
        if not ready:
            self.proc.kill()
            raise CommandTimedOut(
                f"no data for {self.stall:g}s; pull stopped (resume by re-running)",
                host=self.host,
                command="ssh pull",
                timeout=self.stall,
            )

    def readinto(self, view: memoryview) -> int:
        if self.start < self.end:
            n = min(len(view), self.end - self.start)
            view[:n] = self.buf[self.start : self.start + n]
            self.start += n
            return n
        if len(view) < len(self.buf):  # small read: refill the internal buffer
            self.start, self.end = 0, self._raw(memoryview(self.buf))
            return self.readinto(view) if self.end else 0
        return self._raw(view)

    def read_exact(self, n: int) -> bytes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = self.readinto(view[got:])
            if not k:
                break
            got += k
        return bytes(buf[:got])


def _skip(reader: _StallReader, n: int) -> None:
    """Discard `n` bytes (or up to EOF)."""
    scratch = memoryview(bytearray(min(max(n, 0), 1 << 20)))
    while n > 0:
        got = reader.readinto(scratch[: min(n, len(scratch))])
        if not got:
            return
        n -= got


def _tar_members(reader: _StallReader) -> Iterator[tuple[str, int]]:
    """Yield (name, size) of each regular file in a tar stream, leaving the reader at its data.

    Handles ustar names (prefix + name), GNU long names ('L') and base-256 sizes.
    The caller must consume `size` bytes plus padding before the next iteration.
    """
    long_name = None
    while True:
        block = reader.read_exact(512)
        if len(block) < 512 or block == b"\0" * 512:
            return
        size = _tar_size(block[124:136])
        kind = block[156:157]
        if kind == b"L":
            long_name = reader.read_exact(size).rstrip(b"\0").decode()
            _skip(reader, -size % 512)
            continue
        name = long_name or _tar_name(block)
        long_name = None
        if kind in (b"0", b"\0", b"7"):
            yield name, size
        else:
            _skip(reader, size + (-size % 512))


def _tar_size(field: bytes) -> int:
    if field[0] & 0x80:  # base-256 (GNU, files >= 8 GiB)
        return int.from_bytes(field[1:], "big")
    return int(field.strip(b"\0 ") or b"0", 8)


def _tar_name(block: bytes) -> str:
    name = block[0:100].split(b"\0", 1)[0].decode()
    prefix = block[345:500].split(b"\0", 1)[0].decode() if block[257:262] == b"ustar" else ""
    return f"{prefix}/{name}" if prefix else name


def pull(
    target: SshTarget,
    root: str,
    items: list[PullItem],
    *,
    ssh_config: str | None = None,
    jobs: int = 2,
    stall_timeout: float = 60.0,
    advance: Advance | None = None,
    strict: bool = True,
    dest: Path | None = None,
) -> PullReport:
    """Pull `items` (paths relative to `root` on the host, local paths inside `dest` when given).

    With `strict`, raise VerifyFailed if any failed or was refused as unsafe; a
    lost connection is `Unreachable` either way.
    """
    puller = Puller(
        target, root, ssh_config=ssh_config, jobs=jobs, stall_timeout=stall_timeout, advance=advance, dest=dest
    )
    report = puller.pull(items)
    if strict and (report.failed or report.unsafe):
        bad = report.unsafe + report.failed
        first = "; ".join(f"{f}: {r}" for f, r in bad[:3])
        raise VerifyFailed(
            f"{len(bad)} file(s) failed: {first}",
            host=target.name,
            hint="re-run the pull: verified files are kept, the rest are fetched again",
            details=report.to_dict(),
        )
    return report


__all__ = [
    "CIPHERS",
    "PullItem",
    "PullReport",
    "Puller",
    "plan_jobs",
    "pull",
    "ssh_argv",
    "is_complete",
    "CommandFailed",
    "bytes_to_write",
    "check_space",
    "free_space",
    "NoSpace",
]
