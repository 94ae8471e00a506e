"""Expiries and TASKLOCK values: validated, read on every use, arguments win."""

from __future__ import annotations

import math

import pytest

from django_tasklock import (
    InvalidLockExpire,
    Lock,
    LockConfigurationError,
    memcache_lock,
)
from django_tasklock.conf import MAX_EXPIRE
from tests.helpers import LONGER

BAD_EXPIRES = {
    "zero": 0,
    "negative": -1,
    "31-days": 31 * 24 * 3600,
    "string": "60",
    "true": True,
    "false": False,
    "nan": float("nan"),
    "inf": float("inf"),
    "list": [60],
}


@pytest.mark.parametrize("expire", BAD_EXPIRES.values(), ids=BAD_EXPIRES.keys())
def test_bad_expire_argument_rejected(expire):
    with pytest.raises(InvalidLockExpire, match="30 days"):
        Lock("x", expire=expire)
    with pytest.raises(InvalidLockExpire):
        memcache_lock("x", expire=expire)


@pytest.mark.parametrize("expire", BAD_EXPIRES.values(), ids=BAD_EXPIRES.keys())
def test_bad_expire_to_extend_rejected(any_store, expire):
    lock = Lock("x")
    lock.acquire()
    with pytest.raises(InvalidLockExpire):
        lock.extend(expire)
    assert lock.owned()
    lock.release()


@pytest.mark.parametrize("expire", [None, *BAD_EXPIRES.values()])
def test_bad_lock_expire_setting_refuses_to_lock(settings, expire):
    settings.TASKLOCK = {"LOCK_EXPIRE": expire}
    with pytest.raises(LockConfigurationError, match="LOCK_EXPIRE"):
        Lock("x").acquire()
    with pytest.raises(LockConfigurationError):
        memcache_lock("x").__enter__()


def test_none_expire_setting_says_why(settings):
    settings.TASKLOCK = {"LOCK_EXPIRE": None}
    with pytest.raises(LockConfigurationError, match="stay held forever after a crash"):
        Lock("x").acquire()


@pytest.mark.parametrize("expire", [1, 0.5, 59.9, MAX_EXPIRE])
def test_good_expires_accepted(any_store, expire):
    lock = Lock("ok", expire=expire)
    # Blocking: a take answered after its sure life is refused and tried
    # again, and on a starved machine (two CPU hogs beside the suite) the
    # first two of a 0.5 s lock were.
    assert lock.acquire(blocking=True, timeout=30)
    ttl = lock.ttl()
    if ttl is None:
        # memcached's clock ticks once a second: a lock it is sure to keep for
        # less than one may be gone already (and only such a lock).
        assert lock.acquisition.life < 1
    else:
        # memcached counts whole seconds and rounds a fraction up.
        assert 0 < ttl <= math.ceil(expire) + LONGER
    if lock.acquisition.life >= 1:
        assert lock.release()
    else:
        # A lock memcached is sure to keep for less than a second (its clock
        # ticks once a second) may be gone by now: then the release says so.
        assert lock.release() or lock.lost


def test_setting_read_on_every_use(settings, any_store):
    settings.TASKLOCK = {**any_store.tasklock, "LOCK_EXPIRE": 100}
    lock = Lock("reread")
    assert lock.expire == 100
    settings.TASKLOCK = {**any_store.tasklock, "LOCK_EXPIRE": 200}
    assert lock.expire == 200
    lock.acquire()
    ttl = lock.ttl()
    assert ttl is not None and 150 < ttl <= 200 + LONGER
    lock.release()


