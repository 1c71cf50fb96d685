"""A host probe as one unit: the command it runs on the host and the parser of its output.

Like pyinfra's fact classes (`command` + `process`), each probe is one class:
an instance carries what its command needs (a path, a container name, the
host's engine) and `command()` builds the shell text with `remote_ops.core.shell`
(or asks the engine seam for it); `parse(status, text)` is pure over what came
back (the exit status and the captured stdout + stderr), so it is tested from
captured text.  Building an instance costs nothing (it only keeps its inputs):
the commands are built when asked.  Where a probe has an ok / warn / fail
verdict, its evaluator sits beside it in the same module and returns `Check`s.

`name` is the probe's section in a batched round trip (`remote_ops.probes.batch`);
callers read a probe's answer with `probe.read(sections)`, never by its name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

if TYPE_CHECKING:
    from ..core.extractplan import ExtractPaths

#: What came back for one probe: its exit status and its output (stdout, stderr merged).
Output = tuple[int, str]
#: A round trip's answers, by probe name (`batch.split`).
Sections = Mapping[str, Output]

T = TypeVar("T")
P = TypeVar("P", bound="Probe[Any]")


class Probe(ABC, Generic[T]):
    """One question asked of a host: `command()` (an instance: its inputs) and `parse` (pure)."""

    #: The probe's section name in a batch; unique within one round trip.
    name: str
    #: What `read` parses when the section did not come back (the probe never ran).
    absent: ClassVar[Output] = (1, "")
    #: Bounded by the batch's per-probe deadline on the host (`batch.bounded`).  False for a
    #: probe that must never be killed half-way (taking the host lock).
    bounded: ClassVar[bool] = True

    @abstractmethod
    def command(self) -> str:
        """The shell text run on the host (`/bin/sh -c`), every value quoted by `core.shell`."""

    @abstractmethod
    def parse(self, status: int, text: str) -> T:
        """The probe's answer from its exit status and output (pure)."""

    def output(self, sections: Sections) -> Output:
        """This probe's raw answer in a round trip's sections (`absent` when it did not run)."""
        return sections.get(self.name, self.absent)

    def read(self, sections: Sections) -> T:
        """This probe's parsed answer in a round trip's sections."""
        return self.parse(*self.output(sections))


class DumpDirProbe(Probe[T]):
    """A probe of a host's dump dir, built from the dir as the inventory names it (`dump_dir`)."""

    def __init__(self, dump_dir: str) -> None:
        self.dump_dir = dump_dir


class WorkDirProbe(Probe[T]):
    """A probe of a client's work dir on the host, built from its paths (`paths`)."""

    def __init__(self, paths: ExtractPaths) -> None:
        self.paths = paths


class Answers:
    """A round trip's answers, looked up by probe class: `answers.read(GpuQuery)`.

    Built from the probes that were asked (or would have been: an evaluator over
    captured text) and their sections; a probe whose section did not come back
    reads as its `absent` answer."""

    def __init__(self, probes: Iterable[Probe[Any]], sections: Sections) -> None:
        self.sections = sections
        self._by_kind: dict[type[Probe[Any]], Probe[Any]] = {type(p): p for p in probes}

    def probe(self, kind: type[P]) -> P:
        found = self._by_kind[kind]
        assert isinstance(found, kind)
        return found

    def output(self, kind: type[Probe[Any]]) -> Output:
        """The probe's raw answer (exit status, text)."""
        return self.probe(kind).output(self.sections)

    def read(self, kind: type[Probe[T]]) -> T:
        """The probe's parsed answer."""
        return self.probe(kind).read(self.sections)

    def came(self, kind: type[Probe[Any]]) -> bool:
        """Did the probe's section come back (it ran, whatever its exit status)?"""
        return self.probe(kind).name in self.sections


@dataclass(frozen=True)
class Check:
    """One evaluator's verdict: `status` is ok / warn / fail / skip, `reason` says why in words."""

    tier: str
    name: str
    status: str
    reason: str
    data: dict[str, Any] = field(default_factory=dict)


def last_line(text: str) -> str:
    """The last line of a probe's output (its error, usually), or `no output`."""
    lines = text.strip().splitlines()
    return lines[-1] if lines else "no output"
