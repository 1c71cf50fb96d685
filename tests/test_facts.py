"""Facts parsers from captured text (pure)."""

from remote_ops.core.inventory import HostSpec
from remote_ops.probes.gpu import parse_gpus
from remote_ops.probes.sglang import parse_sglang_version
from remote_ops.workflows import facts

NVSMI = (
    "0, NVIDIA RTX PRO 6000 Blackwell Workstation Edition, 97887, 1, 34, 0, 12.0, 580.82.07\n"
    "1, NVIDIA RTX PRO 6000 Blackwell Workstation Edition, 97887, 90000, 61, [N/A], 12.0, 580.82.07\n"
)


def test_parse_gpus():
    gpus, err = parse_gpus(0, NVSMI)
    assert err is None and len(gpus) == 2
    assert gpus[0].compute_cap == "12.0" and gpus[1].memory_used_mib == 90000
    assert gpus[1].ecc_uncorrected is None


def test_no_driver():
    gpus, err = parse_gpus(127, "no NVIDIA driver")
    assert gpus == [] and err == "no NVIDIA driver"


def test_parse_full_sections():
    sec = {
        "os": (0, 'PRETTY_NAME="Ubuntu 22.04.4 LTS"\n'),
        "kernel": (0, "Linux 5.15.0 x86_64\n"),
        "cpu": (0, "128\nmodel name\t: AMD EPYC 9554\n"),
        "mem": (0, "MemTotal:       2113459200 kB\nMemAvailable:   2000000000 kB\n"),
        "gpus": (0, NVSMI),
        "docker": (0, '{"Client":{"Version":"27.1.1"},"Server":{"Version":"27.1.1","ApiVersion":"1.46"}}'),
        "runtimes": (0, '{"nvidia":{"path":"nvidia-container-runtime"},"runc":{"path":"runc"}}'),
        "nvidia_ctk": (0, "/usr/bin/nvidia-ctk\n"),
        "disk": (
            0,
            "Filesystem 1-blocks Used Available Capacity Mounted on\n/dev/nvme0n1 100 50 4000000000000 1% /data\n",
        ),
        "sglang_version": (0, '__version__ = "0.5.9"\n'),
        "target": (0, "abc123  /root/sglang/python/sglang/srt/models/deepseek_v2.py\n2986 /root/...\n"),
    }
    f = facts.parse(HostSpec(name="gpu-node"), sec)
    assert f.os == "Ubuntu 22.04.4 LTS" and f.cpus == 128 and f.cpu_model == "AMD EPYC 9554"
    assert f.mem_total_bytes == 2113459200 * 1024
    assert f.docker["server"] == "27.1.1" and f.nvidia_runtime and f.docker_runtimes == ["nvidia", "runc"]
    assert f.dump_dir_free_bytes == 4000000000000
    assert (f.sglang_version, f.target_sha256, f.target_lines) == ("0.5.9", "abc123", 2986)


def test_sglang_version_ignores_indented_fallback():
    version_py = (
        'try:\n    from sglang._version import __version__\nexcept ImportError:\n    __version__ = "0.0.0.dev0"\n'
    )
    scm = "__version__ = version = '0.5.9'\n__version_tuple__ = (0, 5, 9)\n"
    assert parse_sglang_version(version_py + scm) == "0.5.9"
    assert parse_sglang_version(version_py) is None
    assert parse_sglang_version('__version__ = "0.4.6.post1"\n') == "0.4.6.post1"
