"""The lock console: what the rosters list (``locks.roster``, ``console``) and
the admin pages, against the real stores, with Django's test client (the
browser tests are in test_console_browser.py)."""

from __future__ import annotations

import os
import socket
import time

import pytest
from django.contrib.admin.models import DELETION, LogEntry
from django.contrib.auth.models import Permission, User

from django_tasklock import Leadership, Lock, Semaphore, lock_id_for, single_instance
from django_tasklock.console import take_inventory
from django_tasklock.locks.liveness import forget_records
from django_tasklock.locks.roster import SLOTS, slot_key
from django_tasklock.status import lock_status
from tests.helpers import wait_until
from tests.workers import Holder

pytestmark = pytest.mark.django_db

CONSOLE = "/admin/django_tasklock/heldlock/"
HOST = socket.gethostname()


@pytest.fixture(autouse=True)
def _quick_records(settings, redis_cluster):
    # The page lists every alias's locks, the cluster's too, which the suite
    # flushes only for the tests that ask for it: an earlier test on this
    # worker may have left locks there under a live record.
    redis_cluster.flush()
    settings.TASKLOCK = {"CACHE": "default", "LOCK_EXPIRE": 60, "LIVENESS": 3}


def listed(lock_id, alias="default"):
    return [one for one in take_inventory([alias]).listed() if one.lock_id == lock_id]


def held_lock(
    lock_id, task="feeds.import_feed", args=(), kwargs=None, wait=True, **options
):
    """A lock held by this process for ``task(*args, **kwargs)``, listed by
    the console (``wait=False``: maybe not yet)."""
    lock = Lock(lock_id, **options)
    lock.about = (task, args, kwargs or {})
    assert lock.acquire()
    if wait:
        # Each look reads the whole roster: every 50 ms, not every 5.
        wait_until(lambda: listed(lock_id, lock.acquisition.alias), 10, every=0.05)
    return lock


def test_a_held_lock_is_listed_with_its_task_arguments_and_holder(settings, store):
    settings.TASKLOCK = {**store.tasklock, "LIVENESS": 3}
    lock = held_lock(
        "feeds.import_feed-lock-1", args=("https://a.example/rss",), kwargs={"n": 2}
    )
    [one] = listed("feeds.import_feed-lock-1", store.alias)
    assert one.entry.kind == "lock"
    assert one.entry.task == "feeds.import_feed"
    assert one.entry.args == "'https://a.example/rss', n=2"
    assert one.host == HOST and f":{os.getpid()}-" in one.record
    assert 0 <= one.age() < 10
    status = one.status()
    assert status.held and status.value == lock.token
    assert status.owner is not None and status.owner.alive is True
    assert lock.release()
    wait_until(lambda: not listed("feeds.import_feed-lock-1", store.alias), 10)


def test_semaphore_slots_and_decorated_runs_are_listed_with_what_took_them(settings):
    semaphore = Semaphore("reports", limit=3)
    assert semaphore.acquire()
    assert semaphore.lock is not None
    slot_id = semaphore.lock.lock_id
    wait_until(lambda: listed(slot_id), 10)
    [slot] = listed(slot_id)
    assert (slot.entry.kind, slot.entry.task) == ("slot", "reports")
    seen = locked_report(7, b="x")
    assert seen.task == locked_report.__module__ + ".locked_report"
    assert seen.args == "7, b='x'"
    semaphore.release()


@single_instance(expire=60)
def locked_report(n, b=None):
    """Returns its own roster entry, as listed while it runs."""
    lock_id = lock_id_for(locked_report, n, b=b)
    wait_until(lambda: listed(lock_id), 10)
    return listed(lock_id)[0].entry


def test_a_process_that_exits_takes_its_roster_slot_with_it(settings, memcached):
    holder = Holder("default", "feeds-lock-exit", liveness=3)
    try:
        wait_until(lambda: listed("feeds-lock-exit"), 10)
        assert holder.ask("exit") == ""  # leaves holding: the way out releases
        holder.process.wait(timeout=10)
        assert not listed("feeds-lock-exit")
        assert take_inventory(["default"]).processes["default"] == 0
    finally:
        holder.close()


