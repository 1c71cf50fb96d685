"""`spec preflight`'s decisions (pure): its own dirs on the host, the samples, the plan, the verdict.

The pre-flight runs the whole job on a handful of samples before days of extraction
(`remote_ops.workflows.preflight` chains it): extract them, train a drafter until it overfits
them, export it, serve it and count on those same prompts what the engine accepts.  It follows
SpecForge's own gate (`scripts/gates/README.md` in sgl-project/SpecForge: a one-sample overfit,
exported and served, passing only when the full draft block is accepted): a drafter that has
learned its samples by heart must have nearly every draft accepted on them, unless what was
captured is not what the engine serves the drafter with (layer ids one off, pre-norm finals,
states of another model).  No file check sees that disagreement; the engine's count does.

Here:
- `preflight_host`: the host spec the pre-flight runs with: everything it writes under one root,
  `<dump.dir>-preflight/` (`dumps/`, `logs/`, and from those the export `dumps-specforge/` and
  the drafter `dumps-drafter/`), so that it never mixes with the operator's own dumps, export,
  work dirs or runs.
- `pick_samples`: the first N dataset lines with a prompt and a reply (`loss_mask`); the prompt
  (the tokens before the first masked one) is what the bench sends, the reply what the drafter
  was taught, hence what the served continuation is compared with (`prefix_match`, as
  SpecForge's gate reports `target_prefix_match_tokens`).
- `default_threshold`: the acceptance length a pass needs, from the lab (docs/drafter.md,
  "Pre-flight": the measured figures).
- `judge`: the verdict from the bench's figures (vLLM's spec-decode counters, or SGLang's
  per-request `spec_accept_length`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from . import shell
from .inventory import HostSpec

#: The pre-flight's own root on the host, beside the dump dir.
ROOT_SUFFIX = "-preflight"
DEFAULT_SAMPLES = 2
DEFAULT_NUM_STEPS = 3
DEFAULT_EPOCHS = 150
DEFAULT_LEARNING_RATE = 1e-3
DEFAULT_MAX_NEW_TOKENS = 32
RUN_ID = "preflight"
#: SpecForge's last acc_0 under which a fail is put down to too little training.
OVERFIT_ACC = 0.9
#: Lines of the dataset read at most while looking for the samples.
MAX_LINES_READ = 10_000

#: The share of the K draft tokens a pass needs accepted: threshold = 1 + FRACTION * K.
#: NOT yet confirmed by a pass in the lab (docs/drafter.md, "Pre-flight", has the figures):
#: on the learned tiny Llama (vLLM 0.32.0, K = 3) a drafter overfit to 2 samples (SpecForge's
#: acc_0 1.0) reached 2.625, held down by a prompt whose served continuation parted from the
#: taught reply (transformers' fp32 reply vs vLLM's bf16 greedy); an underfit one (acc_0 ~0.43) 1.42.
FRACTION = 2 / 3


def default_threshold(num_steps: int) -> float:
    """The mean acceptance length a pass needs at `num_steps` draft tokens: 1 + FRACTION * K
    (the full block is K + 1)."""
    return round(1.0 + FRACTION * num_steps, 2)


def root_of(spec: HostSpec) -> str:
    return spec.dump.dir.rstrip("/") + ROOT_SUFFIX


def preflight_host(spec: HostSpec) -> HostSpec:
    """The host spec the pre-flight runs with: its dump dir and logs under `root_of(spec)` (the
    export and the drafter dir follow the dump dir: `<root>/dumps-specforge`, `<root>/dumps-drafter`);
    the server, model, lock and audit log are the host's own."""
    root = root_of(spec)
    logs = f"{root}/logs"
    return spec.model_copy(
        update={
            "dump": spec.dump.model_copy(update={"dir": f"{root}/dumps"}),
            "logs": spec.logs.model_copy(
                update={"dir": logs, "extraction": f"{logs}/extraction.log", "training": f"{logs}/training.log"}
            ),
        }
    )


def clean_command(spec: HostSpec) -> str:
    """Empty the pre-flight's root on the host, keeping its dump dir (and on vLLM the connector's
    dir in it) as directories: a server a pre-flight left running (it was interrupted) has them
    bind-mounted, and a removed dir would keep receiving its files unseen."""
    p = preflight_host(spec)
    root, dumps = shell.quote(root_of(spec)), shell.quote(p.dump.dir)
    keep = p.vllm.connector_dir if spec.serving.engine == "vllm" else None
    inner = f"find {dumps} -mindepth 1 -maxdepth 1" + (f" ! -name {shell.quote(keep)}" if keep else "")
    cmd = (
        f"mkdir -p {dumps} && find {root} -mindepth 1 -maxdepth 1 ! -name {shell.quote('dumps')} -exec rm -rf {{}} + "
        f"&& {inner} -exec rm -rf {{}} +"
    )
    if keep:
        conn = shell.quote(f"{p.dump.dir}/{keep}")
        cmd += f" && mkdir -p {conn} && find {conn} -mindepth 1 -delete"
    return cmd + f" && mkdir -p {shell.quote(p.logs.dir)}"


