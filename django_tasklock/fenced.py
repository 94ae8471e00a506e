"""Fenced writes: a model row that a holder whose lock was lost cannot
overwrite once a newer holder wrote it.

A ``FenceField`` on the model keeps the fence of the holder that wrote the row
last. ``FencedQuerySet`` (``objects = FencedQuerySet.as_manager()``) puts the
condition in the statement itself, so the database refuses an older write
atomically, whatever the lock store did:

- ``fenced_update(**values)``: ``UPDATE ... SET ..., fence = %s WHERE <the
  queryset's filter> AND (fence IS NULL OR fence <= %s)``;
- ``fenced_update_or_create(defaults, **lookup)``: ``INSERT ... ON CONFLICT
  (<lookup>) DO UPDATE SET ... WHERE fence IS NULL OR fence <= excluded.fence``;
- ``fenced_save(obj)``: the object's fields, by its primary key.

Equal fences pass: one holder writes its row as often as it likes, and no two
holds of a lock id share a fence. The fence is the innermost holder's in this
context (a ``@single_instance`` body, a ``with Lock``, ``Semaphore`` or
``Leadership`` block, ``fenced_by(holder)``) unless ``fence=`` gives one; a
write that finds none is refused (``NoFence``), never sent unfenced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from django.core import checks
from django.db import IntegrityError, connections, models, transaction
from django.db.models import Q

from .check_ids import FENCE_FIELDS_AMBIGUOUS
from .exceptions import (
    InvalidArgument,
    InvalidArgumentType,
    LockConfigurationError,
    LockUsageError,
    NoFence,
    StaleFence,
)
from .locks.fencing import FenceHolder, holders, in_reach, push_holder, want_fences

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper

__all__ = ["VENDORS", "FenceField", "FencedQuerySet", "fenced_by"]

#: The databases these writes are built and tested for (mysql: MariaDB).
VENDORS = ("postgresql", "sqlite", "mysql")
#: How often a write whose row came or went under it is tried.
TRIES = 3

_M = TypeVar("_M", bound=models.Model)
#: What ``fence=`` takes: a fence, or a holder to read it from.
FenceGiven = int | FenceHolder


class FenceField(models.BigIntegerField):  # type: ignore[type-arg]
    """The fence of the holder that wrote the row last (NULL: never fenced).

    ``lock`` names the holder whose fence it keeps, for a row that several
    locks write: a lock id, or the name of a ``@single_instance`` task or a
    ``Leadership`` role. Without it, the innermost holder in reach that no
    other fence field of the model names.
    """

    description = "the fence of the holder that wrote the row last"

    def __init__(self, *args: Any, lock: str | None = None, **kwargs: Any) -> None:
        if lock is not None and (not isinstance(lock, str) or not lock):
            raise InvalidArgumentType(
                f"FenceField(lock=...) takes a lock id or a task or role name, "
                f"not {lock!r}."
            )
        self.lock = lock
        kwargs.setdefault("null", True)
        kwargs.setdefault("blank", True)
        kwargs.setdefault("editable", False)
        super().__init__(*args, **kwargs)
        want_fences()

    def deconstruct(self) -> Any:
        name, path, args, kwargs = super().deconstruct()
        for key, default in (("null", True), ("blank", True), ("editable", False)):
            if getattr(self, key) == default:
                kwargs.pop(key, None)
            else:
                kwargs[key] = getattr(self, key)
        if self.lock is not None:
            kwargs["lock"] = self.lock
        return name, path, args, kwargs

    def check(self, **kwargs: Any) -> list[checks.CheckMessage]:
        errors = super().check(**kwargs)
        unnamed = [f.name for f in fence_fields(self.model) if f.lock is None]
        if len(unnamed) > 1 and unnamed[0] == self.name:
            errors.append(
                checks.Error(
                    f"{self.model._meta.label} has {len(unnamed)} FenceFields "
                    f"without lock= ({', '.join(unnamed)}); a write could not tell "
                    "which holder's fence goes in which.",
                    hint="Name the lock each one keeps the fence of: "
                    "FenceField(lock='<lock id, task or role name>'). At most one "
                    "may be left to the innermost holder.",
                    obj=self,
                    id=FENCE_FIELDS_AMBIGUOUS,
                )
            )
        return errors


def fence_fields(model: type[models.Model]) -> list[FenceField]:
    """The model's fence fields, in declaration order."""
    return [f for f in model._meta.concrete_fields if isinstance(f, FenceField)]


