"""Each system check fires on its misconfiguration and stays quiet otherwise."""

from __future__ import annotations

import pytest
from django.core.checks import run_checks
from django.core.management import call_command
from django.core.management.base import SystemCheckError

from django_tasklock import Lock
from django_tasklock.checks import check_settings

MEMCACHED = "django.core.cache.backends.memcached.PyMemcacheCache"


def ids(settings=None):
    return [message.id for message in check_settings()]


def with_lock_cache(settings, config):
    settings.CACHES = {**settings.CACHES, "locks": config}
    settings.TASKLOCK = {"CACHE": "locks"}


def test_check_quiet_for_memcached_and_redis(settings):
    assert ids() == []
    settings.TASKLOCK = {
        "CACHE": "redis",
        "LOCK_EXPIRE": 30.5,
        "MEMCACHED_PROTOCOL": "meta",
    }
    assert ids() == []


def test_check_quiet_without_tasklock_setting(settings):
    del settings.TASKLOCK
    assert ids() == []


def test_check_registered_with_the_app(settings):
    settings.TASKLOCK = {"CACHE": "nope"}
    assert "django_tasklock.E003" in [m.id for m in run_checks(tags=["caches"])]
    with pytest.raises(SystemCheckError, match=r"django_tasklock\.E003"):
        call_command("check")


def test_e001_not_a_dict(settings):
    settings.TASKLOCK = "memcached"
    assert ids() == ["django_tasklock.E001"]


def test_e001_unknown_key(settings):
    settings.TASKLOCK = {"LOCK_EXPIRES": 60}
    [message] = check_settings()
    assert message.id == "django_tasklock.E001"
    assert "'LOCK_EXPIRES'" in message.msg and "LOCK_EXPIRE" in message.msg


@pytest.mark.parametrize("expire", [0, None, -1, 31 * 86400, "60", True])
def test_e002_bad_lock_expire(settings, expire):
    settings.TASKLOCK = {"LOCK_EXPIRE": expire}
    assert ids() == ["django_tasklock.E002"]


@pytest.mark.parametrize("alias", ["nope", "", 7])
def test_e003_bad_cache_alias(settings, alias):
    settings.TASKLOCK = {"CACHE": alias}
    assert ids() == ["django_tasklock.E003"]


@pytest.mark.parametrize(
    "backend",
    [
        "django.core.cache.backends.dummy.DummyCache",
        "django.core.cache.backends.filebased.FileBasedCache",
        "django.core.cache.backends.db.DatabaseCache",
        "tests.project.test_checks.HomeMadeCache",
    ],
)
def test_e004_backend_cannot_lock(settings, backend):
    with_lock_cache(settings, {"BACKEND": backend, "LOCATION": "x"})
    [message] = check_settings()
    assert message.id == "django_tasklock.E004"
    assert "PyMemcacheCache" in message.hint


def test_e005_noreply(settings):
    with_lock_cache(
        settings,
        {"BACKEND": MEMCACHED, "LOCATION": "x", "OPTIONS": {"default_noreply": True}},
    )
    assert ids() == ["django_tasklock.E005"]


def test_e006_ignore_exc(settings):
    with_lock_cache(
        settings,
        {"BACKEND": MEMCACHED, "LOCATION": "x", "OPTIONS": {"ignore_exc": True}},
    )
    assert ids() == ["django_tasklock.E006"]


def test_e005_e006_quiet_when_false(settings):
    options = {"default_noreply": False, "ignore_exc": False, "use_pooling": True}
    with_lock_cache(
        settings, {"BACKEND": MEMCACHED, "LOCATION": "x", "OPTIONS": options}
    )
    assert ids() == []


def test_e007_bad_protocol(settings):
    settings.TASKLOCK = {"MEMCACHED_PROTOCOL": "binary"}
    assert ids() == ["django_tasklock.E007"]


def test_w001_locmem(settings):
    settings.TASKLOCK = {"CACHE": "locmem"}
    [message] = check_settings()
    assert message.id == "django_tasklock.W001"
    assert message.is_serious() is False


def test_several_problems_reported_together(settings):
    settings.TASKLOCK = {"LOCK_EXPIRE": 0, "CACHE": "nope", "COLOUR": "red"}
    assert sorted(ids()) == [
        "django_tasklock.E001",
        "django_tasklock.E002",
        "django_tasklock.E003",
    ]


class HomeMadeCache:
    """A cache backend django_tasklock knows nothing about."""


@pytest.mark.parametrize(
    ("key", "value", "check_id"),
    [
        ("ON_CONTENTION", "queue", "django_tasklock.E008"),
        ("ON_CONTENTION", None, "django_tasklock.E008"),
        ("WAIT_TIMEOUT", 0, "django_tasklock.E009"),
        ("WAIT_TIMEOUT", "60", "django_tasklock.E009"),
        ("RETRY_COUNTDOWN", -1, "django_tasklock.E010"),
        ("RETRY_COUNTDOWN", float("inf"), "django_tasklock.E010"),
        ("RENEW", "yes", "django_tasklock.E011"),
        ("RENEW", 1, "django_tasklock.E011"),
        ("RENEW", None, "django_tasklock.E011"),
    ],
)
def test_e008_e011_decorator_defaults(settings, key, value, check_id):
    settings.TASKLOCK = {key: value}
    assert ids() == [check_id]


def test_decorator_defaults_quiet_when_valid(settings):
    settings.TASKLOCK = {
        "ON_CONTENTION": "wait",
        "WAIT_TIMEOUT": 5.5,
        "RETRY_COUNTDOWN": 0,
        "RENEW": True,
    }
    assert ids() == []


def test_using_the_app_without_installing_it_is_logged_once(settings, caplog):
    from django_tasklock.backends import _app_checked, close_thread_connections

    apps_without = [app for app in settings.INSTALLED_APPS if app != "django_tasklock"]
    settings.INSTALLED_APPS = apps_without
    _app_checked[0] = False
    close_thread_connections()  # a fresh backend lookup
    try:
        caplog.set_level("WARNING", "django_tasklock.backends")
        assert Lock("not-installed").acquire()
        assert Lock("not-installed-2").acquire()
        settings.CACHES = {**settings.CACHES}  # look the backend up again
        assert Lock("not-installed-3").acquire()
        warned = [r for r in caplog.records if "INSTALLED_APPS" in r.getMessage()]
        assert len(warned) == 1
    finally:
        _app_checked[0] = False
    # Installed: nothing said.
    settings.INSTALLED_APPS = [*apps_without, "django_tasklock"]
    caplog.clear()
    settings.CACHES = {**settings.CACHES}
    assert Lock("installed").acquire()
    assert not [r for r in caplog.records if "INSTALLED_APPS" in r.getMessage()]


@pytest.mark.parametrize(
    ("tasklock", "warned"),
    [
        ({"RESTART_GRACE": 2, "LIVENESS": 10}, True),
        ({"RESTART_GRACE": 0}, True),  # LIVENESS 10 by default
        ({"RESTART_GRACE": 10, "LIVENESS": 10}, False),
        ({"RESTART_GRACE": 2, "LIVENESS": None}, False),
        ({"LIVENESS": 30}, False),  # the grace is LIVENESS then
    ],
)
def test_a_restart_grace_shorter_than_liveness_is_warned_of(
    settings, memcached, tasklock, warned
):
    settings.TASKLOCK = {"CACHE": "default", **tasklock}
    found = [m for m in check_settings() if m.id == "django_tasklock.W005"]
    assert len(found) == int(warned), found
    if warned:
        assert "RESTART_GRACE" in found[0].msg and "LIVENESS" in found[0].hint
