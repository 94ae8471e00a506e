from __future__ import annotations


def reversed_key(key: str, key_prefix: str, version: int) -> str:
    """A KEY_FUNCTION unlike Django's default, to prove it is honoured."""
    return f"{version}|{key_prefix}|{key}"
