"""The run-config label must keep its value across releases for an unchanged inventory.

A running container whose label differs from what deploy computes now is
restarted ("run settings changed"), and on a GPU host that reloads the model
(a 1T-parameter model: many minutes).  `engine.spec.for_host` computes the
label with the formula of the first release (`container.run_argv` before the
engine seam); these tests pin it: against a verbatim copy of that code, and
against fixed values.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from remote_ops.core import shell
from remote_ops.core.inventory import parse_inventory_data
from remote_ops.engine import labels
from remote_ops.engine.spec import for_host
from remote_ops.workflows import container


def host(**over):
    return parse_inventory_data({"hosts": {"gpu-node": {"address": "10.1.230.174", **over}}}, "t.yaml")[0]


# -- the first release's code, verbatim (container.py before the engine seam) ----------------
def _legacy_run_argv(host, image):
    LABEL_PREFIX = "org.remote-ops."
    c = host.container
    argv = [
        "docker",
        "run",
        "-d",
        "--pull=never",
        "--init",
        "--name",
        c.name,
        "--restart",
        c.restart,
        *_legacy_gpu_args(host),
        "--shm-size",
        c.shm_size,
        "--ipc",
        c.ipc,
        "-p",
        f"{c.bind_address}:{host.server.port}:{host.server.port}",
        *_legacy_volume_args(host),
    ]
    argv += ["--runtime", c.runtime] if c.runtime else []
    env = {**container.dump_env(host), "SGLANG_PORT": str(host.server.port), **c.env}
    argv += [a for k, v in sorted(env.items()) for a in ("-e", f"{k}={v}")]
    argv += ["--label", f"{LABEL_PREFIX}managed=1", "--label", f"{LABEL_PREFIX}host={host.name}"]
    doc = json.dumps([argv, image, host.server.launcher, container.server_args(host)])
    config = hashlib.sha256(doc.encode()).hexdigest()[:16]
    return argv + [
        "--label",
        f"{LABEL_PREFIX}run-config={config}",
        image,
        *host.server.launcher,
        *container.server_args(host),
    ]


def _legacy_gpu_args(host):
    gpus = host.container.gpus
    if gpus == "none":
        return []
    if gpus == "all":
        return ["--gpus", "all"]
    return ["--gpus", '"device=' + ",".join(str(g) for g in gpus) + '"']


def _legacy_volume_args(host):
    pairs = [
        f"{host.model.path}:{host.model.path}:ro",
        f"{host.dump.dir}:{host.dump.dir}",
        f"{host.logs.dir}:{host.logs.dir}",
        *host.container.volumes,
    ]
    return [a for v in pairs for a in ("-v", v)]


HOSTS = [
    host(),
    host(dump={"layers": [2, 30, 58], "all_ranks": True}),
    host(
        container={
            "gpus": [0, 1],
            "runtime": "nvidia",
            "env": {"HF_TOKEN": "x", "A": "b"},
            "volumes": ["/a:/b:ro"],
            "restart": "no",
        }
    ),
    host(server={"tp": 4, "extra_args": ["--max-running-requests", "8"], "mem_fraction_static": 0.8}),
    host(container={"gpus": "none", "shm_size": "64g", "ipc": "private"}),
]


@pytest.mark.parametrize("h", HOSTS)
def test_label_and_argv_equal_the_first_release(h):
    image = "remote-ops/sglang-eagle3:0.5.9-0123456789ab"
    legacy = _legacy_run_argv(h, image)
    assert container.run_argv(h, image) == legacy
    label = next(a for a in legacy if a.startswith(labels.RUN_CONFIG + "=")).split("=", 1)[1]
    assert for_host(h, image).labels[labels.RUN_CONFIG] == label == container.expected_run_config(h, image)


def test_label_values_are_pinned():
    """Values computed by the first release's code (a change here restarts running containers)."""
    assert container.expected_run_config(host(), "remote-ops/sglang-eagle3:0.5.9-abc") == "fd1766cb7c9dd961"
    h = host(container={"gpus": [0, 1], "runtime": "nvidia", "env": {"HF_TOKEN": "x"}}, dump={"layers": [2, 30, 58]})
    assert container.expected_run_config(h, "img:t") == "3ad600fb23d5a41b"


def test_the_engine_creates_what_the_label_describes():
    """The label is over the same spec the engine posts: every `docker run` flag comes from it."""
    spec = for_host(host(), "img:t")
    line = shell.join(container.run_argv(host(), "img:t"))
    for k, v in spec.env.items():
        assert f"-e {shell.quote(f'{k}={v}')}" in line
    assert all(v in line for v in spec.volumes) and spec.command[-1] in line
