"""Several probes in one round trip: their commands joined into framed sections, the output
split back to each probe by its name.

`script(probes)` frames each probe's command (`core.shell.sections`, in order; or
`core.shell.parallel_sections`, all at once on the host, for read-only probes),
`split(output)` gives {name: (exit status, text)}, and each probe reads its own
answer from that (`Probe.read`).  One SSH round trip instead of one per probe is
what keeps `facts`, `health` and a no-op `deploy` fast.

Deadlines: with `probe_s`, each probe ends within that many seconds on the host
(`bounded`: coreutils `timeout`), so a hung probe (a frozen engine daemon) is that
probe's own failure ("no answer within Ns", exit 124) and every other answer still
comes back.  `probe_deadline` gives that bound from the run's command deadline: 80 %.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from ..core import shell
from .base import Output, Probe

if TYPE_CHECKING:
    from ..remote.base import Remote

T = TypeVar("T")

PROBE_TIMED_OUT = "no answer within {s:g}s (probe timed out)"


def probe_deadline(command_s: float) -> float:
    """Seconds one probe may take inside a round trip bounded by `command_s`: 80 %, at least
    1 s less, so the framed output of the other probes still comes back in time."""
    return round(max(1.0, min(command_s - 1.0, command_s * 0.8)), 1)


def deadline_of(remote: Remote) -> float:
    """`probe_deadline` of the run's command deadline (`--command-timeout`) on this connection."""
    from ..remote.base import command_deadline

    return probe_deadline(command_deadline(remote))


def bounded(named: list[tuple[str, str]], seconds: float) -> list[tuple[str, str]]:
    """Each command ends within `seconds` on the host: `timeout -k 1 (seconds - 1)` (a probe that
    ignores SIGTERM, like an engine CLI waiting for a frozen daemon, is killed 1 s later); exit
    124 and a line saying so when it ran out.  Hosts without coreutils `timeout` run it
    unbounded (pure)."""
    limit = round(max(0.5, seconds - 1.0), 1)
    note = shell.quote(PROBE_TIMED_OUT.format(s=limit))
    out = []
    for name, command in named:
        inner = shell.join(["sh", "-c", command])
        out.append(
            (
                name,
                f"if command -v timeout >/dev/null 2>&1; then timeout -k 1 {limit:g} {inner}; "
                f"rc=$?; [ $rc -eq 124 ] && echo {note}; exit $rc; else {inner}; fi",
            )
        )
    return out


def script(
    probes: Sequence[Probe[Any]],
    *,
    parallel: bool = False,
    probe_s: float | None = None,
    unbounded: Collection[type[Probe[Any]]] = (),
) -> str:
    """One shell script asking every probe (pure).  With `probe_s`, each probe whose class is
    `bounded` and not in `unbounded` ends within that many seconds on the host."""
    names = [p.name for p in probes]
    if len(set(names)) != len(names):
        raise ValueError(f"two probes share a section name: {names}")
    named = [(p.name, p.command()) for p in probes]
    if probe_s:
        named = [
            bounded([pair], probe_s)[0] if p.bounded and type(p) not in unbounded else pair
            for p, pair in zip(probes, named)
        ]
    return shell.parallel_sections(named) if parallel else shell.sections(named)


def split(output: str) -> dict[str, Output]:
    """A batch's output -> {probe name: (exit status, text)} (pure; `core.shell.split_sections`)."""
    return shell.split_sections(output)


def run(
    remote: Remote,
    probes: Sequence[Probe[Any]],
    *,
    parallel: bool = False,
    probe_s: float | None = None,
    unbounded: Collection[type[Probe[Any]]] = (),
    check: bool = False,
    timeout: float | None = None,
) -> dict[str, Output]:
    """Ask every probe in one round trip (under the run's command deadline, or `timeout`)."""
    text = script(probes, parallel=parallel, probe_s=probe_s, unbounded=unbounded)
    return split(remote.run(text, check=check, timeout=timeout).stdout)


def ask(remote: Remote, probe: Probe[T], **run_kwargs: Any) -> T:
    """One probe alone, unframed (its output is parsed as the host printed it)."""
    result = remote.run(probe.command(), **{"check": False, **run_kwargs})
    return probe.parse(result.exit_status, result.stdout)
