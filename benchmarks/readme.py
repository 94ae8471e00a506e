"""Replace a generated table in README.rst, between two comment markers."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.rst"


def write_section(start: str, end: str, text: str) -> None:
    """Put ``text`` between the lines ``start`` and ``end`` of README.rst."""
    content = README.read_text()
    pattern = re.compile(rf"{re.escape(start)}\n.*?{re.escape(end)}", re.S)
    if not pattern.search(content):
        raise SystemExit(f"README.rst has no {start} / {end} markers")
    README.write_text(pattern.sub(lambda _: f"{start}\n\n{text}\n{end}", content))
