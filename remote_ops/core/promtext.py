"""Prometheus text exposition (what a server's `/metrics` answers), and vLLM's spec-decode counters (pure).

`parse` reads the text format 0.0.4 (`# HELP`/`# TYPE` comments; `name{label="value",...} value
[timestamp]`; label values escape `\\\\`, `\\"` and `\\n`; values may be `NaN`, `+Inf`, `-Inf`).

vLLM (0.32.0, `vllm/v1/spec_decode/metrics.py`, `SpecDecodingProm`) counts speculative decoding
in four counters, registered only when the server runs a speculative method, and exposed by
`prometheus_client` with a `_total` suffix:

- `vllm:spec_decode_num_drafts_total`: drafts proposed (one per request per decode step);
- `vllm:spec_decode_num_draft_tokens_total`: draft tokens proposed;
- `vllm:spec_decode_num_accepted_tokens_total`: draft tokens the target accepted;
- `vllm:spec_decode_num_accepted_tokens_per_pos_total{position="i"}`: accepted at draft
  position i (0-based, `num_speculative_tokens` of them).

Each carries the engine's labels (`engine`, `model_name`); `spec_counters` sums over them.
`spec_delta` is what a prompt set made them move (after - before), and `acceptance` the
figures SpecDecodingProm's own docstring gives: mean acceptance length `1 + accepted / drafts`
(the bonus token included), per-position acceptance `accepted_per_pos[i] / drafts`, and the
draft acceptance rate `accepted / draft_tokens`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
SPEC_PREFIX = "vllm:spec_decode_"

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,)?')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


@dataclass(frozen=True)
class Sample:
    """One line of the exposition: metric name, its labels, its value."""

    name: str
    labels: dict[str, str]
    value: float


class ParseError(ValueError):
    """A line that is not the text exposition format (its number and text)."""


def _unescape(value: str) -> str:
    return re.sub(r"\\[\\\"n]", lambda m: _UNESCAPE[m.group(0)], value)


def _value(text: str, lineno: int, line: str) -> float:
    try:
        return float(text)  # "NaN", "+Inf", "-Inf" included
    except ValueError:
        raise ParseError(f"line {lineno}: value {text!r} is not a number: {line[:200]!r}") from None


def parse(text: str) -> list[Sample]:
    """Every sample of a Prometheus text exposition, in order (comments and blank lines skipped);
    ParseError naming the line for one that is not the format."""
    out: list[Sample] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _NAME.match(line)
        if m is None:
            raise ParseError(f"line {lineno}: no metric name: {line[:200]!r}")
        name, rest = m.group(0), line[m.end() :]
        labels: dict[str, str] = {}
        if rest.startswith("{"):
            pos = 1
            while True:
                if rest[pos:].lstrip().startswith("}"):
                    pos += len(rest[pos:]) - len(rest[pos:].lstrip()) + 1
                    break
                lm = _LABEL.match(rest, pos)
                if lm is None:
                    raise ParseError(f"line {lineno}: bad labels: {line[:200]!r}")
                labels[lm.group(1)] = _unescape(lm.group(2))
                pos = lm.end()
                if lm.group(3) is None:
                    tail = rest[pos:].lstrip()
                    if not tail.startswith("}"):
                        raise ParseError(f"line {lineno}: bad labels: {line[:200]!r}")
                    pos = len(rest) - len(tail) + 1
                    break
            rest = rest[pos:]
        parts = rest.split()
        if not parts or len(parts) > 2:
            raise ParseError(f"line {lineno}: want a value (and a timestamp): {line[:200]!r}")
        out.append(Sample(name, labels, _value(parts[0], lineno, line)))
    return out


@dataclass(frozen=True)
class SpecCounters:
    """vLLM's spec-decode counters at one moment, summed over the engines' label sets."""

    drafts: float
    draft_tokens: float
    accepted: float
    per_position: dict[int, float] = field(default_factory=dict)


def spec_counters(text: str) -> SpecCounters | None:
    """vLLM's spec-decode counters in a `/metrics` text; None when the server exposes none (it
    runs no speculative method)."""
    sums = {DRAFTS: 0.0, DRAFT_TOKENS: 0.0, ACCEPTED: 0.0}
    seen = False
    per_pos: dict[int, float] = {}
    for s in parse(text):
        if s.name in sums:
            sums[s.name] += s.value
            seen = True
        elif s.name == PER_POS and s.labels.get("position", "").isdigit():
            pos = int(s.labels["position"])
            per_pos[pos] = per_pos.get(pos, 0.0) + s.value
            seen = True
    if not seen:
        return None
    return SpecCounters(sums[DRAFTS], sums[DRAFT_TOKENS], sums[ACCEPTED], dict(sorted(per_pos.items())))


def spec_delta(before: SpecCounters, after: SpecCounters) -> SpecCounters:
    """What moved between two readings (after - before; a position first seen after counts from 0)."""
    positions = sorted(set(before.per_position) | set(after.per_position))
    return SpecCounters(
        after.drafts - before.drafts,
        after.draft_tokens - before.draft_tokens,
        after.accepted - before.accepted,
        {p: after.per_position.get(p, 0.0) - before.per_position.get(p, 0.0) for p in positions},
    )


@dataclass(frozen=True)
class Acceptance:
    """What the engine accepted over a prompt set (from `spec_delta`)."""

    drafts: int
    draft_tokens: int
    accepted: int
    mean_acceptance_length: float | None  # 1 + accepted / drafts
    per_position: list[float]  # accepted at position i / drafts
    accept_rate: float | None  # accepted / draft_tokens
    histogram: list[int]  # drafts with exactly j tokens accepted, j = 0..K (when every draft is K tokens)


def acceptance(d: SpecCounters) -> Acceptance:
    """The figures of SpecDecodingProm's docstring from counter deltas (pure; rounded to 4 places).

    Acceptance is a prefix (a draft token counts only when those before it were accepted), so
    the drafts that accepted exactly j tokens are `per_pos[j-1] - per_pos[j]`; given only when
    each draft has the same K tokens (`draft_tokens == drafts * K`)."""
    drafts, tokens, accepted = (int(round(v)) for v in (d.drafts, d.draft_tokens, d.accepted))
    k = len(d.per_position)
    per = [int(round(d.per_position.get(i, 0.0))) for i in range(k)]
    hist: list[int] = []
    if drafts and k and tokens == drafts * k:
        edges = [drafts, *per, 0]
        hist = [edges[j] - edges[j + 1] for j in range(k + 1)]
    return Acceptance(
        drafts,
        tokens,
        accepted,
        round(1 + accepted / drafts, 4) if drafts else None,
        [round(p / drafts, 4) for p in per] if drafts else [],
        round(accepted / tokens, 4) if tokens else None,
        hist,
    )
