"""What the dumper learns from the running SGLang: version, ranks, server args, hazards.

Every lookup tolerates version differences (getattr with fallbacks, imports in
try blocks): the dumper must never take the server down because a helper moved.
Tests pass a `Runtime` built by hand instead of probing a real SGLang.
"""

from __future__ import annotations

import importlib
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Callable, List, Mapping, Optional, Tuple

log = logging.getLogger("remote_ops_dump")

FUSION_WINDOW = ((0, 5, 7), (0, 5, 14))  # releases whose capture reads per-rank partial sums
FUSION_FLAG = "enable_flashinfer_allreduce_fusion"
FUSE_METHOD = "should_fuse_mlp_allreduce_with_next_layer"


class ServerArgsView:
    """Uniform `get(name, default)` over SGLang's ServerArgs object or an older dict."""

    def __init__(self, source: Any = None):
        self.source = source

    def get(self, name: str, default: Any = None) -> Any:
        if isinstance(self.source, Mapping):
            return self.source.get(name, default)
        return getattr(self.source, name, default)

    def set(self, name: str, value: Any) -> bool:
        """Set a flag in place (all ranks do the same in their own process); False if impossible."""
        try:
            if isinstance(self.source, Mapping):
                self.source[name] = value  # type: ignore[index]  # a read-only one raises, caught below
            elif self.source is not None:
                setattr(self.source, name, value)
            return self.source is not None
        except Exception:
            return False


@dataclass
class Runtime:
    """Facts about this SGLang process that the dumper decides on."""

    version: str = "unknown"
    rank: int = 0  # attention-TP rank (= TP rank without DP attention)
    tp_size: int = 1
    server_args: ServerArgsView = field(default_factory=ServerArgsView)
    rank_source: str = "default"


def _call(module: str, attr: str) -> Any:
    """`module.attr()` or None when the module, the helper or its state is missing."""
    try:
        return getattr(importlib.import_module(module), attr)()
    except Exception:
        return None


def _first(candidates: List[Tuple[str, Callable[[], Any]]]) -> Tuple[Any, str]:
    for source, fn in candidates:
        try:
            value = fn()
        except Exception:
            value = None
        if value is not None:
            return value, source
    return None, "default"


def sglang_version() -> str:
    """sglang.__version__, sglang.version.__version__ or the installed distribution's version."""
    value, _ = _first(
        [
            ("sglang", lambda: getattr(importlib.import_module("sglang"), "__version__", None)),
            ("sglang.version", lambda: getattr(importlib.import_module("sglang.version"), "__version__", None)),
            ("metadata", lambda: importlib.import_module("importlib.metadata").version("sglang")),
        ]
    )
    return str(value) if value else "unknown"


def load_server_args() -> ServerArgsView:
    """get_global_server_args() (0.5.x) or the older global_server_args_dict."""
    value, _ = _first(
        [
            ("server_args", lambda: _call("sglang.srt.server_args", "get_global_server_args")),
            (
                "schedule_batch",
                lambda: getattr(
                    importlib.import_module("sglang.srt.managers.schedule_batch"), "global_server_args_dict", None
                ),
            ),
        ]
    )
    return ServerArgsView(value)


def attention_tp_rank() -> Tuple[int, str]:
    """The attention-TP rank, falling back to the TP rank, the torch.distributed rank, 0."""
    value, source = _first(
        [
            (
                "dp_attention.get_attention_tp_rank",
                lambda: _call("sglang.srt.layers.dp_attention", "get_attention_tp_rank"),
            ),
            (
                "distributed.get_tensor_model_parallel_rank",
                lambda: _call("sglang.srt.distributed", "get_tensor_model_parallel_rank"),
            ),
            ("torch.distributed", _torch_rank),
        ]
    )
    return (int(value), source) if value is not None else (0, "default")


def _torch_rank() -> Optional[int]:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


def tensor_parallel_size(args: ServerArgsView) -> int:
    """TP world size from SGLang's parallel state, else server args, else 1."""
    value, _ = _first(
        [
            ("dp_attention", lambda: _call("sglang.srt.layers.dp_attention", "get_attention_tp_size")),
            ("distributed", lambda: _call("sglang.srt.distributed", "get_tensor_model_parallel_world_size")),
            ("server_args", lambda: args.get("tp_size")),
        ]
    )
    return int(value) if value else 1


