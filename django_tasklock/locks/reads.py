"""What a Lock reads from the store, owned or not: who holds it, for how long.

The base of ``Lock``: each read looks up this thread's backend for the lock's
cache (the holder's own connection in the thread that took it) and turns a store
failure into ``LockBackendError``, naming the lock id and the store.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from ..backends import backend_for, fork_generation
from ..conf import settings
from ..exceptions import LockBackendError
from ..signals import lock_contended, lock_store_failed

if TYPE_CHECKING:
    from django.dispatch import Signal

    from ..backends import LockBackend, Peek
    from .acquisition import Acquisition

__all__ = ["StoreReads"]


class StoreReads:
    """The store reads of a Lock, owned or not."""

    lock_id: str
    _cache: str | None = None
    # The current hold, else the last one; None before the first acquire.
    _acq: Acquisition | None = None

    def _backend(self) -> tuple[LockBackend, str]:
        """This thread's backend and the store key, for the alias of the hold."""
        acq = self._acq
        if acq is not None:
            if acq.thread == threading.get_ident() and acq.fork == fork_generation[0]:
                return acq.backend, acq.key
            return backend_for(acq.alias), acq.key
        backend = backend_for(self._cache or settings.CACHE)
        return backend, backend.key_for(self.lock_id)

    def _send(self, signal: Signal, owner: object, **details: object) -> None:
        raise NotImplementedError

    def _send_contended(self, backend: LockBackend, key: str, waited: float) -> None:
        if not lock_contended.receivers:
            return
        try:
            peek = backend.peek(key)
        except backend.errors:
            peek = None
        self._send(lock_contended, None if peek is None else peek.value, waited=waited)

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
        acq = self._acq
        if acq is None or acq.hold is None:
            return False
        backend, key = self._backend()
        try:
            return backend.owned(key, acq.hold, acq.token)
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
