"""Which hosts a command runs on: `--host PATTERN`, `--all`, `--limit PATTERN` (pure).

A pattern is Ansible's host pattern, kept to the parts operators use:

- `gpu-node`            a host name
- `fleet`               a group: every host in it, its child groups' included
- `gpu-0*`, `*-a100`    a glob over host and group names
- `a,b,c` or `a:b:c`    a union, in the order given
- `fleet:!gpu-03`       minus a host, group or glob
- `fleet:&rack-2`       intersection with a host, group or glob
- `all` / `*`           every inventory host (same as `--all`)
- `!gpu-03`             every host but one (a pattern of only `&`/`!` terms starts from all)

Terms are applied in Ansible's order, whatever order they are written in:
the plain terms (union) first, then each `&` term, then each `!` term; so
`a:b:&c:!d` == `!d:&c:a:b` == hosts in (a or b) and in c and not in d.  `,`
and `:` both separate terms; a term that is an address with a port
(`addr:port`, `user@addr:port`, `[v6]:port`) or an IPv6 literal is kept whole.

`--limit` narrows the selection with a second pattern, as `ansible --limit`.
An unknown bare name is an error that lists the closest inventory names; a
value that can only be an address (`user@addr`, `addr:port`, an IP literal) is
an ad-hoc host with defaults, as ssh itself would treat it.  Hosts come back
in inventory order within each union term (terms in the order given), each once.
"""

from __future__ import annotations

import difflib
import fnmatch
import ipaddress
from typing import Any, Protocol

from ..errors import ConfigError, UsageError


class _Inventory(Protocol):
    @property
    def hosts(self) -> dict[str, Any]: ...

    @property
    def groups(self) -> dict[str, Any]: ...


def select(inventory: _Inventory, pattern: str | None, *, all_hosts: bool = False, limit: str | None = None) -> list:
    """The hosts `pattern` (or `--all`) names, narrowed by `limit`; never empty."""
    if bool(pattern) == all_hosts:
        raise UsageError("give exactly one of --host or --all")
    chosen = list(inventory.hosts.values()) if all_hosts else _match(inventory, pattern or "")
    if limit:
        allowed = {h.name for h in _match(inventory, limit, adhoc=False)}
        chosen = [h for h in chosen if h.name in allowed]
    if not chosen:
        raise ConfigError(
            f"no host matches {pattern or 'all'!r}" + (f" with --limit {limit!r}" if limit else ""),
            field="--limit" if limit else "--host",
        )
    return chosen


def _match(inventory: _Inventory, pattern: str, adhoc: bool = True) -> list:
    """The union of the plain terms, then kept only where in every `&` term, then without
    any `!` term: Ansible's order, whatever the order written."""
    terms = split_pattern(pattern)
    bare = next((t for t in terms if t in ("!", "&")), None)
    if bare:
        raise UsageError(f"{bare!r} in {pattern!r} needs a host, group or glob right after it")
    plain = [t for t in terms if t[0] not in "!&"] or ["all"]  # only exclusions: start from all
    names: list[str] = []
    for term in plain:
        names += [n for n in _term(inventory, term, adhoc) if n not in names]
    for term in (t for t in terms if t[0] == "&"):
        keep = set(_term(inventory, term[1:], adhoc=False))
        names = [n for n in names if n in keep]
    for term in (t for t in terms if t[0] == "!"):
        drop = set(_term(inventory, term[1:], adhoc=False))
        names = [n for n in names if n not in drop]
    return [_host(inventory, n) for n in names]


def split_pattern(pattern: str) -> list[str]:
    """`a,b:!c` -> ['a', 'b', '!c'] (pure).  `,` and `:` separate terms; `:` does not split a
    term that is an address with a port or an IPv6 literal."""
    out: list[str] = []
    for part in (p.strip() for p in pattern.split(",")):
        if not part:
            continue
        if _one_address(part.lstrip("!&")):
            out.append(part)
        else:
            out += [p.strip() for p in part.split(":") if p.strip()]
    if not out:
        raise UsageError(f"empty host pattern {pattern!r}")
    return out


def _one_address(term: str) -> bool:
    """`host:port`, `user@host:port`, `[v6]` or `[v6]:port`, or an IPv6 literal: one term."""
    if term.startswith("["):
        return True
    head, sep, port = term.rpartition(":")
    if sep and head and ":" not in head and port.isdigit():
        return True
    try:
        return ipaddress.ip_address(term).version == 6
    except ValueError:
        return False


def _term(inventory: _Inventory, term: str, adhoc: bool) -> list[str]:
    """Host names one term names: all, a host, a group, a glob, an address, or an ad-hoc host."""
    if term in ("all", "*"):
        return list(inventory.hosts)
    if term in inventory.hosts:
        return [term]
    if term in inventory.groups:
        return list(inventory.groups[term])
    if any(c in term for c in "*?["):
        return _glob(inventory, term)
    by_address = [h.name for h in inventory.hosts.values() if getattr(h, "address", None) == term]
    if by_address:
        return by_address[:1]
    if adhoc and looks_like_address(term):
        return [_ADHOC + term]
    raise ConfigError(f"unknown host or group {term!r}", field="--host", hint=_suggest(inventory, term))


def _glob(inventory: _Inventory, term: str) -> list[str]:
    names = [n for n in inventory.hosts if fnmatch.fnmatchcase(n, term)]
    for group, members in inventory.groups.items():
        if fnmatch.fnmatchcase(group, term):
            names += [n for n in members if n not in names]
    return [n for n in inventory.hosts if n in names]


def looks_like_address(term: str) -> bool:
    """`user@host`, `host:port` or an IP literal: only an address, never a typo of a name."""
    if "@" in term:
        return True
    host, _, port = term.rpartition(":")
    if host and port.isdigit():
        return True
    try:
        ipaddress.ip_address(term)
        return True
    except ValueError:
        return False


def _suggest(inventory: _Inventory, term: str) -> str:
    names = list(inventory.hosts) + list(inventory.groups)
    close = difflib.get_close_matches(term, names, n=3, cutoff=0.5)
    if close:
        return "did you mean " + ", ".join(close) + "?"
    if names:
        return "inventory hosts and groups: " + ", ".join(sorted(names)[:12])
    return "no inventory loaded: pass --inventory, or an address (user@host, host:port, or an IP)"


_ADHOC = "\0adhoc:"


def _host(inventory: _Inventory, name: str) -> Any:
    if name.startswith(_ADHOC):
        from .inventory import adhoc_host

        return adhoc_host(name[len(_ADHOC) :])
    return inventory.hosts[name]