def probe_runtime() -> Runtime:
    """Probe the real SGLang this process runs."""
    args = load_server_args()
    rank, source = attention_tp_rank()
    return Runtime(sglang_version(), rank, tensor_parallel_size(args), args, source)


def parse_version(text: str) -> Tuple[int, int, int]:
    """'0.5.10rc0' -> (0, 5, 10); unparsable -> (0, 0, 0)."""
    nums = [int(n) for n in re.findall(r"\d+", text.split("+")[0])[:3]]
    nums += [0] * (3 - len(nums))
    return (nums[0], nums[1], nums[2])


def in_fusion_window(version: str) -> bool:
    """True for 0.5.7 <= version < 0.5.14, where fused all-reduce defers into the captured stream."""
    lo, hi = FUSION_WINDOW
    return lo <= parse_version(version) < hi


# --------------------------------------------------------------------------- hazards

HAZARD_FLAGS = (
    ("pp_size", lambda v: (v or 1) > 1, "pipeline parallelism (--pp-size > 1): aux states live on other ranks"),
    ("enable_dp_attention", bool, "DP attention: each attention-TP group holds other requests"),
    ("enable_two_batch_overlap", bool, "two-batch overlap: layers run split micro-batches outside the capture loop"),
    ("enable_piecewise_cuda_graph", bool, "piecewise CUDA graph: the extend forward is compiled and replayed"),
    ("enable_attn_tp_input_scattered", bool, "attention-TP input scattering: each rank holds a slice of the tokens"),
    ("enable_nsa_prefill_context_parallel", bool, "NSA prefill context parallelism: tokens are split across ranks"),
    (
        "dp_size",
        lambda v: (v or 1) > 1,
        "data-parallel replicas (--dp-size > 1) would share rank dirs; run one per dump dir",
    ),
)


def hazards(args: ServerArgsView) -> List[str]:
    """Reasons why capture would be wrong or break in this configuration (empty = fine)."""
    found = []
    for name, is_on, why in HAZARD_FLAGS:
        value = args.get(name, None)
        if value is not None and is_on(value):
            found.append("%s=%r: %s" % (name, value, why))
    return found


# --------------------------------------------------------------------------- all-reduce fusion


def handle_fusion(model: Any, runtime: Runtime, mode: str, layers: List[int]) -> str:
    """Make the captured residual stream complete under flashinfer all-reduce fusion.

    In 0.5.7-0.5.13 a layer whose MLP all-reduce is fused into the next layer's
    norm leaves a per-rank partial sum in `hidden_states`, and the capture at the
    top of the next layer reads it.  `disable` turns the fusion flag off for the
    whole run; `allreduce` keeps fusion but makes the layers feeding a capture
    (layers_to_capture - 1) all-reduce their own output before it is captured.
    Returns what was done, for the log and the file metadata.
    """
    args = runtime.server_args
    if not in_fusion_window(runtime.version):
        return "not-needed (sglang %s outside 0.5.7-0.5.13)" % runtime.version
    if not args.get(FUSION_FLAG, False):
        return "off (%s is false)" % FUSION_FLAG
    if runtime.tp_size <= 1:
        return "not-needed (tp_size=1)"
    if mode == "allreduce" and _unfuse_capture_layers(model, layers):
        return "allreduce (layers %s all-reduce before capture; fusion kept elsewhere)" % [i - 1 for i in layers]
    if args.set(FUSION_FLAG, False):
        fallback = " (allreduce not possible in this release)" if mode == "allreduce" else ""
        return "disabled (%s=False while dumping)%s" % (FUSION_FLAG, fallback)
    raise RuntimeError("all-reduce fusion is on and could not be turned off")


def _unfuse_capture_layers(model: Any, layers: List[int]) -> bool:
    """Override `should_fuse_mlp_allreduce_with_next_layer` on the layers before each capture."""
    decoder_layers: Any = getattr(getattr(model, "model", None), "layers", None)
    try:
        comms = [getattr(decoder_layers[i - 1], "layer_communicator", None) for i in layers]
    except Exception:
        return False
    if any(c is None or not callable(getattr(c, FUSE_METHOD, None)) for c in comms):
        return False
    for comm in comms:
        setattr(comm, FUSE_METHOD, _never_fuse)
    return True


def _never_fuse(forward_batch: Any = None) -> bool:
    """Stand-in for the fuse decision: this layer's all-reduce runs before the capture."""
    return False
