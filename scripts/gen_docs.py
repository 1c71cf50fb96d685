"""Generate the reference pages under docs/ from the code, so they cannot drift from it.

    scripts/gen-docs            write the generated pages (and the generated parts of pages)
    scripts/gen-docs --check    exit 1 and name each page that is out of date (tests/test_docs.py)

What is generated, and from what:

- docs/commands.md, whole: every click command's usage, help text and options, read from
  the click objects of `remote_ops.cli` (the same objects `remote-ops X --help` prints).
- docs/models.md, between its GENERATED markers: `remote-ops patch specs --markdown`.
- docs/inventory.md, between its GENERATED markers: one row per field of
  `remote-ops inventory schema` (path, type, default, description).

Nothing here connects anywhere or reads the environment: the output depends on the code only.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
REGENERATE = "scripts/gen-docs"

#: an option record (names, help) on at least this many leaf commands is a shared option:
#: listed once at the top of docs/commands.md instead of under every command.
SHARED_MIN = 8


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Generate docs/commands.md and the generated parts of docs/.")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a page is out of date")
    args = parser.parse_args(argv)
    stale = {path: text for path, text in pages().items() if _read(path) != text}
    for path, text in stale.items():
        if args.check:
            print(f"out of date: {path.relative_to(ROOT)} (regenerate with: {REGENERATE})", file=sys.stderr)
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(ROOT)}", file=sys.stderr)
    return 1 if (args.check and stale) else 0


def pages() -> dict[Path, str]:
    """{page: its full text as generated now}."""
    models = DOCS / "models.md"
    inventory = DOCS / "inventory.md"
    return {
        DOCS / "commands.md": commands_page(),
        models: splice(_read(models), "remote-ops patch specs --markdown", specs_table()),
        inventory: splice(_read(inventory), "remote-ops inventory schema", inventory_table()),
    }


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8") if path.exists() else ""


# --- docs/commands.md ---------------------------------------------------------------------


#: where the root click group may live (the CLI process may move into a `remote_ops/cli/` folder)
ROOT_GROUP_AT = ("remote_ops.cli", "remote_ops.cli.cli", "remote_ops.cli.main")


def root_command() -> click.Group:
    """The `remote-ops` click group: the first `cli` group found at ROOT_GROUP_AT."""
    for module_name in ROOT_GROUP_AT:
        try:
            group = getattr(importlib.import_module(module_name), "cli", None)
        except ImportError:
            continue
        if isinstance(group, click.Group):
            return group
    raise SystemExit(f"gen-docs: no click group `cli` in {', '.join(ROOT_GROUP_AT)}")


def leaf_commands() -> list[tuple[str, click.Command, click.Context, list[click.Group]]]:
    """(full name, command, its context, the groups above it) for every command that runs."""
    root = root_command()
    found: list[tuple[str, click.Command, click.Context, list[click.Group]]] = []

    def walk(cmd: click.Command, ctx: click.Context, path: list[str], groups: list[click.Group]) -> None:
        if isinstance(cmd, click.Group):
            for name in cmd.list_commands(ctx):
                sub = cmd.get_command(ctx, name)
                if sub is not None and not sub.hidden:
                    walk(sub, click.Context(sub, info_name=name, parent=ctx), [*path, name], [*groups, cmd])
        else:
            found.append((" ".join(path), cmd, ctx, groups))

    walk(root, click.Context(root, info_name="remote-ops"), ["remote-ops"], [])
    return found


def option_records(cmd: click.Command, ctx: click.Context) -> list[tuple[str, str]]:
    """(names, help) of each option (and each argument with a help text) as `--help` shows them,
    without --help itself."""
    records = []
    for param in cmd.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is not None and record[1].strip() and "--help" not in record[0]:
            records.append(record)
    return records


def commands_page() -> str:
    root = root_command()
    root_ctx = click.Context(root, info_name="remote-ops")
    leaves = leaf_commands()
    counts = Counter(r for _, cmd, ctx, _ in leaves for r in dict.fromkeys(option_records(cmd, ctx)))
    shared = [r for r, n in counts.items() if n >= SHARED_MIN]  # in order of first appearance
    out = [
        "# Command reference",
        "",
        f"<!-- GENERATED by {REGENERATE} from the click commands; do not edit. -->",
        "",
        "Generated from the commands themselves: `remote-ops COMMAND --help` prints the same text.",
        "Exit codes: [exit-codes.md](exit-codes.md). Host patterns (`--host fleet`, `'fleet,!gpu-03'`):",
        "[fleets.md](fleets.md).",
        "",
        "## `remote-ops`",
        "",
        f"`remote-ops {' '.join(root.collect_usage_pieces(root_ctx))}`",
        "",
        *_help_markdown(root.help or ""),
        "",
        *[f"- `{names}`: {_one_line(help_)}" for names, help_ in option_records(root, root_ctx)],
        "",
        "## Shared options",
        "",
        "Most commands take these; each command below lists which of them it takes.",
        "",
        *[f"- `{names}`: {_one_line(help_)}" for names, help_ in shared],
        "",
        "## Commands",
        "",
        *[f"- [`{name}`](#{_anchor(name)})" for name, *_ in leaves],
        "",
    ]
    seen_groups: set[str] = set()
    for name, cmd, ctx, groups in leaves:
        for group in groups[1:]:
            group_name = group.name or ""
            if group_name not in seen_groups:
                seen_groups.add(group_name)
                out += [f"## `remote-ops {group_name}`", "", *_help_markdown(group.help or ""), ""]
        out += _command_section(name, cmd, ctx, set(shared))
    return "\n".join(out).rstrip("\n") + "\n"


def _command_section(name: str, cmd: click.Command, ctx: click.Context, shared: set[tuple[str, str]]) -> list[str]:
    usage = " ".join([name, *cmd.collect_usage_pieces(ctx)])
    records = option_records(cmd, ctx)
    own = [r for r in records if r not in shared]
    common = [r[0].split(" ")[0].rstrip(",") for r in records if r in shared]
    lines = [f"### `{name}`", "", f"`{usage}`", "", *_help_markdown(cmd.help or ""), ""]
    if own:
        lines += [*(f"- `{names}`: {_one_line(help_)}" for names, help_ in own), ""]
    if common:
        lines += ["Shared options: " + ", ".join(f"`{n}`" for n in common) + ".", ""]
    return lines


def _help_markdown(text: str) -> list[str]:
    """A click help text as Markdown: plain paragraphs re-flowed to one line each, the
    paragraphs click keeps as written (marked `\\b`: examples, aligned lists) in a text block."""
    lines: list[str] = []
    for paragraph in inspect.cleandoc(text).split("\n\n"):
        if paragraph.startswith("\b"):
            body = paragraph[1:].strip("\n")
            if body.strip():
                lines += ["```text", *(line.rstrip() for line in body.splitlines()), "```", ""]
        elif paragraph.strip():
            lines += [_one_line(paragraph), ""]
    return lines[:-1] if lines else lines


def _one_line(text: str) -> str:
    """`text` on one line, as Markdown prose: outside `code spans`, `<` and `*` are escaped, so
    `<state>` is shown (not taken for an HTML tag) and `gpu-0*` starts no emphasis."""
    parts = " ".join(text.split()).split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("<", "&lt;").replace("*", "\\*")
    return "`".join(parts)


def _anchor(name: str) -> str:
    """GitHub's heading anchor for the heading "`name`"."""
    return "".join(c for c in name.lower().replace(" ", "-") if c.isalnum() or c in "-_")


