"""@single_instance: lock ids, argument rules, contention modes, pass-through."""

from __future__ import annotations

import datetime
import decimal
import hashlib
import inspect
import json
import logging
import threading
import time
import uuid

import pytest
from django.core.serializers.json import DjangoJSONEncoder

from django_tasklock import (
    Lock,
    LockNotAcquired,
    current_lock,
    lock_id_for,
    single_instance,
)
from django_tasklock.exceptions import InvalidLockExpire
from tests.helpers import in_thread


@single_instance
def combine(a, b=2, *rest, c=None, **extra):
    return ("ran", a, b, rest, c, extra)


def plain_id(function, *args, **kwargs):
    return lock_id_for(function, *args, **kwargs)


# -- lock ids -----------------------------------------------------------------------


def test_lock_id_shape_for_plain_function():
    digest = plain_id(combine, 1).rsplit("-lock-", 1)
    assert digest[0] == "tests.integrations.test_decorator.combine"
    assert len(digest[1]) == 32
    int(digest[1], 16)


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((1,), {}),
        ((1, 2), {}),
        ((1,), {"b": 2}),
        ((), {"a": 1, "b": 2}),
        ((), {"b": 2, "a": 1}),
    ],
)
def test_equivalent_spellings_share_one_lock(args, kwargs):
    assert plain_id(combine, *args, **kwargs) == plain_id(combine, 1, 2)


def test_different_values_get_different_locks():
    ids = {plain_id(combine, 1), plain_id(combine, 2), plain_id(combine, 1, 3)}
    ids |= {
        plain_id(combine, 1, c=1),
        plain_id(combine, 1, d=1),
        plain_id(combine, "1"),
    }
    assert len(ids) == 6


def test_tuples_and_lists_and_dict_order_alike():
    assert plain_id(combine, (1, 2), {"x": 1, "y": 2}) == plain_id(
        combine, [1, 2], {"y": 2, "x": 1}
    )


RICH = {
    "uuid": uuid.UUID("12345678-1234-5678-1234-567812345678"),
    "when": datetime.datetime(
        2026, 11, 22, 10, 0, 0, 123456, tzinfo=datetime.timezone.utc
    ),
    "day": datetime.date(2026, 11, 22),
    "price": decimal.Decimal("10.50"),
    "nested": ({"b": [1, (2, 3)], "a": None}, 1.5, True),
}


def test_key_survives_json_round_trips():
    """The worker sees arguments after JSON; the key must not change."""
    from kombu.utils.json import dumps, loads

    before = plain_id(combine, RICH, b=RICH["nested"], c=RICH["uuid"])
    kombu_args = loads(dumps([RICH, RICH["nested"], RICH["uuid"]]))
    assert plain_id(combine, kombu_args[0], b=kombu_args[1], c=kombu_args[2]) == before
    plain = json.loads(json.dumps({"nested": RICH["nested"]}, cls=DjangoJSONEncoder))
    assert plain_id(combine, 1, plain["nested"]) == plain_id(combine, 1, RICH["nested"])


@pytest.mark.parametrize("value", [{1, 2}, object(), b"bytes", float("nan")])
def test_unserialisable_argument_rejected_before_body(value):
    calls = []

    @single_instance
    def body(first, awkward):
        calls.append(1)

    with pytest.raises(TypeError, match="argument 'awkward'"):
        body(1, value)
    assert calls == []


def test_bound_arguments_checked_like_a_call():
    with pytest.raises(TypeError, match="missing a required argument"):
        combine()


# -- key= ---------------------------------------------------------------------------


def test_key_single_str_argument_is_the_cookbook_lock_id():
    @single_instance(key="feed_url")
    def import_feed(feed_url, force=False):
        return feed_url

    url = "https://example.com/feed.xml"
    cookbook = (
        f"{import_feed._tasklock_name}-lock-{hashlib.md5(url.encode()).hexdigest()}"
    )
    assert plain_id(import_feed, url) == cookbook
    assert plain_id(import_feed, url, force=True) == cookbook


def test_key_list_ignores_other_arguments():
    @single_instance(key=["a", "b"])
    def f(a, b, noise=None):
        return a

    assert plain_id(f, 1, 2, noise=1) == plain_id(f, 1, 2, noise=2)
    assert plain_id(f, 1, 2) != plain_id(f, 1, 3)


def test_key_non_str_single_argument_is_hashed_canonically():
    @single_instance(key="ids")
    def f(ids):
        return ids

    assert plain_id(f, (1, 2)) == plain_id(f, [1, 2])
    assert plain_id(f, [1, 2]) != plain_id(f, [2, 1])


