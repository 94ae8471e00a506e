"""Policies, each a small class chosen by name: what a run does when its lock
is held (``contention``), and what a second ``.delay()`` of a pending call gets
(``duplicates``)."""

from __future__ import annotations

from .contention import CONTENTION, ContentionPolicy
from .duplicates import DUPLICATES, DuplicatePolicy

__all__ = ["CONTENTION", "DUPLICATES", "ContentionPolicy", "DuplicatePolicy"]