# --- generated parts of hand-written pages --------------------------------------------------


def splice(page: str, source: str, body: str) -> str:
    """`page` with the text between its GENERATED markers for `source` replaced by `body`."""
    begin = f"<!-- BEGIN GENERATED by {REGENERATE}: {source} -->"
    end = f"<!-- END GENERATED: {source} -->"
    head, sep, rest = page.partition(begin)
    if not sep or end not in rest:
        raise SystemExit(f"gen-docs: the page lacks the markers {begin!r} ... {end!r}")
    return f"{head}{begin}\n{body.rstrip()}\n{end}{rest.partition(end)[2]}"


def cli_output(*args: str) -> str:
    """stdout of `remote-ops ARGS` run in-process in a child (no inventory, no connection)."""
    env = {**os.environ, "REMOTE_OPS_DAEMON": "0", "NO_COLOR": "1", "REMOTE_OPS_PATCH_PATH": ""}
    done = subprocess.run(
        [sys.executable, "-m", "remote_ops", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout


def specs_table() -> str:
    return cli_output("patch", "specs", "--markdown")


def inventory_table() -> str:
    """One row per inventory field: `section.field`, type, default, description."""
    schema = json.loads(cli_output("inventory", "schema"))
    defs = schema["$defs"]
    rows = ["| field | type | default | description |", "|---|---|---|---|"]
    host = defs["HostSettings"]
    for field, prop in host["properties"].items():
        ref = _ref(prop)
        if ref is None:
            rows.append(_field_row(field, prop, field in host.get("required", [])))
            continue
        section = defs[ref]
        parent_default = prop.get("default") or {}
        for sub, sub_prop in section["properties"].items():
            if "default" not in sub_prop and sub in parent_default:
                sub_prop = {**sub_prop, "default": parent_default[sub]}
            rows.append(_field_row(f"{field}.{sub}", sub_prop, sub in section.get("required", [])))
    return "\n".join(rows)


def _ref(prop: dict) -> str | None:
    target = prop.get("$ref") or next((a.get("$ref") for a in prop.get("allOf", [])), None)
    return target.rsplit("/", 1)[-1] if target else None


def _field_row(path: str, prop: dict, required: bool) -> str:
    default = f"`{json.dumps(prop['default'])}`" if "default" in prop else ("required" if required else "")
    description = prop.get("description", "").replace("|", "\\|")  # a table cell
    return f"| `{path}` | {_type(prop)} | {default} | {_one_line(description)} |"


def _type(prop: dict) -> str:
    if "anyOf" in prop:
        return " or ".join(_type(p) for p in prop["anyOf"])
    if "enum" in prop:
        return " / ".join(f"`{v}`" for v in prop["enum"])
    kind = prop.get("type", "object")
    if kind == "array":
        return f"list of {_type(prop.get('items', {}))}"
    if kind == "object" and isinstance(prop.get("additionalProperties"), dict):
        return f"map of {_type(prop['additionalProperties'])}"
    bounds = [f"≥ {prop['minimum']}" if "minimum" in prop else "", f"≤ {prop['maximum']}" if "maximum" in prop else ""]
    return " ".join([kind, *filter(None, bounds)])


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
