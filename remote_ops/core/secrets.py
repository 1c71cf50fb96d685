"""Mask secret values before they are shown or recorded (pure: values in, values out).

A value is secret when its *name* looks secret: one of the words in
`SECRET_WORDS` appears as a whole word of the name (`HF_TOKEN`, `OPENAI_API_KEY`,
`dbPassword`, `--api-key`), so `TOKENIZER_PATH`, `MAX_TOKENS` or `KEYBOARD` are
left alone.  The value is replaced by `MASK`; the name stays, so a plan still
says *which* variable is set.

Applied where remote-ops renders what it will run or did run: the `docker run`
argv in `deploy --dry-run`/`--diff` and `container start --dry-run`, the
command of an error raised by such a run, the local run record and the audit
line on the host, `hosts --json`.  The container still receives the real
values (they must reach it), so `docker inspect` on the host shows them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

E = TypeVar("E", bound=BaseException)

MASK = "***"

#: Whole words of a name that make its value secret.
SECRET_WORDS = frozenset(
    {
        "TOKEN",
        "KEY",
        "KEYS",
        "APIKEY",
        "SECRET",
        "SECRETS",
        "PASSWORD",
        "PASSWORDS",
        "PASSWD",
        "PASS",
        "PASSPHRASE",
        "CREDENTIAL",
        "CREDENTIALS",
        "CREDS",
        "AUTH",
        "AUTHORIZATION",
        "BEARER",
        "COOKIE",
        "DSN",
    }
)

_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")
_NAME = r"[A-Za-z_][A-Za-z0-9_.-]*"
#: `NAME=value` in free text; the value runs to whitespace or a closing quote.
_ASSIGN = re.compile(rf"(?<![A-Za-z0-9_.-])(?P<flag>--?)?(?P<name>{_NAME})=(?P<value>'[^']*'|\"[^\"]*\"|[^\s'\"]+)")
#: `--secret-flag value` in free text.
_FLAG_PAIR = re.compile(rf"(?<!\S)--(?P<name>{_NAME})(?P<sep>\s+)(?P<value>'[^']*'|\"[^\"]*\"|[^\s'\"-][^\s'\"]*)")


def name_words(name: str) -> list[str]:
    """`HF_TOKEN` -> [HF, TOKEN]; `dbPassword` -> [DB, PASSWORD]; `--api-key` -> [API, KEY]."""
    return [w.upper() for part in re.split(r"[^A-Za-z0-9]+", name) for w in _WORD.findall(part)]


def is_secret_name(name: str) -> bool:
    """True when a whole word of `name` is one of `SECRET_WORDS` (word-boundary aware)."""
    return any(w in SECRET_WORDS for w in name_words(name))


def mask_value(name: str, value: Any) -> Any:
    """`MASK` for a non-empty value under a secret name, else the value unchanged."""
    return MASK if is_secret_name(name) and value not in (None, "") else value


def mask_env(env: Mapping[str, Any]) -> dict[str, Any]:
    """An environment mapping with every secret value masked."""
    return {k: mask_value(k, v) for k, v in env.items()}


def mask_assignment(text: str) -> str:
    """`NAME=value` (or `--name=value`) with the value masked when NAME is secret."""
    flag = "--" if text.startswith("--") else ""
    name, sep, value = text[len(flag) :].partition("=")
    if not sep or not re.fullmatch(_NAME, name):
        return text
    return f"{flag}{name}={mask_value(name, value)}"


def mask_argv(argv: Sequence[str]) -> list[str]:
    """An argv with secret values masked: `-e HF_TOKEN=x`, `--api-key x`, `--api-key=x`."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        prev = argv[i - 1] if i else ""
        flag_value = (
            prev.startswith("--") and "=" not in prev and is_secret_name(prev) and not arg.startswith("-") and arg != ""
        )
        out.append(MASK if flag_value else mask_assignment(arg))
    return out


def mask_text(text: str) -> str:
    """Free text (a rendered command, an error message) with `SECRET=value` and
    `--secret value` masked.  Quoted values (`'HF_TOKEN=a b'`) are masked whole."""

    def assign(m: re.Match[str]) -> str:
        if not is_secret_name(m["name"]):
            return m[0]
        q = m["value"][0] if m["value"][0] in "'\"" else ""
        return f"{m['flag'] or ''}{m['name']}={q}{MASK}{q}"

    def pair(m: re.Match[str]) -> str:
        return f"--{m['name']}{m['sep']}{MASK}" if is_secret_name(m["name"]) else m[0]

    text = _FLAG_PAIR.sub(pair, text)
    # a whole quoted word `'NAME=v a l'` (shell-quoted argv): mask inside the quotes
    text = re.sub(rf"'({_NAME})=([^']*)'", lambda m: f"'{m[1]}={mask_value(m[1], m[2])}'", text)
    return _ASSIGN.sub(assign, text)


def mask_data(obj: Any) -> Any:
    """A JSON-like document (record, inventory dump) with secret values masked: every
    `env` mapping's secret entries, and `SECRET=value` inside strings (commands, messages).
    Other keys are left alone: `host_key_fingerprint` is evidence, not a secret."""
    if isinstance(obj, Mapping):
        return {k: mask_env(v) if k == "env" and isinstance(v, Mapping) else mask_data(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [mask_data(v) for v in obj]
    return mask_text(obj) if isinstance(obj, str) else obj


def mask_error(exc: E) -> E:
    """Mask the message, command and output tails a typed error carries (in place); returns it."""
    for attr in ("message", "command", "stderr_tail", "stdout_tail"):
        value = getattr(exc, attr, None)
        if isinstance(value, str):
            setattr(exc, attr, mask_text(value))
    if getattr(exc, "args", None):
        exc.args = (mask_text(str(exc.args[0])), *exc.args[1:])
    return exc
