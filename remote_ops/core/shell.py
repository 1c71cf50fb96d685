"""Build remote command lines: the quoting rule and the combinators, in one place.

Every value that reaches a remote shell (inventory paths, container names,
patterns typed by the operator) goes through `quote`/`join` here.  Modules
build argv lists and combine them with the helpers below (`and_then`, `seq`,
`sections`, ...).  Where a probe needs shell syntax these helpers do not
cover (a loop, `$(...)`, a redirection), its module writes that part as an
f-string, and still passes every value through `quote`: the probe units in
`remote_ops.probes` and the engine's command lines (`engine.cli`) do.  The
result is a plain `str` run by the login shell on the host (sshd's exec request),
which the seam sends wrapped in `deadline` (the host's `timeout`, so the
command's deadline ends the host's process too).  A small host file is read
with `read_small_file` (a regular file, at most a cap), never a bare `cat`.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable, Sequence

Argv = Sequence[str]


def quote(value: object) -> str:
    """Quote one value so the remote shell sees it as exactly one word."""
    return shlex.quote(str(value))


def join(argv: Argv) -> str:
    """Quote each argument and join them: `["ls", "a b"]` -> `ls 'a b'`."""
    return " ".join(quote(a) for a in argv)


def cmd(command: str | Argv) -> str:
    """Normalise a command: argv lists are quoted, strings were built here already."""
    return command if isinstance(command, str) else join(command)


def and_then(*commands: str | Argv) -> str:
    """Run commands in order, stopping at the first failure (`a && b`)."""
    return " && ".join(cmd(c) for c in commands)


def seq(*commands: str | Argv) -> str:
    """Run commands in order regardless of failures (`a; b`)."""
    return "; ".join(cmd(c) for c in commands)


def pipe(*commands: str | Argv) -> str:
    return " | ".join(cmd(c) for c in commands)


def subshell(command: str | Argv) -> str:
    return f"( {cmd(command)} )"


def redirect(command: str | Argv, *, stdout: str | None = None, stderr: str | None = None, append: bool = False) -> str:
    """Redirect a command's output to remote files (paths are quoted)."""
    out = cmd(command)
    op = ">>" if append else ">"
    if stdout is not None:
        out += f" {op} {quote(stdout)}"
    if stderr is not None:
        out += " 2>&1" if stderr == "&1" else f" 2{op} {quote(stderr)}"
    return out


def quiet(command: str | Argv) -> str:
    """Discard stderr (for probes whose absence is itself the answer)."""
    return f"{cmd(command)} 2>/dev/null"


def read_stdin(command: str | Argv, path: str) -> str:
    """`command < PATH`: the command reads the file on stdin, so it never prints its name."""
    return f"{cmd(command)} < {quote(path)}"


def sha256_of(path: str) -> str:
    """The one builder for "sha256 of a remote file": prints 64 hex digits and nothing else,
    and fails (non-zero, reason on stderr) when the file cannot be read.

    The file is hashed from stdin.  `sha256sum PATH` escapes a name holding a
    backslash or a newline (the line then starts with `\\`), so `| cut -c1-64`
    returned a wrong digest and every read of such a file looked corrupted.
    """
    return sha256_of_word(quote(path))


def sha256_of_word(word: str) -> str:
    """`sha256_of` for a path already written as one shell word (e.g. `"$f"` in a script)."""
    return f"( h=$(sha256sum < {word}) && printf '%s\\n' \"${{h%% *}}\" )"


def sections(named: Iterable[tuple[str, str | Argv]]) -> str:
    """Run several probes in one round trip, each output framed by a marker line.

    Output looks like `@@remote-ops:NAME:begin`, the probe's stdout, then
    `@@remote-ops:NAME:end RC`.  Each probe runs in a subshell, so an `exit`
    or `cd` in one cannot affect the others.  `split_sections` parses it back.
    This is the framing only: probe units are batched by `remote_ops.probes.batch`,
    which names each section after its probe and hands each probe its answer.
    """
    parts = []
    for name, command in named:
        parts.append(
            f"echo {quote(SECTION + name + ':begin')}; "
            f"( {cmd(command)} ) 2>&1; "
            f"echo {quote(SECTION + name + ':end')} $?"
        )
    return "; ".join(parts)


SECTION = "@@remote-ops:"


def parallel_sections(named: Iterable[tuple[str, str | Argv]]) -> str:
    """Like `sections`, but the probes run concurrently on the host.

    Each probe writes its whole framed section (begin marker, output, end
    marker with its exit status) to its own file in a private temp dir (removed
    on exit); one `cat` prints the files in order once all have finished, so
    the output parses with `split_sections` exactly as before.  Wall time is
    the slowest probe instead of the sum: what makes `health` cheap when
    every engine CLI call costs 0.1-0.25 s.  Processes: mktemp, one cat, rm,
    and the probes' own (a cat per file cost 2 per probe: 16 of health's ~50).
    """
    named = list(named)
    jobs = " ".join(
        f"{{ echo {quote(SECTION + n + ':begin')}; ( {cmd(c)} ) 2>&1; echo {quote(SECTION + n + ':end')} $?; }}"
        f' >"$t/{i}" &'
        for i, (n, c) in enumerate(named)
    )
    files = " ".join(f'"$t/{i}"' for i in range(len(named))) or "/dev/null"  # never a bare `cat` (stdin)
    return f"t=$(mktemp -d) || exit 1; trap 'rm -rf \"$t\"' EXIT; {jobs} wait; cat {files}"


