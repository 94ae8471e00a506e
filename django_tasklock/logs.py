"""The package's loggers: each module logs under its own name
(``django_tasklock.integrations.celery.publish``...), and a name an earlier
build logged the same messages under (``django_tasklock.calls``,
``django_tasklock.decorator``, ``django_tasklock.locks``) keeps working.

A module that moved out from under its old name gets a logger that looks at
the old one on every record: while a logging configuration names the old
logger (a level, a handler, ``propagate`` or ``disabled`` set on it), the
module's records are judged by its level and go through it, its handlers
and its parents, exactly as before; while nothing names it, they go the
usual way under the module's name. Configure the new names (or just
``django_tasklock``) in new code.
"""

from __future__ import annotations

import logging

__all__ = ["module_logger"]


def _configured(logger: logging.Logger) -> bool:
    """True if a logging configuration set anything on ``logger``."""
    return bool(
        logger.level != logging.NOTSET
        or logger.handlers
        or not logger.propagate
        or logger.disabled
        or logger.filters
    )


class _Moved(logging.Logger):
    """The logger of a module whose messages were logged under ``legacy``."""

    #: The old name's logger (None: behave as a plain Logger).
    legacy: logging.Logger | None = None

    def getEffectiveLevel(self) -> int:
        legacy = self.legacy
        if legacy is not None and _configured(legacy):
            return legacy.getEffectiveLevel()
        return super().getEffectiveLevel()

    def handle(self, record: logging.LogRecord) -> None:
        legacy = self.legacy
        if legacy is not None and _configured(legacy):
            if not self.disabled:
                legacy.handle(record)
            return
        super().handle(record)


def module_logger(name: str, legacy: str | None = None) -> logging.Logger:
    """The logger of the module ``name``; ``legacy``: the name its messages
    were logged under before, which keeps working (see the module's doc)."""
    if legacy is None:
        return logging.getLogger(name)
    manager = logging.Logger.manager
    existing = manager.loggerDict.get(name)
    if isinstance(existing, logging.Logger):
        # Made already: by this function, or by a configuration naming the
        # new name (then the new name rules).
        return existing
    previous = manager.loggerClass
    manager.loggerClass = _Moved
    try:
        logger = manager.getLogger(name)
    finally:
        manager.loggerClass = previous
    if isinstance(logger, _Moved):
        logger.legacy = logging.getLogger(legacy)
        # (Its level set again: what makes the manager forget the levels
        # it cached for every logger, the old name's children too.)
        logger.setLevel(logger.level)
    return logger
