"""Regeneration (pure): `remote-ops dataset regenerate`'s content keys, shards, the command lines of
the on-host client (`remote_ops/onhost/regenerate_onhost.py`) and the merge of what the hosts
wrote into one local chat JSONL.

- **Key**: `sha256` of the prompt turns (every system and user turn, in order: what the server
  is asked, never the source's assistant turns or the record's id) and the sampling parameters,
  32 hex characters + `-c`.  The same prompts with the same parameters are one key: regenerated
  once, written for every record that has them.  Other parameters are other keys (a rerun with
  `--temperature 0` regenerates everything).
- **Where the work lives**: the client runs on each host beside its server, in
  `<logs.dir>/regenerate/` (`RegenPaths`: the extraction client's layout, its own program), and
  writes each chat there (`regenerated.jsonl`) before its manifest line: a dropped laptop link
  loses nothing, and a restart resumes by key.  The laptop then pulls the records it lacks
  (`records_command`: only those keys travel) and merges them into ONE file in the dataset's
  order (`merge`): a group's shards live on different hosts, and `dataset prepare` takes one file.
- **Defaults** are SpecForge's `scripts/regenerate_train_data.py`'s (sgl-project/SpecForge, the
  script of PR #223 as reworked by PR #306): temperature 0.7, top_p left to the server (not
  sent), 4096 max tokens per assistant turn, 64 requests in flight per server.

Nothing here runs anything; `remote_ops.workflows.regenerate` does, over a `Remote`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, ClassVar

from . import datasetcheck, shell
from .extractplan import ExtractPaths, Sample, client_command

if TYPE_CHECKING:
    from .inventory import HostSpec

CLIENT_NAME = "regenerate_onhost.py"
OUTPUT_NAME = "regenerated.jsonl"
KEY_HASH_CHARS = 32

# SpecForge scripts/regenerate_train_data.py's defaults
TEMPERATURE = 0.7
MAX_TOKENS = 4096
CONCURRENCY = 64


@dataclass(frozen=True)
class Sampling:
    """What the server is asked to sample with; part of every chat's key."""

    temperature: float = TEMPERATURE
    top_p: float | None = None
    max_tokens: int = MAX_TOKENS

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"temperature": float(self.temperature), "max_tokens": int(self.max_tokens)}
        if self.top_p is not None:
            out["top_p"] = float(self.top_p)
        return out


@dataclass(frozen=True)
class RegenPaths(ExtractPaths):
    """The client's work dir on the host: every client's layout, its own program."""

    client_name: ClassVar[str] = CLIENT_NAME

    @property
    def output(self) -> str:
        return self.file(OUTPUT_NAME)


def paths_for(host: HostSpec) -> RegenPaths:
    workdir = PurePosixPath(host.logs.dir) / "regenerate"
    return RegenPaths(str(workdir), str(workdir / "regenerate.log"), "")


def prompt_turns(messages: list[dict]) -> list[dict]:
    """The turns the server is asked with: every system and user turn, in order."""
    return [{"role": t["role"], "content": t["content"]} for t in messages if t["role"] != "assistant"]


def chat_key(messages: list[dict], sampling: Sampling) -> str:
    """The content key of a chat under `sampling`: sha256 of its prompt turns and the parameters."""
    doc = {"prompts": prompt_turns(messages), "sampling": sampling.to_dict()}
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return hashlib.sha256(raw).hexdigest()[:KEY_HASH_CHARS] + "-c"


def read_chats(path: Path, sampling: Sampling, max_samples: int | None = None) -> list[Sample]:
    """The local chat dataset (checked first: `workflows.regenerate.check_chats`) as `Sample`s:
    id (the record's, else its 0-based line index), key, load (prompt characters, what a split
    balances) and the shard line `{"id", "key", "messages"}` the client reads."""
    samples: list[Sample] = []
    with open(path, "rb") as fh:
        index = 0
        for raw in fh:
            chat, reason = datasetcheck.chat_record(raw)
            if reason:
                raise ValueError(f"{path}:{index + 1}: {reason}")
            if chat is not None:
                sid = chat.get("id", index)
                key = chat_key(chat["messages"], sampling)
                load = sum(len(t["content"]) for t in prompt_turns(chat["messages"])) + 1
                line = json.dumps({"id": sid, "key": key, "messages": chat["messages"]}, ensure_ascii=False)
                samples.append(Sample(str(sid), key, load, line))
            index += 1
    return samples[:max_samples] if max_samples else samples


def one_per_key(samples: list[Sample]) -> list[Sample]:
    """The first sample of each key: what is sent (the others get its turns when merged)."""
    seen: set[str] = set()
    out = []
    for s in samples:
        if s.key not in seen:
            seen.add(s.key)
            out.append(s)
    return out


def launch_command(
    p: RegenPaths, server_url: str, sampling: Sampling, concurrency: int, retries: int, dataset: str
) -> str:
    """Start the client detached (`extractplan.client_command`); print its PID."""
    options = ["--temperature", f"{sampling.temperature:g}", "--max-tokens", str(sampling.max_tokens)]
    if sampling.top_p is not None:
        options += ["--top-p", f"{sampling.top_p:g}"]
    return client_command(p, dataset, server_url, concurrency, retries, options)


def records_command(p: RegenPaths) -> str:
    """The host's output lines of the keys given on stdin (one a line)."""
    return shell.join(["python3", p.client, "records", "--workdir", p.workdir])


def parse_records(text: str | bytes) -> dict[str, dict]:
    """Output lines -> {source key: record} (the last of a key wins; unreadable lines skipped)."""
    lines = text.splitlines() if isinstance(text, str) else text.decode("utf-8", "replace").splitlines()
    out: dict[str, dict] = {}
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("source_key"), str) and isinstance(rec.get("messages"), list):
            out[rec["source_key"]] = rec
    return out


def read_output(path: Path) -> dict[str, dict]:
    """A local regenerated file -> {source key: record}; none when it does not exist."""
    return parse_records(path.read_bytes()) if path.is_file() else {}


def merge(samples: list[Sample], have: dict[str, dict]) -> list[dict]:
    """The regenerated records in the dataset's order: each sample whose key has a record, once,
    with the sample's own id (records sharing a key share its turns)."""
    out = []
    for s in samples:
        rec = have.get(s.key)
        if rec is not None:
            source_id = json.loads(s.line)["id"]
            out.append({**rec, "id": source_id, "source_key": s.key})
    return out


def output_bytes(records: list[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in records).encode("utf-8")