@contextlib.contextmanager
def fenced_by(holder: FenceHolder, *names: str) -> Iterator[FenceHolder]:
    """Make ``holder`` (a held ``Lock``, ``Semaphore`` or ``Leadership``) the
    one fenced writes in the block carry the fence of, innermost; ``names``
    are further names a ``FenceField(lock=...)`` may claim it by."""
    reset = push_holder(holder, *names)
    try:
        yield holder
    finally:
        holders.reset(reset)


# -- which fence, for which field ------------------------------------------------


def _value(given: object, where: str) -> int:
    """A fence given by hand: the number itself, or its holder's fence now."""
    if isinstance(given, int) and not isinstance(given, bool):
        if given < 0:
            raise InvalidArgument(f"{where} must be a fence (>= 0), not {given}.")
        return given
    held_fence = getattr(given, "held_fence", None)
    if held_fence is None:
        raise InvalidArgumentType(
            f"{where} takes a fence (an int, e.g. lock.fence) or its holder (a "
            f"Lock, Semaphore or Leadership), not {type(given).__name__}."
        )
    fence: int = held_fence()
    return fence


def _no_fence(model: type[models.Model], fields: list[FenceField]) -> NoFence:
    named = [f"{f.name} (lock={f.lock!r})" for f in fields if f.lock is not None]
    which = (
        f"no holder of {' or '.join(named)} and no other lock" if named else "no lock"
    )
    return NoFence(
        f"A fenced write to {model._meta.label} found {which} held in this context, "
        "so it has no fence to carry, and nothing was written. Write inside a "
        "@single_instance task, a `with Lock(...)`, `with Semaphore(...)` or `with "
        "Leadership(...)` block, or `with fenced_by(lock):`; or pass "
        "fence=lock.fence. (In async code, run the write with sync_to_async inside "
        "the `async with` block: the context goes with it.)"
    )


def _from_context(fields: list[FenceField]) -> dict[str, int]:
    stack = in_reach()
    found: dict[str, int] = {}
    claimed: set[int] = set()
    for field in fields:
        if field.lock is None:
            continue
        for holder, names in stack:
            if field.lock == holder.lock_id or field.lock in names:
                found[field.name] = holder.held_fence()
                claimed.add(id(holder))
                break
    for field in fields:
        if field.lock is not None:
            continue
        for holder, _names in stack:
            if id(holder) not in claimed:
                found[field.name] = holder.held_fence()
                break
        break
    return found


def fences_for(
    model: type[models.Model], fence: FenceGiven | Mapping[str, FenceGiven] | None
) -> dict[str, int]:
    """The fence each fence field of ``model`` is written with (by field name):
    ``fence`` as given, else from the holders in this context."""
    fields = fence_fields(model)
    label = model._meta.label
    if not fields:
        raise LockConfigurationError(
            f"{label} has no FenceField, so no fence can be checked on its rows. Add "
            "`fence = FenceField()` (django_tasklock.fenced) to it, and a migration."
        )
    if fence is None:
        found = _from_context(fields)
        if not found:
            raise _no_fence(model, fields)
        return found
    if isinstance(fence, Mapping):
        names = {f.name for f in fields}
        unknown = sorted(set(fence) - names)
        if unknown:
            raise InvalidArgument(
                f"fence= names {', '.join(unknown)}, not fence fields of {label} "
                f"(those are {', '.join(sorted(names))})."
            )
        return {
            name: _value(given, f"fence[{name!r}]") for name, given in fence.items()
        }
    if len(fields) > 1:
        raise InvalidArgument(
            f"{label} has {len(fields)} fence fields; pass fence={{name: fence}} "
            "for the ones this write carries."
        )
    return {fields[0].name: _value(fence, "fence=")}


