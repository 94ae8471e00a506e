"""Duplicates stopped at ``.delay()``: what is published, what a duplicate gets,
and what the store holds, on a real Redis broker (no worker consumes here; the
worker tests are in test_calls_workers.py)."""

from __future__ import annotations

import os
import pickle
import signal

import pytest
import redis
from celery import chain, group
from django.db import transaction
from kombu.exceptions import OperationalError

from django_tasklock import AlreadyQueued, LockBackendError, lock_id_for
from django_tasklock.calls import QUEUE_SUFFIX, call_of
from django_tasklock.signals import call_deduplicated
from django_tasklock.status import lock_status
from tests import tasks
from tests.celery_app import app
from tests.helpers import LONGER, reset_publisher, wait_until
from tests.services import Redis

pytestmark = pytest.mark.usefixtures("memcached_locks")


@pytest.fixture
def broker(redis_server):
    """A private Redis broker (db 3), emptied before and after: nothing published
    here may reach a later test's workers. No result backend: nothing runs."""
    base = redis_server.url[:-2]
    env = {"TASKLOCK_TEST_BROKER": f"{base}/3"}
    os.environ.update(env)
    app.conf.update(broker_url=env["TASKLOCK_TEST_BROKER"], result_backend=None)
    reset_publisher(app)
    queue = redis.Redis.from_url(env["TASKLOCK_TEST_BROKER"])
    queue.flushdb()
    yield queue
    queue.flushdb()
    queue.close()
    reset_publisher(app)


@pytest.fixture
def announced():
    """Every call_deduplicated signal sent during the test."""
    seen: list[dict[str, object]] = []

    def receiver(sender, **details):
        seen.append({"sender": sender, **details})

    call_deduplicated.connect(receiver)
    yield seen
    call_deduplicated.disconnect(receiver)


def published(queue, name="celery") -> list[str]:
    """The task ids of the messages waiting in queue ``name``."""
    import json

    # kombu pushes on the left: the oldest message is last.
    raw = reversed(queue.lrange(name, 0, -1))
    return [json.loads(message)["headers"]["id"] for message in raw]


def holder(lock_id):
    return call_of(lock_status(lock_id).value)


def test_duplicate_delay_gets_the_pending_call_and_is_not_published(broker, announced):
    results = [tasks.finish_once.delay("a") for _ in range(10)]
    first = results[0].id
    assert {result.id for result in results} == {first}
    assert published(broker) == [first]
    assert holder(lock_id_for(tasks.finish_once, "a")) == ("queued", first)
    assert [(s["action"], s["task_id"], s["mode"]) for s in announced] == [
        ("joined", first, "until_finished")
    ] * 9
    assert {s["sender"].name for s in announced} == {tasks.finish_once.name}
    assert len({s["new_id"] for s in announced} | {first}) == 10


def test_distinct_arguments_are_distinct_calls(broker):
    ids = [tasks.finish_once.delay(key).id for key in ("a", "b", "c", "a", "b")]
    assert ids[3:] == ids[:2]
    assert published(broker) == ids[:3]


def test_every_spelling_of_a_call_is_one_call(broker):
    first = tasks.finish_once.delay("a", 0.3)
    assert tasks.finish_once.delay("a").id == first.id
    assert tasks.finish_once.apply_async(kwargs={"key": "a"}).id == first.id
    assert tasks.finish_once.s("a").delay().id == first.id
    assert published(broker) == [first.id]


def test_send_task_by_name_is_checked_too(broker):
    first = tasks.finish_once.delay("a")
    again = app.send_task("tests.tasks.finish_once", args=["a"])
    assert again.id == first.id
    assert published(broker) == [first.id]


def test_on_duplicate_raise_names_the_pending_call(broker, announced):
    first = tasks.finish_once_or_raise.delay("a")
    with pytest.raises(AlreadyQueued) as raised:
        tasks.finish_once_or_raise.delay("a")
    assert raised.value.task_id == first.id
    assert raised.value.lock_id == lock_id_for(tasks.finish_once_or_raise, "a")
    assert first.id in str(raised.value)
    copy = pickle.loads(pickle.dumps(raised.value))
    assert (copy.task_id, copy.lock_id, str(copy)) == (
        raised.value.task_id,
        raised.value.lock_id,
        str(raised.value),
    )
    assert published(broker) == [first.id]
    assert [s["action"] for s in announced] == ["raised"]


