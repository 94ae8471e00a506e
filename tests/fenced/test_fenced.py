"""Fenced writes: the database refuses a write whose fence is older than the
row's, in the statement itself, on SQLite and PostgreSQL; the fence comes from
the holder in reach, and a write with none is refused."""

from __future__ import annotations

import pytest
from django.conf import settings
from django.db import models
from django.test.utils import isolate_apps

from django_tasklock import (
    InvalidArgument,
    Leadership,
    Lock,
    LockConfigurationError,
    LockLost,
    LockUsageError,
    NoFence,
    Semaphore,
    StaleFence,
    current_lock,
    memcache_lock,
    single_instance,
)
from django_tasklock.check_ids import FENCE_FIELDS_AMBIGUOUS
from django_tasklock.fenced import FencedQuerySet, FenceField, fenced_by
from django_tasklock.locks.fencing import FENCES_WANTED, in_reach
from tests.fenced.models import Register, Shared
from tests.helpers import drop, run

#: SQLite and PostgreSQL; MariaDB too in the session test_on_mariadb runs.
DATABASES = [
    "default",
    "pg_tests",
    *(["mysql"] if "mysql" in settings.DATABASES else []),
]
NAMES = {"default": "sqlite", "pg_tests": "postgresql", "mysql": "mariadb"}
#: For writes from other threads: SQLite in a file (an in-memory database's
#: connections ignore close(), and Python 3.13 warns of each one left open).
THREADED = ["sqlite_file", *DATABASES[1:]]
pytestmark = pytest.mark.django_db(
    databases=["sqlite_file", *DATABASES], transaction=True
)


