"""Which Dockerfile step a build is at, read from one line of its output (pure).

The three builders a host may run print their step counters differently:

- BuildKit (plain progress): `#7 [3/9] RUN pip install ...`, in a multi-stage
  build `#7 [builder 3/9] RUN ...`; `#4 [internal] load ...` lines are not steps;
- the classic docker builder: `Step 3/9 : RUN pip install ...`;
- podman / buildah: `STEP 3/9: RUN pip install ...`.

`step` returns (n, total, instruction) for a line that starts a step, else None;
the CLI turns it into "build step n of total" on a terminal.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_BUILDKIT = re.compile(r"^#\d+ \[(?:[\w.-]+ )?(\d+)/(\d+)\] (.*)$")
_CLASSIC = re.compile(r"^(?:Step|STEP) (\d+)/(\d+)\s*: ?(.*)$")


@dataclass(frozen=True)
class BuildStep:
    n: int
    total: int
    instruction: str


def step(line: str) -> BuildStep | None:
    """The step a build output line starts, or None (`#N [internal] ...`, `#N DONE`, a RUN's output)."""
    text = line.strip()
    m = _BUILDKIT.match(text) or _CLASSIC.match(text)
    if not m:
        return None
    n, total = int(m.group(1)), int(m.group(2))
    if not 0 < n <= total:
        return None
    return BuildStep(n, total, m.group(3).strip())