def test_on_duplicate_replace_sends_the_newer_call_in_the_older_ones_place(
    broker, announced
):
    first = tasks.latest_wins.delay("k", 1)
    second = tasks.latest_wins.delay("k", 2)
    assert second.id != first.id
    assert holder(lock_id_for(tasks.latest_wins, "k", 0)) == ("queued", second.id)
    assert published(broker) == [first.id, second.id]
    assert [(s["action"], s["task_id"], s["new_id"]) for s in announced] == [
        ("replaced", first.id, second.id)
    ]


def test_the_lock_lasts_the_countdown_plus_the_queue_allowance(broker, settings):
    settings.TASKLOCK = {**settings.TASKLOCK, "QUEUE_EXPIRE": 100}
    tasks.finish_once.apply_async(("a",), countdown=500)
    ttl = lock_status(lock_id_for(tasks.finish_once, "a")).ttl
    assert 598 <= ttl <= 600 + LONGER
    tasks.finish_once.delay("b")
    assert 98 <= lock_status(lock_id_for(tasks.finish_once, "b")).ttl <= 100 + LONGER


def test_a_failed_publish_leaves_no_lock(broker):
    dead = Redis().start()
    app.conf.broker_url = dead.url
    reset_publisher(app)
    dead.stop()
    lock_id = lock_id_for(tasks.finish_once, "a")
    try:
        with pytest.raises(OperationalError):
            tasks.finish_once.apply_async(("a",), retry=False)
        assert not lock_status(lock_id).held
    finally:
        app.conf.broker_url = os.environ["TASKLOCK_TEST_BROKER"]
        reset_publisher(app)
    # And the call goes out once the broker is back.
    sent = tasks.finish_once.delay("a")
    assert holder(lock_id) == ("queued", sent.id)
    assert published(broker) == [sent.id]


def test_a_message_nobody_consumes_frees_its_call_within_the_queue_allowance(
    broker, settings
):
    settings.TASKLOCK = {**settings.TASKLOCK, "QUEUE_EXPIRE": 2}
    lock_id = lock_id_for(tasks.finish_once, "lost")
    sent = tasks.finish_once.apply_async(("lost",), queue="nobody-consumes")
    assert holder(lock_id) == ("queued", sent.id)
    took = wait_until(lambda: not lock_status(lock_id).held, 10)
    assert took <= 2 + LONGER  # an end on the server's clock: up to 3 s late
    assert published(broker, "nobody-consumes") == [sent.id]
    assert tasks.finish_once.delay("lost").id != sent.id


def test_a_store_that_is_down_sends_nothing(broker, memcached, settings):
    # The restart below is this test's own doing: no grace after it.
    settings.TASKLOCK = {**settings.TASKLOCK, "RESTART_GRACE": 0}
    memcached.stop()
    try:
        with pytest.raises(LockBackendError):
            tasks.finish_once.delay("a")
    finally:
        memcached.start()
        # This thread's connections went with the old process: the next use
        # of the session's memcached (a later test's) must not meet them.
        from tests.helpers import close_connections

        close_connections()
    assert published(broker) == []
    sent = tasks.finish_once.delay("a")  # and once it is back, the call goes out
    assert published(broker) == [sent.id]


@pytest.mark.django_db(transaction=True)
def test_publish_on_commit_locks_at_commit_and_a_rollback_leaves_nothing(broker):
    lock_id = lock_id_for(tasks.finish_once, "a")
    with pytest.raises(RuntimeError), transaction.atomic():
        transaction.on_commit(lambda: tasks.finish_once.delay("a"))
        raise RuntimeError("rolled back")
    assert not lock_status(lock_id).held
    assert published(broker) == []
    with transaction.atomic():
        transaction.on_commit(lambda: tasks.finish_once.delay("a"))
        assert not lock_status(lock_id).held  # nothing before the commit
    assert holder(lock_id)[0] == "queued"
    assert len(published(broker)) == 1


def test_canvas_members_are_never_merged_into_another_call(broker):
    pending = tasks.finish_once.delay("a")
    in_chain = chain(tasks.finish_once.si("a"), tasks.add_one.s()).apply_async()
    in_group = group(tasks.finish_once.si("a"), tasks.finish_once.si("b")).apply_async()
    ids = published(broker)
    assert pending.id in ids
    assert in_chain.parent.id in ids, "the chain's first link was dropped"
    assert [r.id for r in in_group.results] == ids[-2:]
    # The free one was claimed by its group member.
    assert holder(lock_id_for(tasks.finish_once, "b")) == (
        "queued",
        in_group.results[1].id,
    )
    assert holder(lock_id_for(tasks.finish_once, "a")) == ("queued", pending.id)


