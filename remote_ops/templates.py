"""Render the project's Jinja2 templates (pure: values in, text out).

StrictUndefined turns every missing variable into an error; `render` maps it
to a `ConfigError` naming the template and the variable, so a half-filled
Dockerfile can never reach a host.  Templates live in the repository's
`templates/` directory (see `remote_ops.paths.repo_resource`).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jinja2

from .errors import ConfigError
from .paths import repo_resource

DOCKERFILE = "Dockerfile.j2"


def template_dir() -> Path:
    return repo_resource("templates")


def environment(directory: Path | None = None) -> jinja2.Environment:
    """A Jinja2 environment that refuses undefined variables and keeps text exact."""
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(directory or template_dir())),
                              undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                              trim_blocks=True, lstrip_blocks=True, autoescape=False)


def render(name: str, variables: dict[str, Any], directory: Path | None = None) -> str:
    """Render template `name`; a missing template or variable is a ConfigError naming it."""
    env = environment(directory)
    try:
        return env.get_template(name).render(**variables)
    except jinja2.TemplateNotFound:
        raise ConfigError("template not found", source=str((directory or template_dir()) / name)) from None
    except jinja2.UndefinedError as exc:
        raise ConfigError(f"template variable {_undefined_name(exc)} is not defined",
                          source=name, field=_undefined_name(exc),
                          hint="every variable the template uses must be given (StrictUndefined)") from None
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"template syntax error at line {exc.lineno}: {exc.message}", source=name) from None


def render_string(text: str, variables: dict[str, Any]) -> str:
    """Render a template given as text (tests, inline snippets) with the same strictness."""
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                             trim_blocks=True, lstrip_blocks=True)
    try:
        return env.from_string(text).render(**variables)
    except jinja2.UndefinedError as exc:
        raise ConfigError(f"template variable {_undefined_name(exc)} is not defined",
                          source="<string>", field=_undefined_name(exc)) from None


def _undefined_name(exc: jinja2.UndefinedError) -> str:
    """'image' from "'image' is undefined" or "'dict object' has no attribute 'tag'"."""
    msg = str(exc)
    m = re.search(r"has no attribute '([^']+)'", msg) or re.search(r"'([^']+)' is undefined", msg)
    return m.group(1) if m else msg