def test_a_killed_holders_locks_stay_listed_and_show_it_dead(settings, admin_client):
    holder = Holder("default", "feeds-lock-killed", liveness=3)
    try:
        wait_until(lambda: listed("feeds-lock-killed"), 10)
        holder.kill()
        [one] = listed("feeds-lock-killed")
        assert one.status().owner.alive is False
        page = admin_client.get(CONSOLE).content.decode()
        assert "feeds-lock-killed" in page and "state-dead" in page
        # Its holder is gone: released without forcing, and logged.
        query = {"alias": "default", "lock_id": "feeds-lock-killed"}
        confirm = admin_client.get(CONSOLE + "release/", query).content.decode()
        assert "Its holder is gone" in confirm and "tasklock-force" not in confirm
        done = admin_client.post(
            CONSOLE + "release/", {**query, "seen": holder.token}, follow=True
        )
        assert "its holder was gone" in done.content.decode()
        assert not lock_status("feeds-lock-killed").held
        entry = LogEntry.objects.get(object_repr="feeds-lock-killed")
        assert entry.action_flag == DELETION and holder.token in entry.change_message
    finally:
        holder.close()


def test_the_page_lists_finds_filters_and_pages(settings, admin_client):
    locks = [
        held_lock(f"feeds.import_feed-lock-{n:03}", args=(n,), wait=False)
        for n in range(60)
    ]
    locks += [
        held_lock(f"feeds.other-lock-{n}", task="feeds.other", wait=False)
        for n in range(5)
    ]
    # Listed once the liveness thread has put them in the roster: waited for
    # all at once (an inventory read each 5 ms for each lock in turn was most
    # of this test's CPU).
    ids = {lock.lock_id for lock in locks}
    wait_until(
        lambda: ids <= {one.lock_id for one in take_inventory(["default"]).listed()},
        10,
        every=0.05,
    )
    page = admin_client.get(CONSOLE).content.decode()
    assert "65 listed" in page, page[page.find("tasklock-summary") :][:300]
    assert page.count('class="tasklock-row"') == 50
    assert f"{os.getpid()}@{HOST}" in page and "alive" in page
    second = admin_client.get(CONSOLE, {"p": 2}).content.decode()
    assert second.count('class="tasklock-row"') == 15
    other = admin_client.get(CONSOLE, {"task": "feeds.other"}).content.decode()
    assert other.count('class="tasklock-row"') == 5 and "5 listed" in other
    found = admin_client.get(CONSOLE, {"q": "lock-042"}).content.decode()
    assert found.count('class="tasklock-row"') == 1
    assert "feeds.import_feed-lock-042" in found
    nothing = admin_client.get(CONSOLE, {"alias": "redis"}).content.decode()
    assert "No held locks match" in nothing
    for lock in locks:
        lock.release()


def test_a_store_that_does_not_answer_is_said_so_not_shown_empty(
    settings, admin_client
):
    holder = Holder("default", "feeds-lock-beside-down", liveness=3)
    try:
        wait_until(lambda: listed("feeds-lock-beside-down"), 10)
        settings.CACHES = {
            **settings.CACHES,
            "down": {
                "BACKEND": "django.core.cache.backends.memcached.PyMemcacheCache",
                "LOCATION": "127.0.0.1:9",
            },
        }
        page = admin_client.get(CONSOLE).content.decode()
        assert "Store down could not be read" in page and "1 listed" in page
    finally:
        holder.close()


def test_a_live_holders_lock_is_released_only_when_forced(settings, admin_client):
    lock = held_lock("feeds-lock-live")
    query = {"alias": "default", "lock_id": "feeds-lock-live", "seen": lock.token}
    refused = admin_client.post(CONSOLE + "release/", query).content.decode()
    assert "Tick “Release anyway”" in refused
    assert lock_status("feeds-lock-live").value == lock.token
    stale = admin_client.post(
        CONSOLE + "release/", {**query, "seen": "someone-else", "force": "on"}
    ).content.decode()
    assert "changed hands" in stale and lock_status("feeds-lock-live").held
    forced = admin_client.post(
        CONSOLE + "release/", {**query, "force": "on"}, follow=True
    ).content.decode()
    assert "forced" in forced
    assert not lock_status("feeds-lock-live").held
    assert lock.release() is False and lock.lost  # its holder is told
    assert LogEntry.objects.filter(object_repr="feeds-lock-live").count() == 1