def test_an_explicit_task_id_is_the_callers_and_is_sent(broker):
    pending = tasks.finish_once.delay("a")
    mine = tasks.finish_once.apply_async(("a",), task_id="my-own-id")
    assert mine.id == "my-own-id"
    assert published(broker) == [pending.id, "my-own-id"]


def test_coalesce_keeps_its_pending_call_beside_the_run_lock(broker):
    first = tasks.coalesced.delay("a")
    assert tasks.coalesced.delay("a").id == first.id
    lock_id = lock_id_for(tasks.coalesced, "a")
    assert holder(lock_id + QUEUE_SUFFIX) == ("queued", first.id)
    assert not lock_status(lock_id).held  # the run lock is the worker's
    assert published(broker) == [first.id]


def test_unknown_modes_and_policies_are_refused_at_decoration():
    from django_tasklock import single_instance

    with pytest.raises(ValueError, match="mode"):
        single_instance(mode="until_done")
    with pytest.raises(ValueError, match="on_duplicate"):
        single_instance(mode="until_finished", on_duplicate="drop")
    with pytest.raises(TypeError, match="limit="):
        single_instance(mode="coalesce", limit=2)


def _tasklock(*args: str) -> str:
    from io import StringIO

    from django.core.management import call_command

    out = StringIO()
    call_command("tasklock", *args, stdout=out)
    return out.getvalue()


def test_status_names_the_pending_call_and_release_needs_force(broker):
    import json

    from django.core.management import CommandError

    sent = tasks.finish_once.delay("a")
    text = _tasklock("status", "--task", "tests.tasks.finish_once", "a")
    assert f"Call:       queued, task id {sent.id}" in text
    assert "published and not started yet" in text
    data = json.loads(
        _tasklock("status", "--task", "tests.tasks.finish_once", "a", "--json")
    )
    assert data["call"] == {"state": "queued", "task_id": sent.id}
    with pytest.raises(CommandError, match="--force") as refused:
        _tasklock("release", "--task", "tests.tasks.finish_once", "a")
    message = str(refused.value)
    assert f"holds call {sent.id}, published and not started yet" in message
    assert "QUEUE_EXPIRE" in message and "unknown holder" not in message
    assert holder(lock_id_for(tasks.finish_once, "a")) == ("queued", sent.id)
    _tasklock("release", "--task", "tests.tasks.finish_once", "a", "--force")
    assert not lock_status(lock_id_for(tasks.finish_once, "a")).held


def test_status_of_a_coalesce_task_shows_its_pending_call_too(broker):
    sent = tasks.coalesced.delay("a")
    text = _tasklock("status", "--task", "tests.tasks.coalesced", "a")
    run_part, pending_part = text.split("\n\n")
    assert "Held:       no" in run_part
    assert QUEUE_SUFFIX in pending_part
    assert f"queued, task id {sent.id}" in pending_part


@pytest.mark.parametrize("kind", ["memcached", "redis"])
def test_a_publish_that_timed_out_on_a_paused_store_leaves_no_phantom_call(
    broker, settings, kind
):
    """The mark's write lands after the client gave up (SIGSTOP, then SIGCONT):
    nothing was sent, so the mark is removed once the store answers, and the
    same call made again is published instead of joining a call no broker saw."""
    from django_tasklock import orphans
    from tests.services import Memcached, stop_and_wait

    server = Memcached().start() if kind == "memcached" else Redis().start()
    if kind == "memcached":
        config = {
            "BACKEND": "django.core.cache.backends.memcached.PyMemcacheCache",
            "LOCATION": server.address,
            "OPTIONS": {"timeout": 0.5, "connect_timeout": 0.5},
        }
    else:
        config = {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": server.url,
            "OPTIONS": {"socket_timeout": 0.5, "socket_connect_timeout": 0.5},
        }
    settings.CACHES = {**settings.CACHES, "paused": config}
    settings.TASKLOCK = {"CACHE": "paused", "LOCK_EXPIRE": 60}
    lock_id = lock_id_for(tasks.finish_once, "phantom")
    try:
        warm = tasks.finish_once.delay("warm-up")  # connected, scripts loaded
        removed = orphans.removed_count()
        stop_and_wait(server.process.pid)
        try:
            with pytest.raises(LockBackendError, match="take the call's lock"):
                tasks.finish_once.delay("phantom")
        finally:
            server.process.send_signal(signal.SIGCONT)
        assert published(broker) == [warm.id]
        wait_until(lambda: orphans.removed_count() > removed, 10)
        assert not lock_status(lock_id).held
        again = tasks.finish_once.delay("phantom")
        assert published(broker) == [warm.id, again.id]
        assert holder(lock_id) == ("queued", again.id)
    finally:
        from tests.helpers import close_connections

        close_connections()
        server.stop()


