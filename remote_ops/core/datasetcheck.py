"""The extraction dataset's rules (pure): which JSONL lines the on-host client can send.

One JSON object per line, UTF-8, with:

- `input_ids` (or `token_ids`): a non-empty list of token ids, each an integer
  from 0 to 2**31 - 1 (the dump key packs them as int32);
- `id` (optional, default the 0-based line index): a string or an integer;
- `loss_mask` (optional, what `remote-ops dataset prepare` writes): a list of
  0/1 of the same length as the token ids.

No key may appear twice in one object (JSON allows it; the last one would win
silently).  Blank lines are skipped.  Line numbers are the file's own, from 1.

`remote-ops extract start` checks a local dataset with these rules before it
uploads anything or takes the host lock (`remote_ops.workflows.extract.check_dataset`),
so a bad line is exit 3 naming `FILE:LINE`, never a host traceback.  The
client (`remote_ops/onhost/extract_onhost.py`) applies the same rules to a
dataset already on the host.

The chat dataset's rules (`chat_record`, `check_chat_lines`): what `remote-ops
dataset regenerate` can send to the server's chat template.  One JSON object per
line, UTF-8, no key twice, with `messages` (OpenAI: `role`/`content`) or
`conversations` (ShareGPT: `from`/`value`, or `role`/`content`): a non-empty
list of turns, each an object whose role is system, user or assistant (ShareGPT
speakers `human`/`gpt`/... map to them; tool turns cannot be regenerated) and
whose content is text (a string, or a list of `{"text": ...}` parts).  The
first turn after any system turns is a user turn (the target answers users;
SpecForge's `regenerate_train_data.py` refuses a chat that starts with an
assistant turn).  `id` (optional) is a string or an integer.  A good line
reads as `{"id", "messages": [{"role", "content"}]}` with the roles normalised.

The line rules themselves are the on-host clients' own functions (`remote_ops/onhost/client.py`'s
`decode_line`, `remote_ops/onhost/extract_onhost.py`'s `record_problem`: stdlib, shipped to the
host), so the laptop and the host check with one copy; this module adds the line numbers and
the chat rules.  `tests/test_faults_inputs.py` holds both sides to one table of bad lines.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..onhost.client import decode_line, json_type
from ..onhost.extract_onhost import record_problem


@dataclass(frozen=True)
class Problem:
    """One bad line: its number in the file (from 1) and why."""

    line: int
    reason: str


def parse_record(raw: bytes) -> tuple[dict | None, str | None]:
    """(record, None) for a good line, (None, reason) for a bad one, (None, None) for a blank one."""
    doc, reason = decode_line(raw)
    if doc is None:
        return None, reason
    reason = record_problem(doc)
    return (None, reason) if reason else (doc, None)


def check_lines(lines: Iterable[bytes], max_problems: int = 20) -> list[Problem]:
    """The first `max_problems` bad lines of a dataset (its lines as bytes, e.g. a file opened "rb")."""
    return _check(lines, parse_record, max_problems)


def _check(
    lines: Iterable[bytes], rule: Callable[[bytes], tuple[dict | None, str | None]], max_problems: int
) -> list[Problem]:
    problems: list[Problem] = []
    for number, raw in enumerate(lines, 1):
        _doc, reason = rule(raw)
        if reason:
            problems.append(Problem(number, reason))
            if len(problems) >= max_problems:
                break
    return problems


# --------------------------------------------------------------------------- chat datasets (regenerate)

#: ShareGPT speakers (`from`) and OpenAI roles -> the roles a chat template takes.
CHAT_ROLES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
}


def chat_record(raw: bytes) -> tuple[dict | None, str | None]:
    """A chat line as `{"id", "messages": [{"role", "content"}]}` (roles normalised, content text):
    (chat, None) for a good line, (None, reason) for a bad one, (None, None) for a blank one."""
    doc, reason = decode_line(raw)
    if doc is None:
        return None, reason
    turns, reason = chat_turns(doc)
    if turns is None:
        return None, reason
    if "id" in doc and (isinstance(doc["id"], bool) or not isinstance(doc["id"], (str, int))):
        return None, f"id must be a string or an integer, not {json_type(doc['id'])}"
    chat: dict = {"messages": turns}
    if "id" in doc:
        chat["id"] = doc["id"]
    return chat, None


def chat_turns(doc: dict) -> tuple[list[dict] | None, str | None]:
    """The record's turns as [{"role", "content"}], or (None, why they cannot be regenerated)."""
    field = "messages" if "messages" in doc else "conversations"
    turns = doc.get(field)
    if field not in doc:
        return None, "no messages (or conversations) list"
    if not isinstance(turns, list):
        return None, f"{field} must be a list of turns, not {json_type(turns)}"
    if not turns:
        return None, f"{field} is empty"
    out: list[dict] = []
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict):
            return None, f"{field}[{k}] is {json_type(turn)}, not a turn object"
        role, reason = _chat_role(turn, f"{field}[{k}]")
        if reason:
            return None, reason
        text, reason = _chat_text(turn.get("content", turn.get("value")), f"{field}[{k}]")
        if reason:
            return None, reason
        out.append({"role": role, "content": text})
    first = next((t["role"] for t in out if t["role"] != "system"), None)
    if first != "user":
        return None, f"{field}: the first turn after the system turns must be a user turn, not {first or 'none'}"
    return out, None


def _chat_role(turn: dict, where: str) -> tuple[str, str | None]:
    said = turn.get("role", turn.get("from"))
    if not isinstance(said, str):
        return "", f"{where} has no role (or from) string"
    role = CHAT_ROLES.get(said.lower())
    if role is None:
        return "", f"{where}: role {said!r} cannot be regenerated (system, user and assistant turns only)"
    return role, None


def _chat_text(content: object, where: str) -> tuple[str, str | None]:
    """String content, or the text of a list of `{"text": ...}` parts."""
    if isinstance(content, str):
        return content, None
    if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text", ""), str) for p in content):
        return "".join(p.get("text", "") for p in content), None
    return "", f"{where}: content must be text (a string or a list of text parts), not {json_type(content)}"


def check_chat_lines(lines: Iterable[bytes], max_problems: int = 20) -> list[Problem]:
    """The first `max_problems` bad lines of a chat dataset (its lines as bytes)."""
    return _check(lines, chat_record, max_problems)
