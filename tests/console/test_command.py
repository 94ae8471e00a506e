"""``manage.py tasklock``: status, release and key, and their errors."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from django.core.cache import caches
from django.core.management import CommandError, call_command

from django_tasklock import Lock, lock_id_for
from django_tasklock.status import Owner, lock_status, remove
from tests import tasks
from tests.helpers import LONGER
from tests.processes import process_context
from tests.services import ROOT, free_port
from tests.workers import crashing_holder

HOST = socket.gethostname()


def run(*args: str) -> str:
    from io import StringIO

    out = StringIO()
    call_command("tasklock", *args, stdout=out)
    return out.getvalue()


def fields(output: str) -> dict[str, str]:
    return {
        label.strip(): value.strip()
        for label, _, value in (line.partition(":") for line in output.splitlines())
    }


# -- key ---------------------------------------------------------------------------


def test_key_prints_the_lock_id_a_call_uses():
    url = "https://example.com/a.xml"
    expected = lock_id_for(tasks.import_feed, url)
    assert run("key", "--task", "tests.tasks.import_feed", url).strip() == expected
    # JSON where it parses: 0.3 is the number, as a worker would receive it.
    with_seconds = lock_id_for(tasks.import_feed, url, seconds=0.3)
    assert with_seconds == expected  # seconds=0.3 is the default
    other = run("key", "--task", "tests.tasks.import_feed", url, "--kwarg", "seconds=1")
    assert other.strip() == lock_id_for(tasks.import_feed, url, seconds=1)
    assert other.strip() != expected


def test_key_json_string_argument_stays_a_string():
    task = "tests.tasks.import_feed"
    as_number = run("key", "--task", task, "u", "--kwarg", "tag=42").strip()
    as_string = run("key", "--task", task, "u", "--kwarg", 'tag="42"').strip()
    as_word = run("key", "--task", task, "u", "--kwarg", "tag=forty-two").strip()
    assert as_number == lock_id_for(tasks.import_feed, "u", tag=42)
    assert as_string == lock_id_for(tasks.import_feed, "u", tag="42")
    assert as_word == lock_id_for(tasks.import_feed, "u", tag="forty-two")
    assert as_number != as_string


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["key"], "needs --task"),
        (["key", "--task", "no.such.task"], "No task 'no.such.task'"),
        (["key", "--task", "os.path.join", "a"], "not decorated with @single_instance"),
        (["key", "--task", "tests.tasks.import_feed"], "Arguments do not fit"),
        (
            ["key", "--task", "tests.tasks.import_feed", "u", "--kwarg", "x"],
            "NAME=VALUE",
        ),
        (["status"], "one lock id"),
        (["status", "a", "b"], "one lock id"),
    ],
)
def test_bad_invocations_say_what_to_do(args, match):
    with pytest.raises(CommandError, match=match):
        run(*args)


# -- status ------------------------------------------------------------------------


def test_status_of_a_free_lock_prints_it_and_exits_1(store):
    from io import StringIO

    out = StringIO()
    with pytest.raises(CommandError, match="'free-lock' is not held") as free:
        call_command("tasklock", "status", "free-lock", stdout=out)
    assert free.value.returncode == 1
    shown = fields(out.getvalue())
    assert shown["Lock"] == "free-lock"
    assert shown["Held"] == "no"
    assert shown["Last fence"] == (
        "none (no fencing counter: no fence was drawn, or it expired)"
    )


def test_status_of_a_held_lock(store):
    lock = Lock("held-lock", expire=60, oid="celery-oid")
    sent = time.monotonic()
    assert lock.acquire()
    assert fields(run("status", "held-lock"))["Last fence"].startswith("none")
    fence = lock.fence  # drawn when read
    shown = fields(run("status", "held-lock"))
    assert shown["Held"] == "yes"
    assert shown["Owner"] == lock.token
    pid = os.getpid()
    assert shown["Holder"] == f"process {pid} on {HOST} (alive: process {pid} runs)"
    seconds = int(shown["Expires"].removeprefix("in ").removesuffix("s"))
    # What is left: 60 s less the time since the take was sent (two status
    # runs and a fence on the way; 5 s beside two CPU hogs), less a second
    # of the store's rounding down.
    assert 60 - (time.monotonic() - sent) - 1 <= seconds <= 60 + LONGER
    assert shown["Last fence"] == str(fence)
    assert lock.release()


def test_status_by_task_and_json(store):
    url = "https://example.com/status.xml"
    lock = Lock(lock_id_for(tasks.import_feed, url), expire=30)
    assert lock.acquire()
    assert lock.fence is not None
    data = json.loads(run("status", "--json", "--task", "tests.tasks.import_feed", url))
    assert data["lock_id"] == lock.lock_id
    assert data["held"] is True and data["stale"] is False
    assert data["owner"] == lock.token
    assert data["holder"] == {
        "name": HOST,
        "host": HOST,
        "pid": os.getpid(),
        "alive": True,
        "why": f"process {os.getpid()} runs",
    }
    assert 0 < data["ttl"] <= 30 + LONGER and data["never_expires"] is False
    assert data["fence"] == lock.fence
    assert lock.release()


def test_status_of_a_value_other_code_stored(store):
    caches[store.alias].set("recipe-lock", "celery-oid-1234", None)
    shown = fields(run("status", "recipe-lock"))
    assert shown["Owner"] == "celery-oid-1234"
    assert "not a django_tasklock token" in shown["Holder"]
    assert shown["Expires"].startswith("never")


def test_status_store_down_is_a_clear_error(settings):
    port = free_port()
    settings.CACHES = {
        **settings.CACHES,
        "down": {
            "BACKEND": "django.core.cache.backends.memcached.PyMemcacheCache",
            "LOCATION": f"127.0.0.1:{port}",
        },
    }
    with pytest.raises(
        CommandError, match=f"Could not read the lock.*127.0.0.1:{port}"
    ):
        run("status", "any", "--cache", "down")


def test_unknown_cache_alias_is_a_clear_error():
    with pytest.raises(CommandError, match="not in CACHES"):
        run("status", "any", "--cache", "nope")


# -- release -----------------------------------------------------------------------


def test_release_of_a_free_lock_is_an_error(store):
    with pytest.raises(CommandError, match="is not held; nothing to release"):
        run("release", "free-lock")


def test_release_refuses_a_live_holder_without_force(store):
    lock = Lock("live", expire=60)
    assert lock.acquire()
    with pytest.raises(CommandError, match=r"may still be running.*--force"):
        run("release", "live")
    assert lock.owned(), "released a live holder's lock without --force"
    out = run("release", "live", "--force")
    assert "Released lock 'live'" in out and "forced" in out
    assert not lock.locked()
    # The holder learns it: release reports the loss and leaves others alone.
    thief = Lock("live")
    assert thief.acquire()
    assert lock.release() is False and lock.lost
    assert thief.owned()
    assert thief.release()


def test_release_clears_a_crashed_holders_lock_without_force(store):
    process = process_context().Process(
        target=crashing_holder, args=(store.tasklock, "crashed")
    )
    process.start()
    process.join(120)  # a spawned Django on a fully loaded machine is slow to start
    assert process.exitcode == 1
    shown = fields(run("status", "crashed"))
    pid = process.pid
    assert shown["Holder"] == f"process {pid} on {HOST} (dead: process {pid} is gone)"
    out = run("release", "crashed")
    assert "stale: its holder is gone" in out
    assert Lock("crashed").acquire()


def test_release_removes_only_the_item_it_judged_stale(store):
    process = process_context().Process(
        target=crashing_holder, args=(store.tasklock, "handover")
    )
    process.start()
    process.join(120)  # a spawned Django on a fully loaded machine is slow to start
    judged = lock_status("handover")
    assert judged.stale
    # Between the read and the removal the stale lock expires (deleted here, as
    # its expiry would) and a live worker takes the id.
    caches[store.alias].delete("handover")
    live = Lock("handover")
    assert live.acquire()
    assert remove(judged) is False, "removed a live holder's lock"
    assert live.owned()
    # Read afresh, the command sees the live holder and leaves it alone.
    with pytest.raises(CommandError, match="may still be running"):
        run("release", "handover")
    assert live.release()


@pytest.mark.parametrize("protocol", ["meta", "classic"])
def test_forced_removal_on_memcached_spares_a_newer_item_with_the_same_value(
    settings, protocol
):
    # The recipe stores one value ("true", its oid) every time: only the item's
    # CAS id tells the lock that was read from the one taken since.
    settings.TASKLOCK = {"CACHE": "default", "MEMCACHED_PROTOCOL": protocol}
    cache = caches["default"]
    assert cache.add("recipe", "true", 60)
    judged = lock_status("recipe")
    cache.delete("recipe")
    assert cache.add("recipe", "true", 60)
    assert remove(judged) is False
    assert cache.get("recipe") == "true"
    assert remove(lock_status("recipe")) is True
    assert cache.get("recipe") is None


def test_release_refuses_other_code_values_without_force(store):
    caches[store.alias].set("recipe", "celery-oid", 60)
    with pytest.raises(
        CommandError, match="not a django_tasklock token: no process to look at"
    ):
        run("release", "recipe")
    assert "forced" in run("release", "recipe", "--force")
    assert caches[store.alias].get("recipe") is None


def test_owner_parse_rejects_foreign_values():
    assert Owner.parse("celery-oid") is None
    assert Owner.parse(b"bytes") is None
    assert Owner.parse("a:b:c:d:e") is None
    owner = Owner.parse(f"oid:with:colons@{HOST}:{os.getpid()}:ab12:140:7")
    assert owner is not None
    assert (owner.name, owner.host, owner.alive) == (
        f"oid:with:colons@{HOST}",
        HOST,
        True,
    )


def test_manage_py_finds_the_example_projects_celery_task(memcached):
    """Through the real manage.py: a task name the project's Celery app knows."""
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "example_project.settings",
        "EXAMPLE_LOCK_STORE": f"memcached://{memcached.address}",
    }
    task = "example_project.feeds.tasks.import_feed_single"
    url = "https://example.com/feed.xml"

    def manage(*args: str) -> str:
        result = subprocess.run(
            [sys.executable, "manage.py", "tasklock", *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == (1 if args[0] == "status" else 0), result.stderr
        return result.stdout + result.stderr

    from example_project.feeds.tasks import import_feed_single

    assert manage("key", "--task", task, url).strip() == lock_id_for(
        import_feed_single, url
    )
    shown = manage("status", "--task", task, url)  # free: exit status 1
    assert "Held:       no" in shown and "CommandError" not in shown, shown