def test_a_copy_of_a_call_running_on_another_host_is_sent_back_until_its_lock_expires(
    broker, caplog
):
    """That host's processes cannot be looked at from here, and this holder keeps
    no liveness record (an old token): the copy is neither run beside the first
    run nor dropped (lost, if that run died), but put back with a countdown."""
    import json

    from django.core.cache import caches

    call_id = "call-on-another-host"
    lock_id = lock_id_for(tasks.skip_duplicate, "remote")
    token = f"oid@elsewhere.example#{call_id}:4242:0123456789abcdef:1:0"
    caches["default"].set(lock_id, token, 30)
    assert lock_status(lock_id).owner.alive is None
    outcome = tasks.skip_duplicate.apply(args=("remote",), task_id=call_id)
    assert outcome.state == "IGNORED"
    assert lock_status(lock_id).value == token  # left alone
    [message] = broker.lrange("celery", 0, -1)
    headers = json.loads(message)["headers"]
    assert headers["id"] == call_id
    assert headers["eta"] is not None
    assert any("on another host" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("alive", [True, False])
def test_a_copy_of_a_call_running_on_another_host_is_judged_by_its_record(
    broker, alive
):
    """A run on another host that keeps a liveness record: alive, its copy is
    dropped (not put back); its record gone, its lock is taken and the copy
    runs."""
    from django.core.cache import caches

    from django_tasklock.backends import backend_for
    from django_tasklock.locks.liveness import record_id

    call_id = f"call-on-another-host-{alive}"
    lock_id = lock_id_for(tasks.skip_duplicate, f"remote-{alive}")
    process = "4242-100-abcdef12"
    token = f"oid@elsewhere.example#{call_id}:{process}-s:0123456789abcdef:1:0"
    caches["default"].set(lock_id, token, 30)
    if alive:  # its record beside its lock, as a live holder keeps it
        backend = backend_for("default")
        place = backend.record_place(backend.keys_for(lock_id)[0])
        backend.write_record(place, record_id("elsewhere.example", process), "1", 30)
    outcome = tasks.skip_duplicate.apply(args=(f"remote-{alive}",), task_id=call_id)
    assert broker.lrange("celery", 0, -1) == []  # not put back
    if alive:
        assert outcome.state == "IGNORED"
        assert lock_status(lock_id).value == token  # left alone
    else:
        assert outcome.state == "SUCCESS"
        assert not lock_status(lock_id).held  # taken, run, released


@pytest.mark.parametrize("option", ["link", "link_error"])
def test_a_call_with_links_and_no_task_id_is_never_merged(broker, option):
    """Its links belong to it: merged into the pending call, they would be
    lost without a word."""
    import base64
    import json

    pending_call = tasks.finish_once.delay("linked")
    linked = tasks.finish_once.apply_async(("linked",), **{option: tasks.add_one.s()})
    assert linked.id != pending_call.id
    assert published(broker) == [pending_call.id, linked.id]
    message = json.loads(broker.lrange("celery", 0, 0)[0])
    body = json.loads(base64.b64decode(message["body"]))
    embed = body[2]
    key = "callbacks" if option == "link" else "errbacks"
    assert [sig["task"] for sig in embed[key]] == ["tests.tasks.add_one"]
    assert holder(lock_id_for(tasks.finish_once, "linked")) == (
        "queued",
        pending_call.id,
    )


class _Unprintable(str):
    """An argument whose repr() raises; JSON sends it as the str it is."""

    def __repr__(self) -> str:
        raise LookupError("the row is gone")


def test_a_sent_call_is_reported_sent_whatever_its_arguments_repr_does(
    broker, settings
):
    settings.TASKLOCK = {"CACHE": "default", "LOCK_EXPIRE": 60, "LIVENESS": 3.0}
    result = tasks.finish_once.delay(_Unprintable("row-7"))
    assert published(broker) == [result.id]
    assert holder(lock_id_for(tasks.finish_once, "row-7")) == ("queued", result.id)
    # Its retry is a duplicate of the call it was told went out.
    assert tasks.finish_once.delay("row-7").id == result.id