def test_key_name_ids_follow_the_value_as_the_worker_receives_it():
    @single_instance(key="value")
    def f(value):
        return value

    # One id for a str and the non-str value JSON writes as that text: the
    # cookbook's ids stay as they were (documented in README).
    assert plain_id(f, 1) == plain_id(f, "1")
    assert plain_id(f, None) == plain_id(f, "null")
    # A UUID (datetime, Decimal...) and its string are one value too.
    ident = uuid.uuid4()
    assert plain_id(f, ident) == plain_id(f, str(ident))
    moment = datetime.datetime(
        2026, 11, 22, 17, 5, 13, 123456, tzinfo=datetime.timezone.utc
    )
    assert plain_id(f, moment) == plain_id(f, "2026-11-22T17:05:13.123456Z")
    # Values of other types never collide with one another.
    values = [1, 1.5, True, False, None, 0, [1], [1, 2], {"a": 1}, {"a": "1"}, ""]
    ids = {plain_id(f, value) for value in values}
    assert len(ids) == len(values)


def test_default_key_keeps_types_apart():
    @single_instance
    def f(value):
        return value

    assert plain_id(f, 1) != plain_id(f, "1")
    assert plain_id(f, None) != plain_id(f, "null")
    assert plain_id(f, True) != plain_id(f, "true") != plain_id(f, 1)


def test_key_callable():
    @single_instance(key=lambda account, **rest: f"account:{account.lower()}")
    def sync(account, full=False):
        return account

    assert plain_id(sync, "ACME") == plain_id(sync, "acme", full=True)
    md5 = hashlib.md5(b"account:acme").hexdigest()
    assert plain_id(sync, "Acme").endswith(md5)


def test_key_callable_must_return_str():
    @single_instance(key=lambda account: 42)
    def sync(account):
        return account

    with pytest.raises(TypeError, match="returned int, not str"):
        sync("a")


@pytest.mark.parametrize("key", ["nope", ["a", "nope"]])
def test_key_unknown_argument_rejected_at_decoration(key):
    with pytest.raises(ValueError, match="'nope', which is not an argument"):

        @single_instance(key=key)
        def f(a):
            return a


@pytest.mark.parametrize("key", [3, [], [1], {"a"}])
def test_key_bad_type_rejected_at_decoration(key):
    with pytest.raises(TypeError, match="key= must be"):

        @single_instance(key=key)
        def f(a):
            return a


# -- options ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"expire": 0}, InvalidLockExpire, "30 days"),
        ({"expire": "60"}, InvalidLockExpire, "30 days"),
        ({"on_contention": "queue"}, ValueError, "skip, raise, retry, wait"),
        ({"timeout": -1}, ValueError, "greater than 0"),
        ({"countdown": -1}, ValueError, "0 or more"),
        ({"on_timeout": "retry"}, ValueError, "skip, raise"),
        ({"renew": "yes"}, ValueError, "True or False"),
        ({"max_hold": 0}, ValueError, "max_hold"),
        ({"on_lost": "ignore"}, ValueError, "warn, raise"),
    ],
)
def test_bad_options_rejected_at_decoration(options, error, match):
    with pytest.raises(error, match=match):
        single_instance(**options)


def test_retry_on_function_without_self_rejected_at_decoration():
    with pytest.raises(TypeError, match="needs a bound Celery task"):

        @single_instance(on_contention="retry")
        def no_self():
            return 1


def test_retry_on_plain_function_call_rejected(any_store):
    @single_instance(on_contention="retry")
    def looks_bound(self, x):
        return x

    with Lock(plain_id(looks_bound, None, 1)):
        with pytest.raises(TypeError, match="runs without one"):
            looks_bound(None, 1)


@pytest.mark.parametrize("where", ["option", "setting"])
def test_retry_without_a_task_refused_on_first_call_with_the_lock_free(
    any_store, settings, where
):
    """A first parameter that is not 'self' passes decoration; the first call
    is refused before any lock is taken, not when a duplicate meets one."""
    ran = []
    if where == "setting":
        settings.TASKLOCK = {**any_store.tasklock, "ON_CONTENTION": "retry"}
        decorate = single_instance
    else:
        decorate = single_instance(on_contention="retry")

    @decorate
    def refresh(feed_url):
        ran.append(feed_url)

    with pytest.raises(TypeError, match=r"needs a bound Celery task.*would be lost"):
        refresh("https://a.example/")
    assert ran == []
    assert not Lock(plain_id(refresh, "https://a.example/")).locked()


def test_positional_non_callable_rejected():
    with pytest.raises(TypeError, match="keyword options only"):
        single_instance("feed_url")


# -- contention modes -------------------------------------------------------------


def test_skip_returns_none_and_logs(any_store, caplog):
    calls = []

    @single_instance
    def job(x):
        calls.append(x)
        return "ran"

    with Lock(plain_id(job, 1)), caplog.at_level(logging.INFO, "django_tasklock"):
        assert job(1) is None
    assert calls == []
    assert "Skipped tests.integrations.test_decorator" in caplog.text
    assert plain_id(job, 1) in caplog.text
    assert job(1) == "ran"
    assert calls == [1]


