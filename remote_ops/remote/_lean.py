"""Import invoke without `unittest.mock` (and the `asyncio` it pulls in): 30-45 ms of every run.

paramiko's `config` module and Fabric import invoke, and `invoke.context` runs
`from unittest.mock import Mock` at import time for `MockContext`, a testing
helper remote-ops never uses; `unittest.mock` imports `asyncio`.  On the lab VM
that is 30-45 ms of a `health` run's ~0.45 CPU-s of imports.

`import_invoke()` imports invoke while `unittest.mock` resolves to a small
stand-in module whose `Mock` builds a real `unittest.mock.Mock` when called
(MockContext still works), then removes the stand-in, so any later
`import unittest.mock` gets the real module.  It does nothing if invoke or
`unittest.mock` is already imported (e.g. under pytest).  Importing this
module does it (`remote_ops.remote` imports it before anything that imports
paramiko or Fabric).
"""

from __future__ import annotations

import sys
import types
from typing import Any


class _Mock:
    """`invoke.context.Mock`: a real `unittest.mock.Mock`, imported on first use."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        from unittest.mock import Mock

        return Mock(*args, **kwargs)


def import_invoke() -> None:
    """Import invoke with the stand-in `unittest.mock` in place for the duration of the import."""
    if "invoke" in sys.modules or "unittest.mock" in sys.modules:
        return
    stand_in = types.ModuleType("unittest.mock", "invoke's Mock, imported on first use (remote_ops.remote._lean)")
    stand_in.Mock = _Mock  # type: ignore[attr-defined]
    sys.modules["unittest.mock"] = stand_in
    try:
        import invoke  # noqa: F401
    finally:
        if sys.modules.get("unittest.mock") is stand_in:
            del sys.modules["unittest.mock"]
        unittest = sys.modules.get("unittest")
        if unittest is not None and getattr(unittest, "mock", None) is stand_in:
            del unittest.mock


import_invoke()
