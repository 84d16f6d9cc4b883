"""Print the README's configuration table from celery_sched.settings.

Run ``.venv/bin/python scripts/settings_table.py`` and paste the output into
README.md; tests/unit/test_repo_layout.py fails when the two drift apart.
"""

from __future__ import annotations

import dataclasses

from celery_sched.settings import PREFIX, setting_fields


def _default(field: dataclasses.Field[object]) -> str:
    if field.default is None:
        return "unset"
    if field.default in ("", ()):
        return "(empty)"
    if isinstance(field.default, float) and field.default.is_integer():
        return f"`{int(field.default)}`"
    return f"`{field.default}`"


def _escape(text: str) -> str:
    # Markdown would swallow <host> as an HTML tag and split cells at |.
    return text.replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")


def render_table() -> str:
    """The configuration table, one row per setting, in declaration order."""
    lines = [
        "| setting | environment variable | default | meaning |",
        "|---|---|---|---|",
    ]
    for field in setting_fields():
        name = PREFIX + field.name
        doc = _escape(field.metadata["doc"])
        lines.append(f"| `{name}` | `{name.upper()}` | {_default(field)} | {doc} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render_table())
