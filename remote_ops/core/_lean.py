"""Import pydantic's plugin lookup without `importlib.metadata` (15-20 ms of every inventory load).

pydantic looks for plugins when it builds its first model: `pydantic.plugin._loader`
runs `from importlib.metadata import entry_points` at import time, and
`importlib.metadata` imports `email`, `zipfile` and `csv` with it.  The CLI turns
plugins off (`PYDANTIC_DISABLE_PLUGINS=__all__`, `cli.main.run`), so the lookup
never calls `entry_points`; the import alone was 15-20 ms of `remote-ops hosts`
(bench/README.md, startup.py).

`import_plugin_loader()` imports that module while `importlib.metadata` resolves
to a small stand-in whose `entry_points` imports the real module and calls it
(plugins still load where they are not disabled), then removes the stand-in, so
any later `import importlib.metadata` gets the real module.  It does nothing if
either module is already imported (e.g. under pytest).  Importing this module
does it (`core.inventory` imports it before pydantic builds a model).  The same
way `remote._lean` imports invoke without `unittest.mock`.
"""

from __future__ import annotations

import sys
import types
from typing import Any

_LOADER = "pydantic.plugin._loader"
_METADATA = "importlib.metadata"


def _entry_points(**params: Any) -> Any:
    """`importlib.metadata.entry_points`, the real module imported on first call."""
    from importlib.metadata import entry_points

    return entry_points(**params)


def import_plugin_loader() -> None:
    """Import pydantic's plugin loader with the stand-in `importlib.metadata` in place for the
    duration of the import."""
    if _LOADER in sys.modules or _METADATA in sys.modules:
        return
    stand_in = types.ModuleType(_METADATA, "pydantic's entry_points, imported on first use (core._lean)")
    stand_in.entry_points = _entry_points  # type: ignore[attr-defined]
    sys.modules[_METADATA] = stand_in
    try:
        import pydantic.plugin._loader  # noqa: F401
    finally:
        if sys.modules.get(_METADATA) is stand_in:
            del sys.modules[_METADATA]
        importlib = sys.modules.get("importlib")
        if importlib is not None and getattr(importlib, "metadata", None) is stand_in:
            del importlib.metadata


import_plugin_loader()