def _condition(fences: Mapping[str, int]) -> Q:
    """Each carried fence is not older than the row's (or the row has none)."""
    condition = Q()
    for name, fence in fences.items():
        condition &= Q(**{f"{name}__isnull": True}) | Q(**{f"{name}__lte": fence})
    return condition


def _connection(alias: str) -> BaseDatabaseWrapper:
    connection = connections[alias]
    if connection.vendor not in VENDORS:
        raise LockConfigurationError(
            f"Fenced writes are built and tested for PostgreSQL, SQLite and "
            "MariaDB (Django's mysql backend); "
            f"database {alias!r} is {connection.vendor}. Keep the fenced models on "
            "one of those (a database router can), or check the fence yourself in "
            "the UPDATE's WHERE."
        )
    return connection


# -- the queryset -------------------------------------------------------------------


class FencedQuerySet(models.QuerySet[_M]):
    """A queryset with fenced writes (``Model.objects = FencedQuerySet.as_manager()``,
    or a manager made ``from_queryset`` it).

    ``fence=`` is an ``int`` (``lock.fence``), a holder (a held ``Lock``,
    ``Semaphore`` or ``Leadership``), or a dict of fence field names to either;
    by default, the holder in reach (see ``FenceField``). A refused write
    raises ``StaleFence`` naming the row, or returns a falsy result with
    ``raise_stale=False``.
    """

    def fenced_update(
        self,
        *,
        fence: FenceGiven | Mapping[str, FenceGiven] | None = None,
        raise_stale: bool = True,
        **values: Any,
    ) -> int:
        """``update(**values)`` of the rows whose fence is not newer than
        this writer's, in one statement; how many rows it wrote. Rows the
        condition refused raise ``StaleFence`` (one more query names the
        first); with ``raise_stale=False`` there is none, and the count
        tells."""
        fences = self._fences(fence, values)
        written: int = self.filter(_condition(fences)).update(**values, **fences)
        if raise_stale:
            self._refused(fences, True)
        return written

    def fenced_update_or_create(
        self,
        defaults: Mapping[str, Any] | None = None,
        *,
        fence: FenceGiven | Mapping[str, FenceGiven] | None = None,
        raise_stale: bool = True,
        **lookup: Any,
    ) -> bool:
        """Create the row ``lookup`` names with ``defaults``, or update its
        ``defaults`` if its fence is not newer than this writer's, in one
        statement (``INSERT ... ON CONFLICT ... DO UPDATE ... WHERE``). The
        ``lookup`` fields must be the model's primary key or a unique
        constraint's fields. True if written; False (``raise_stale=False``)
        or ``StaleFence`` if refused."""
        defaults = dict(defaults or {})
        fences = self._fences(fence, defaults)
        connection = _connection(self.db)
        sql, params = _upsert(self.model, connection, lookup, defaults, fences)
        if connection.vendor == "mysql":
            return self._mysql_upsert(
                connection, sql, params, lookup, fences, raise_stale
            )
        for _try in range(TRIES):
            with connection.cursor() as cursor:
                cursor.execute(sql, params)
                if cursor.rowcount:
                    return True
            if self.filter(**lookup)._refused(fences, raise_stale):
                return False
        raise _unsettled(self.model, lookup)

    def fenced_save(
        self,
        obj: _M,
        *,
        fence: FenceGiven | Mapping[str, FenceGiven] | None = None,
        raise_stale: bool = True,
        update_fields: list[str] | None = None,
    ) -> bool:
        """Save ``obj`` (every field, or ``update_fields``) by its primary key
        if the row's fence is not newer than this writer's, and set its fence
        fields; a new object is inserted. True if written; False
        (``raise_stale=False``) or ``StaleFence`` if refused."""
        meta = self.model._meta
        fences = self._fences(fence, dict.fromkeys(update_fields or ()))
        if obj.pk is None:
            return self._insert_row(obj, fences)
        names = update_fields or [
            f.name
            for f in meta.concrete_fields
            if not f.primary_key and not isinstance(f, FenceField)
        ]
        values = {}
        for name in names:
            field = _field(meta, name)
            values[field.attname] = field.pre_save(obj, False)
        rows = self.filter(pk=obj.pk)
        for _try in range(TRIES):
            if rows.filter(_condition(fences)).update(**values, **fences):
                _set_fences(obj, fences)
                return True
            if rows._refused(fences, raise_stale):
                return False
            if self._insert_row(obj, fences, racing=True):
                return True
        raise _unsettled(self.model, {"pk": obj.pk})

    # -- helpers ----------------------------------------------------------------

    def _mysql_upsert(
        self,
        connection: BaseDatabaseWrapper,
        sql: str,
        params: list[Any],
        lookup: Mapping[str, Any],
        fences: Mapping[str, int],
        raise_stale: bool,
    ) -> bool:
        """MySQL's upsert counts a changed row 2, and a new row, a refused
        one and one set to what it held 1 alike (Django asks for found rows):
        a 1 is told apart by the row's fence, read under the upsert's row
        lock, in its transaction."""
        with transaction.atomic(using=self.db), connection.cursor() as cursor:
            cursor.execute(sql, params)
            if cursor.rowcount == 2:
                return True
            return not self.filter(**lookup)._refused(fences, raise_stale)

    def _fences(
        self,
        fence: FenceGiven | Mapping[str, FenceGiven] | None,
        values: Mapping[str, Any],
    ) -> dict[str, int]:
        _connection(self.db)
        fences = fences_for(self.model, fence)
        given = sorted(set(values) & {f.name for f in fence_fields(self.model)})
        if given:
            raise InvalidArgument(
                f"{', '.join(given)} of {self.model._meta.label} is set by the fenced "
                "write itself, from the holder's fence; leave it out of the values."
            )
        return fences

    def _insert_row(
        self, obj: _M, fences: dict[str, int], *, racing: bool = False
    ) -> bool:
        """Insert ``obj`` with ``fences``; with ``racing``, False if a row
        with its key appeared meanwhile."""
        _set_fences(obj, fences)
        if not racing:
            obj.save(force_insert=True, using=self.db)
            return True
        try:
            with transaction.atomic(using=self.db):
                obj.save(force_insert=True, using=self.db)
        except IntegrityError:
            return False
        return True

    def _refused(self, fences: Mapping[str, int], raise_stale: bool) -> bool:
        """Whether a row here has a fence newer than the writer's: ``StaleFence``
        naming the first such row, with ``raise_stale``."""
        newer = Q()
        for name, fence in fences.items():
            newer |= Q(**{f"{name}__gt": fence})
        for row in self.filter(newer).values("pk", *fences)[:1]:
            if not raise_stale:
                return True
            for name, fence in fences.items():
                stored = row[name]
                if stored is not None and stored > fence:
                    raise StaleFence(
                        f"{self.model._meta.label} pk={row['pk']!r}",
                        name,
                        stored,
                        fence,
                    )
        return False


