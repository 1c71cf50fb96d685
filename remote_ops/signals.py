"""SIGINT, SIGTERM and SIGHUP all end a run the same way: as `errors.Interrupted`.

`install()` (called once by the CLI) turns each of them into an `Interrupted`
exception raised in the main thread, so `finally` blocks run: the deploy
writes its run record with the failed step and releases the host lock, a
`hostlock.held` block releases its lock.  The exit code is 128 + the signal
number (130 SIGINT, 143 SIGTERM, 129 SIGHUP), like a shell reports it.

`deferred()` holds one further signal back while cleanup runs (release the
lock, write the record; each bounded by --command-timeout) and re-raises it
when the block ends; a second one (Ctrl-C twice) interrupts the cleanup too.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from .errors import Interrupted

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_state: dict[str, int] = {"deferring": 0, "pending": 0}  # pending: a signal number, 0 for none


def _handler(signum, _frame) -> None:
    if _state["deferring"] and not _state["pending"]:
        _state["pending"] = signum  # the first one waits for the cleanup; a second one does not
        return
    raise Interrupted(signum)


def install() -> dict:
    """Route SIGINT/SIGTERM/SIGHUP to `Interrupted` (main thread only; no-op elsewhere).
    Returns the previous handlers, for `restore`."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, _handler) for sig in HANDLED}


def restore(previous: dict) -> None:
    """Put back the handlers `install` replaced (the CLI called in-process, e.g. by tests)."""
    for sig, handler in previous.items():
        signal.signal(sig, handler)


@contextmanager
def deferred() -> Iterator[None]:
    """Run a cleanup block without being interrupted; re-raise a signal that came meanwhile."""
    _state["deferring"] += 1
    try:
        yield
    finally:
        _state["deferring"] -= 1
    if not _state["deferring"] and _state["pending"]:
        pending, _state["pending"] = _state["pending"], 0
        raise Interrupted(pending)
