"""`ConsoleEvents`: deploy's live step lines and build output on the console (deploy, spec deploy).

Its own module so that `commands.deploy` loads without the deploy package (see its BUILD_TIMEOUT_S)."""

from __future__ import annotations

from ...workflows import deploy as deploy_mod

STATUS = {"ok": "ok", "changed": "ok", "planned": "info", "skipped": "skip", "failed": "fail"}


class ConsoleEvents(deploy_mod.Events):
    """Live step lines and build output (prefixed with the host name) on stderr."""

    def __init__(self, console, host: str) -> None:
        self.console, self.host = console, host

    def step(self, s: deploy_mod.StepResult) -> None:
        took = f" ({s.duration_s:.2f}s)" if s.duration_s >= 0.01 else ""
        self.console.status(STATUS.get(s.status, "info"), f"{self.host}: {s.name:<9} {s.status}: {s.detail}{took}")

    def line(self, stream: str, text: str) -> None:
        self.console.host_line(self.host, stream, text)

    def progress(self, text: str) -> None:
        self.console.say(f"  {self.host}: {text}", style="dim")
