"""What a second ``.delay()`` of a pending call gets: ``on_duplicate``.

``join`` gets the pending (or running) call's result, ``raise`` raises
``AlreadyQueued``, ``replace`` revokes a call still pending and is sent in its
place (a running call is joined). Each integration's publisher carries the
action out; the policy only chooses it.
"""

from __future__ import annotations

from typing import Any, Final, Protocol

__all__ = ["DUPLICATES", "DuplicatePolicy", "Publisher"]


class Publisher(Protocol):
    """What an integration's publish can do with a duplicate call."""

    def join(self, holder_id: str) -> Any:
        """Give the caller the result of call ``holder_id``."""

    def refuse(self, holder_id: str) -> Any:
        """Raise ``AlreadyQueued`` naming call ``holder_id``."""

    def replace(self, holder_id: str, seen: Any) -> Any:
        """Revoke pending call ``holder_id`` and send this call in its place."""


class DuplicatePolicy:
    """Join: the caller gets the pending call's result."""

    #: False if the integration must be able to revoke a call.
    needs_revoke = False

    def resolve(
        self, publisher: Publisher, holder_id: str, pending: bool, seen: Any
    ) -> Any:
        """What ``publisher`` does for a duplicate of call ``holder_id``
        (``pending``: not started yet; ``seen``: what the store held)."""
        return publisher.join(holder_id)


class Raise(DuplicatePolicy):
    def resolve(
        self, publisher: Publisher, holder_id: str, pending: bool, seen: Any
    ) -> Any:
        return publisher.refuse(holder_id)


class Replace(DuplicatePolicy):
    needs_revoke = True

    def resolve(
        self, publisher: Publisher, holder_id: str, pending: bool, seen: Any
    ) -> Any:
        if pending:
            return publisher.replace(holder_id, seen)
        return publisher.join(holder_id)  # a running call cannot be replaced


#: The policies by name: ``on_duplicate``.
DUPLICATES: Final[dict[str, DuplicatePolicy]] = {
    "join": DuplicatePolicy(),
    "raise": Raise(),
    "replace": Replace(),
}