def _unsettled(model: type[models.Model], lookup: Mapping[str, Any]) -> LockUsageError:
    """Rows created and deleted under a write every time it tried."""
    return LockUsageError(
        f"A fenced write to {model._meta.label} {dict(lookup)!r} found the row "
        f"neither writable nor newer {TRIES} times (it was deleted or created "
        "meanwhile each time); nothing was written. Try the write again."
    )


def _set_fences(obj: models.Model, fences: Mapping[str, int]) -> None:
    for name, fence in fences.items():
        setattr(obj, name, fence)


def _field(meta: Any, name: str) -> models.Field[Any, Any]:
    """The model field ``name`` names, with a column of its own."""
    field = meta.get_field(name)
    if not isinstance(field, models.Field) or not field.column:
        raise InvalidArgument(
            f"{meta.label}.{name} is no column of its table, so a fenced write "
            "cannot set or look up by it; name a concrete field."
        )
    return field


def _column(meta: Any, name: str) -> str:
    column = _field(meta, name).column
    assert column is not None
    return column


def _unique_sets(meta: Any) -> list[set[str]]:
    """The field-name sets a row is unique by (no conditional constraint)."""
    sets = [{meta.pk.name}]
    sets += [{f.name} for f in meta.concrete_fields if f.unique]
    sets += [set(together) for together in meta.unique_together]
    for constraint in meta.total_unique_constraints:
        sets.append(set(constraint.fields))
    return sets


