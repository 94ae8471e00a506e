"""What django_tasklock reads of other packages' unpublished parts
(``django_tasklock.foreign``): each one read on the versions installed, and a
clear refusal where a release no longer has it. The matrix's ``oldest``
session runs this module on the oldest releases setup.cfg allows, without the
suite's conftest (whose helpers need newer clients): nothing here talks to a
server but the Redis its test starts, and a listener of its own."""

from __future__ import annotations

import asyncio
import socket
import sys
import time

import pytest
from django.core.cache import caches

from django_tasklock import LockConfigurationError, foreign


def test_djangos_redis_cache_client_and_its_serializer_round_trip():
    client = foreign.django_cache_client(caches["redis"])
    assert callable(client.get_client)
    serializer = foreign.redis_serializer(client)
    assert serializer.loads(serializer.dumps("a token")) == "a token"


@pytest.mark.parametrize("alias", ["default", "pylibmc"])
def test_djangos_memcached_client_class_and_options(alias):
    made, options = foreign.memcached_client_of(caches[alias])
    assert isinstance(made, type)
    client = made(caches[alias].client_servers, **options)
    try:
        if alias == "default":  # Django's defaults merged in for pymemcache
            assert options["default_noreply"] is False
    finally:
        client.disconnect_all() if alias == "pylibmc" else client.close()


def test_locmem_deadline_is_when_the_item_expires():
    cache = caches["locmem"]
    cache.set("foreign-deadline", 1, timeout=30)
    deadline = foreign.locmem_deadline(cache, cache.make_key("foreign-deadline"))
    assert deadline is not None and 25 < deadline - time.time() <= 30
    assert foreign.locmem_deadline(cache, cache.make_key("absent")) is None


def test_pymemcache_picks_a_keys_server_and_connects_it():
    from django.core.cache.backends.memcached import PyMemcacheCache

    pair = PyMemcacheCache(["127.0.0.1:1", "127.0.0.1:2"], {})
    made, options = foreign.memcached_client_of(pair)
    hash_client = made(pair.client_servers, **options)
    pick = foreign.memcached_server_picker(hash_client)
    servers = {pick(f"key-{n}").server for n in range(50)}
    assert len(servers) == 2  # both servers of the pair, by the keys' hashes
    with socket.socket() as listener:  # connecting is all that is asked
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        made_one, options = foreign.memcached_client_of(caches["default"])
        one = made_one([f"127.0.0.1:{listener.getsockname()[1]}"], **options)
        client = foreign.memcached_server_picker(one)("any")
        assert client.sock is None
        foreign.memcached_connect(client)
        assert client.sock is not None
        client.close()
    hash_client.close()


def test_redis_asyncio_connections_stream_writer():
    from redis.asyncio import Connection

    from tests.services import Redis

    server = Redis().start()  # (its own: the oldest session runs no conftest)

    async def scenario() -> tuple[object, object]:
        conn = Connection(host="127.0.0.1", port=server.port)
        await conn.connect()
        open_writer = foreign.stream_writer(conn)
        await conn.disconnect()
        return open_writer, foreign.stream_writer(conn)

    try:
        open_writer, closed = asyncio.run(scenario())
    finally:
        server.stop()
    assert isinstance(open_writer, asyncio.StreamWriter)
    assert closed is None


def test_django_valkeys_default_pickle_protocol():
    import pickle

    version = foreign.valkey_pickle_version(caches["cluster"].client)
    assert isinstance(version, int)
    assert pickle.loads(pickle.dumps("a token", version)) == "a token"
    # The very bytes the client itself writes for a token:
    assert caches["cluster"].client.encode("a token") == pickle.dumps(
        "a token", version
    )


def test_celerys_task_stack_and_an_autoretry_tasks_own_run():
    import celery._state
    from celery import Celery

    found = foreign.celery_task_stack(sys.modules[foreign.CELERY_STATE])
    assert found is not None
    storage, ident = found
    app = Celery("foreign", set_as_current=False)

    @app.task(bind=True, autoretry_for=(ValueError,))
    def retried(self):
        return "ran"

    @app.task
    def plain():
        return "ran"

    assert foreign.celery_original_run(plain) is None
    original = foreign.celery_original_run(retried)
    assert original is not None and original() == "ran"
    assert ident() not in storage
    celery._state._task_stack.push(plain)
    try:
        assert ident() in storage  # what is asked on every decorated call
    finally:
        celery._state._task_stack.pop()
    assert ident() not in storage


@pytest.mark.parametrize(
    "read",
    [
        foreign.django_cache_client,
        foreign.memcached_client_of,
        foreign.memcached_server_picker,
        foreign.memcached_connect,
        foreign.redis_serializer,
        foreign.stream_writer,
        foreign.valkey_pickle_version,
    ],
)
def test_a_part_a_release_no_longer_has_is_refused_by_name(read):
    with pytest.raises(
        LockConfigurationError, match=r"reads .+ of \S+, which \S+ \S+ does not have"
    ):
        read(object())


@pytest.mark.parametrize(
    "location",
    [
        "redis://127.0.0.1:1/0,redis://127.0.0.1:2/0",
        "redis://127.0.0.1:1/0;redis://127.0.0.1:2/0",
        ["redis://127.0.0.1:1/0", "redis://127.0.0.1:2/0"],
    ],
)
def test_a_redis_store_is_named_by_the_first_server_of_its_location(settings, location):
    """Read from the alias's LOCATION, as Django and django-redis split it,
    not from either cache's private list of servers."""
    from django_tasklock.backends.redis.backend import first_location

    backend = "django.core.cache.backends.redis.RedisCache"
    settings.CACHES = {
        **settings.CACHES,
        "two": {"BACKEND": backend, "LOCATION": location},
    }
    assert first_location("two") == "redis://127.0.0.1:1/0"
    assert caches["two"]._servers[0] == first_location("two")  # Django's own
