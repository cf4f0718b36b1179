"""Render the templates in templates/ (every file pvegpu writes on a host is one of them)."""

from __future__ import annotations

import shlex
from pathlib import Path

import jinja2

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"

_env = jinja2.Environment(
    loader=jinja2.FileSystemLoader(str(TEMPLATES)),
    undefined=jinja2.StrictUndefined,  # a missing variable is a bug, not an empty string
    keep_trailing_newline=True,
    trim_blocks=True,
    lstrip_blocks=True,
    autoescape=False,
)
# `{{ value | q }}`: one shell word whatever the value holds (shell templates quote every value)
_env.filters["q"] = lambda value: shlex.quote(str(value))


def render_template(name: str, **context) -> str:
    return _env.get_template(name).render(**context)
