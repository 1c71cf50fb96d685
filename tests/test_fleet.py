"""Fleet selection (Ansible-style patterns) and fan-out (bounded, isolated, worst exit code): pure."""

from __future__ import annotations

import threading
import time

import pytest

from remote_ops.core import targets
from remote_ops.core.inventory import Inventory, parse_inventory_data
from remote_ops.errors import CommandFailed, ConfigError, ExitCode, UsageError
from remote_ops.workflows import fleet


def _inventory() -> Inventory:
    hosts = parse_inventory_data(
        {"hosts": {f"gpu-0{i}": {"address": f"127.0.9.{i}"} for i in range(1, 5)}}, source="inventory/fleet.yaml"
    )
    rack = parse_inventory_data(
        {"hosts": {"gpu-03": {"address": "127.0.9.3"}, "gpu-04": {"address": "127.0.9.4"}}},
        source="inventory/rack2.yaml",
    )
    lone = parse_inventory_data({"hosts": {"trainer": {"address": "127.0.8.1"}}}, source="inventory/trainer.yaml")
    by_name = {h.name: h for h in hosts + lone}
    return Inventory(
        hosts=by_name, groups={"fleet": tuple(h.name for h in hosts), "rack2": tuple(h.name for h in rack)}
    )


def names(hosts) -> list[str]:
    return [h.name for h in hosts]


@pytest.mark.parametrize(
    "pattern,want",
    [
        ("gpu-01", ["gpu-01"]),
        ("fleet", ["gpu-01", "gpu-02", "gpu-03", "gpu-04"]),
        ("gpu-0[12]", ["gpu-01", "gpu-02"]),
        ("trainer,gpu-02", ["trainer", "gpu-02"]),
        ("trainer:gpu-02", ["trainer", "gpu-02"]),
        ("fleet,!rack2", ["gpu-01", "gpu-02"]),
        ("fleet,&rack2", ["gpu-03", "gpu-04"]),
        ("all", ["gpu-01", "gpu-02", "gpu-03", "gpu-04", "trainer"]),
        ("rack*", ["gpu-03", "gpu-04"]),
        ("127.0.8.1", ["trainer"]),
        ("gpu-01,gpu-01,fleet", ["gpu-01", "gpu-02", "gpu-03", "gpu-04"]),
    ],
)
def test_patterns(pattern, want):
    assert names(targets.select(_inventory(), pattern)) == want


def test_all_and_limit():
    inv = _inventory()
    assert names(targets.select(inv, None, all_hosts=True, limit="rack2")) == ["gpu-03", "gpu-04"]
    assert names(targets.select(inv, "fleet", limit="!gpu-01")) == ["gpu-02", "gpu-03", "gpu-04"]
    with pytest.raises(ConfigError, match="no host matches"):
        targets.select(inv, "trainer", limit="rack2")
    with pytest.raises(UsageError):
        targets.select(inv, "fleet", all_hosts=True)


def test_an_unknown_name_is_an_error_with_close_matches():
    with pytest.raises(ConfigError) as err:
        targets.select(_inventory(), "gpu-1")
    assert "did you mean" in err.value.hint and "gpu-01" in err.value.hint


@pytest.mark.parametrize("ref", ["root@example-host", "127.0.0.9:2222", "10.1.230.174", "ubuntu@10.1.230.174:22"])
def test_an_address_form_is_an_ad_hoc_host(ref):
    (host,) = targets.select(_inventory(), ref)
    assert host.source == "(ad hoc)"


def test_fan_out_isolates_failures_and_keeps_order():
    inv = _inventory()

    def work(h):
        if h.name == "gpu-02":
            raise CommandFailed("boom", command="false", exit_status=1)
        return 0, {"name": h.name}

    run = fleet.fan_out(list(inv.hosts.values()), work, forks=3)
    assert names_of(run) == list(inv.hosts)
    assert run.exit_code == ExitCode.COMMAND_FAILED
    bad = run.outcomes[1]
    assert bad.error.host == "gpu-02" and run.to_dict()["failed"] == ["gpu-02"]


def names_of(run):
    return [o.host for o in run.outcomes]


def test_fan_out_is_bounded_by_forks():
    live, peak, lock = [0], [0], threading.Lock()

    def work(h):
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        time.sleep(0.05)
        with lock:
            live[0] -= 1
        return 0, None

    fleet.fan_out(list(_inventory().hosts.values()), work, forks=2)
    assert peak[0] == 2


@pytest.mark.parametrize("codes,want", [([0, 0], 0), ([0, 11], 11), ([11, 12, 0], 12), ([4, 11, 9], 9), ([], 0)])
def test_worst_exit(codes, want):
    assert fleet.worst_exit(codes) == want


def test_rolling_stops_after_a_failed_batch_unless_told_to_go_on():
    hosts = list(_inventory().hosts.values())
    work = lambda h: (ExitCode.TIMEOUT if h.name == "gpu-02" else 0, None)  # noqa: E731
    run = fleet.rolling(hosts, work, serial=2)
    assert [o.skipped for o in run.outcomes] == [False, False, True, True, True]
    assert run.exit_code == ExitCode.TIMEOUT
    run = fleet.rolling(hosts, work, serial=2, keep_going=True)
    assert not any(o.skipped for o in run.outcomes)
