"""The serving engine seam: what differs between SGLang and vLLM, chosen in one place.

The inventory's `serving.engine` (`sglang` default, `vllm`) names the engine that serves the
model; the host's `engine:` (docker | podman) is the *container* engine and lives in
`remote_ops.engine`.  Each serving engine is one module here with the same names:

- `NAME`, `NEEDS_PATCH` (SGLang's dumper is a source patch; vLLM has `extract_hidden_states`),
- `ENDPOINTS` (cheap HTTP endpoint groups `health` asks, first path of a group names it),
  `HEALTH_PATH` (the container's health check), `VERSION_PATH` and `version_of(body)`,
- `METRICS` (our name -> the engine's Prometheus metric name on `/metrics`),
- `EXTRACT_MODE` (how `onhost/extract_onhost.py` sends a sample: `generate` or `completions`),
- `log_stats(text)` (the engine's periodic throughput lines, `core.logparse`).

`KINDS` is the one table from `serving.engine` to its module (as `remote_ops.engine.KINDS` is
for docker | podman); a third engine is a third module and a row here.  Everything here is
pure: no SSH, no engine SDK.

Usage::

    from remote_ops.serving import serving_for
    s = serving_for(host)
    if s.NEEDS_PATCH: ...
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..core.inventory import HostSpec

#: serving.engine -> module of this package
KINDS = {"sglang": "sglang", "vllm": "vllm"}


def module_for(name: str) -> ModuleType:
    """The module of serving engine `name` (KeyError for an unknown one: the inventory refuses it first)."""
    return importlib.import_module(f"{__name__}.{KINDS[name]}")


def serving_for(host: "HostSpec") -> ModuleType:
    """The serving engine module of an inventory host."""
    return module_for(host.serving.engine)


def is_vllm(host: "HostSpec") -> bool:
    return host.serving.engine == "vllm"