# --------------------------------------------------------------------------- samples


@dataclass(frozen=True)
class Sample:
    """One dataset line the pre-flight uses: its prompt (before the first masked token) and reply."""

    id: str
    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]

    @property
    def prompt_len(self) -> int:
        return self.loss_mask.index(1)

    @property
    def prompt(self) -> list[int]:
        return list(self.input_ids[: self.prompt_len])

    @property
    def reply(self) -> list[int]:
        return list(self.input_ids[self.prompt_len :])

    def line(self) -> str:
        return json.dumps({"id": self.id, "input_ids": list(self.input_ids), "loss_mask": list(self.loss_mask)}) + "\n"


def _sample(doc: Any, index: int) -> Sample | None:
    if not isinstance(doc, dict):
        return None
    ids, mask = doc.get("input_ids"), doc.get("loss_mask")
    if not isinstance(ids, list) or not isinstance(mask, list) or len(ids) != len(mask) or not ids:
        return None
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids) or any(m not in (0, 1) for m in mask):
        return None
    if 1 not in mask or mask.index(1) == 0:  # no reply, or no prompt to send
        return None
    return Sample(str(doc.get("id", f"line-{index + 1}")), tuple(ids), tuple(int(m) for m in mask))


def pick_samples(lines: Iterable[str], n: int) -> tuple[list[Sample], int]:
    """(the first `n` lines that hold a prompt and a reply, lines skipped); lines past
    `MAX_LINES_READ` are not read.  A sample needs `input_ids`, a `loss_mask` of the same length
    whose first 1 is not the first token (the prompt the bench sends is what comes before it)."""
    out: list[Sample] = []
    skipped = 0
    for i, text in enumerate(lines):
        if len(out) >= n or i >= MAX_LINES_READ:
            break
        if not text.strip():
            continue
        try:
            s = _sample(json.loads(text), i)
        except ValueError:
            s = None
        if s is None:
            skipped += 1
        else:
            out.append(s)
    return out, skipped


def samples_jsonl(samples: Sequence[Sample]) -> bytes:
    """The pre-flight's dataset (what `extract start` and `dumps export` take)."""
    return "".join(s.line() for s in samples).encode()


def bench_prompts(samples: Sequence[Sample]) -> list[dict[str, Any]]:
    """What `spec bench` sends: each sample's prompt as token ids."""
    return [{"input_ids": s.prompt} for s in samples]


def max_new_tokens(samples: Sequence[Sample], cap: int = DEFAULT_MAX_NEW_TOKENS) -> int:
    """Tokens to generate per prompt: the shortest reply, at most `cap` (past the reply the
    drafter was taught nothing)."""
    return max(1, min([cap, *(len(s.reply) for s in samples)]))


def prefix_match(expected: Sequence[int], got: Sequence[int] | None) -> int:
    """Leading tokens of the served continuation equal to the sample's reply."""
    n = 0
    for a, b in zip(expected, got or ()):
        if a != b:
            break
        n += 1
    return n


# --------------------------------------------------------------------------- the plan


def plan_steps(spec: HostSpec, s: Mapping[str, Any]) -> list[dict[str, str]]:
    """The steps `spec preflight` runs, each with what it does (`--dry-run` prints them).  `s`:
    samples, num_steps, epochs, learning_rate, threshold, max_new_tokens, draft_config, engine."""
    pf = preflight_host(spec)
    root = root_of(spec)
    vllm = spec.serving.engine == "vllm"
    to = "hf" if vllm else "sglang"
    k = s["num_steps"]
    serve = (
        f'vLLM --speculative-config {{"method": "eagle3", "num_speculative_tokens": {k}}}'
        if vllm
        else f"SGLang --speculative-algorithm EAGLE3, {k} steps, topk 1, {k + 1} draft tokens"
    )
    return [
        {"step": "check", "does": "no extraction client and no training run of the host's own is running"},
        {"step": "clean", "does": f"remove and make {root} (the pre-flight's own dirs)"},
        {"step": "deploy", "does": f"the extraction server, dumps into {pf.dump.dir}"},
        {"step": "extract", "does": f"{s['samples']} samples of {s['dataset']}"},
        {"step": "export", "does": f"`dumps export` -> {pf.dump.dir}-specforge"},
        {
            "step": "train",
            "does": f"SpecForge {s['draft_config']}, {s['epochs']} epochs at lr {s['learning_rate']:g} "
            f"(run {RUN_ID}, checkpoint at the end) -> {pf.dump.dir}-drafter",
        },
        {"step": "train export", "does": f"`specforge export --to {to}` of the last checkpoint"},
        {"step": "spec deploy", "does": serve},
        {
            "step": "spec bench",
            "does": f"the samples' own prompts, {s['max_new_tokens']} new tokens each (greedy)",
        },
        {
            "step": "verdict",
            "does": f"pass when the mean acceptance length >= {s['threshold']:g} (full block {k + 1})",
        },
        {"step": "restore", "does": "`deploy` of the host's own server (also after a failure)"},
    ]


