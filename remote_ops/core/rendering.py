"""Render the project's Jinja2 templates (pure: values in, text out).

StrictUndefined turns every missing variable into an error; `render` maps it
to a `ConfigError` naming the template and the variable, so a half-filled
Dockerfile can never reach a host.  Templates live in the repository's
`templates/` directory (see `remote_ops.paths.repo_resource`).

Values are escaped for the Dockerfile context they land in, one filter per
context (`FILTERS`), so a value that slipped past inventory validation still
cannot become an instruction: a newline inside a `FROM`, a `LABEL` value or a
`COPY` path would otherwise start a new line, i.e. a new `RUN`.  As a last
net, any `{{ }}` output that still spans lines is refused (`finalize`).
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any, Callable

import jinja2

from ..errors import ConfigError
from ..paths import repo_resource

DOCKERFILE = "Dockerfile.j2"


def template_dir() -> Path:
    return repo_resource("templates")


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _escape_controls(text: str) -> str:
    """Control characters as visible escapes (`\\n`, `\\u0000`): the text stays on one line."""
    return _CONTROL.sub(lambda m: json.dumps(m.group())[1:-1], text)


def dockerfile_json(value: Any) -> str:
    """JSON-array (exec) form: `["a", "b"]`.  JSON escapes every control character and
    `ensure_ascii` every non-ASCII one, so the array is one line whatever it holds."""
    items = [value] if isinstance(value, str) else list(value)
    return json.dumps([str(v) for v in items], ensure_ascii=True)


def dockerfile_quoted(value: Any) -> str:
    """A LABEL or ENV value in double quotes: `\\`, `"` and `$` escaped (no variable
    expansion), control characters as visible escapes (one line)."""
    text = re.sub(r'([\\"$])', r"\\\1", str(value))
    return f'"{_escape_controls(text)}"'


def dockerfile_image(value: Any) -> str:
    """A FROM image: `FROM` has no quoting, so anything but a valid reference is refused."""
    from .inventory import IMAGE_REFERENCE

    if not IMAGE_REFERENCE.fullmatch(str(value)):
        raise ConfigError(f"not a valid image reference for FROM: {str(value)!r}", field="base_image")
    return str(value)


def dockerfile_shell(value: Any) -> str:
    """One word of a shell-form RUN: shell-quoted; a control character is refused
    (a quoted newline would still end the Dockerfile line)."""
    if _CONTROL.search(str(value)):
        raise ConfigError(f"a RUN argument cannot hold a control character: {str(value)!r}")
    return shlex.quote(str(value))


def dockerfile_int(value: Any) -> str:
    """A number (ports, seconds): anything else is refused."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"expected a whole number in the Dockerfile, got {value!r}")
    return str(value)


def dockerfile_comment(value: Any) -> str:
    """Text in a `#` comment: kept on its line."""
    return _escape_controls(str(value))


def _strict(fn: Callable[[Any], str]) -> Callable[[Any], str]:
    """A filter given an undefined value raises StrictUndefined's error (naming the variable)."""

    def wrapped(value: Any) -> str:
        if isinstance(value, jinja2.Undefined):
            str(value)
        return fn(value)

    wrapped.__doc__ = fn.__doc__
    return wrapped


#: One filter per Dockerfile context.
FILTERS = {
    fn.__name__: _strict(fn)
    for fn in (
        dockerfile_json,
        dockerfile_quoted,
        dockerfile_image,
        dockerfile_shell,
        dockerfile_int,
        dockerfile_comment,
    )
}


def _one_line(value: Any) -> Any:
    """`finalize`: no `{{ }}` output may span lines (the net under the filters)."""
    if isinstance(value, str) and ("\n" in value or "\r" in value):
        raise ConfigError(
            f"a template value spans lines: {value!r}",
            hint="values are escaped per Dockerfile context; this one was not",
        )
    return value


def environment(directory: Path | None = None) -> jinja2.Environment:
    """A Jinja2 environment that refuses undefined variables and keeps text exact."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(directory or template_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
        finalize=_one_line,
    )
    env.filters.update(FILTERS)
    return env


def render(name: str, variables: dict[str, Any], directory: Path | None = None) -> str:
    """Render template `name`; a missing template or variable is a ConfigError naming it."""
    env = environment(directory)
    try:
        return env.get_template(name).render(**variables)
    except jinja2.TemplateNotFound:
        raise ConfigError("template not found", source=str((directory or template_dir()) / name)) from None
    except jinja2.UndefinedError as exc:
        raise ConfigError(
            f"template variable {_undefined_name(exc)} is not defined",
            source=name,
            field=_undefined_name(exc),
            hint="every variable the template uses must be given (StrictUndefined)",
        ) from None
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"template syntax error at line {exc.lineno}: {exc.message}", source=name) from None


def render_string(text: str, variables: dict[str, Any]) -> str:
    """Render a template given as text (tests, inline snippets) with the same strictness."""
    env = jinja2.Environment(
        undefined=jinja2.StrictUndefined, keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True
    )
    try:
        return env.from_string(text).render(**variables)
    except jinja2.UndefinedError as exc:
        raise ConfigError(
            f"template variable {_undefined_name(exc)} is not defined", source="<string>", field=_undefined_name(exc)
        ) from None


def _undefined_name(exc: jinja2.UndefinedError) -> str:
    """'image' from "'image' is undefined" or "'dict object' has no attribute 'tag'"."""
    msg = str(exc)
    m = re.search(r"has no attribute '([^']+)'", msg) or re.search(r"'([^']+)' is undefined", msg)
    return m.group(1) if m else msg