def test_a_user_without_the_permissions_is_refused(settings, client):
    lock = held_lock("feeds-lock-perms")
    viewer = User.objects.create_user("viewer", password="pw", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_heldlock"))
    client.force_login(viewer)
    page = client.get(CONSOLE).content.decode()
    assert "feeds-lock-perms" in page and "Release…" not in page
    query = {"alias": "default", "lock_id": "feeds-lock-perms", "seen": lock.token}
    assert client.get(CONSOLE + "release/", query).status_code == 403
    assert (
        client.post(CONSOLE + "release/", {**query, "force": "on"}).status_code == 403
    )
    assert lock_status("feeds-lock-perms").held
    nobody = User.objects.create_user("nobody", password="pw", is_staff=True)
    client.force_login(nobody)
    assert client.get(CONSOLE).status_code == 403
    lock.release()


def test_the_roster_is_read_in_two_round_trips_whatever_the_cache_holds(
    settings, memcached, redis_server
):
    from django.core.cache import caches

    from tests.helpers import close_connections, counted_cache

    holder = Holder("default", "feeds-lock-counted", liveness=3)
    wait_until(lambda: listed("feeds-lock-counted"), 10)
    caches["default"].set_many({f"unrelated-{n}": n for n in range(5000)})
    proxy = counted_cache(settings, memcached, redis_server, "memcached")
    try:
        before = proxy.requests
        inventory = take_inventory(["counted"])
        assert [one.lock_id for one in inventory.listed()] == ["feeds-lock-counted"]
        # One get_many of the slots and one stats (did the server just
        # restart?); the spilled chunks (over CHUNK entries per process)
        # would take one more (see test_console_scale.py).
        assert proxy.requests - before == 2
    finally:
        close_connections()
        proxy.close()
        holder.close()


def test_every_slot_taken_is_said_not_hidden(settings, caplog):
    from django.core.cache import caches

    forget_records()
    caches["default"].set_many(
        {
            slot_key(slot): '{"record":"x","host":"h","chunks":1,"entries":[]}'
            for slot in range(SLOTS)
        }
    )
    lock = Lock("feeds-lock-full")
    assert lock.acquire()
    wait_until(lambda: "roster slots" in caplog.text, 10)
    inventory = take_inventory(["default"])
    assert inventory.full == ["default"] and not listed("feeds-lock-full")
    lock.release()


def test_rate_limits_are_shown_with_their_state(settings, admin_client):
    from django_tasklock import RateLimiter, rate_limited

    settings.TASKLOCK = {
        "CACHE": "default",
        "LIVENESS": 3,
        "RATE_LIMITS": {"partner-api": "5/m"},
    }
    limiter = RateLimiter("partner-api")
    assert limiter.admit() and limiter.admit()

    @rate_limited("3/h", name="console-declared", on_limit="raise")
    def call_partner():
        return True

    assert call_partner()
    page = admin_client.get(CONSOLE).content.decode()
    start = page.index('id="tasklock-limit-list"')
    table = page[start : page.index("</table>", start)]
    row = table[table.index('data-limit-id="partner-api"') :].split("</tr>")[0]
    assert "TASKLOCK[&#x27;RATE_LIMITS&#x27;]" in row and "5/m" in row
    assert limiter.state()["admitted in the last period"] == 2
    assert "admitted in the last period: 2" in row and "left in this period: 3" in row
    declared = table[table.index('data-limit-id="console-declared"') :]
    assert "admitted in the last period: 1" in declared.split("</tr>")[0]
    limiter.reset()


# -- the release page shows and removes only locks ----------------------------------


def test_the_release_page_neither_shows_nor_deletes_other_cache_entries(
    settings, admin_client
):
    from django.core.cache import caches

    from django_tasklock import RateLimiter
    from django_tasklock.locks import liveness
    from django_tasklock.locks.liveness import RECORD_PREFIX

    caches["default"].set("partner:api-key", "s3cret-value", 600)
    limiter = RateLimiter("partner-api", "5/h")
    assert limiter.admit().admitted
    lock = held_lock("a-real-lock")  # this process's record and roster exist
    try:
        record = liveness._records["default"].id
        assert record.startswith(RECORD_PREFIX)
        for lock_id in (
            "partner:api-key",  # an application's value
            "partner-api-rate",  # a rate limit's state
            record,  # a liveness record
            slot_key(0),  # a roster slot
        ):
            query = {"lock_id": lock_id, "alias": "default"}
            page = admin_client.get(CONSOLE + "release/", query)
            assert page.status_code == 404, lock_id
            assert "s3cret" not in page.content.decode()
            forced = admin_client.post(
                CONSOLE + "release/", {**query, "force": "on", "seen": "x"}
            )
            assert forced.status_code == 404, lock_id
        assert caches["default"].get("partner:api-key") == "s3cret-value"
        assert limiter.admit().admitted  # its state kept: 2 of 5
        assert lock.owned()
        # A lock of this app still has its page.
        query = {"lock_id": "a-real-lock", "alias": "default"}
        assert admin_client.get(CONSOLE + "release/", query).status_code == 200
    finally:
        lock.release()


def test_the_release_page_answers_any_query_string_without_a_server_error(
    settings, admin_client
):
    import random

    chosen = random.Random(30)
    alphabet = "ab:-_ /%\x00\x01\r\n\t\u00e9\u2603\U0001f512\ud800'\"<>&?=#"
    aliases = ["", "default", "redis", "nope", "locmem", "dummy", "\x00", "a" * 300]
    for _ in range(150):
        lock_id = "".join(chosen.choice(alphabet) for _ in range(chosen.randint(0, 40)))
        if chosen.random() < 0.1:
            lock_id *= 20  # past memcached's key length
        query = {"lock_id": lock_id, "alias": chosen.choice(aliases)}
        for method in (admin_client.get, admin_client.post):
            try:
                answer = method(CONSOLE + "release/", {**query, "force": "on"})
            except UnicodeEncodeError:
                continue  # the test client cannot send a lone surrogate
            assert answer.status_code in (200, 302, 404), (query, answer.status_code)
    unknown = admin_client.get(CONSOLE + "release/", {"lock_id": "x", "alias": "nope"})
    assert unknown.status_code == 404


from tests.celery_app import app  # noqa: E402


@app.task(bind=True)
@single_instance(key="tenant", limit=2, expire=60)
def slot_report(self, tenant):
    """Returns its own slot's roster entries, as listed while it runs."""
    wait_until(
        lambda: [
            e
            for e in take_inventory(["default"]).listed()
            if e.entry.kind == "slot" and e.entry.call_id
        ],
        10,
    )
    return [e.entry for e in take_inventory(["default"]).listed() if e.entry.call_id]


def test_a_slot_held_by_a_call_shows_its_task_id_and_is_found_by_it(settings):
    entries = slot_report.apply(args=("acme",), task_id="call-in-a-slot").get()
    assert [(e.kind, e.call_id) for e in entries] == [("slot", "call-in-a-slot")]
    assert entries[0].task == slot_report.name


def test_a_lock_on_any_server_of_a_pool_is_listed(settings):
    # The roster is kept by the thread of the record on the pool's first
    # server: a process whose locks are all on another server starts it too.
    from django_tasklock.backends import backend_for

    settings.TASKLOCK = {"CACHE": "pair", "LOCK_EXPIRE": 60, "LIVENESS": 3}
    backend = backend_for("pair")
    first = backend.record_places()[0]
    lock_id = next(
        f"on-another-server-{n}"
        for n in range(100)
        if backend.record_place(backend.keys_for(f"on-another-server-{n}")[0]) != first
    )
    lock = Lock(lock_id, expire=30)
    assert lock.acquire()
    try:
        wait_until(lambda: listed(lock_id, "pair"), 10)
    finally:
        lock.release()


def test_after_a_restart_held_locks_are_listed_again_within_a_beat(settings):
    """A restarted memcached comes back without the roster: the holder's
    liveness thread finds its slot gone at its next beat and writes it again
    (it used to wait until the slot neared its expiry, minutes later), and
    meanwhile the page says what it lists may be incomplete."""
    from tests.helpers import close_connections
    from tests.services import Memcached

    server = Memcached().start()
    settings.CACHES = {
        **settings.CACHES,
        "restarted": {
            "BACKEND": "django.core.cache.backends.memcached.PyMemcacheCache",
            "LOCATION": server.address,
        },
    }
    settings.TASKLOCK = {"CACHE": "restarted", "LOCK_EXPIRE": 60, "LIVENESS": 3}
    try:
        lock = held_lock("feeds-lock-restart", expire=60)
        server.restart()  # same port, empty
        restarted = time.monotonic()
        inventory = take_inventory(["restarted"])
        assert any(
            f"{server.address} (restarted)" in why and "Started lately" in why
            for why in inventory.incomplete
        ), inventory.incomplete
        relisted = wait_until(lambda: listed("feeds-lock-restart", "restarted"), 10)
        # One beat is 0.3 s here; the reconnection and the page's read add some.
        print(f"listed again {time.monotonic() - restarted:.2f}s after the restart")
        assert relisted < 5
        # The lock itself is put back at the record's next beat (liveness.
        # reassert), which the roster's relisting may come before: beside two
        # CPU hogs the release came first, and found the lock gone.
        key = lock.acquisition.key.encode()
        wait_until(lambda: server.raw(b"mg %s" % key).startswith(b"HD"), 10)
        assert lock.release()
    finally:
        forget_records()
        close_connections()
        server.stop()


def test_a_slot_another_process_took_is_neither_written_over_nor_deleted(settings):
    """Its slot gone and claimed by another process (an eviction, then a new
    worker): the holder lists its locks in another slot, and at its exit
    leaves the other process's slot in place."""
    from django.core.cache import caches

    from django_tasklock.locks import liveness

    lock = held_lock("feeds-lock-moved", expire=60)
    roster = liveness._records["default"].roster
    mine = roster.slot
    assert mine is not None and mine >= 0
    other = '{"record":"other-process","host":"h","chunks":1,"entries":[]}'
    caches["default"].set(slot_key(mine), other, timeout=60)
    wait_until(lambda: roster.slot not in (None, mine), 10)
    wait_until(lambda: listed("feeds-lock-moved"), 10)
    assert caches["default"].get(slot_key(mine)) == other, "written over"
    assert roster.reclaimed == 1
    now_in = roster.slot
    assert lock.release()
    forget_records(delete=True)  # the way out of the process
    assert caches["default"].get(slot_key(mine)) == other, "deleted at exit"
    assert caches["default"].get(slot_key(now_in)) is None


@pytest.mark.django_db(transaction=True)
def test_a_forced_release_removes_only_the_item_it_judged(settings, memcached):
    """The lock changes hands while a forced release is on its way to the
    store (the delete held back by a proxy): the release removes nothing, and
    the new holder's lock stays."""
    import functools

    from django.test import Client
    from pymemcache.client.base import Client as Memcache

    from tests.faultproxy import FaultProxy
    from tests.helpers import background, close_connections

    proxy = FaultProxy(memcached.port)
    settings.CACHES = {
        **settings.CACHES,
        "proxied": {
            "BACKEND": "django.core.cache.backends.memcached.PyMemcacheCache",
            "LOCATION": proxy.address,
        },
    }
    settings.TASKLOCK = {"CACHE": "proxied", "LOCK_EXPIRE": 60, "LIVENESS": 3}
    admin = User.objects.create_superuser("admin", "admin@example.com", "pw")
    client = Client()
    client.force_login(admin)
    lock = Lock("feeds-lock-judged")
    assert lock.acquire()
    key = b":1:feeds-lock-judged"
    query = {
        "alias": "proxied",
        "lock_id": "feeds-lock-judged",
        "seen": lock.token,
        "force": "on",
    }
    try:
        proxy.hold(b"md " + key, b"delete " + key)  # reads pass; removals wait
        post = functools.partial(client.post, follow=True)
        thread, outcome = background(post, CONSOLE + "release/", query)
        wait_until(lambda: proxy.held >= 1, 30)
        # Meanwhile its lock expired and another process took it.
        direct = Memcache(("127.0.0.1", memcached.port))
        direct.set(key.decode(), "another-owners-token", expire=60, noreply=False)
        proxy.let_go()
        thread.join(30)
        page = outcome["result"].content.decode()
        stored = direct.get(key.decode())
        shown = page[page.find('class="messagelist"') :][:400]
        assert stored == b"another-owners-token", (stored, shown)
        assert "nothing was removed" in page, shown
        assert not LogEntry.objects.filter(object_repr="feeds-lock-judged").exists()
        direct.close()
    finally:
        proxy.close()
        close_connections()


def test_leaders_are_shown_with_their_holder_and_fence(settings, admin_client):
    with Leadership("console-shown", poll=0.1) as leadership:
        assert leadership.wait(30)
        fence = leadership.fence
        wait_until(lambda: listed("leader-console-shown"), 10)
        page = admin_client.get(CONSOLE).content.decode()
        table = page[page.index('id="tasklock-leaders"') :]
        row = table[table.index('data-leadership="console-shown"') :]
        row = row[: row.index("</tr>")]
        assert f"{os.getpid()}@{HOST}" in row and "state-alive" in row
        # The fence of its term as the page was made: one read before, or,
        # where a starved leader let its lease lapse and led again meanwhile
        # (a new term, a larger fence: a matrix run beside three others),
        # after.
        shown = {f'<td class="fence">{f}</td>' for f in (fence, leadership.fence)}
        assert any(cell in row for cell in shown), (shown, row)
    # Given up: no longer shown as led.
    wait_until(lambda: not listed("leader-console-shown"), 10)
    page = admin_client.get(CONSOLE).content.decode()
    assert 'data-leadership="console-shown"' not in page
