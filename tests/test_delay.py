"""The latency lab: a user-space delay proxy (RTT, rate cap) in front of a real lab sshd."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
from conftest import require

from remote_ops.hostlab import HostLab, lab_unavailable
from remote_ops.hostlab.delay import release_time


def test_release_time_is_one_way_later_without_a_cap():
    assert release_time(10.0, 1000, 0.025, None, 0.0) == pytest.approx(10.025)


def test_release_time_waits_for_the_link_with_a_cap():
    # 1 Mbit/s: 125,000 bytes take 1 s on the wire; a chunk behind a busy link waits for it.
    assert release_time(10.0, 125_000, 0.025, 1e6, 0.0) == pytest.approx(11.025)
    assert release_time(10.0, 125_000, 0.025, 1e6, 10.5) == pytest.approx(11.525)


def test_the_proxy_refuses_non_loopback_addresses():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "remote_ops.hostlab.delay",
            "--listen",
            "127.0.0.1:0",
            "--target",
            "192.0.2.1:22",
            "--rtt-ms",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode != 0 and "not a loopback address" in proc.stderr


@pytest.fixture(scope="module")
def slow_lab(tmp_path_factory):
    require(lab_unavailable())
    with HostLab(tmp_path_factory.mktemp("delaylab"), names=["far"], docker=False) as lab:
        lab.add_delay("far", 60, alias="far-60ms")
        lab.add_delay("far", 0, rate_mbit=40, alias="far-40mbit")
        yield lab


def _rtt(address: str, port: int) -> float:
    """Seconds from connect to sshd's banner: one round trip through the proxy (plus sshd's own start)."""
    t0 = time.monotonic()
    with socket.create_connection((address, port), timeout=10) as s:
        s.recv(64)
    return time.monotonic() - t0


def test_an_ssh_command_through_the_proxy_pays_the_round_trips(slow_lab):
    near = slow_lab.connect("far")
    far = slow_lab.connect("far-60ms")  # strict host keys: the alias has its own known_hosts line
    try:
        near_s = min(_timed(near) for _ in range(5))
        far_s = min(_timed(far) for _ in range(5))
    finally:
        near.close()
        far.close()
    # The fastest of 5 (least disturbed by other load): a command cannot come back through
    # the proxy in less than one round trip, and should not need many more.
    assert far_s >= 0.058
    assert far_s - near_s < 0.6


def _timed(remote) -> float:
    t0 = time.monotonic()
    assert remote.run("true").ok
    return time.monotonic() - t0


def test_a_rate_cap_slows_a_bulk_read(slow_lab):
    far = slow_lab.connect("far-40mbit")
    try:
        t0 = time.monotonic()
        out = far.run("head -c 4000000 /dev/zero | base64 -w0 | head -c 4000000", timeout=60).stdout
        elapsed = time.monotonic() - t0
    finally:
        far.close()
    assert len(out) == 4_000_000
    assert elapsed >= 0.75  # 32 Mbit at 40 Mbit/s: 0.8 s on the wire


def test_stop_leaves_no_proxy_process(tmp_path):
    require(lab_unavailable())
    lab = HostLab(tmp_path / "lab", names=["h"], docker=False).start()
    lab.add_delay("h", 10)
    pid = next(iter(lab.delayed.values()))[1].pid
    lab.stop()
    with pytest.raises(ProcessLookupError):
        import os

        os.kill(pid, 0)
