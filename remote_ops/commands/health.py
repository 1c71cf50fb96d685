"""`remote-ops health`: tiered, read-only checks; exit code follows the worst result."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import click

from .. import health as health_mod
from ..errors import UsageError
from ..paths import host_dir
from ._options import app_options, host_option


def _expected_image(spec) -> str | None:
    """The image ref deploy builds for this host (None when deploy can't tell)."""
    try:
        from .. import deploy
    except ImportError:
        return None
    fn = getattr(deploy, "image_ref", None)
    if not fn or not spec.sglang.patch:     # a spec derived on the host: the tag is not known here
        return None
    return fn(spec)


def _check_all(app, hosts, deep: bool) -> list[health_mod.HostHealth]:
    """Check hosts in parallel, one connection each."""
    def one(spec):
        return health_mod.check_host(app.remote, spec, deep=deep, expected_image=_expected_image(spec),
                                     state_dir=host_dir(spec.name))
    with ThreadPoolExecutor(max_workers=min(16, max(1, len(hosts)))) as pool:
        return list(pool.map(one, hosts))


def _drop_broken(app, results) -> None:
    """Forget the connections of hosts whose round failed at the SSH level, so the next
    watch round reconnects (under --connect-timeout) instead of reusing a dead one."""
    for r in results:
        if r.error_exit:
            app.forget(r.host)


def render(console, results) -> None:
    for r in results:
        console.step(f"{r.host}: {r.worst} ({r.duration_s:.2f}s)")
        for c in r.checks:
            console.status(c.status, f"{c.tier}/{c.name}: {c.reason}")


@click.command("health")
@host_option(required=False)
@click.option("--all", "all_hosts", is_flag=True, help="check every inventory host, in parallel")
@click.option("--deep", is_flag=True, help="also run ONE one-token generation probe per host")
@click.option("--watch", type=click.FloatRange(min=0, min_open=True), default=None, metavar="SECONDS",
              help="repeat every SECONDS")
@click.option("--watch-for", type=click.FloatRange(min=0), default=3600.0, show_default=True,
              help="stop watching after this many seconds (a round started before then may end up to "
                   "--connect-timeout + --command-timeout later)")
@app_options
def health_cmd(app, host, all_hosts, deep, watch, watch_for) -> int:
    """Check SSH, docker, GPUs, container, patch, SGLang endpoints and dumps.

    Cheap endpoints only (/model_info, /server_info, /v1/models); SGLang's
    /health runs a generation, so a generation probe runs only with --deep.
    Exit code: 0 ok, 11 worst was warn, 12 something failed; a host that
    cannot be reached 4, authenticated 5, or whose key is unknown/changed 6
    (the JSON still lists its ssh check).  Each probe is bounded by
    --command-timeout, so one hung probe fails alone.
    """
    if bool(host) == bool(all_hosts):
        raise UsageError("give exactly one of --host or --all")
    hosts = list(app.inventory().hosts.values()) if all_hosts else app.hosts(host)
    deadline = time.monotonic() + watch_for
    while True:
        results = _check_all(app, hosts, deep)
        render(app.console, results)
        app.console.emit({"hosts": [r.to_dict() for r in results]})
        if not watch or time.monotonic() + watch >= deadline:
            return health_mod.exit_code(results)
        time.sleep(watch)
        _drop_broken(app, results)


commands = [health_cmd]
