"""What the admin's lock console lists: every held lock, semaphore slot and
queued call that a process lists in its store's roster (``locks.roster``),
found, filtered and paged without scanning the cache.

A page costs, per store, two ``get_many`` calls for the rosters, then, for each
row shown, the reads of ``status.lock_status`` (the store's own value, time
left and last fence, and the holder's liveness record when it runs elsewhere):
bounded by the page's size, whatever the size of the cache.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import TYPE_CHECKING, Any, Final

from django.conf import settings as django_settings

from .backends import backend_for
from .conf import settings
from .exceptions import LockBackendError, LockConfigurationError
from .leader import LOCK_PREFIX
from .locks.roster import Entry, read_roster
from .parking import DECLARED, Registry
from .status import LockStatus, ParkStatus, lock_status, park_status
from .tokens import holder_record_id
from .values import token_process

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from .limits.limiter import RateLimiter

__all__ = [
    "Inventory",
    "LeaderRow",
    "LimitRow",
    "Listed",
    "ParkRow",
    "leaders",
    "lock_aliases",
    "park_lines",
    "rate_limits",
    "take_inventory",
]

#: Kinds of entries, in the order the console filters them.
KINDS = ("lock", "slot", "queued")
#: A store server that started less than this many seconds ago may not list
#: every held lock yet: each holder lists them again at its first beat (about
#: a second) after it meets the restarted server.
RELIST: Final = 10.0


#: One entry as the rosters list it: (alias, lister's record id, lister's
#: host, the entry's fields in ``Entry``'s order). Kept as read (100,000 of
#: them make a page): an ``Entry`` is made only for the rows shown.
Found = tuple[str, str, str, list[Any]]
_LOCK_ID, _KIND, _TASK, _CALL_ID, _SINCE = 0, 1, 2, 4, 5


@dataclasses.dataclass(frozen=True)
class Listed:
    """One lock id a process lists in one store."""

    alias: str
    entry: Entry
    #: The lister's liveness record id and host.
    record: str
    host: str

    @classmethod
    def of(cls, found: Found) -> Listed:
        alias, record, host, row = found
        return cls(alias, Entry(*row), record, host)

    @property
    def lock_id(self) -> str:
        return self.entry.lock_id

    def age(self, now: float | None = None) -> float:
        """Seconds since it was taken or published."""
        return max((time.time() if now is None else now) - self.entry.since, 0.0)

    def status(self) -> LockStatus:
        """The lock as its store holds it now (raises ``LockBackendError``)."""
        return lock_status(self.entry.lock_id, cache=self.alias)


@dataclasses.dataclass
class Inventory:
    """Everything the rosters of some stores list."""

    entries: list[Found]
    #: Processes listing at least one entry, per alias; aliases whose roster
    #: could not be read, with why; aliases whose every roster slot is taken.
    processes: dict[str, int]
    failed: dict[str, str]
    full: list[str]
    #: Why what is listed may be incomplete (a server that just restarted, a
    #: store whose holders keep no roster), one sentence each.
    incomplete: list[str] = dataclasses.field(default_factory=list)

    def listed(self) -> list[Listed]:
        """Every entry, as ``Listed``."""
        return [Listed.of(found) for found in self.entries]

    def tasks(self) -> list[str]:
        return sorted({found[3][_TASK] for found in self.entries})

    def select(
        self,
        *,
        task: str | None = None,
        alias: str | None = None,
        kind: str | None = None,
        search: str | None = None,
    ) -> list[Found]:
        """The entries of ``task``, in ``alias``, of ``kind``, whose lock id or
        task id contains ``search``; oldest first."""
        found: Iterable[Found] = self.entries
        if task:
            found = [one for one in found if one[3][_TASK] == task]
        if alias:
            found = [one for one in found if one[0] == alias]
        if kind:
            found = [one for one in found if one[3][_KIND] == kind]
        if search:
            needle = search.strip()
            found = [
                one
                for one in found
                if needle in one[3][_LOCK_ID] or needle == (one[3][_CALL_ID] or "")
            ]
        return sorted(found, key=lambda one: (one[3][_SINCE], one[3][_LOCK_ID]))


def lock_aliases() -> list[str]:
    """The CACHES aliases locks can be taken in (``TASKLOCK['CACHE']`` first)."""
    aliases = [settings.CACHE]
    for alias in django_settings.CACHES:
        if alias in aliases:
            continue
        try:
            backend_for(alias)
        except LockConfigurationError:
            continue  # a cache locks cannot be taken in (the dummy cache, ...)
        aliases.append(alias)
    return aliases


def take_inventory(aliases: Iterable[str] | None = None) -> Inventory:
    """Read the rosters of ``aliases`` (default: every lock store). A lock id
    listed twice (a queued mark its publisher lists, taken over by the worker
    that runs it; a lock a dead holder still lists, taken over since) is
    listed once, by its holder (the latest taker)."""
    inventory = Inventory([], {}, {}, [])
    young: dict[str, tuple[float, list[str]]] = {}
    aliases = lock_aliases() if aliases is None else list(aliases)
    for alias in aliases:
        backend = backend_for(alias)
        try:
            listing = read_roster(backend)
        except backend.errors as exc:
            inventory.failed[alias] = f"{type(exc).__name__}: {exc}"
            continue
        if listing.full:
            inventory.full.append(alias)
        inventory.incomplete += _incomplete(alias, backend, young)
        best: dict[str, Found] = {}
        records = set()
        for record, host, written, rows in listing.entries:
            if written != alias and written in aliases:
                continue  # the same store under another alias: listed there
            if rows:
                records.add(record)
            for row in rows:
                seen = best.get(row[_LOCK_ID])
                if seen is None or _holder_first(row) > _holder_first(seen[3]):
                    best[row[_LOCK_ID]] = (alias, record, host, row)
        inventory.entries += best.values()
        inventory.processes[alias] = len(records)
    inventory.incomplete += _young_notice(young)
    return inventory


def _holder_first(row: list[Any]) -> tuple[bool, float]:
    """Which of two listings of one lock id names its holder: a lock over a
    queued mark, then the latest taken."""
    return row[_KIND] != "queued", row[_SINCE]


def _incomplete(
    alias: str, backend: Any, young: dict[str, tuple[float, list[str]]]
) -> list[str]:
    """Why the roster of ``alias`` may not list every held lock now; its
    servers that started lately go into ``young`` (server: uptime, aliases),
    told in one sentence for every store (``_young_notice``)."""
    if backend.records is None:
        return [
            f"Store {alias} keeps no liveness records (libmemcached picks each "
            "key's server itself), so its holders list no locks here; "
            "`manage.py tasklock status <lock id>` reads any one of them."
        ]
    try:
        uptimes = {} if backend.uptime is None else backend.uptime.uptimes()
    except backend.errors as exc:
        return [
            f"Could not tell whether store {alias} restarted lately "
            f"({type(exc).__name__}: {exc}); if it did, some locks may be missing."
        ]
    for server, uptime in uptimes.items():
        if uptime < RELIST:
            young.setdefault(server, (uptime, []))[1].append(alias)
    return []


def _young_notice(young: dict[str, tuple[float, list[str]]]) -> list[str]:
    if not young:
        return []
    servers = [
        f"{server} ({', '.join(aliases)}) {uptime:.0f}s ago"
        for server, (uptime, aliases) in sorted(young.items())
    ]
    return [
        f"Started lately: {'; '.join(servers)}. Holders list their locks on a "
        "server within about a second of meeting it, so some may be missing "
        "for now: look again."
    ]


@dataclasses.dataclass(frozen=True)
class LeaderRow:
    """One leadership (``Leadership``) and who leads it, as its store holds
    it now: the holder, whether it lives, since when it leads (Unix time) and
    its fence; or why it could not be read."""

    name: str
    alias: str
    #: When its holder took it (None: the roster lists it by another process,
    #: an earlier holder's listing not yet gone).
    since: float | None
    status: LockStatus | None = None
    error: str = ""

    @property
    def holder(self) -> str:
        owner = None if self.status is None else self.status.owner
        return "" if owner is None else f"{owner.pid}@{owner.host}"

    @property
    def alive(self) -> bool | None:
        owner = None if self.status is None else self.status.owner
        return None if owner is None else owner.alive

    @property
    def fence(self) -> int | None:
        return None if self.status is None else self.status.fence


def leaders(inventory: Inventory, name: str | None = None) -> list[LeaderRow]:
    """Every leadership the rosters list as led (or the one of ``name``), by
    name, each read from its store now: one ``lock_status`` per leadership."""
    rows = []
    for alias, lister, _host, row in inventory.entries:
        lock_id = row[_LOCK_ID]
        if row[_KIND] != "lock" or not lock_id.startswith(LOCK_PREFIX):
            continue
        role = lock_id.removeprefix(LOCK_PREFIX)
        if name is not None and role != name:
            continue
        try:
            status = lock_status(lock_id, cache=alias)
        except LockBackendError as exc:
            rows.append(LeaderRow(role, alias, row[_SINCE], error=str(exc)))
            continue
        if status.held:
            parsed = token_process(status.value)
            own = parsed is not None and lister == holder_record_id(*parsed)
            since = row[_SINCE] if own else None
            rows.append(LeaderRow(role, alias, since, status))
    return sorted(rows, key=lambda one: (one.name, one.alias))


@dataclasses.dataclass(frozen=True)
class LimitRow:
    """A rate limit the console shows: its state as the store holds it now, or
    why it could not be read, or (one limit per argument key) how to look one
    up."""

    limit_id: str
    source: str
    state: dict[str, object]
    error: str = ""


_tasks_imported = [False]


def _import_tasks() -> None:
    """The installed apps' ``tasks`` modules, imported once (their
    decorators declare what the console lists)."""
    from .declared import import_task_modules

    if not _tasks_imported[0]:
        _tasks_imported[0] = True
        import_task_modules()


def rate_limits() -> list[LimitRow]:
    """The named limits (``TASKLOCK["RATE_LIMITS"]``) and every
    ``@rate_limited`` of the installed apps' ``tasks`` modules (imported once,
    as the checks do), each read from its store: one read per limit."""
    from .limits.decorator import DECLARED
    from .limits.limiter import RateLimiter

    _import_tasks()
    found: dict[str, tuple[str, Callable[[], RateLimiter] | None]] = {}
    for name in settings.rate_limit_names():
        found[name] = ("TASKLOCK['RATE_LIMITS']", functools.partial(RateLimiter, name))
    for name, limits in DECLARED.items():
        if limits.key is not None:
            found.setdefault(name, (f"@rate_limited(key={limits.key!r})", None))
        else:
            found.setdefault(
                name, ("@rate_limited", functools.partial(limits._make, name))
            )
    rows = []
    for name, (source, make) in sorted(found.items()):
        if make is None:
            rows.append(
                LimitRow(
                    name,
                    source,
                    {},
                    "one limit per argument key: "
                    f"manage.py tasklock rate {name}-<digest>",
                )
            )
            continue
        try:
            rows.append(LimitRow(name, source, make().state()))
        except (LockBackendError, LockConfigurationError, ValueError) as exc:
            rows.append(LimitRow(name, source, {}, str(exc)))
    return rows


@dataclasses.dataclass(frozen=True)
class ParkRow:
    """One park line the console shows (``on_contention="park"``)."""

    alias: str
    lock_id: str
    line: ParkStatus | None
    error: str = ""

    @property
    def oldest(self) -> float:
        """Seconds the head of the line has waited (0: none parked)."""
        return self.line.parked[0][1] if self.line and self.line.parked else 0.0


def park_lines(aliases: Iterable[str] | None = None) -> list[ParkRow]:
    """The park lines each store of a parking task lists (``parking.Registry``;
    the installed apps' ``tasks`` modules imported once, as the checks do),
    each read: one read per such store and one per line; none where no task
    parks."""
    _import_tasks()
    declared = {alias or settings.CACHE for alias in DECLARED}
    rows = []
    for alias in sorted(declared) if aliases is None else aliases:
        try:
            listed = Registry(alias).read()
        except (LockBackendError, LockConfigurationError) as exc:
            rows.append(ParkRow(alias, "", None, str(exc)))
            continue
        for lock_id in sorted(listed):
            try:
                line = park_status(lock_id, cache=alias)
            except LockBackendError as exc:
                rows.append(ParkRow(alias, lock_id, None, str(exc)))
                continue
            if not line.empty:
                rows.append(ParkRow(alias, lock_id, line))
    return rows
