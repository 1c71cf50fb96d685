"""bench/vllm_extract.py --profile's probe: mounted in a container AS the connector module, it loads
remote-ops' connector (mounted beside it, `REMOTE_OPS_PROBE_REAL`) and times it from outside.

- `REMOTE_OPS_PROBE=split`: the connector as it is, with the calls it makes timed per request in
  the engine's step (`inline`: `_copy_to_host`, `extract_from_kv_cache` or `gather_on_host`, `_file_context`,
  `file_metadata`, `vllm_version`, `os.makedirs`, `os.open`, `executor.submit`, ...) and in its
  writer thread (`write`: `save_file`, `os.replace`, `os.unlink`, `os.close`), each as wall and
  thread CPU seconds; the whole inline and write phases also with the thread's run-queue wait
  (`/proc/thread-self/schedstat`): wall - CPU - run-queue wait is time the thread slept (the
  GIL, an OpenMP barrier, I/O).  `wait_for_save` (upstream's lock files) and `get_finished` are
  timed per step.
- `REMOTE_OPS_PROBE=engine-only`: the connector does nothing (no lock file, no gather, no file); a
  finished request is reported done at once, so its blocks are freed as usual.  What is left of
  extraction's cost is vLLM's: the `extract_hidden_states` method (the cache-only draft layer, the
  blocks held until the connector reports the request done, the scheduler's connector calls).

One JSON line per request and phase into `REMOTE_OPS_PROBE_OUT`.  Wrapping costs about a
microsecond a call (a dozen calls a request).  Not shipped: nothing outside bench/ imports it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

REAL = os.environ.get("REMOTE_OPS_PROBE_REAL", "/opt/remote-ops-real/vllm_connector.py")
MODE = os.environ.get("REMOTE_OPS_PROBE", "split")
OUT = os.environ.get("REMOTE_OPS_PROBE_OUT", "/dumps/.probe.jsonl")

_spec = importlib.util.spec_from_file_location("remote_ops_vllm_connector_real", REAL)
assert _spec is not None and _spec.loader is not None
real: Any = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = real
_spec.loader.exec_module(real)

_lock = threading.Lock()
_out = open(OUT, "a", buffering=1)  # noqa: SIM115 - open for the process's life
_ctx = threading.local()


def emit(rec: dict) -> None:
    line = json.dumps(rec)
    with _lock:
        _out.write(line + "\n")


def _schedstat() -> tuple[float, float]:
    """(seconds on a CPU, seconds waiting in the run queue) of this thread."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            run, wait, _ = f.read().split()
        return int(run) / 1e9, int(wait) / 1e9
    except (OSError, ValueError):
        return 0.0, 0.0


def timed(name: str, fn: Callable) -> Callable:
    """`fn`, adding its wall and thread-CPU seconds to the current request's parts (when one is
    being timed on this thread)."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        parts = getattr(_ctx, "parts", None)
        if parts is None:
            return fn(*args, **kwargs)
        w0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            e = parts.setdefault(name, [0.0, 0.0, 0])
            e[0] += time.perf_counter() - w0
            e[1] += time.thread_time() - c0
            e[2] += 1

    return wrapper


class _TimedOs:
    """`os` as the connector sees it, with the calls it makes on files timed."""

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)


for _name in ("makedirs", "open", "replace", "unlink", "close", "fsync", "rename"):
    setattr(_TimedOs, _name, staticmethod(timed(f"os.{_name}", getattr(os, _name))))


def phase(name: str, fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """Run `fn` as one timed phase (wall, thread CPU, run-queue wait, its parts) and emit it."""
    _ctx.parts = {}
    s0, w0, c0 = _schedstat(), time.perf_counter(), time.thread_time()
    try:
        return fn(*args, **kwargs)
    finally:
        wall, cpu, s1 = time.perf_counter() - w0, time.thread_time() - c0, _schedstat()
        parts, _ctx.parts = _ctx.parts, None
        rec = {
            "phase": name,
            "wall": wall,
            "cpu": cpu,
            "runq": s1[1] - s0[1],
            "thread": threading.current_thread().name,
        }
        rec["parts"] = {k: [round(v[0], 7), round(v[1], 7), v[2]] for k, v in parts.items()}
        emit(rec)


if MODE == "split":
    for _name in (
        "extract_from_kv_cache",
        "gather_on_host",
        "stored",
        "file_metadata",
        "vllm_version",
        "save_file",
        "record_timing",
    ):
        if callable(getattr(real, _name, None)):
            setattr(real, _name, timed(_name, getattr(real, _name)))
    real.os = _TimedOs()
    _write = real.write_atomically
    real.write_atomically = lambda *a, **k: phase("write", _write, *a, **k)


class RemoteOpsHiddenStatesConnector(real.RemoteOpsHiddenStatesConnector):  # type: ignore[misc,name-defined]
    """The real connector, timed (`split`) or doing nothing (`engine-only`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._probe_steps: dict[str, list[float]] = {}
        if MODE == "split":
            self._executor.submit = timed("executor.submit", self._executor.submit)  # type: ignore[method-assign]
            for name in ("_file_context", "_copy_to_host"):
                if hasattr(self, name):
                    setattr(self, name, timed(name, getattr(self, name)))
        try:
            import torch

            threads = torch.get_num_threads()
        except Exception:  # noqa: BLE001 - context only
            threads = -1
        env = {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "KMP_", "VLLM_CPU", "LD_PRELOAD"))}
        emit(
            {
                "phase": "init",
                "mode": MODE,
                "torch_threads": threads,
                "affinity": sorted(os.sched_getaffinity(0)),
                "switchinterval": sys.getswitchinterval(),
                "writer_threads": getattr(self._executor, "_max_workers", None),
                "env": env,
            }
        )

    def _step(self, name: str, fn: Callable, *args: Any) -> Any:
        w0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*args)
        finally:
            e = self._probe_steps.setdefault(name, [0.0, 0.0, 0])
            e[0] += time.perf_counter() - w0
            e[1] += time.thread_time() - c0
            e[2] += 1

    def wait_for_save(self) -> None:
        if MODE == "engine-only":
            return
        self._step("wait_for_save", super().wait_for_save)

    def get_finished(self, finished_req_ids: set[str]) -> Any:
        return self._step("get_finished", super().get_finished, finished_req_ids)

    def _submit_async_write(self, pending: Any) -> None:
        if MODE == "engine-only":
            if self._is_tp_rank_zero:
                self._req_copy_events[pending.req_id] = real._DoneEvent()
            emit({"phase": "steps", "steps": self._probe_steps})
            return
        phase("inline", super()._submit_async_write, pending)
        emit({"phase": "steps", "steps": self._probe_steps})
