"""A function whose lock is in an alias of its own (``cache="pair"``), not
TASKLOCK's: the isolation must cover it (tests/testing/test_testing.py)."""

from __future__ import annotations

from django_tasklock import single_instance


@single_instance(cache="pair")
def counted(name: str) -> str:
    return f"ran {name}"
