"""SGLang as the serving engine: the patched server of `remote_ops.workflows.deploy`.

Its launch arguments are `remote_ops.engine.spec.server_args`, its endpoints
`remote_ops.probes.endpoints`, its log format `remote_ops.core.sglanglog`; this module names
them for the serving seam (`remote_ops.serving`) so that callers that must tell the engines
apart ask here.

Serving a drafter (`spec deploy`): `spec_host` is the host spec with SGLang's EAGLE-3 flags
(`speculative_args`) and the draft dir mounted read-only; `flag_problems` checks those flags
against a release's own argparse definitions (`argparse_flags` of its `server_args.py`; the
tests read SGLang 0.5.9's from the released wheel).
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


# --------------------------------------------------------------------------- serving a drafter (EAGLE-3)

#: The flags `spec deploy` passes (SGLang 0.5.9's names; `flag_problems` checks them against a
#: release's own `server_args.py`).
SPEC_FLAGS = (
    "--speculative-algorithm",
    "--speculative-draft-model-path",
    "--speculative-num-steps",
    "--speculative-eagle-topk",
    "--speculative-num-draft-tokens",
)


def speculative_args(draft: str, steps: int, topk: int, draft_tokens: int) -> list[str]:
    """SGLang's EAGLE-3 flags for the drafter at `draft` (a dir on the host)."""
    return [
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        draft,
        "--speculative-num-steps",
        str(steps),
        "--speculative-eagle-topk",
        str(topk),
        "--speculative-num-draft-tokens",
        str(draft_tokens),
    ]


def without_spec_flags(args: list[str]) -> list[str]:
    """Drop earlier speculative flags (and their values) from the inventory's extra_args."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in SPEC_FLAGS:
            skip = True
        elif not a.startswith(tuple(f + "=" for f in SPEC_FLAGS)):
            out.append(a)
    return out


def spec_args_of(args: list[str]) -> list[str]:
    """Every `--speculative-*` flag in `args` with its value (the next argument unless it is a
    flag, or `=value`): what `flag_problems` checks, the inventory's own extra ones included."""
    out, take = [], False
    for a in args:
        if take and not a.startswith("--"):
            out.append(a)
            take = False
            continue
        take = False
        if a.startswith("--speculative-"):
            out.append(a)
            take = "=" not in a
    return out


def spec_host(host: Any, draft: str, steps: int, topk: int, draft_tokens: int) -> Any:
    """The host spec serving the drafter (pure): the EAGLE-3 flags appended to `server.extra_args`
    (earlier ones dropped, so a re-run gives the same spec) and the draft dir mounted read-only."""
    extra = without_spec_flags(list(host.server.extra_args)) + speculative_args(draft, steps, topk, draft_tokens)
    server = host.server.model_copy(update={"extra_args": extra})
    mount = f"{draft}:{draft}:ro"
    volumes = list(host.container.volumes) + ([mount] if mount not in host.container.volumes else [])
    return host.model_copy(
        update={"server": server, "container": host.container.model_copy(update={"volumes": volumes})}
    )


#: Where a release defines its launch flags (checkout-relative, as a patch spec's target).
SERVER_ARGS_FILE = "python/sglang/srt/server_args.py"


def argparse_flags(source: str) -> dict[str, list[str] | None]:
    """Every `--flag` of a release's `server_args.py` (its `parser.add_argument(...)` calls, read
    with `ast`, not run) -> the literal `choices=[...]` of that argument, or None (pure)."""
    import ast

    found: dict[str, list[str] | None] = {}
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr != "add_argument":
            continue
        names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        choices = None
        for kw in node.keywords:
            if kw.arg == "choices" and isinstance(kw.value, (ast.List, ast.Tuple)):
                vals = [e.value for e in kw.value.elts if isinstance(e, ast.Constant)]
                choices = [str(v) for v in vals] if len(vals) == len(kw.value.elts) else None
        for name in names:
            if name.startswith("--"):
                found[name] = choices
    return found


def flag_problems(args: list[str], flags: dict[str, list[str] | None]) -> list[str]:
    """What in `args` (flag, value, flag, value ...; `--flag=value` too) a release whose
    `argparse_flags` are `flags` would refuse: an unknown flag, a value outside its choices (pure)."""
    problems: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if not a.startswith("--"):
            i += 1
            continue
        name, eq, value = a.partition("=")
        if not eq and i + 1 < len(args) and not args[i + 1].startswith("--"):
            value, i = args[i + 1], i + 1
        if name not in flags:
            problems.append(f"{name}: no such flag")
        elif flags[name] is not None and value not in (flags[name] or []):
            problems.append(f"{name} {value}: not one of {', '.join(flags[name] or [])}")
        i += 1
    return problems
