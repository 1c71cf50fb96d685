"""SIGINT, SIGTERM and SIGHUP all end a run the same way: as `errors.Interrupted`.

`install()` (called once by the CLI) turns each of them into an `Interrupted`
exception raised in the main thread, so `finally` blocks run: the deploy
writes its run record with the failed step and releases the host lock, a
`hostlock.held` block releases its lock.  The exit code is 128 + the signal
number (130 SIGINT, 143 SIGTERM, 129 SIGHUP), like a shell reports it.

`deferred()` holds further signals back while cleanup runs (a CI cancel
often sends SIGTERM twice); a signal that arrives meanwhile is re-raised
when the block ends.
"""
from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from .errors import Interrupted

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_state = {"deferring": 0, "pending": None}


def _handler(signum, _frame) -> None:
    if _state["deferring"]:
        _state["pending"] = _state["pending"] or signum
        return
    raise Interrupted(signum)


def install() -> None:
    """Route SIGINT/SIGTERM/SIGHUP to `Interrupted` (main thread only; no-op elsewhere)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in HANDLED:
        signal.signal(sig, _handler)


@contextmanager
def deferred() -> Iterator[None]:
    """Run a cleanup block without being interrupted; re-raise a signal that came meanwhile."""
    _state["deferring"] += 1
    try:
        yield
    finally:
        _state["deferring"] -= 1
    if not _state["deferring"] and _state["pending"]:
        pending, _state["pending"] = _state["pending"], None
        raise Interrupted(pending)
