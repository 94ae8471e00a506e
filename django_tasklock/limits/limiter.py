"""``RateLimiter``: at most N admissions per period, across every process that
uses the same lock store."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, NamedTuple

from ..aio import loop_backend
from ..backends import backend_for
from ..conf import settings, validate_seconds
from ..exceptions import InvalidArgument, InvalidArgumentType, LockBackendError
from ..rates import MAX_WINDOW_COUNT, Rate, RateSpec, parse_rate
from ..signals import rate_limit_paused, rate_limit_refused
from . import store
from .kinds import KINDS, Kind, Turns, Verdict

if TYPE_CHECKING:
    from ..backends import LockBackend

__all__ = ["Admission", "RateLimiter", "make_kind"]

logger = logging.getLogger(__name__)


class Admission(NamedTuple):
    """The answer to one ``admit()``: true when admitted. ``retry_after`` is
    the seconds until an admission could be allowed (0 when admitted), ``at``
    the time it was judged at (seconds since the epoch, by the clock that
    judged it: Redis's, else this host's), ``paused`` whether a pause refused it."""

    admitted: bool
    retry_after: float
    at: float
    paused: bool = False

    def __bool__(self) -> bool:
        return self.admitted


class RateLimiter:
    """At most ``rate`` admissions under the name ``limit_id``, shared by every
    process and task that uses it.

    ``rate``: ``"10/m"``, ``"100/30s"``, ``(10, 60)``; None takes the named
    limit ``TASKLOCK["RATE_LIMITS"][limit_id]``. ``kind``: ``"window"`` (at
    most N in any period of that length; default ``TASKLOCK["RATE_KIND"]``) or
    ``"smooth"`` (GCRA: one per period/N on average, bursts of up to
    ``burst``, default N). ``cache``: a CACHES alias (default
    ``TASKLOCK["CACHE"]``).
    """

    def __init__(
        self,
        limit_id: str,
        rate: RateSpec | None = None,
        *,
        kind: str | None = None,
        burst: int | None = None,
        cache: str | None = None,
    ) -> None:
        if not isinstance(limit_id, str) or not limit_id:
            raise InvalidArgumentType(
                f"limit_id must be a non-empty str, not {limit_id!r}."
            )
        named: dict[str, Any] = settings.named_rate(limit_id) if rate is None else {}
        if rate is None and not named:
            raise InvalidArgument(
                f'RateLimiter({limit_id!r}) has no rate: pass one ("10/m") or '
                f"define TASKLOCK['RATE_LIMITS'][{limit_id!r}]."
            )
        self.limit_id = limit_id
        self.rate: Rate = parse_rate(named.get("rate", rate), name="rate")
        kind_name = kind or named.get("kind") or settings.RATE_KIND
        if burst is None:
            burst = named.get("burst", self.rate.count)
        self.kind: Kind = make_kind(self.rate, kind_name, burst)
        self._cache = cache or named.get("cache")

    def __repr__(self) -> str:
        return f"<RateLimiter {self.limit_id!r} {self.rate} {self.kind.name}>"

    @property
    def cache(self) -> str:
        """The CACHES alias that keeps this limit's state."""
        return self._cache or settings.CACHE

    def _store(self) -> tuple[Any, str]:
        backend = backend_for(self.cache)
        return backend, self._key(backend)

    def _key(self, backend: LockBackend) -> str:
        return backend.key_for(f"{self.limit_id}-rate")

    def _call(self, doing: str, step: Any, *args: Any) -> Any:
        backend, key = self._store()
        try:
            return step(backend, key, self.kind, *args)
        except (*backend.errors, store.KeptChanging) as exc:
            raise self._failed(doing, backend, key, exc) from exc

    def _failed(
        self, doing: str, backend: LockBackend, key: str, exc: BaseException
    ) -> LockBackendError:
        return LockBackendError(
            f"Could not {doing}: {type(exc).__name__}: {exc}",
            lock_id=self.limit_id,
            store=backend.describe(key),
        )

    def admit(self) -> Admission:
        """One admission now, or a refusal saying when to come back. Raises
        ``LockBackendError`` when the store cannot be reached: nothing is
        admitted then."""
        return self._admission(self._call("admit under the rate limit", store.admit))

    async def aadmit(self, *, timeout: float | None = None) -> Admission:
        """``admit()``, awaited: the store's round trips are the event loop's
        own (``aio``). With ``timeout``, ``wait(timeout)``: refused, it sleeps
        on the loop as long as the refusal said and tries again, up to
        ``timeout`` seconds. A task cancelled while an admission is in flight
        may have used that admission (never one more than the rate)."""
        if timeout is not None:
            validate_seconds(timeout, name="timeout", allow_zero=True)
        deadline = None if timeout is None else time.monotonic() + timeout
        loop_store = await loop_backend(self.cache, settings.MEMCACHED_PROTOCOL)
        backend = loop_store.sync
        key = self._key(backend)
        failures: tuple[type[BaseException], ...] = (
            *loop_store.errors,
            store.KeptChanging,
        )
        while True:
            try:
                verdict = await store.aadmit(loop_store, key, self.kind)
            except failures as exc:
                doing = "admit under the rate limit"
                raise self._failed(doing, backend, key, exc) from exc
            admission = self._admission(verdict)
            if admission or deadline is None:
                return admission
            if admission.retry_after > deadline - time.monotonic():
                return admission
            await asyncio.sleep(max(admission.retry_after, 0.001))

    def _admission(self, verdict: Verdict) -> Admission:
        """The Admission of ``verdict``; a refusal is signalled."""
        admission = Admission(
            verdict.admitted, verdict.retry_after, verdict.at / 1000, verdict.paused
        )
        if not verdict.admitted and rate_limit_refused.receivers:
            rate_limit_refused.send_robust(
                RateLimiter,
                limiter=self,
                limit_id=self.limit_id,
                retry_after=admission.retry_after,
                paused=admission.paused,
            )
        return admission

    def turn(self, after: float) -> float:
        """Seconds until the turn of a call this limit refused ``after``
        seconds before it could admit one, in the queue of refused calls sent
        again: at least ``after``, and one ``period / count`` after the turn
        before (``kinds.Turns``). Raises ``LockBackendError``."""
        turns = Turns(self.rate, after)
        verdict = self._call(
            "take a turn under the rate limit",
            lambda b, k, _kind: store.admit(b, f"{k}:turns", turns),
        )
        return float(verdict.retry_after)

    def wait(self, timeout: float) -> Admission:
        """Admit, waiting up to ``timeout`` seconds for room (each wait as long
        as the refusal said); the last refusal if there was none by then."""
        deadline = time.monotonic() + timeout
        while True:
            admission = self.admit()
            left = deadline - time.monotonic()
            if admission or admission.retry_after > left:
                return admission
            time.sleep(max(admission.retry_after, 0.001))

    def pause(self, seconds: float) -> float:
        """Stop admissions under this limit for ``seconds``, in every process
        (a partner answered "429, retry after 30 s"). A longer pause already
        set is kept. Returns the seconds until admissions resume."""
        if (
            isinstance(seconds, bool)
            or not isinstance(seconds, (int, float))
            or not 0 < seconds <= 30 * 86400
        ):
            raise InvalidArgument(
                f"pause() takes seconds in (0, 30 days], not {seconds!r}."
            )
        left: float = self._call("pause the rate limit", store.pause, seconds)
        logger.info(
            "Rate limit %r paused for %.1fs (admissions resume in %.1fs)",
            self.limit_id,
            seconds,
            left,
        )
        if rate_limit_paused.receivers:
            rate_limit_paused.send_robust(
                RateLimiter, limiter=self, limit_id=self.limit_id, seconds=left
            )
        return left

    def state(self) -> dict[str, object]:
        """What the store says of this limit now (``tasklock status``)."""
        found = self._call("read the rate limit", lambda b, k, _kind: store.read(b, k))
        shown: dict[str, object] = {
            "limit": self.limit_id,
            "rate": str(self.rate),
            "kind": self.kind.name,
            "cache": self.cache,
        }
        if self.kind.name == "smooth":
            shown["burst"] = self.kind.burst
        # The same fields whatever the state: a limit with none remembered is
        # described as one that admitted nothing.
        value, now = (None, store.now_ms()) if found is None else found
        shown["state"] = "no admissions remembered" if found is None else "remembered"
        shown.update(self.kind.describe(value, now))
        return shown

    def reset(self) -> bool:
        """Forget every admission and pause (and the queue of refused calls'
        turns); True if there was any admission or pause."""
        self._call(
            "reset the rate limit", lambda b, k, _kind: store.reset(b, f"{k}:turns")
        )
        return bool(
            self._call("reset the rate limit", lambda b, k, _kind: store.reset(b, k))
        )


def make_kind(rate: Rate, kind: object, burst: object) -> Kind:
    """The kind ``kind`` of limit at ``rate``; ValueError saying what to write
    for a kind, burst or count it cannot keep."""
    if kind not in KINDS:
        raise InvalidArgument(f"kind must be one of {', '.join(KINDS)}, not {kind!r}.")
    if isinstance(burst, bool) or not isinstance(burst, int) or burst < 1:
        raise InvalidArgument(f"burst must be a whole number >= 1, not {burst!r}.")
    if kind == "window" and rate.count > MAX_WINDOW_COUNT:
        raise InvalidArgument(
            f"rate {rate}: the window kind keeps every admission of the last "
            f'period, at most {MAX_WINDOW_COUNT}; use kind="smooth" for higher '
            "counts."
        )
    return KINDS[str(kind)](rate, burst)
