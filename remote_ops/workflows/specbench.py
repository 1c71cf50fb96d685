"""`spec bench`: acceptance length and speed of the served model, with and without speculation.

The client (`specbench_onhost.py`, stdlib) runs on the host against the server's
published port and returns SGLang 0.5.9's per-request `meta_info`. Read from the
0.5.9 source (`srt/managers/tokenizer_manager.py`,
`_calculate_spec_decoding_metrics`, called for a finished request when the
server runs with `--speculative-algorithm`): `completion_tokens`,
`spec_verify_ct` (verify steps), `spec_accept_length = completion_tokens /
spec_verify_ct`, `spec_accept_rate = accepted / (spec_verify_ct * (num_draft_tokens - 1))`,
`spec_accept_histogram`. The bench's acceptance length is the token-weighted
one, `sum(completion_tokens) / sum(spec_verify_ct)` over the prompt set.

On a vLLM host (`serving.engine: vllm`) the bench counts what vLLM accepted: the client
reads `/metrics` before and after the prompt set (sent to `/v1/completions`), and
`core.promtext` turns the moves of vLLM's spec-decode counters
(`vllm:spec_decode_num_drafts_total`, `..._num_draft_tokens_total`,
`..._num_accepted_tokens_total`, `..._num_accepted_tokens_per_pos_total{position}`) into
the mean acceptance length `1 + accepted / drafts`, the acceptance per draft position and
the draft acceptance rate.  Whether the server runs the drafter (`spec deploy`) or the
target alone (`spec deploy --target-only`) is read from its container's
`org.remote-ops.vllm.serves` label; the extraction server (no label) is no baseline and is
refused (exit 9) before any prompt is sent.  The greedy outputs are kept per prompt, so the
comparison says on how many prompts the drafter left the output as the target's own.

One run measures whatever is served now and is stored locally as
`<state>/hosts/<host>/specbench/<spec|baseline>.json`; when both exist for the
same prompt set, the comparison (tokens/s speed-up) is a table and a PNG.
Results from the SGLang stand-in carry `standin: true` and are labelled as
stand-in everywhere (the stand-in's acceptance comes from a deterministic model, not a drafter).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath

from .. import onhost
from ..core import promtext, shell
from ..errors import CommandFailed, Refused

CLIENT = "specbench_onhost.py"
DEFAULT_PROMPTS = [
    "Explain speculative decoding to a new engineer in three short paragraphs.",
    "Write a Python function that merges two sorted lists, with a docstring and tests.",
    "Summarise the causes of the French Revolution in a numbered list.",
    "What is the difference between TCP and UDP? Give two use cases for each.",
    "Translate into French: The weather is nice today, let us walk to the river.",
    "Write a haiku about GPUs running all night.",
    "Describe how a hash map handles collisions, with a small example.",
    "List five checks to run before deploying a model server to production.",
]


def prompts_jsonl(prompts: list[str] | list[dict]) -> bytes:
    rows = [p if isinstance(p, dict) else {"text": p} for p in prompts]
    return "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows).encode()


def prompt_set_id(data: bytes, max_new_tokens: int) -> str:
    return hashlib.sha256(data + b"|%d" % max_new_tokens).hexdigest()[:12]


# --------------------------------------------------------------------------- summary (pure)


@dataclass
class BenchSummary:
    """One run over the prompt set."""

    mode: str  # "spec" | "baseline"
    standin: bool
    requests: int
    completion_tokens: int
    seconds: float  # sum of per-request wall times (batch 1)
    tokens_per_s: float
    acceptance_length: float | None  # sum(completion_tokens) / sum(spec_verify_ct)
    acceptance_length_mean: float | None  # mean of per-request spec_accept_length
    accept_rate: float | None
    verify_steps: int | None
    histogram: list[int] = field(default_factory=list)
    server: dict = field(default_factory=dict)
    prompt_set: str = ""
    max_new_tokens: int = 0
    per_request: list[dict] = field(default_factory=list)
    engine: str = "sglang"  # whose counters: sglang (per-request meta_info) | vllm (/metrics)
    per_position: list[float] = field(default_factory=list)  # vLLM: accepted at position i / drafts
    drafts: int | None = None  # vLLM: drafts proposed over the prompt set
    draft_tokens: int | None = None
    accepted_tokens: int | None = None
    metrics: dict = field(default_factory=dict)  # vLLM: the spec-decode lines of /metrics before, after

    def to_dict(self) -> dict:
        return asdict(self)


def spec_lines(text: str) -> str:
    """The lines of a `/metrics` text that name vLLM's spec-decode counters (what a run keeps)."""
    return "".join(line + "\n" for line in text.splitlines() if promtext.SPEC_PREFIX in line)