def test_skip_setting_default_can_be_raise(any_store, settings):
    settings.TASKLOCK = {**any_store.tasklock, "ON_CONTENTION": "raise"}

    @single_instance
    def job(x):
        return x

    with Lock(plain_id(job, 1)), pytest.raises(LockNotAcquired):
        job(1)


def test_raise(any_store):
    @single_instance(on_contention="raise")
    def job(x):
        return x

    with (
        Lock(plain_id(job, 1)),
        pytest.raises(LockNotAcquired, match="held by another"),
    ):
        job(1)
    assert job(1) == 1


def test_wait_gets_the_lock_when_released(any_store):
    @single_instance(on_contention="wait", timeout=10)
    def job(x):
        return ("ran", Lock(plain_id(job, x)).locked())

    holder = Lock(plain_id(job, 1))
    holder.acquire()
    started = time.monotonic()

    def release_later():
        time.sleep(0.3)
        holder.release()

    thread = threading.Thread(target=lambda: in_thread(release_later))
    thread.start()
    assert job(1) == ("ran", True)
    assert time.monotonic() - started >= 0.25
    thread.join()


@pytest.mark.parametrize(
    ("on_timeout", "outcome"), [("skip", None), ("raise", LockNotAcquired)]
)
def test_wait_timeout_then_skip_or_raise(any_store, on_timeout, outcome):
    @single_instance(on_contention="wait", timeout=0.3, on_timeout=on_timeout)
    def job(x):
        return "ran"

    with Lock(plain_id(job, 1)):
        started = time.monotonic()
        if outcome is None:
            assert job(1) is None
        else:
            with pytest.raises(outcome):
                job(1)
        assert 0.25 <= time.monotonic() - started < 3


def test_different_arguments_do_not_contend(any_store):
    @single_instance(on_contention="raise")
    def job(x):
        return x

    with Lock(plain_id(job, 1)):
        assert job(2) == 2


# -- pass-through -------------------------------------------------------------------


def test_return_value_exception_and_release(any_store):
    @single_instance
    def job(x):
        if x == "boom":
            raise ValueError("the body's own error")
        return {"x": x}

    assert job(1) == {"x": 1}
    with pytest.raises(ValueError, match="the body's own error"):
        job("boom")
    assert not Lock(plain_id(job, "boom")).locked()
    assert not Lock(plain_id(job, 1)).locked()


def test_lock_held_while_body_runs(any_store):
    @single_instance
    def job(x):
        return Lock(plain_id(job, x)).locked()

    assert job(5) is True


def test_metadata_and_signature_kept():
    def original(feed_url: str, force: bool = False) -> str:
        """Import one feed."""
        return feed_url

    decorated = single_instance(original)
    assert decorated.__name__ == "original"
    assert decorated.__doc__ == "Import one feed."
    assert decorated.__wrapped__ is original
    assert inspect.signature(decorated) == inspect.signature(original)
    assert inspect.getfullargspec(decorated).args == ["feed_url", "force"]


def test_plain_function_body_gets_its_renewing_lock_and_fence(settings):
    settings.TASKLOCK = {"CACHE": "default", "RENEW": True}
    seen = []

    @single_instance(expire=3)
    def work(n):
        lock = current_lock()
        seen.append((lock.lock_id, lock.renewing, lock.fence))
        return n

    assert work(1) == 1 and work(1) == 1
    (first_id, renewing, first_fence), (second_id, _, second_fence) = seen
    assert renewing and first_id == second_id
    assert second_fence > first_fence
    assert current_lock() is None


@pytest.mark.parametrize("decorator", ["single_instance", "rate_limited"])
@pytest.mark.parametrize("made_by", ["task", "proxy"])
def test_a_lock_decorator_above_the_task_decorator_is_refused_at_once(
    decorator, made_by
):
    """Above ``@app.task`` (a Task, or the proxy of one that ``@shared_task``
    and a lazy app hand out) the decorator would wrap the task object and
    lose ``.delay()``: refused at decoration, saying where it goes, without
    building the proxied task (which would finalize its app at import time).
    (Apps of the test's own: ``@shared_task`` would add the task to every app
    made after it, other tests' too.)"""
    from celery import Celery

    from django_tasklock import rate_limited

    def body(self, url):
        return url

    app = Celery(f"above-{made_by}-{decorator}", set_as_current=False)
    lazy = made_by == "proxy"
    task = app.task(bind=True, lazy=lazy, name=f"{app.main}.above")(body)
    assert not app.finalized
    lock = single_instance(key="url") if decorator == "single_instance" else None
    wrap = lock or rate_limited("10/m")
    with pytest.raises(TypeError, match=f"Put @{decorator} under @shared_task"):
        wrap(task)
    assert not app.finalized, "the proxy was evaluated"
    # Under it, as documented, it works.
    under = Celery(f"under-{made_by}-{decorator}", set_as_current=False)
    assert under.task(bind=True, lazy=False, name=f"{under.main}.under")(wrap(body))
