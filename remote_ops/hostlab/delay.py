"""A user-space delay proxy: a chosen round-trip time (and bandwidth cap) in front of a lab sshd.

This kernel has no `netem` qdisc (`tc qdisc add ... netem` answers "Specified
qdisc kind is unknown"), so WAN latency is made in user space: every chunk read
from one side is written to the other side RTT/2 later, in order, in each
direction; a byte that crosses both ways has waited one RTT.  With a rate cap a
chunk also waits until the link (a token bucket per direction) has carried the
bytes before it, like a serial link of that speed.

It runs as its own process (`python -m remote_ops.hostlab.delay`), started in its
own session by `DelayProxy.start()` and stopped by PID, so its event loop never
competes for the GIL with the client being measured.  It listens and connects on
loopback only.

    proxy = DelayProxy("127.9.8.7", 22, "127.5.6.7", 22, rtt_ms=50, dir=lab_dir).start()
    ...
    proxy.stop()
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import subprocess

CHUNK = 256 * 1024


def release_time(read_at: float, nbytes: int, one_way_s: float, rate_bps: float | None, link_free_at: float) -> float:
    """When a chunk read at `read_at` may leave: one-way delay later, and not before the link is free.

    Pure: `link_free_at` is when the previous chunk finished serialising on a
    link of `rate_bps` bits/s (None = unlimited)."""
    if not rate_bps:
        return read_at + one_way_s
    start = max(read_at, link_free_at)
    return start + nbytes * 8 / rate_bps + one_way_s


def _loopback(address: str) -> str:
    if not ipaddress.ip_address(address).is_loopback:
        raise SystemExit(f"delay proxy: {address} is not a loopback address (lab traffic stays on 127.0.0.0/8)")
    return address


@dataclass
class _Direction:
    """One direction of one connection: a reader that timestamps chunks, a writer that releases them."""

    one_way_s: float
    rate_bps: float | None
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    link_free_at: float = 0.0

    async def read(self, reader: asyncio.StreamReader) -> None:
        while True:
            data = await reader.read(CHUNK)
            now = time.monotonic()
            if not data:
                await self.queue.put((now + self.one_way_s, b""))
                return
            due = release_time(now, len(data), self.one_way_s, self.rate_bps, self.link_free_at)
            self.link_free_at = due - self.one_way_s
            await self.queue.put((due, data))

    async def write(self, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                due, data = await self.queue.get()
                delay = due - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                if not data:
                    writer.write_eof() if writer.can_write_eof() else None
                    return
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            return


async def _pipe(client_r, client_w, target: tuple[str, int], one_way_s: float, rate_bps: float | None) -> None:
    try:
        server_r, server_w = await asyncio.wait_for(asyncio.open_connection(*target), timeout=10)
    except (OSError, asyncio.TimeoutError):
        client_w.close()
        return
    up, down = _Direction(one_way_s, rate_bps), _Direction(one_way_s, rate_bps)
    tasks = [
        asyncio.ensure_future(c)
        for c in (up.read(client_r), up.write(server_w), down.read(server_r), down.write(client_w))
    ]
    try:
        await asyncio.gather(*tasks)
    except (ConnectionError, OSError):
        pass
    finally:
        for t in tasks:
            t.cancel()
        for w in (client_w, server_w):
            w.close()


async def serve(listen: tuple[str, int], target: tuple[str, int], rtt_ms: float, rate_mbit: float | None) -> None:
    """Accept on `listen` forever, forwarding each connection to `target` with the delay."""
    one_way = rtt_ms / 2000.0
    rate = rate_mbit * 1e6 if rate_mbit else None
    server = await asyncio.start_server(lambda r, w: _pipe(r, w, target, one_way, rate), *listen)
    print(
        f"delay proxy {listen[0]}:{listen[1]} -> {target[0]}:{target[1]} rtt {rtt_ms:g} ms"
        f"{f', {rate_mbit:g} Mbit/s' if rate_mbit else ''}",
        flush=True,
    )
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--listen", required=True, help="ADDR:PORT on loopback")
    p.add_argument("--target", required=True, help="ADDR:PORT on loopback")
    p.add_argument("--rtt-ms", type=float, required=True)
    p.add_argument("--rate-mbit", type=float, default=None)
    p.add_argument("--tag", default="", help="ignored; names the lab dir in the command line (PID checks)")
    a = p.parse_args(argv)
    listen, target = (_endpoint(a.listen), _endpoint(a.target))
    try:
        asyncio.run(serve(listen, target, a.rtt_ms, a.rate_mbit))
    except KeyboardInterrupt:
        pass
    return 0


def _endpoint(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return _loopback(host), int(port)


@dataclass
class DelayProxy:
    """The proxy process for one lab host: start in its own session, stop by PID."""

    listen_address: str
    listen_port: int
    target_address: str
    target_port: int
    rtt_ms: float
    dir: Path
    rate_mbit: float | None = None
    proc: subprocess.Popen[Any] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def argv(self) -> list[str]:
        argv = [
            sys.executable,
            "-m",
            "remote_ops.hostlab.delay",
            "--listen",
            f"{self.listen_address}:{self.listen_port}",
            "--target",
            f"{self.target_address}:{self.target_port}",
            "--rtt-ms",
            str(self.rtt_ms),
            "--tag",
            str(self.dir),
        ]
        return argv + (["--rate-mbit", str(self.rate_mbit)] if self.rate_mbit else [])

    def start(self, timeout: float = 10.0) -> "DelayProxy":
        from ._proc import port_open, spawn, wait_for

        repo = Path(__file__).resolve().parents[2]
        proc = self.proc = spawn(
            self.argv(), self.dir / f"delay-{self.listen_address}-{self.listen_port}.log", cwd=repo
        )
        wait_for(
            lambda: port_open(self.listen_address, self.listen_port) or proc.poll() is not None,
            timeout,
            f"delay proxy on {self.listen_address}:{self.listen_port}",
        )
        if proc.poll() is not None:
            from ._proc import LabError

            raise LabError(f"delay proxy exited with {proc.returncode}; see {self.dir}")
        return self

    def stop(self) -> None:
        from ._proc import kill_tree

        if self.proc is not None and self.proc.poll() is None:
            kill_tree(self.proc.pid, term_timeout=2, timeout=5, proc=self.proc)
        self.proc = None


if __name__ == "__main__":
    sys.exit(main())