def summarise_vllm(doc: dict, prompt_set: str = "", max_new_tokens: int = 0) -> BenchSummary:
    """vLLM's run -> BenchSummary: tokens/s from the requests, acceptance from the moves of the
    spec-decode counters between the two `/metrics` readings (none: the target alone)."""
    rows = [{k: v for k, v in r.items() if k != "kv_transfer_params"} for r in doc["results"]]
    server = doc.get("server", {})
    tokens = sum(int(r.get("completion_tokens") or 0) for r in rows)
    seconds = sum(float(r["client_s"]) for r in rows)
    before = promtext.spec_counters(doc.get("metrics_before", ""))
    after = promtext.spec_counters(doc.get("metrics_after", ""))
    acc = promtext.acceptance(promtext.spec_delta(before, after)) if before and after else None
    spec = server.get("serves") == "eagle3"
    return BenchSummary(
        "spec" if spec else "baseline",
        False,
        len(rows),
        tokens,
        round(seconds, 4),
        round(tokens / seconds, 2) if seconds else 0.0,
        acc.mean_acceptance_length if acc else None,
        None,
        acc.accept_rate if acc else None,
        acc.drafts if acc else None,
        acc.histogram if acc else [],
        server,
        prompt_set,
        max_new_tokens,
        rows,
        engine="vllm",
        per_position=acc.per_position if acc else [],
        drafts=acc.drafts if acc else None,
        draft_tokens=acc.draft_tokens if acc else None,
        accepted_tokens=acc.accepted if acc else None,
        metrics={
            "before": spec_lines(doc.get("metrics_before", "")),
            "after": spec_lines(doc.get("metrics_after", "")),
        },
    )


def summarise(doc: dict, prompt_set: str = "", max_new_tokens: int = 0) -> BenchSummary:
    """The client's document -> BenchSummary (spec mode when the server runs a speculative
    algorithm; a vLLM run is `summarise_vllm`'s)."""
    if (doc.get("server") or {}).get("engine") == "vllm":
        return summarise_vllm(doc, prompt_set, max_new_tokens)
    rows, server = doc["results"], doc.get("server", {})
    spec = bool(server.get("speculative_algorithm")) or any("spec_verify_ct" in r for r in rows)
    tokens = sum(int(r.get("completion_tokens", 0)) for r in rows)
    seconds = sum(float(r["client_s"]) for r in rows)
    steps = sum(int(r.get("spec_verify_ct", 0)) for r in rows) if spec else None
    lengths = [float(r["spec_accept_length"]) for r in rows if "spec_accept_length" in r]
    drafted = sum(int(r.get("spec_draft_token_num", 0)) for r in rows)
    accepted = sum(int(r.get("spec_accept_token_num", 0)) for r in rows)
    return BenchSummary(
        "spec" if spec else "baseline",
        bool(server.get("standin") or any(r.get("standin") for r in rows)),
        len(rows),
        tokens,
        round(seconds, 4),
        round(tokens / seconds, 2) if seconds else 0.0,
        round(tokens / steps, 4) if steps else None,
        round(sum(lengths) / len(lengths), 4) if lengths else None,
        round(accepted / drafted, 4) if drafted else None,
        steps,
        _histogram(rows),
        server,
        prompt_set,
        max_new_tokens,
        rows,
    )


