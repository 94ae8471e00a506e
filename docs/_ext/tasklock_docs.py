"""Sphinx directives that print tables from the code, so the docs cannot drift:

- ``.. tasklock-caches::``: the supported caches, from ``backends.supported``;
- ``.. tasklock-modes::``: the modes and policies, from their tables.
"""

from __future__ import annotations

from typing import Any

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = [".. list-table::", "   :header-rows: 1", ""]
    for row in [header, *rows]:
        lines.append(f"   * - {row[0]}")
        lines.extend(f"     - {cell}" for cell in row[1:])
    return lines


class _Generated(SphinxDirective):
    def rows(self) -> list[str]:
        raise NotImplementedError

    def run(self) -> list[nodes.Node]:
        container = nodes.section()
        container.document = self.state.document
        self.state.nested_parse(StringList(self.rows()), self.content_offset, container)
        return list(container.children)


class CachesTable(_Generated):
    """The supported caches (``backends.supported.SUPPORTED``)."""

    def rows(self) -> list[str]:
        from django_tasklock.backends.supported import SUPPORTED, UNSUPPORTED

        supported = [
            [
                f"``{entry.path}``",
                "yes" if entry.shared else "no (one process)",
                f"``{entry.needs}``" if entry.needs else "Django alone",
                entry.notes,
            ]
            for entry in SUPPORTED
        ]
        refused = [
            [f"``{cls.__module__}.{cls.__qualname__}``", reason]
            for cls, reason in UNSUPPORTED
        ]
        return [
            *_table(
                ["cache (CACHES ``BACKEND``)", "shared", "needs", "notes"], supported
            ),
            "",
            "Refused (check ``django_tasklock.E004``, and ``LockConfigurationError`` "
            "at run time):",
            "",
            *_table(["cache", "why"], refused),
        ]


class ModesTable(_Generated):
    """The modes and policies, from their tables."""

    def rows(self) -> list[str]:
        from django_tasklock.modes import LIMITED, MODES
        from django_tasklock.policies import CONTENTION, DUPLICATES

        def first_line(obj: Any) -> str:
            doc = (type(obj).__doc__ or "").strip() or (
                __import__(type(obj).__module__, fromlist=["x"]).__doc__ or ""
            )
            return " ".join(doc.split("\n\n")[0].split())

        modes = [
            [f"``{name}``", f"``{type(mode).__module__}``", first_line(mode)]
            for name, mode in [*MODES.items(), ("limit=N", LIMITED)]
        ]
        contention = [
            [f"``{n}``", f"``{type(p).__name__}``"] for n, p in CONTENTION.items()
        ]
        duplicates = [
            [f"``{n}``", f"``{type(p).__name__}``"] for n, p in DUPLICATES.items()
        ]
        return [
            *_table(["mode", "module", "what it does"], modes),
            "",
            *_table(["on_contention", "class"], contention),
            "",
            *_table(["on_duplicate", "class"], duplicates),
        ]


def setup(app: Any) -> dict[str, Any]:
    app.add_directive("tasklock-caches", CachesTable)
    app.add_directive("tasklock-modes", ModesTable)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
