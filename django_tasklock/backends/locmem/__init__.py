"""Locks within one process, on Django's ``LocMemCache``: for tests and
development (the system checks and the worker's start-up say so where it
would be used across processes)."""

from __future__ import annotations

from typing import Final

from ..base import Supported
from .backend import LocMemBackend

__all__ = ["SUPPORTED", "LocMemBackend"]

#: This package's row of the supported-caches table.
SUPPORTED: Final = (
    Supported(
        "django.core.cache.backends.locmem.LocMemCache",
        "(one process only) LocMemCache",
        LocMemBackend,
        shared=False,
        recommended=False,
        notes="tests and development: locks hold within one process",
    ),
)
