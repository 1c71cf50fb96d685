"""`attach(model)`: the init block's call, on every TP rank, in DeepseekV2ForCausalLM.__init__.

It reads the environment, refuses configurations that break the capture
(clear log error, capture left off, `stats.json` says why), handles the
all-reduce-fusion window, turns capture on with the chosen layers and stores
the dumper as `model._remote_ops_dump`.  Every rank turns capture on (the
aux path may hold collectives); only writer ranks copy and write.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any, Mapping, Optional

from . import format as fmt
from .config import DumpConfig, config_from_env, eagle_layer_ids, resolve_layers
from .runtime import Runtime, handle_fusion, hazards, probe_runtime

log = logging.getLogger("remote_ops_dump")


def model_shape(model: Any) -> "tuple[int, int]":
    """(num_hidden_layers, hidden_size) from the model's config, with fallbacks."""
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    layers = getattr(config, "num_hidden_layers", None) or len(getattr(model.model, "layers", []))
    return int(layers), int(getattr(config, "hidden_size", 0) or 0)


def file_metadata(model: Any, runtime: Runtime, layers: list, hidden_size: int, fusion: str) -> dict:
    """Run-wide metadata of every file (span fields are added by format.span_metadata)."""
    num_layers, _ = model_shape(model)
    arch = getattr(getattr(model, "config", None), "architectures", None) or [type(model).__name__]
    return {"sglang_version": runtime.version, "layers_to_capture": json.dumps(layers),
            "eagle_aux_hidden_state_layer_ids": json.dumps(eagle_layer_ids(layers)),
            "num_hidden_layers": str(num_layers), "hidden_size": str(hidden_size),
            "hidden_states_norm": "post-norm", "aux_hidden_states_norm": "pre-norm",
            "allreduce_fusion": fusion, "tp_size": str(runtime.tp_size), "model_arch": str(arch[0]),
            "dtype": "unknown"}


def refuse(config: Optional[DumpConfig], runtime: Runtime, reasons: list) -> None:
    """Log the refusal loudly and leave a `stats.json` saying why (writer rank only)."""
    for reason in reasons:
        log.error("[hs-dump] REFUSED, hidden states will NOT be dumped: %s", reason)
    if config is None or not (config.all_ranks or runtime.rank == 0):
        return
    try:
        folder = os.path.join(config.root, fmt.rank_dir_name(runtime.rank))
        os.makedirs(folder, exist_ok=True)
        fmt.write_json_atomic(os.path.join(folder, fmt.STATS_NAME),
                              {"state": "refused", "reason": reasons, "rank": runtime.rank,
                               "sglang_version": runtime.version, "files": 0})
    except OSError as exc:
        log.error("[hs-dump] could not write the refusal to %s: %s", config.root, exc)


def attach(model: Any, env: Optional[Mapping[str, str]] = None, runtime: Optional[Runtime] = None):
    """Turn capture on and store the dumper as `model._remote_ops_dump`; returns it (None if refused)."""
    from .dumper import Dumper

    model._remote_ops_dump = None
    runtime = runtime or probe_runtime()
    config = None
    try:
        config = config_from_env(os.environ if env is None else env)
        num_layers, hidden_size = model_shape(model)
        layers = resolve_layers(num_layers, config.layers)
    except (ValueError, AttributeError, TypeError) as exc:
        refuse(config, runtime, ["bad dump settings: %s" % exc])
        return None
    problems = hazards(runtime.server_args)
    if problems:
        refuse(config, runtime, problems)
        return None
    try:
        fusion = handle_fusion(model, runtime, config.fusion, layers)
    except RuntimeError as exc:
        refuse(config, runtime, [str(exc)])
        return None
    return _install(model, config, runtime, layers, hidden_size, fusion, Dumper)


def _install(model, config, runtime, layers, hidden_size, fusion, dumper_cls):
    """Flip the model's capture switches and create this rank's dumper."""
    model.capture_aux_hidden_states = True
    model.model.layers_to_capture = list(layers)
    writer = config.all_ranks or runtime.rank == 0
    chunk = runtime.server_args.get("chunked_prefill_size", None)
    dumper = dumper_cls(config, runtime.rank, writer, layers, hidden_size,
                        file_metadata(model, runtime, layers, hidden_size, fusion),
                        buffer_tokens=config.buffer_tokens or (chunk if chunk and chunk > 0 else None))
    model._remote_ops_dump = dumper
    log.warning("[hs-dump] rank %d (%s): capture on, layers_to_capture=%s (EAGLE-3 ids %s), %s, "
                "all-reduce fusion: %s, policy=%s buffers=%d writers=%d, dir=%s",
                runtime.rank, runtime.rank_source, layers, eagle_layer_ids(layers),
                "writer" if writer else "not writing", fusion, config.policy, config.buffers,
                config.writers, config.root)
    return dumper
