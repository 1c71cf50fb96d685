"""SGLang as the serving engine: the patched server of `remote_ops.workflows.deploy`.

Its launch arguments are `remote_ops.engine.spec.server_args`, its endpoints
`remote_ops.probes.endpoints`, its log format `remote_ops.core.sglanglog`; this module names
them for the serving seam (`remote_ops.serving`) so that callers that must tell the engines
apart ask here.
"""

from __future__ import annotations

from typing import Any

NAME = "sglang"
NEEDS_PATCH = True
#: cheap endpoints only: SGLang 0.5.x's /health runs a generation (each group: the path, then older aliases)
ENDPOINTS = [["/model_info", "/get_model_info"], ["/server_info", "/get_server_info"], ["/v1/models"]]
HEALTH_PATH = "/get_model_info"
VERSION_PATH = "/server_info"
EXTRACT_MODE = "generate"
METRICS = {
    "prompt_tokens": "sglang:prompt_tokens_total",
    "generation_tokens": "sglang:generation_tokens_total",
    "running": "sglang:num_running_reqs",
    "waiting": "sglang:num_queue_reqs",
}


def version_of(body: dict[str, Any]) -> str | None:
    """The release `/server_info` reports."""
    v = body.get("version")
    return str(v) if v is not None else None


def want_version(host: Any) -> str:
    return str(host.sglang.version)


def client_args(host: Any) -> tuple[str, ...]:
    """The extraction client's options for this engine (SGLang: its defaults, `/generate`)."""
    return ()