@pytest.fixture(params=DATABASES, ids=[NAMES[d] for d in DATABASES])
def db_alias(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def registers(alias: str) -> FencedQuerySet[Register]:
    return Register.objects.using(alias)  # type: ignore[return-value]


def test_an_older_fence_is_refused_and_names_the_row(db_alias):
    rows = registers(db_alias)
    row = rows.create(name="a")
    assert rows.filter(name="a").fenced_update(value=1, fence=5) == 1
    with pytest.raises(StaleFence) as refused:
        rows.filter(name="a").fenced_update(value=2, fence=4)
    assert (refused.value.stored, refused.value.fence) == (5, 4)
    assert refused.value.field == "fence"
    assert f"pk={row.pk}" in refused.value.row and "fence 4" in str(refused.value)
    assert rows.values_list("value", "fence").get() == (1, 5)  # nothing written
    # An equal fence is the same hold writing again; a newer one writes.
    assert rows.filter(name="a").fenced_update(value=3, fence=5) == 1
    assert rows.filter(name="a").fenced_update(value=4, fence=9) == 1
    assert rows.filter(name="a").fenced_update(value=5, fence=6, raise_stale=False) == 0
    assert rows.values_list("value", "fence").get() == (4, 9)


def test_the_queryset_keeps_every_method_of_djangos(db_alias):
    rows = registers(db_alias)
    rows.bulk_create([Register(name="b1"), Register(name="b2")])
    assert rows.filter(name__startswith="b").update(value=1) == 2
    assert rows.get_or_create(name="b3")[1]
    assert rows.count() == 3


def test_an_update_of_many_rows_writes_those_it_may(db_alias):
    rows = registers(db_alias)
    for name, fence in (("a", 3), ("b", 7), ("c", None)):
        rows.create(name=name, fence=fence)
    assert rows.fenced_update(value=1, fence=5, raise_stale=False) == 2
    assert dict(rows.values_list("name", "value")) == {"a": 1, "b": 0, "c": 1}
    with pytest.raises(StaleFence, match="fence is 7"):
        rows.fenced_update(value=2, fence=6)


def test_an_upsert_creates_then_refuses_older_fences(db_alias):
    rows = registers(db_alias)
    assert rows.fenced_update_or_create(name="u", defaults={"value": 1}, fence=10)
    first = rows.get(name="u")
    assert (first.value, first.fence) == (1, 10)
    with pytest.raises(StaleFence) as refused:
        rows.fenced_update_or_create(name="u", defaults={"value": 2}, fence=9)
    assert (refused.value.stored, refused.value.fence) == (10, 9)
    assert not rows.fenced_update_or_create(
        name="u", defaults={"value": 2}, fence=9, raise_stale=False
    )
    assert rows.fenced_update_or_create(name="u", defaults={"value": 3}, fence=11)
    row = rows.get(name="u")
    assert (row.value, row.fence, row.pk) == (3, 11, first.pk)
    assert row.changed >= first.changed  # auto_now fields are written too
    assert rows.count() == 1


def test_an_upsert_needs_a_unique_lookup_and_leaves_the_fence_to_the_write(db_alias):
    rows = registers(db_alias)
    with pytest.raises(InvalidArgument, match="no unique constraint"):
        rows.fenced_update_or_create(value=1, defaults={"note": "x"}, fence=1)
    with pytest.raises(InvalidArgument, match="set by the fenced write"):
        rows.fenced_update_or_create(name="x", defaults={"fence": 3}, fence=1)
    shared = Shared.objects.using(db_alias)
    assert shared.fenced_update_or_create(
        shop="s", sku="k", defaults={"stock": 2}, fence={"fence": 4}
    )
    assert shared.values_list("stock", "fence", "sweep_fence").get() == (2, 4, None)


def test_a_save_by_primary_key_is_fenced(db_alias):
    rows = registers(db_alias)
    obj = Register(name="s", value=1)
    assert rows.fenced_save(obj, fence=3)  # a new row: inserted
    assert obj.pk is not None and obj.fence == 3
    stale = rows.get(pk=obj.pk)
    assert rows.filter(pk=obj.pk).fenced_update(value=2, fence=8) == 1
    stale.value = 99
    with pytest.raises(StaleFence):
        rows.fenced_save(stale, fence=3)
    assert rows.get(pk=obj.pk).value == 2
    fresh = rows.get(pk=obj.pk)
    fresh.note = "newer"
    assert rows.fenced_save(fresh, fence=8, update_fields=["note"])
    assert rows.values_list("value", "note").get() == (2, "newer")
    gone = Register(pk=obj.pk + 100, name="gone", value=5)
    assert rows.fenced_save(gone, fence=1)  # its row is missing: inserted
    assert rows.get(pk=obj.pk + 100).fence == 1


def test_the_fence_of_the_lock_held_is_found(db_alias):
    rows = registers(db_alias)
    rows.create(name="ctx")
    with Lock("fenced-ctx") as lock:
        assert rows.filter(name="ctx").fenced_update(value=1) == 1
        fence = lock.fence
    assert rows.get(name="ctx").fence == fence
    with pytest.raises(NoFence, match="with fenced_by"):
        rows.filter(name="ctx").fenced_update(value=2)
    with memcache_lock("fenced-recipe", "me") as acquired:
        assert acquired
        assert rows.filter(name="ctx").fenced_update(value=2) == 1
    assert rows.get(name="ctx").fence > fence  # another lock id's counter


def test_blocks_push_their_holder_once_a_fence_field_exists():
    """A process with no model with a FenceField can make no fenced write, so
    its blocks push no holder (the cost of a context variable's set and
    reset); defining a fence field turns pushing on for every block after."""
    assert FENCES_WANTED[0] is True  # (this suite's models have fence fields)
    FENCES_WANTED[0] = False
    try:
        with Lock("no-fields") as lock, memcache_lock("no-fields-recipe") as taken:
            assert lock.held and taken
            assert in_reach() == []
        FenceField()
        assert FENCES_WANTED[0] is True
    finally:
        FENCES_WANTED[0] = True
    with Lock("fields") as lock, memcache_lock("fields-recipe") as taken:
        assert taken
        reached = [holder for holder, _names in in_reach()]
        assert reached[1] is lock and reached[0].lock_id == "fields-recipe"
    assert in_reach() == []


def test_a_decorated_call_and_nested_locks_give_the_innermost_fence(db_alias):
    rows = registers(db_alias)
    rows.create(name="run")

    @single_instance
    def write(value: int) -> int | None:
        rows.filter(name="run").fenced_update(value=value)
        return rows.get(name="run").fence

    fence = write(1)
    assert fence is not None
    with Lock("fenced-outer") as outer, Lock("fenced-inner") as inner:
        rows.filter(name="run").fenced_update(value=2)
        assert rows.get(name="run").fence == inner.fence != outer.fence
    with Semaphore("fenced-slots", limit=2) as slots:
        assert rows.filter(name="run").fenced_update(value=3) == 1
        assert rows.get(name="run").fence == slots.fence


def test_a_field_named_for_a_lock_takes_that_holders_fence(db_alias):
    shared = Shared.objects.using(db_alias)
    shared.create(shop="s", sku="k")
    with Lock("sweep") as sweep, Lock("row-s-k") as row:
        assert shared.fenced_update(price=1) == 1
    assert shared.values_list("fence", "sweep_fence").get() == (row.fence, sweep.fence)
    with fenced_by(row):  # released: it has no fence any more
        with pytest.raises(LockUsageError, match="not held"):
            shared.fenced_update(price=2)
    with Lock("row-s-k"):  # the sweep's field is left as it was
        assert shared.fenced_update(stock=5) == 1
    assert shared.values_list("sweep_fence", "stock").get() == (sweep.fence, 5)


def test_a_lost_lock_gives_no_fence(db_alias):
    rows = registers(db_alias)
    rows.create(name="lost")
    lock = Lock("fenced-lost", renew=False)
    assert lock.acquire()
    drop("default", "fenced-lost")
    assert not lock.extend()  # found gone
    with fenced_by(lock), pytest.raises(LockLost):
        rows.filter(name="lost").fenced_update(value=1)
    assert rows.get(name="lost").value == 0


def test_a_leader_writes_with_its_epoch(db_alias):
    rows = registers(db_alias)
    rows.create(name="leader")
    with Leadership("fenced-role", poll=0.1) as leadership:
        assert leadership.wait(10)
        assert rows.filter(name="leader").fenced_update(value=1) == 1
        assert rows.get(name="leader").fence == leadership.fence
    with fenced_by(leadership), pytest.raises(LockLost):
        rows.filter(name="leader").fenced_update(value=2)


@isolate_apps("tests.fenced")
def test_two_unnamed_fence_fields_are_refused_by_a_check():
    class Twice(models.Model):
        a = FenceField()
        b = FenceField()

        class Meta:
            app_label = "fenced"

    errors = [e for e in Twice.check() if e.id == FENCE_FIELDS_AMBIGUOUS]
    assert len(errors) == 1 and "lock=" in errors[0].hint


@isolate_apps("tests.fenced")
def test_a_model_without_a_fence_field_says_how_to_add_one(db_alias):
    class Plain(models.Model):
        objects = FencedQuerySet.as_manager()

        class Meta:
            app_label = "fenced"

    with pytest.raises(LockConfigurationError, match="Add `fence = FenceField"):
        Plain.objects.using(db_alias).fenced_update(fence=1)


@pytest.mark.parametrize("data", DATABASES, ids=[NAMES[d] for d in DATABASES])
def test_every_lock_store_fences_the_write(store, data):
    """The lock on each shared store (memcached, Redis, cluster, PostgreSQL,
    PgBouncer...), the data on SQLite and PostgreSQL: the holder's fence is
    written, and an older one refused."""
    rows = registers(data)
    with Lock(f"fenced-store-{store.name}") as lock:
        assert rows.fenced_update_or_create(name=store.name, defaults={"value": 1})
    assert rows.get(name=store.name).fence == lock.fence
    with pytest.raises(StaleFence):
        rows.filter(name=store.name).fenced_update(value=2, fence=lock.fence - 1)
    with Lock(f"fenced-store-{store.name}") as again:
        assert rows.filter(name=store.name).fenced_update(value=3) == 1
    assert rows.values_list("value", "fence").get(name=store.name) == (3, again.fence)


@pytest.mark.parametrize(
    "db_alias", THREADED, ids=["sqlite", *[NAMES[d] for d in THREADED[1:]]]
)
def test_async_holders_give_their_fence_to_a_write_run_in_a_thread(db_alias):
    """``async with`` a Lock, and an async ``@single_instance`` body: the write
    run with sync_to_async finds the fence (the context goes with it)."""
    from asgiref.sync import sync_to_async
    from django.db import connections

    rows = registers(db_alias)
    rows.create(name="async")

    def written(value: int) -> int:
        try:
            return rows.filter(name="async").fenced_update(value=value)
        finally:  # (the executor's thread keeps no connection open)
            connections[db_alias].close()

    write = sync_to_async(written, thread_sensitive=False)

    async def in_a_block() -> int | None:
        async with Lock("fenced-async") as lock:
            await write(1)
            return await lock.afence()

    @single_instance
    async def decorated() -> None:
        await write(2)

    fence = run(in_a_block)
    assert rows.values_list("value", "fence").get(name="async") == (1, fence)
    run(decorated)
    row = rows.get(name="async")
    assert row.value == 2 and row.fence != fence


def test_runs_and_blocks_interleaved_give_the_innermost_fence(db_alias):
    """A decorated call made inside a lock's block writes with its own run's
    fence; a block inside the run's body, with that block's; the block's own
    writes after the call, with the block's. (A row each: fences of two lock
    ids are not comparable.)"""
    rows = registers(db_alias)
    fences: dict[str, int | None] = {}

    def write(name: str) -> int | None:
        assert rows.fenced_update_or_create(name=name)
        return rows.get(name=name).fence

    @single_instance
    def call(inner: bool) -> None:
        if inner:
            with Lock("fenced-in-the-body") as block:
                fences["in the body"] = write("in the body")
                fences["block"] = block.fence
        else:
            fences["in the run"] = write("in the run")
            lock = current_lock()
            fences["run"] = None if lock is None else lock.fence

    with Lock("fenced-around") as around:
        call(False)
        call(True)
        fences["after"] = write("after")
    assert fences["in the run"] == fences["run"]
    assert fences["in the body"] == fences["block"]
    assert fences["after"] == around.fence
    assert len({fences["run"], fences["block"], around.fence}) == 3
