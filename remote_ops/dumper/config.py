"""Dumper settings from the environment, and the layer-id conventions.

Stdlib only.  Two conventions for the captured layers exist and both are
recorded in every file:
- SGLang's `layers_to_capture`: capture at the top of layer i, i.e. the residual
  stream entering layer i = the output of layer i-1;
- EAGLE-3's `eagle_aux_hidden_state_layer_ids` = layers_to_capture - 1.
For Kimi-K2.5 / DeepSeek-V3 (61 layers): [2, 30, 58] <-> [1, 29, 57].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Mapping, Optional

ENV_DIR = "SGLANG_HS_DUMP_DIR"
ENV_LAYERS = "SGLANG_HS_DUMP_LAYERS"
ENV_ALL_RANKS = "SGLANG_HS_DUMP_ALL_RANKS"
ENV_POLICY = "SGLANG_HS_DUMP_POLICY"
ENV_BUFFERS = "SGLANG_HS_DUMP_BUFFERS"
ENV_WRITERS = "SGLANG_HS_DUMP_WRITERS"
ENV_FUSION = "SGLANG_HS_DUMP_FUSION"
ENV_BUFFER_TOKENS = "SGLANG_HS_DUMP_BUFFER_TOKENS"
ENV_WAIT_S = "SGLANG_HS_DUMP_WAIT_S"
ENV_FSYNC = "SGLANG_HS_DUMP_FSYNC"
ENV_WRITER = "SGLANG_HS_DUMP_WRITER"
ENV_WRITER_SCHED = "SGLANG_HS_DUMP_WRITER_SCHED"
ENV_WRITER_CPUS = "SGLANG_HS_DUMP_WRITER_CPUS"
ENV_GATHER_TOKENS = "SGLANG_HS_DUMP_GATHER_TOKENS"
ENV_GATHER_STEPS = "SGLANG_HS_DUMP_GATHER_STEPS"
ENV_GATHER_MS = "SGLANG_HS_DUMP_GATHER_MS"
ENV_DTYPE = "SGLANG_HS_DUMP_DTYPE"

POLICIES = ("backpressure", "drop")
FUSION_MODES = ("disable", "allreduce")
# process (default): span files written by a child process (procwriter.py), which shares no GIL with
# the forward thread.  thread: writer threads inside the SGLang process (writer.py).  Threads are the
# production fallback, taken without asking when the child cannot start or libcuda.so.1 cannot be
# loaded through ctypes (the child learns that copies landed from a CUDA host function); asking for
# them here is for hosts where a child process is unwelcome.
WRITER_MODES = ("process", "thread")
WRITER_SCHEDS = ("batch", "idle", "normal")  # the writer process's Linux scheduling policy
# How the float states are stored (FORMAT.md "FP8 storage").  bf16 (default): as the model computed
# them, in its own dtype (bf16 for every model served here), bit-exact.  fp8_e4m3: e4m3 values with a
# float32 scale per token row and layer (fp8.py), cast on the GPU before the copy to the host, so the
# host buffers, the copy and the files hold about half the bytes; lossy, opt-in.
STORAGES = ("bf16", "fp8_e4m3")


@dataclass
class DumpConfig:
    """What the environment asks of the dumper (validated, with defaults)."""

    root: str
    layers: Optional[List[int]] = None  # layers_to_capture convention; None = default for L
    all_ranks: bool = False
    policy: str = "backpressure"
    buffers: int = 4
    writers: int = 8
    fusion: str = "disable"
    buffer_tokens: Optional[int] = None  # None = chunked_prefill_size, else 8192
    wait_s: float = 600.0  # longest backpressure wait before a batch is dropped
    fsync: bool = True
    writer: str = "process"  # WRITER_MODES: a child process (default), or threads in this one (the fallback)
    writer_sched: str = "batch"  # writer process: SCHED_BATCH (never preempts the forward thread on wake-up)
    writer_cpus: Optional[List[int]] = None  # writer process's CPUs (None = all the process may use)
    # steps under gather_tokens rows are copied together, up to gather_steps of them or gather_ms after
    # the first (gather.py); 0 tokens = every step copied on its own.  Held GPU memory: up to
    # gather_tokens rows of captured tensors more (57,344 B per row for Kimi-K2.5: 235 MB at 4,096)
    gather_tokens: int = 4096
    gather_steps: int = 8
    gather_ms: int = 500
    storage: str = "bf16"  # STORAGES
    env_seen: dict = field(default_factory=dict)


def _int(env: Mapping[str, str], name: str, default: int, minimum: int = 1) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError("%s=%r is not an integer" % (name, raw)) from None
    if value < minimum:
        raise ValueError("%s=%d must be >= %d" % (name, value, minimum))
    return value


def _choice(env: Mapping[str, str], name: str, choices: tuple) -> str:
    raw = env.get(name, "").strip().lower() or choices[0]
    if raw not in choices:
        raise ValueError("%s=%r: want one of %s" % (name, raw, "|".join(choices)))
    return raw


def parse_layer_list(raw: str) -> Optional[List[int]]:
    """'2,30,58' -> [2, 30, 58]; empty -> None (use the default)."""
    parts = [p.strip() for p in raw.replace(" ", ",").split(",") if p.strip()]
    if not parts:
        return None
    try:
        return [int(p) for p in parts]
    except ValueError:
        raise ValueError("%s=%r is not a comma list of integers" % (ENV_LAYERS, raw)) from None


def config_from_env(env: Mapping[str, str]) -> DumpConfig:
    """Build the config from SGLANG_HS_DUMP_*; ValueError names the bad variable."""
    root = env.get(ENV_DIR, "").strip()
    if not root:
        raise ValueError("%s is not set" % ENV_DIR)
    return DumpConfig(
        root=root,
        layers=parse_layer_list(env.get(ENV_LAYERS, "")),
        all_ranks=env.get(ENV_ALL_RANKS, "").strip().lower() in ("1", "true", "yes", "on"),
        policy=_choice(env, ENV_POLICY, POLICIES),
        buffers=_int(env, ENV_BUFFERS, 4),
        writers=_int(env, ENV_WRITERS, 8),
        fusion=_choice(env, ENV_FUSION, FUSION_MODES),
        buffer_tokens=_int(env, ENV_BUFFER_TOKENS, 0, 0) or None,
        wait_s=float(_int(env, ENV_WAIT_S, 600)),
        fsync=env.get(ENV_FSYNC, "1").strip().lower() not in ("0", "false", "no", "off"),
        writer=_choice(env, ENV_WRITER, WRITER_MODES),
        writer_sched=_choice(env, ENV_WRITER_SCHED, WRITER_SCHEDS),
        writer_cpus=parse_cpu_list(env.get(ENV_WRITER_CPUS, "")),
        gather_tokens=_int(env, ENV_GATHER_TOKENS, 4096, 0),
        gather_steps=_int(env, ENV_GATHER_STEPS, 8),
        gather_ms=_int(env, ENV_GATHER_MS, 500),
        storage=_choice(env, ENV_DTYPE, STORAGES),
        env_seen={k: v for k, v in env.items() if k.startswith("SGLANG_HS_DUMP_")},
    )


def parse_cpu_list(raw: str) -> Optional[List[int]]:
    """'2-7,12' -> [2, 3, 4, 5, 6, 7, 12]; empty -> None (no restriction)."""
    cpus: List[int] = []
    for part in [p.strip() for p in raw.replace(" ", ",").split(",") if p.strip()]:
        lo, _, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError("%s=%r is not a CPU list like 2-7,12" % (ENV_WRITER_CPUS, raw)) from None
        if first < 0 or last < first:
            raise ValueError("%s=%r: bad range %r" % (ENV_WRITER_CPUS, raw, part))
        cpus.extend(range(first, last + 1))
    return sorted(set(cpus)) or None


def default_layers(num_layers: int) -> List[int]:
    """SGLang's EAGLE-3 default `[2, L//2, L-3]` ([2, 30, 58] for 61 layers)."""
    return [2, num_layers // 2, num_layers - 3]


def resolve_layers(num_layers: int, override: Optional[List[int]] = None) -> List[int]:
    """The sorted, unique layers_to_capture; each id must lie in 1..L-1.

    The model appends aux states in loop order, so the file's aux order is
    ascending whatever order the environment gave.  Layer 0 is refused: its
    residual is still None there.
    """
    layers = sorted(set(override if override is not None else default_layers(num_layers)))
    bad = [i for i in layers if not 1 <= i <= num_layers - 1]
    if bad or len(layers) != 3:
        raise ValueError(
            "layers_to_capture %s: want 3 distinct ids in 1..%d (L=%d)" % (layers, num_layers - 1, num_layers)
        )
    return layers


def eagle_layer_ids(layers_to_capture: List[int]) -> List[int]:
    """EAGLE-3 convention: the layers whose *output* is captured."""
    return [i - 1 for i in layers_to_capture]
