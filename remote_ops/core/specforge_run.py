"""A SpecForge 0.2.0 training run, read from what it leaves on the host (pure).

SpecForge's `specforge train` prints, every `training.log_interval` optimizer steps,

    step N: {'acc_0': .., 'ploss_0': .., 'acceptance_rate_0': .., 'acc': .., 'loss': .., 'lr': ..,
             'perf/optimizer_step_time_s': .., ...}

and, every `training.eval_interval` steps when the run has eval data, a line of `eval/` keys
(`eval/avg_loss`, `eval/per_position_acc`, `eval/simulated_acc_len`, `eval/acceptance_rate_k`,
`eval/ploss_k`) (`specforge/training/assembly.py::_logger`, `specforge/eval/evaluator.py`).  Its
CheckpointManager writes `<run_id>-step<N>/training_state.pt`, repoints `<run_id>-latest`, and
after an eval that beats the best so far repoints `<run_id>-best` and writes
`<run_id>.best_meta.json` (`{run_id, step, score, metric: eval/simulated_acc_len, metrics}`).

The lines are parsed by `logparse.parse_training`; this module turns that, the output dir's
listing and the best meta into what `train status` shows and which checkpoint `train export`
exports.  `exported_drafter_dir` is where that export lands (what `spec deploy` serves).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field

from .logparse import TrainingSummary, parse_training

_STEP_DIR = re.compile(r"^(?P<run>.+)-step(?P<step>\d{1,18})$")
_RATE_KEY = re.compile(r"^(?:eval/)?acceptance_rate_(?P<pos>\d{1,9})$")
BEST_METRIC = "eval/simulated_acc_len"


def checkpoint_steps(listing: str, run_id: str | None = None) -> dict[int, str]:
    """`ls -1` of the output dir -> {step: dir name} of `<run_id>-step<N>` (any run when run_id is None)."""
    out: dict[int, str] = {}
    for name in listing.split():
        m = _STEP_DIR.match(name)
        if m and (run_id is None or m["run"] == run_id):
            out[int(m["step"])] = name
    return out


def best_meta(text: str, run_id: str | None) -> dict | None:
    """SpecForge's `<run_id>.best_meta.json` (one JSON document a line, any number of runs) for `run_id`."""
    for line in text.splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if (
            isinstance(doc, dict)
            and (run_id is None or doc.get("run_id") == run_id)
            and isinstance(doc.get("step"), int)
            and isinstance(doc.get("score"), (int, float))
        ):
            return doc
    return None


def _rates(metrics: dict[str, float]) -> dict[int, float]:
    return {int(m["pos"]): v for k, v in metrics.items() if (m := _RATE_KEY.match(k))}


@dataclass
class RunMetrics:
    """The newest train line, the newest and the best eval line, and the ETA."""

    step: int | None = None  # newest optimizer step logged
    acc: dict[int, float] = field(default_factory=dict)  # acc_k, the newest train line
    ploss: dict[int, float] = field(default_factory=dict)
    acceptance_rate: dict[int, float] = field(default_factory=dict)  # SpecForge's acceptance_rate_k
    loss: float | None = None
    lr: float | None = None
    step_time_s: float | None = None  # perf/optimizer_step_time_s
    eval_step: int | None = None
    eval_acc: dict[int, float] = field(default_factory=dict)  # eval/per_position_acc
    eval_simulated_acc_len: float | None = None
    evals: list[tuple[int, float]] = field(default_factory=list)  # (step, eval/simulated_acc_len), in log order
    total_steps: int | None = None
    eta_s: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def total_steps(samples: int | None, epochs: int | None, batch_size: int = 1, dp: int = 1) -> int | None:
    """Optimizer steps of a run: ceil(samples / (batch * data-parallel ranks)) per epoch (SpecForge 0.2.0,
    accumulation 1: 16 samples x 2 epochs at batch 1 on one rank log up to step 32)."""
    if not samples or not epochs:
        return None
    return math.ceil(samples / max(1, batch_size * dp)) * epochs


def run_metrics(log_text: str, total: int | None = None, summary: TrainingSummary | None = None) -> RunMetrics:
    """SpecForge's own metrics from its log; the ETA = the newest step time x the steps left."""
    summary = summary or parse_training(log_text)
    out = RunMetrics(total_steps=total)
    train = [r for r in summary.records if r.phase == "train" and r.unit == "step"]
    if train:
        rec = train[-1]
        out.step, out.acc, out.ploss = rec.index, dict(rec.acc), dict(rec.ploss)
        out.acceptance_rate = _rates(rec.metrics)
        out.loss, out.lr = rec.metrics.get("loss"), rec.metrics.get("lr")
        out.step_time_s = rec.metrics.get("perf/optimizer_step_time_s")
        if total and out.step_time_s is not None:
            out.eta_s = round(out.step_time_s * max(0, total - rec.index), 1)
    for rec in summary.records:
        if rec.phase == "eval" and rec.unit == "step":
            score = rec.metrics.get(BEST_METRIC)
            out.eval_step, out.eval_acc = rec.index, dict(rec.acc)
            out.eval_simulated_acc_len = score
            if score is not None:
                out.evals.append((rec.index, score))
    return out


@dataclass(frozen=True)
class Choice:
    """The checkpoint `train export` exports, and why."""

    step: int
    name: str  # <run_id>-step<N>
    reason: str
    metrics: dict

    def to_dict(self) -> dict:
        return asdict(self)


def choose_checkpoint(steps: dict[int, str], best: dict | None, metrics: RunMetrics) -> Choice | None:
    """The best by eval `simulated_acc_len` when the run had eval data (SpecForge's own best meta,
    else the best eval line whose step was saved), else the newest; None when nothing was saved."""
    if not steps:
        return None
    if best and best.get("step") in steps:
        step = int(best["step"])
        return Choice(
            step,
            steps[step],
            f"best {BEST_METRIC} = {best['score']:.4g} at step {step} (SpecForge's best meta)",
            {"eval": best.get("metrics") or {}, BEST_METRIC: best["score"]},
        )
    saved = [(score, step) for step, score in metrics.evals if step in steps]
    if saved:
        score, step = max(saved)
        return Choice(step, steps[step], f"best {BEST_METRIC} = {score:.4g} at step {step} (log)", {BEST_METRIC: score})
    step = max(steps)
    train = {"acc": metrics.acc, "ploss": metrics.ploss, "step": metrics.step} if metrics.step else {}
    return Choice(step, steps[step], f"newest (step {step}; the run had no eval data)", {"train": train})


def exported_drafter_dir(output: str, run_id: str, to: str = "hf") -> str:
    """Where `train export` writes the drafter of run `run_id` (`--to hf` for vLLM, `sglang` for SGLang):
    `<output>/<run_id>-drafter-<to>`, holding config.json, model.safetensors and provenance.json.
    `spec deploy` of a training run serves this directory."""
    return f"{output.rstrip('/')}/{run_id}-drafter-{to}"