def _histogram(rows: list[dict]) -> list[int]:
    total: list[int] = []
    for r in rows:
        for i, n in enumerate(r.get("spec_accept_histogram") or []):
            total += [0] * (i + 1 - len(total))
            total[i] += int(n)
    return total


@dataclass
class Comparison:
    baseline: BenchSummary
    spec: BenchSummary
    speedup: float
    standin: bool
    same_outputs: int | None = None  # prompts whose greedy output the drafter left as the target's
    outputs_compared: int = 0

    def to_dict(self) -> dict:
        return {
            "baseline": self.baseline.to_dict(),
            "spec": self.spec.to_dict(),
            "speedup": self.speedup,
            "standin": self.standin,
            "same_outputs": self.same_outputs,
            "outputs_compared": self.outputs_compared,
        }


def same_outputs(baseline: BenchSummary, spec: BenchSummary) -> tuple[int | None, int]:
    """(prompts with equal output token ids, prompts compared): both runs must carry them."""
    a = {r.get("prompt"): r.get("output_ids") for r in baseline.per_request if r.get("output_ids") is not None}
    b = {r.get("prompt"): r.get("output_ids") for r in spec.per_request if r.get("output_ids") is not None}
    both = sorted(set(a) & set(b), key=str)
    return (sum(1 for k in both if a[k] == b[k]) if both else None), len(both)


def compare(baseline: BenchSummary, spec: BenchSummary) -> Comparison | None:
    """Speed-up of the spec run over the baseline, only for the same prompt set and length."""
    if baseline.prompt_set != spec.prompt_set or not baseline.tokens_per_s:
        return None
    same, compared = same_outputs(baseline, spec)
    return Comparison(
        baseline,
        spec,
        round(spec.tokens_per_s / baseline.tokens_per_s, 3),
        baseline.standin or spec.standin,
        same,
        compared,
    )


def table_rows(c: Comparison) -> list[list[str]]:
    fmt = lambda v, f="{:.2f}": "-" if v is None else f.format(v)  # noqa: E731
    rows = [
        ["tokens/s (batch 1)", fmt(c.baseline.tokens_per_s), fmt(c.spec.tokens_per_s), f"x{c.speedup:.2f}"],
        ["acceptance length", "1.00", fmt(c.spec.acceptance_length), ""],
        ["accept rate (drafts)", "-", fmt(c.spec.accept_rate, "{:.1%}"), ""],
    ]
    if c.spec.per_position:
        rows.append(["acceptance per position", "-", ", ".join(f"{p:.2f}" for p in c.spec.per_position), ""])
    if c.same_outputs is not None:
        rows.append(["outputs equal to the baseline", "", f"{c.same_outputs}/{c.outputs_compared}", ""])
    return rows + [
        ["completion tokens", str(c.baseline.completion_tokens), str(c.spec.completion_tokens), ""],
        ["requests", str(c.baseline.requests), str(c.spec.requests), ""],
    ]


def label(standin: bool, engine: str = "sglang") -> str:
    if standin:
        return "STAND-IN (deterministic acceptance model, no drafter, no GPU)"
    return "measured (vLLM's spec-decode counters)" if engine == "vllm" else "measured"


# --------------------------------------------------------------------------- files (local)


def result_dir(host_name: str) -> Path:
    from ..paths import host_dir

    return host_dir(host_name) / "specbench"


def save(summary: BenchSummary, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{summary.mode}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"label": label(summary.standin, summary.engine), **summary.to_dict()}, indent=1))
    tmp.replace(path)
    return path


def load(folder: Path, mode: str) -> BenchSummary | None:
    path = folder / f"{mode}.json"
    if not path.exists():
        return None
    doc = json.loads(path.read_text())
    doc.pop("label", None)  # says STAND-IN or measured in the file; derived from `standin`
    return BenchSummary(**doc)