def test_acquire_sees_every_kind_of_settings_change(settings, any_store):
    """acquire() reuses the TASKLOCK values it read last while they are the
    same objects; each way of changing them is seen at the next acquire."""
    from django.conf import settings as django_settings
    from django.test import override_settings

    def acquired_ttl() -> float:
        lock = Lock("changes")
        assert lock.acquire()
        ttl = lock.ttl()
        assert lock.release()
        assert ttl is not None
        return ttl

    settings.TASKLOCK = {**any_store.tasklock, "LOCK_EXPIRE": 100}
    assert 50 < acquired_ttl() <= 100 + LONGER
    # Assigned straight to django.conf.settings (no setting_changed signal).
    django_settings.TASKLOCK = {**any_store.tasklock, "LOCK_EXPIRE": 300}
    assert 250 < acquired_ttl() <= 300 + LONGER
    with override_settings(TASKLOCK={**any_store.tasklock, "LOCK_EXPIRE": 20}):
        assert acquired_ttl() <= 20 + LONGER
    assert 250 < acquired_ttl() <= 300 + LONGER
    # Changed inside the same dict: seen, and validated.
    django_settings.TASKLOCK["LOCK_EXPIRE"] = 500
    assert 450 < acquired_ttl() <= 500 + LONGER
    django_settings.TASKLOCK["LOCK_EXPIRE"] = -1
    with pytest.raises(LockConfigurationError, match="LOCK_EXPIRE"):
        Lock("changes").acquire()
    # An equal value of the wrong type is not taken for the valid one.
    django_settings.TASKLOCK["LOCK_EXPIRE"] = 500
    django_settings.TASKLOCK["RENEW"] = False
    assert acquired_ttl() > 450
    django_settings.TASKLOCK["RENEW"] = 0
    with pytest.raises(LockConfigurationError, match="RENEW"):
        Lock("changes").acquire()
    del django_settings.TASKLOCK
    assert Lock("changes").expire == 600  # LOCK_EXPIRE's default


def test_argument_beats_setting(settings, any_store):
    settings.TASKLOCK = {**any_store.tasklock, "LOCK_EXPIRE": 500}
    lock = Lock("arg", expire=20)
    lock.acquire()
    ttl = lock.ttl()
    assert ttl is not None and ttl <= 20 + LONGER
    lock.release()


def test_cache_argument_beats_setting(settings, memcached):
    settings.TASKLOCK = {"CACHE": "default"}
    lock = Lock("where", cache="redis")
    lock.acquire()
    from django.core.cache import caches

    assert caches["redis"].get("where") == lock.token
    assert caches["default"].get("where") is None
    lock.release()


def test_missing_cache_alias_refuses_to_lock(settings):
    settings.TASKLOCK = {"CACHE": "nope"}
    with pytest.raises(LockConfigurationError, match="'nope', which is not in CACHES"):
        Lock("x").acquire()


@pytest.mark.parametrize(
    ("backend", "reason"),
    [
        ("django.core.cache.backends.dummy.DummyCache", "stores nothing"),
        ("django.core.cache.backends.filebased.FileBasedCache", "checks for the file"),
        ("django.core.cache.backends.db.DatabaseCache", "SELECT and then an UPDATE"),
    ],
)
def test_unsafe_backend_refuses_to_lock(settings, tmp_path, backend, reason):
    settings.CACHES = {
        **settings.CACHES,
        "unsafe": {"BACKEND": backend, "LOCATION": str(tmp_path)},
    }
    settings.TASKLOCK = {"CACHE": "unsafe"}
    ran = []
    with pytest.raises(LockConfigurationError, match=reason):
        with memcache_lock("x"):
            ran.append(True)
    assert ran == []


def test_tasklock_not_a_dict_refuses_to_lock(settings):
    settings.TASKLOCK = ["LOCK_EXPIRE", 60]
    with pytest.raises(LockConfigurationError, match="must be a dict"):
        Lock("x").acquire()


def test_bad_protocol_setting_refuses_to_lock(settings):
    settings.TASKLOCK = {"MEMCACHED_PROTOCOL": "binary"}
    with pytest.raises(LockConfigurationError, match="auto, meta, classic"):
        Lock("x").acquire()


@pytest.mark.parametrize("bad", ["", 3])
def test_bad_cache_argument_rejected(bad):
    with pytest.raises(TypeError, match="name of a CACHES entry"):
        Lock("x", cache=bad)
