"""Every config key with its type, default and what it means, read from the schema itself: the
dataclasses of this package for the names, types and defaults, and the comments beside each
field in their source for the meaning (one place to write it: the field's comment).

    moe-jax train --help-config            # every section, as text
    moe-jax train --help-config train      # one section
    moe-jax train --help-config --markdown > docs/reference/config.md

docs/reference/config.md is `markdown()`'s output; tests/test_config_reference.py checks that
it is current, so a new key is documented where it is declared and nowhere else by hand.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from dataclasses import MISSING, fields, is_dataclass
from functools import cache
from typing import NamedTuple

from moe_jax.config.tree import Config

INDENT = " " * 6  # a key's meaning under it, in --help-config
TOP = "top level"  # the keys outside every section (run_dir, seed, init_from, ...)


class Key(NamedTuple):
    name: str  # dotted, as an override spells it: train.steps
    type: str
    default: str
    doc: str


@cache
def _comments(cls: type) -> dict[str, str]:
    """{field: its comment}: the comment lines right above the field and those at the ends of
    its own lines, joined."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    (node,) = ast.parse(source).body
    out = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above = []
        i = stmt.lineno - 2  # the line before the field's, 0-based
        while i >= 0 and lines[i].strip().startswith("#"):
            above.insert(0, lines[i].strip().lstrip("#").strip())
            i -= 1
        # the comments at the ends of its lines (a formatter may wrap a long default)
        own = lines[stmt.lineno - 1 : stmt.end_lineno]
        trailing = [ln.split("  # ", 1)[1].strip() for ln in own if "  # " in ln]
        out[stmt.target.id] = " ".join(part for part in (*above, *trailing) if part)
    return out


def _default(f: dataclasses.Field) -> object:
    if f.default_factory is not MISSING:
        return f.default_factory()
    return f.default


def _shown(value: object) -> str:
    if isinstance(value, tuple):
        return "[" + ", ".join(map(str, value)) + "]"  # as YAML and an override write it
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {v}" for k, v in value.items()) + "}"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str) and not value.isprintable():  # "\n": shown escaped, as written
        return repr(value)
    return "null" if value is None else str(value)


def keys(cls: type = Config, prefix: str = "") -> list[Key]:
    """The leaf keys under `cls`, depth first in declaration order."""
    docs = _comments(cls)
    out = []
    for f in fields(cls):
        value = _default(f)
        if is_dataclass(value):
            out += keys(type(value), f"{prefix}{f.name}.")
        else:
            out.append(Key(prefix + f.name, str(f.type), _shown(value), docs.get(f.name, "")))
    return out


def sections() -> dict[str, list[Key]]:
    """{section: its keys}, the sections in Config's order, the top-level keys last."""
    out: dict[str, list[Key]] = {}
    for key in keys():
        section = key.name.split(".")[0] if "." in key.name else TOP
        out.setdefault(section, []).append(key)
    out[TOP] = out.pop(TOP)
    return out


def text(section: str | None = None, width: int = 100) -> str:
    """The keys as `--help-config` prints them: of one section, or of all."""
    chosen = sections()
    if section is not None:
        if section not in chosen:
            from moe_jax.config.checks import ConfigError

            raise ConfigError(f"no config section '{section}'; the sections: {', '.join(chosen)}")
        chosen = {section: chosen[section]}
    out = []
    for name, ks in chosen.items():
        out.append(f"[{name}]")
        for k in ks:
            out.append(f"  {k.name} ({k.type}) = {k.default}")
            if k.doc:
                out += textwrap.wrap(k.doc, width, initial_indent=INDENT, subsequent_indent=INDENT)
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def _cell(s: str) -> str:
    return s.replace("|", "\\|")


def markdown() -> str:
    """docs/reference/config.md: a table a section."""
    out = [
        "[Back to the README](../../README.md) · [Configuration](../configuration.md)",
        "",
        "# Config reference",
        "",
        "Every key a config file or a `section.key=value` override can set, with its type and",
        "default, generated from the schema (`moe_jax/config/`, the comments beside each field)",
        "by `moe-jax train --help-config --markdown > docs/reference/config.md`; as text:",
        "`moe-jax train --help-config [SECTION]`. Do not edit by hand.",
        "",
    ]
    for name, ks in sections().items():
        out += [f"## {name}", "", "| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        out += [
            f"| `{k.name}` | `{_cell(k.type)}` | `{_cell(k.default)}` | {_cell(k.doc)} |"
            for k in ks
        ]
        out.append("")
    return "\n".join(out)
