"""`attach(model)`: the init block's call, on every TP rank, in the patched model class's __init__.

It reads the environment, refuses configurations that break the capture
(clear log error, capture left off, `stats.json` says why), handles the
all-reduce-fusion window, turns capture on with the chosen layers and stores
the dumper as `model._remote_ops_dump`.  Every rank turns capture on (the
aux path may hold collectives); only writer ranks copy and write.

The model decides how its layers are set: `set_eagle3_layers_to_capture` where
it exists (Qwen3-MoE marks the decoder layers themselves, Qwen2.5-VL also
flips its inner model's flag, DeepSeek >= 0.5.13 adds 1 only when the first id
is 1), read back and checked; the language model is found inside wrappers
(Kimi-K2.5's `language_model`).  The class and convention go into the metadata.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Mapping, Optional

from . import dumpfile
from .config import DumpConfig, config_from_env, default_layers, eagle_layer_ids, resolve_layers
from .runtime import Runtime, handle_fusion, hazards, probe_runtime

log = logging.getLogger("remote_ops_dump")


def model_shape(model: Any) -> "tuple[int, int]":
    """(num_hidden_layers, hidden_size) from the model's config, with fallbacks."""
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    layers = getattr(config, "num_hidden_layers", None) or len(getattr(model.model, "layers", []))
    return int(layers), int(getattr(config, "hidden_size", 0) or 0)


def language_model(model: Any) -> "tuple[Any, str]":
    """(the module holding the capture flag, where it was found): the model itself, or one
    level down in a wrapper (Kimi-K2.5's `language_model`); the model itself when none has it."""
    if not hasattr(model, "capture_aux_hidden_states"):
        for attr in ("language_model", "model"):
            inner = getattr(model, attr, None)
            if inner is not None and hasattr(inner, "capture_aux_hidden_states"):
                return inner, attr
    return model, "self"


def _captured(lm: Any) -> list:
    return list(getattr(getattr(lm, "model", None), "layers_to_capture", None) or [])


def turn_on(lm: Any, layers: list, num_layers: int) -> dict:
    """Turn capture on for `layers` (layers_to_capture convention) the model's own way; read back.

    With `set_eagle3_layers_to_capture`: None for SGLang's default layers, else the
    EAGLE-3 ids (layers - 1); a model that took them as given (DeepSeek >= 0.5.13
    unless the first id is 1) is called again with `layers`.  Without the method:
    the two attributes.  Raises RuntimeError when the model did not end up capturing
    exactly `layers` (e.g. a non-last pipeline rank returns early)."""
    method = getattr(lm, "set_eagle3_layers_to_capture", None)
    if method is None:
        lm.capture_aux_hidden_states = True
        lm.model.layers_to_capture = list(layers)
        convention = "attributes"
    elif list(layers) == default_layers(num_layers):
        method(None)
        convention = "default"
    else:
        method(eagle_layer_ids(layers))
        convention = "plus_one"
        if _captured(lm) == eagle_layer_ids(layers):
            _unmark_layers(lm, layers)
            method(list(layers))
            convention = "as_given"
    if lm.capture_aux_hidden_states is not True or _captured(lm) != list(layers):
        raise RuntimeError(
            "%s.set_eagle3_layers_to_capture left capture=%s, layers_to_capture=%s; wanted %s"
            % (type(lm).__name__, lm.capture_aux_hidden_states, _captured(lm), list(layers))
        )
    return {
        "model_class": type(lm).__name__,
        "capture_convention": convention,
        "capture_method": "attributes" if method is None else "set_eagle3_layers_to_capture",
    }


def _unmark_layers(lm: Any, keep: list) -> None:
    """Undo per-layer capture marks (Qwen2-MoE style `_is_layer_to_capture`) of a first call."""
    for i, layer in enumerate(getattr(lm.model, "layers", None) or []):
        if getattr(layer, "_is_layer_to_capture", False) and i not in keep:
            layer._is_layer_to_capture = False


def file_metadata(model: Any, runtime: Runtime, layers: list, hidden_size: int, fusion: str) -> dict:
    """Run-wide metadata of every file (span fields are added by format.span_metadata)."""
    num_layers, _ = model_shape(model)
    arch = getattr(getattr(model, "config", None), "architectures", None) or [type(model).__name__]
    return {
        "sglang_version": runtime.version,
        "layers_to_capture": json.dumps(layers),
        "eagle_aux_hidden_state_layer_ids": json.dumps(eagle_layer_ids(layers)),
        "num_hidden_layers": str(num_layers),
        "hidden_size": str(hidden_size),
        "hidden_states_norm": "post-norm",
        "aux_hidden_states_norm": "pre-norm",
        "allreduce_fusion": fusion,
        "tp_size": str(runtime.tp_size),
        "model_arch": str(arch[0]),
        "dtype": "unknown",
    }


def refuse(config: Optional[DumpConfig], runtime: Runtime, reasons: list) -> None:
    """Log the refusal loudly and leave a `stats.json` saying why (writer rank only)."""
    for reason in reasons:
        log.error("[hs-dump] REFUSED, hidden states will NOT be dumped: %s", reason)
    if config is None or not (config.all_ranks or runtime.rank == 0):
        return
    try:
        folder = os.path.join(config.root, dumpfile.rank_dir_name(runtime.rank))
        os.makedirs(folder, exist_ok=True)
        dumpfile.write_json_atomic(
            os.path.join(folder, dumpfile.STATS_NAME),
            {
                "state": "refused",
                "reason": reasons,
                "rank": runtime.rank,
                "sglang_version": runtime.version,
                "files": 0,
            },
        )
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
        model, found_in = language_model(model)
        model._remote_ops_dump = None
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
    try:
        capture = dict(turn_on(model, layers, num_layers), language_model=found_in)
    except RuntimeError as exc:
        refuse(config, runtime, [str(exc)])
        return None
    return _install(model, config, runtime, layers, hidden_size, fusion, Dumper, capture)


def _install(model, config, runtime, layers, hidden_size, fusion, dumper_cls, capture=None):
    """Create this rank's dumper (capture is already on) and store it on the model."""
    writer = config.all_ranks or runtime.rank == 0
    chunk = runtime.server_args.get("chunked_prefill_size", None)
    dumper = dumper_cls(
        config,
        runtime.rank,
        writer,
        layers,
        hidden_size,
        dict(file_metadata(model, runtime, layers, hidden_size, fusion), **(capture or {})),
        buffer_tokens=config.buffer_tokens or (chunk if chunk and chunk > 0 else None),
    )
    model._remote_ops_dump = dumper
    log.warning(
        "[hs-dump] rank %d (%s): capture on, layers_to_capture=%s (EAGLE-3 ids %s), %s, "
        "all-reduce fusion: %s, policy=%s buffers=%d writers=%d gather=%d rows/%d steps/%d ms, dir=%s",
        runtime.rank,
        runtime.rank_source,
        layers,
        eagle_layer_ids(layers),
        "writer" if writer else "not writing",
        fusion,
        config.policy,
        config.buffers,
        config.writers,
        config.gather_tokens,
        config.gather_steps,
        config.gather_ms,
        config.root,
    )
    return dumper