def plot(c: Comparison, path: Path) -> Path:
    """Two panels: tokens/s baseline vs spec, and the spec run's accepted-drafts histogram."""
    from ..core.plots import _pyplot, _save

    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.bar(["baseline", "spec"], [c.baseline.tokens_per_s, c.spec.tokens_per_s], color=["#888", "#2a7"])
    ax1.set_ylabel("tokens/s (batch 1)")
    ax1.set_title(f"speed-up x{c.speedup:.2f}, acceptance length {c.spec.acceptance_length or 0:.2f}")
    hist = c.spec.histogram or [0]
    ax2.bar(range(len(hist)), hist, color="#27a")
    ax2.set_xticks(range(len(hist)))
    ax2.set_xlabel("draft tokens accepted in a verify step")
    ax2.set_ylabel("verify steps")
    fig.suptitle(
        label(c.standin) if c.standin else "measured on the served model",
        fontsize=10,
        color="#c00" if c.standin else "black",
    )
    return _save(fig, plt, path)


# --------------------------------------------------------------------------- edges


def workdir(spec) -> str:
    return str(PurePosixPath(spec.logs.dir) / "specbench")


def client_command(url: str, prompts: str, max_new_tokens: int, warmup: int, extra: tuple[str, ...] = ()) -> str:
    return shell.join(
        [
            "python3",
            "-",
            "--url",
            url,
            "--prompts",
            prompts,
            "--max-new-tokens",
            str(max_new_tokens),
            "--warmup",
            str(warmup),
            *extra,
        ]
    )


def vllm_serves(labels: dict[str, str] | None) -> str | None:
    """What a vLLM server container serves, from its labels (pure): `eagle3`, `target`, or None
    (the extraction server, which carries no such label)."""
    from ..serving import vllm

    mode = (labels or {}).get(vllm.SERVES_LABEL)
    return mode if mode in ("eagle3", "target") else None


def vllm_mode(remote, spec) -> str:
    """The running vLLM server's mode (`vllm_serves` of its container); Refused (exit 9) when no
    container runs or it is the extraction server (a bench would write dumps and measure extraction)."""
    from . import container

    info = container.status(remote, spec)
    if info is None or not info.running:
        raise Refused(
            f"spec bench: no running server container {spec.container.name}",
            host=spec.name,
            hint="`remote-ops spec deploy` (the drafter) or `spec deploy --target-only` (the baseline) first",
        )
    mode = vllm_serves(info.labels)
    if mode is None:
        raise Refused(
            f"spec bench: {spec.container.name} is vLLM's extraction server, neither the drafter nor the target alone",
            host=spec.name,
            hint="`remote-ops spec deploy --target-only` for the baseline, `spec deploy --draft DIR` for the "
            "drafter; `deploy` restores extraction",
        )
    return mode


def run(
    remote, spec, prompts: bytes, max_new_tokens: int, warmup: int = 1, url: str | None = None, timeout: float = 3600
) -> dict:
    """Upload the prompt set, run the client on the host, return its document (a vLLM host's
    says what the server serves: `server.serves`, from `vllm_mode`)."""
    vllm = spec.serving.engine == "vllm"
    mode = vllm_mode(remote, spec) if vllm else None
    extra = ("--serving", "vllm", "--model", spec.model.served_name) if vllm else ()
    wd = workdir(spec)
    remote.run(["mkdir", "-p", wd])
    remote.put(prompts, f"{wd}/prompts.jsonl")
    url = url or f"http://127.0.0.1:{spec.server.port}"
    client = onhost.source(CLIENT)
    result = remote.run(
        client_command(url, f"{wd}/prompts.jsonl", max_new_tokens, warmup, extra),
        input=client,
        check=False,
        timeout=timeout,
    )
    try:
        doc = json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        doc = {"error": "no output"}
    if "error" in doc or result.exit_status != 0:
        raise CommandFailed.of(f"spec bench client failed: {doc.get('error')}", result, remote.name)
    if mode is not None:
        doc.setdefault("server", {})["serves"] = mode
    return doc
