"""Lock ids become the very keys cache.add() uses, and hostile ids stay harmless."""

from __future__ import annotations

import pytest
from django.core.cache import caches
from pymemcache.client.base import Client

from django_tasklock import Lock
from django_tasklock.keys import HASHED_PREFIX, memcached_key

HOSTILE_IDS = {
    "space": "feeds import-lock with spaces",
    "newline": "line\nbreak",
    "crlf-injection": "x 0 0 1\r\nflush_all\r\nset victim 0 0 1\r\nz",
    "meta-injection": "k\r\nmd sentinel\r\nmg k",
    "nul": "nul\x00byte",
    "tab-and-del": "tab\tdel\x7f",
    "unicode": "импорт-ленты-✓-フィード",
    "unicode-whitespace": "no-break\u00a0space\u2028line",
    "lone-surrogate": "bad\udcffsurrogate",
    "10kB": "x" * 10_000,
    "250-bytes-of-2-byte-chars": "é" * 125,
    "emoji": "🔒" * 70,
}


@pytest.fixture
def sentinel(store):
    """A key other code owns; no lock id may touch it."""
    cache = caches[store.alias]
    cache.set("sentinel", "keep me", 300)
    cache.set("victim", "keep me too", 300)
    yield
    assert cache.get("sentinel") == "keep me"
    assert cache.get("victim") == "keep me too"


@pytest.mark.parametrize("lock_id", HOSTILE_IDS.values(), ids=HOSTILE_IDS.keys())
@pytest.mark.usefixtures("sentinel")
def test_hostile_id_locks_and_injects_nothing(store, lock_id):
    holder = Lock(lock_id)
    assert holder.acquire() is True
    assert Lock(lock_id).acquire() is False
    assert holder.locked() and holder.owned()
    assert holder.extend(120) is True
    assert holder.release() is True
    assert not Lock(lock_id).locked()


def test_hostile_ids_get_distinct_keys(store):
    held = []
    for lock_id in HOSTILE_IDS.values():
        lock = Lock(lock_id)
        assert lock.acquire(), f"{lock_id!r} collided with an earlier id"
        held.append(lock)
    for lock in held:
        assert lock.release()


def test_long_ids_differing_at_the_end_are_distinct(store):
    first, second = Lock("a" * 5000 + "1"), Lock("a" * 5000 + "2")
    assert first.acquire() and second.acquire()
    first.release()
    second.release()


def test_memcached_keys_are_django_keys_unless_unusable(memcached):
    cache = caches["default"]
    assert (
        memcached_key(cache, "feeds.import_feed-lock-ab12")
        == ":1:feeds.import_feed-lock-ab12"
    )
    assert memcached_key(cache, "é" * 123) == ":1:" + "é" * 123  # 249 bytes
    hashed = memcached_key(cache, "é" * 124)  # 251 bytes after make_key
    assert hashed.startswith(":1:" + HASHED_PREFIX)
    assert memcached_key(cache, "a b").startswith(":1:" + HASHED_PREFIX)


def test_locks_honour_key_prefix_version_and_key_function(settings, memcached):
    """Django's make_key (KEY_PREFIX, VERSION, KEY_FUNCTION) decides the key."""
    settings.TASKLOCK = {"CACHE": "prefixed"}
    lock = Lock("feeds.import_feed-lock-1")
    assert lock.acquire()
    raw = Client(("127.0.0.1", memcached.port), default_noreply=False)
    try:
        assert raw.get("3|site-a|feeds.import_feed-lock-1") == lock.token.encode()
        assert raw.get(":1:feeds.import_feed-lock-1") is None
    finally:
        raw.close()
    assert caches["prefixed"].add("feeds.import_feed-lock-1", "true", 60) is False
    # The unprefixed alias is a different namespace, so a different lock.
    assert caches["default"].add("feeds.import_feed-lock-1", "true", 60) is True
    lock.release()


def test_two_servers_locks_land_where_django_puts_them(settings, memcached_pair):
    """With several LOCATIONs the lock lives on the server cache.add() would pick."""
    settings.TASKLOCK = {"CACHE": "pair"}
    cache = caches["pair"]
    raws = [
        Client(("127.0.0.1", s.port), default_noreply=False) for s in memcached_pair
    ]
    try:
        used = set()
        for number in range(40):
            lock_id = f"task-lock-{number}"
            lock = Lock(lock_id)
            assert lock.acquire()
            assert cache.add(lock_id, "true", 60) is False
            key = cache.make_key(lock_id)
            holders = [i for i, raw in enumerate(raws) if raw.get(key) is not None]
            assert len(holders) == 1
            expected = cache._cache._get_client(key).server
            assert memcached_pair[holders[0]].port == expected[1]
            used.add(holders[0])
            lock.release()
            assert cache.add(lock_id, "true", 60) is True
        assert used == {0, 1}, "40 ids should spread over both servers"
    finally:
        for raw in raws:
            raw.close()


@pytest.mark.parametrize("bad", [None, 12, b"bytes", ["list"]])
def test_non_str_lock_id_is_rejected(bad):
    with pytest.raises(TypeError, match="lock_id must be a str"):
        Lock(bad)


def test_empty_lock_id_is_rejected():
    with pytest.raises(ValueError, match="non-empty"):
        Lock("")


@pytest.mark.parametrize("builtin", [True, False], ids=["_md5", "hashlib"])
def test_the_digest_is_hashlibs_md5_whichever_makes_it(builtin, monkeypatch):
    import hashlib
    import importlib

    from django_tasklock import arguments

    if not builtin:  # a Python built without _md5: hashlib's
        real = importlib.import_module

        def no_md5(name, *args):
            if name == "_md5":
                raise ImportError(name)
            return real(name, *args)

        monkeypatch.setattr(importlib, "import_module", no_md5)
    make = arguments._md5_maker()
    for text in ["", "http://example.com/feed", "é€😀", "\udc80x", "x" * 5000]:
        data = text.encode("utf-8", "surrogatepass")
        assert make(data).hexdigest() == hashlib.md5(data).hexdigest()
