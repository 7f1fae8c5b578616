"""The MOE_* settings table of docs/DEPLOY.md and deploy/env.example, rendered from
`service.config.Settings.model_fields`. tests/deploy/test_settings_docs.py fails when either file
differs from what this renders; after changing Settings, rewrite both with

    python -m tests.deploy.settings_docs --write
"""

from __future__ import annotations

import argparse
import sys
import typing
from pathlib import Path

import annotated_types

from service.config import PRESETS, Settings, default_text  # (default_text: --help shows the same)

ROOT = Path(__file__).resolve().parents[2]
DEPLOY_MD = ROOT / "docs" / "DEPLOY.md"
ENV_EXAMPLE = ROOT / "deploy" / "env.example"
BEGIN = "<!-- settings-table:begin (generated: python -m tests.deploy.settings_docs --write) -->"
END = "<!-- settings-table:end -->"

# What a setting means, for the fields whose Field() has no description yet. A field that gains a
# description must leave this table (the test says so), so there is one source for each text.
NOTES: dict[str, str] = {}  # every Settings field now carries its own description


def env_name(field: str) -> str:
    return "MOE_" + field.upper()


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def meaning(field: str) -> str:
    info = Settings.model_fields[field]
    return info.description or NOTES.get(field, "")


def env_default(field: str) -> str:
    value = Settings.model_fields[field].default
    return "" if value is None else str(value)


def allowed_text(field: str) -> str:
    """Choices of a Literal, or the bounds of a number, from the field's annotation and metadata."""
    info = Settings.model_fields[field]
    if field == "preset":  # checked by a validator against PRESETS, not by the annotation
        return ", ".join(f"`{name}`" for name in PRESETS)
    for arg in (info.annotation, *typing.get_args(info.annotation)):
        if typing.get_origin(arg) is typing.Literal:
            return ", ".join(f"`{c}`" for c in typing.get_args(arg))
    bounds = []
    for m in info.metadata:
        if isinstance(m, annotated_types.Ge):
            bounds.append(f">= {m.ge}")
        elif isinstance(m, annotated_types.Gt):
            bounds.append(f"> {m.gt}")
        elif isinstance(m, annotated_types.Le):
            bounds.append(f"<= {m.le}")
        elif isinstance(m, annotated_types.Lt):
            bounds.append(f"< {m.lt}")
    return ", ".join(bounds)


def render_table() -> str:
    rows = ["| variable | flag | default | allowed | meaning |", "|---|---|---|---|---|"]
    for field in Settings.model_fields:
        rows.append(f"| `{env_name(field)}` | `{flag_name(field)}` | {default_text(field)} | "
                    f"{allowed_text(field)} | {meaning(field)} |")
    return "\n".join(rows)


def render_env_example() -> str:
    lines = [
        "# Every moe-serve setting with its default, as a MOE_* variable. Generated from",
        "# service.config.Settings by `python -m tests.deploy.settings_docs --write`; do not edit by hand.",
        "#",
        "# docker compose: `cp deploy/env.example moe-serve.env` and uncomment what you change (the",
        "# service's env_file; compose's own variables, the Grafana password among them, go in .env:",
        "# deploy/compose.env.example). Under compose MOE_HTTP_PORT and MOE_GRPC_PORT are pinned to",
        "# 8000/8001: publish other host ports with HTTP_HOST_PORT / GRPC_HOST_PORT in .env instead.",
        "# An empty value (MOE_PRESET=) means unset: the default. Each variable is also a flag of",
        "# `moe-serve`; a flag wins over the variable. docs/DEPLOY.md has the table.",
        "",
    ]
    for field in Settings.model_fields:
        allowed = allowed_text(field).replace("`", "")
        about = f"# {meaning(field).replace('`', '')}. Default: {default_text(field)}."
        lines.append(about + (f" Allowed: {allowed}." if allowed else ""))
        lines.append(f"# {env_name(field)}={env_default(field)}")
        lines.append("")
    return "\n".join(lines)


def splice_table(doc: str) -> str:
    """docs/DEPLOY.md with the text between the markers replaced by the rendered table."""
    head, sep, rest = doc.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise ValueError(f"{DEPLOY_MD} lacks the markers {BEGIN!r} ... {END!r}")
    return f"{head}{BEGIN}\n{render_table()}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite docs/DEPLOY.md's table and deploy/env.example")
    args = parser.parse_args(argv)
    if not args.write:
        sys.stdout.write(render_table() + "\n")
        return 0
    DEPLOY_MD.write_text(splice_table(DEPLOY_MD.read_text()))
    ENV_EXAMPLE.write_text(render_env_example())
    return 0


if __name__ == "__main__":
    sys.exit(main())