# --------------------------------------------------------------------------- the verdict


@dataclass
class Verdict:
    """What the engine accepted on the samples' prompts, against the threshold."""

    passed: bool
    state: str  # pass | fail | inconclusive (the SGLang stand-in: it measures no drafter)
    reason: str
    engine: str
    threshold: float
    num_steps: int
    full_block: int  # K + 1: every draft token accepted
    acceptance_length: float | None
    per_position: list[float] = field(default_factory=list)
    accept_rate: float | None = None
    drafts: int | None = None
    accepted_tokens: int | None = None
    requests: int = 0
    max_new_tokens: int = 0
    prefix_match: list[int] = field(default_factory=list)  # per prompt: tokens equal to the reply taught
    standin: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def judge(
    bench: Mapping[str, Any],
    samples: Sequence[Sample],
    threshold: float,
    num_steps: int,
    new_tokens: int,
    train_acc: Mapping[int, float] | None = None,
) -> Verdict:
    """The verdict of a `spec bench` run (`BenchSummary.to_dict()`) over the samples' prompts:
    pass when the mean acceptance length is at least `threshold`.  A stand-in's run is
    inconclusive; a run that counted no draft fails (the drafter did not run).  A fail names
    the likelier cause: the continuations parted from the taught replies on most prompts (not
    the target's own replies), the drafter did not overfit (`train_acc`: SpecForge's last
    per-position acc, acc_0 under `OVERFIT_ACC`), else the capture and the serving disagree."""
    rows = {r.get("prompt"): r for r in bench.get("per_request") or []}
    matches = [prefix_match(s.reply[:new_tokens], (rows.get(i) or {}).get("output_ids")) for i, s in enumerate(samples)]
    length = bench.get("acceptance_length")
    engine = str(bench.get("engine") or "sglang")
    v = Verdict(
        False,
        "fail",
        "",
        engine,
        threshold,
        num_steps,
        num_steps + 1,
        length,
        list(bench.get("per_position") or []),
        bench.get("accept_rate"),
        bench.get("drafts") if engine == "vllm" else bench.get("verify_steps"),
        bench.get("accepted_tokens"),
        int(bench.get("requests") or 0),
        new_tokens,
        matches,
        bool(bench.get("standin")),
    )
    if v.standin:
        v.state = "inconclusive"
        v.reason = "the SGLang STAND-IN served the bench: its acceptance comes from a model, not a drafter"
        return v
    if length is None or not v.drafts:
        v.reason = "the server counted no drafts: the drafter did not run"
        return v
    if length >= threshold:
        v.passed, v.state = True, "pass"
        v.reason = f"acceptance length {length:g} >= {threshold:g} (full block {v.full_block})"
        return v
    v.reason = f"acceptance length {length:g} < {threshold:g} (full block {v.full_block})"
    parted = [m for m in matches if m < new_tokens]
    acc0 = (train_acc or {}).get(0)
    if parted:
        v.reason += (
            f"; on {len(parted)} of {len(matches)} prompts the served continuation parted from the reply the "
            f"drafter was taught (after {min(parted)} tokens at the earliest)"
        )
    replies = bool(parted) and len(parted) * 2 >= len(matches)
    underfit = acc0 is not None and acc0 < OVERFIT_ACC
    if replies:
        v.reason += ": are the samples the target's own greedy replies (`dataset regenerate --temperature 0`)?"
    if underfit:
        v.reason += (
            f"; the drafter did not learn its samples by heart (SpecForge's last acc_0 {acc0:.2f} < {OVERFIT_ACC}): "
            "more --epochs (or --samples fewer)"
        )
    if not replies and not underfit:
        v.reason += (
            "; the drafter was taught these replies, so what it was taught (the capture) is not what the "
            "engine serves it with: check the aux layer ids and the final states"
        )
    return v


def figures_line(v: Verdict) -> str:
    """One line of the figures the verdict rests on."""
    pos = ", ".join(f"{p:.2f}" for p in v.per_position) or "-"
    same = sum(1 for m in v.prefix_match if m >= v.max_new_tokens)
    return (
        f"acceptance length {v.acceptance_length if v.acceptance_length is not None else '-'} "
        f"(threshold {v.threshold:g}, full block {v.full_block}), per position {pos}, "
        f"drafts {v.drafts if v.drafts is not None else '-'}, "
        f"{same}/{len(v.prefix_match)} continuations equal to the taught replies over {v.max_new_tokens} tokens"
    )