def split_sections(output: str) -> dict[str, tuple[int, str]]:
    """Parse `sections` output into {name: (exit_status, text)}; pure.

    The end marker may follow text on the same line (a probe whose output has
    no final newline); that text belongs to the section.
    """
    result: dict[str, tuple[int, str]] = {}
    name: str | None = None
    lines: list[str] = []
    for line in output.splitlines():
        end = line.find(SECTION + name + ":end") if name is not None else -1
        if name is not None and end >= 0:
            lines += [line[:end]] if end > 0 else []
            status = line.rsplit(" ", 1)[-1]
            result[name] = (int(status) if status.lstrip("-").isdigit() else -1, "\n".join(lines))
            name = None
        elif line.startswith(SECTION) and line.endswith(":begin"):
            name, lines = line[len(SECTION) : -len(":begin")], []
        elif name is not None:
            lines.append(line)
    return result


def authorized_keys_value(value: str) -> str:
    """An authorized_keys option value (`command="..."`, `from="..."`): double-quoted, each `"`
    written `\\"` (sshd's only escape).  A line break or NUL would end the key line, and a
    backslash could escape the closing quote: both are refused (ValueError)."""
    if any(c in value for c in "\n\r\0\\"):
        raise ValueError("an authorized_keys option value cannot hold a line break, NUL or backslash")
    return '"' + value.replace('"', '\\"') + '"'


# --------------------------------------------------------------------------- deadlines on the host

#: Seconds the host's `timeout` waits after its TERM before it sends KILL.
KILL_AFTER_S = 2
#: Seconds the host's deadline runs past the local one, so the local side reports the timeout
#: (exit 8) and the host ends the process a moment later.
HOST_GRACE_S = 1


def deadline(command: str | Argv, seconds: float) -> str:
    """`command` bounded ON the host: coreutils `timeout -k 2 N` runs it in its own process group
    and, at N seconds, sends TERM to that whole group (KILL 2 s later), so a command blocked in
    `open()` of a FIFO, or a pipeline's readers, end with the deadline instead of living on after
    the local side gave up.  N is the deadline plus `HOST_GRACE_S`.  The command runs in the
    login shell sshd would have used (`$SHELL -c`), so its meaning does not change; a host with
    no `timeout` runs it unbounded there, as before."""
    n = max(1, int(seconds + 0.999)) + HOST_GRACE_S
    return (
        f"if command -v timeout >/dev/null 2>&1; then set -- timeout -k {KILL_AFTER_S} {n}; else set --; fi; "
        f'exec "$@" "${{SHELL:-/bin/sh}}" -c {quote(cmd(command))}'
    )


# --------------------------------------------------------------------------- small host files

#: The cap of a small host file (a config.json, a run record, a manifest row set): 1 MiB.
SMALL_FILE_CAP = 1 << 20
#: Exit statuses of `read_small_file` on the host (distinct from cat's 1 and timeout's 124).
RC_MISSING, RC_NOT_REGULAR, RC_TOO_LARGE = 65, 66, 67
SMALL_FILE_PROBLEMS = {RC_MISSING: "missing", RC_NOT_REGULAR: "not_regular", RC_TOO_LARGE: "too_large"}


def read_small_file(path: str, cap: int = SMALL_FILE_CAP) -> str:
    """Print a host file's bytes only when it is a regular file of at most `cap` bytes.

    Checked before it is opened: missing (a dangling symlink too) exits `RC_MISSING`; anything
    `test -f` does not call regular (a FIFO, a device, a directory, a symlink to one of these)
    exits `RC_NOT_REGULAR`, never opened; larger than `cap` (`wc -c`, an fstat) exits
    `RC_TOO_LARGE`.  Then `head -c CAP` reads it: a file that grows after the check still gives
    at most `cap` bytes.  A file swapped for a FIFO between the check and the open blocks, which
    the command's deadline ends on the host (`deadline`: every remote command runs under it).
    The status names the problem (`small_file_problem`); the reason is on stderr."""
    p = quote(path)
    return (
        f"if ! [ -e {p} ]; then echo 'no such file' >&2; exit {RC_MISSING}; fi; "
        f"if ! [ -f {p} ]; then echo 'not a regular file' >&2; exit {RC_NOT_REGULAR}; fi; "
        f"n=$(wc -c < {p}) || exit 1; "
        f'if [ "$n" -gt {int(cap)} ]; then echo "$n bytes" >&2; exit {RC_TOO_LARGE}; fi; '
        f"exec head -c {int(cap)} < {p}"
    )


def small_file_command(path: str, cap: int = SMALL_FILE_CAP) -> str:
    """`read_small_file` as one command of its own (`sh -c`), so that it can stand in a
    sequence or a pipeline like `cat PATH` (its `exec` ends only that shell); stderr discarded:
    for probes that read a file whose absence is itself the answer."""
    return quiet(join(["sh", "-c", read_small_file(path, cap)]))


def head_of_regular_file(path: str, cap: int) -> str:
    """The first `cap` bytes of a host file when it is a regular file (a symlink to one counts),
    nothing otherwise (a FIFO or a device is never opened): for files that may be long, like a
    list of records, where the head is still an answer and a line cut at `cap` is dropped."""
    p = quote(path)
    return f"if [ -f {p} ]; then head -c {int(cap)} < {p}; fi"


def small_file_problem(status: int) -> str | None:
    """What `read_small_file`'s exit status says: `missing`, `not_regular`, `too_large`, or None
    (read, or some other failure: the status is then the reader's own); pure."""
    return SMALL_FILE_PROBLEMS.get(status)
