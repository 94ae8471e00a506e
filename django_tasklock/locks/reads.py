"""What a Lock reads from the store, owned or not: who holds it, for how long.

The base of ``Lock``: each read looks up this thread's backend for the lock's
cache (the holder's own connection in the thread that took it) and turns a store
failure into ``LockBackendError``, naming the lock id and the store.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from ..backends import backend_for, fork_generation
from ..conf import settings
from ..exceptions import LockBackendError
from ..signals import lock_store_failed

if TYPE_CHECKING:
    from django.dispatch import Signal

    from ..backends import Hold, LockBackend, Peek
    from .liveness import Record

__all__ = ["StoreReads"]


class StoreReads:
    """The store reads of a Lock, and the state of a Lock its collaborators
    (``loss``, ``fencing``, ``heartbeat``) work on, declared here so that they
    need not import ``lock``, which imports them."""

    lock_id: str
    token: str | None
    _hold: Hold | None
    _cache: str | None
    _alias: str | None
    _key: str | None
    _held_backend: LockBackend | None
    _holder_thread: int | None
    _held_fork: int
    # Serialises the heartbeat's extend with the holder's release and extend.
    _guard: Any
    acquired_at: float | None
    max_hold: float | None
    _held_expire: float
    _life: float
    _valid_until: float | None
    _record: Record | None
    _deadline: float | None
    _fence: int | None
    _lost: bool
    _reported: bool

    def _extend(self, seconds: float | None, doing: str) -> bool:
        raise NotImplementedError

    def _report_lost(self, doing: str) -> None:
        """Report the lock lost, found so while ``doing``."""
        raise NotImplementedError

    def _send(self, signal: Signal, owner: object, **details: object) -> None:
        raise NotImplementedError

    def _backend(self) -> tuple[LockBackend, str]:
        """This thread's backend and the store key, for the alias of the hold."""
        if (
            self._holder_thread == threading.get_ident()
            and self._held_backend
            and self._held_fork == fork_generation[0]
        ):
            return self._held_backend, self._key  # type: ignore[return-value]
        alias = self._alias or self._cache or settings.CACHE
        backend = backend_for(alias, protocol=settings.MEMCACHED_PROTOCOL)
        key = self._key if self._alias is not None else backend.key_for(self.lock_id)
        assert key is not None
        return backend, key

    def _store_error(
        self, backend: LockBackend, key: str, doing: str, exc: BaseException
    ) -> LockBackendError:
        error = LockBackendError(
            f"Could not {doing}: {type(exc).__name__}: {exc}",
            lock_id=self.lock_id,
            store=backend.describe(key),
        )
        if lock_store_failed.receivers:
            lock_store_failed.send_robust(
                type(self), lock=self, lock_id=self.lock_id, doing=doing, error=error
            )
        return error

    def owned(self) -> bool:
        """True if this object holds the lock and the store agrees."""
        if self._hold is None:
            return False
        backend, key = self._backend()
        assert self.token is not None
        try:
            return backend.owned(key, self._hold, self.token)
        except backend.errors as exc:
            raise self._store_error(backend, key, "read the lock", exc) from exc

    def locked(self) -> bool:
        """True if anybody holds the lock."""
        backend, key = self._backend()
        try:
            return backend.locked(key)
        except backend.errors as exc:
            raise self._store_error(backend, key, "read the lock", exc) from exc

    def ttl(self) -> float | None:
        """Seconds left on the current hold, whoever owns it; None if nobody holds it.

        memcached counts whole seconds; ``inf`` means the key never expires (set by
        other code without a timeout).
        """
        backend, key = self._backend()
        try:
            return backend.ttl(key)
        except backend.errors as exc:
            raise self._store_error(
                backend, key, "read the lock's expiry", exc
            ) from exc

    def peek(self) -> Peek | None:
        """What the store holds under this lock id, whoever holds it: the stored
        value (a token, or a call's mark) and its version; None if it is free."""
        backend, key = self._backend()
        try:
            return backend.peek(key)
        except backend.errors as exc:
            raise self._store_error(backend, key, "read the lock", exc) from exc

    def remove(self, seen: Peek) -> bool:
        """Remove the lock only while the store still holds exactly ``seen`` (a
        value ``peek()`` read): how a dead holder's lock is freed, owner-checked.
        True if it was removed."""
        backend, key = self._backend()
        try:
            return backend.release(key, seen.hold, seen.value)
        except backend.errors as exc:
            raise self._store_error(backend, key, "remove the lock", exc) from exc