def _check_upsert(meta: Any, lookup: Mapping[str, Any]) -> None:
    """Refuse an upsert the database could not aim at one row of one table."""
    label = meta.label
    if meta.parents:
        parents = ", ".join(p._meta.label for p in meta.parents)
        raise LockConfigurationError(
            f"{label} inherits its table from {parents}; a fenced upsert writes "
            "one table. Use fenced_update instead."
        )
    if set(lookup) not in _unique_sets(meta):
        raise InvalidArgument(
            f"fenced_update_or_create of {label} by {', '.join(sorted(lookup))}: "
            "those fields are no unique constraint of it, so the database could "
            "not tell the row to update; look it up by its primary key or the "
            "fields of a unique constraint."
        )


def _upsert(
    model: type[models.Model],
    connection: BaseDatabaseWrapper,
    lookup: Mapping[str, Any],
    defaults: Mapping[str, Any],
    fences: Mapping[str, int],
) -> tuple[str, list[Any]]:
    """The one upsert statement: ``INSERT ... ON CONFLICT ... DO UPDATE ...
    WHERE`` (MariaDB: ``ON DUPLICATE KEY UPDATE``, each column ``IF``)."""
    meta = model._meta
    _check_upsert(meta, lookup)
    obj = model(**lookup, **defaults, **fences)
    quote = connection.ops.quote_name
    table = quote(meta.db_table)
    fields = [
        f
        for f in meta.concrete_fields
        if not (f.primary_key and getattr(obj, f.attname) is None)
    ]
    params = [f.get_db_prep_save(f.pre_save(obj, True), connection) for f in fields]
    updated = [_field(meta, name) for name in defaults]
    updated += [f for f in fields if getattr(f, "auto_now", False) and f not in updated]
    updated += [_field(meta, name) for name in fences]  # last: see below
    columns = ", ".join(quote(_column(meta, f.name)) for f in fields)
    insert = (
        f"INSERT INTO {table} ({columns}) VALUES ({', '.join(['%s'] * len(fields))})"
    )
    sets = [quote(_column(meta, f.name)) for f in updated]
    fenced = [quote(_column(meta, name)) for name in fences]
    if connection.vendor == "mysql":
        # No WHERE on MySQL's upsert: each column is set only if the fences
        # let it, the fences last (assignments run left to right, and read
        # the columns assigned before them).
        newer = " AND ".join(f"({c} IS NULL OR {c} <= VALUES({c}))" for c in fenced)
        assign = ", ".join(f"{c} = IF({newer}, VALUES({c}), {c})" for c in sets)
        return f"{insert} ON DUPLICATE KEY UPDATE {assign}", params
    assign = ", ".join(f"{c} = excluded.{c}" for c in sets)
    conflict = ", ".join(quote(_column(meta, name)) for name in lookup)
    where = " AND ".join(
        f"({table}.{c} IS NULL OR {table}.{c} <= excluded.{c})" for c in fenced
    )
    return (
        f"{insert} ON CONFLICT ({conflict}) DO UPDATE SET {assign} WHERE {where}",
        params,
    )
