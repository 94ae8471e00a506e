"""Replace a generated table in the docs, between two comment markers.

The page that holds the markers is found under ``docs/``: the tables of figures
live where they are explained (``docs/explanation/``), and only the commands
that measure them write them.
"""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"


def write_section(start: str, end: str, text: str) -> Path:
    """Put ``text`` between the lines ``start`` and ``end`` of the docs page
    that has them; the page's path."""
    pattern = re.compile(rf"^{re.escape(start)}\n.*?^{re.escape(end)}$", re.S | re.M)
    for page in sorted(DOCS.rglob("*.rst")):
        content = page.read_text()
        if pattern.search(content):
            page.write_text(pattern.sub(lambda _: f"{start}\n\n{text}\n{end}", content))
            return page
    raise SystemExit(f"no page under docs/ has the {start} / {end} markers")


def psycopg_form(
    statement: bytes, params: tuple[object, ...]
) -> tuple[str, tuple[object, ...]]:
    """``statement`` (libpq's ``$n`` placeholders) in psycopg's positional
    ``%s`` form, with ``params`` (``$1`` first) in its placeholders' order:
    a parameter used twice is passed twice, positional binding being
    psycopg's cheapest (a floor must not pay for names)."""
    order: list[int] = []

    def placeholder(match: re.Match[str]) -> str:
        order.append(int(match.group(1)) - 1)
        return "%s"

    text = re.sub(r"\$(\d+)", placeholder, statement.decode())
    return text, tuple(params[i] for i in order)
