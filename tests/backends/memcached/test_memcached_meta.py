"""The meta protocol with no socket (``backends.memcached.meta``): commands,
the split of bytes into replies, what each reply means, and the owner check
of a write as steps. Both memcached backends speak it; their tests against
real servers are elsewhere (test_lock, test_async_lock, test_slab_moves)."""

from __future__ import annotations

import random

import pytest
from pymemcache.exceptions import MemcacheError

from django_tasklock.backends.memcached import meta
from django_tasklock.backends.memcached.wire import MemcachedHold


def test_commands_are_the_meta_protocols_lines():
    assert meta.add(b"k", b"tok", 30) == b"ms k 3 T30 F16 ME c\r\ntok\r\n"
    assert meta.swap(b"k", b"new", 7, 30) == b"ms k 3 C7 T30 F16 c\r\nnew\r\n"
    assert meta.delete(b"k", 7) == b"md k C7\r\n"
    assert meta.delete(b"k") == b"md k\r\n"
    assert meta.read(b"k") == b"mg k v c\r\n"
    assert meta.read(b"k", flags=True) == b"mg k v c f\r\n"
    assert meta.exists(b"k") == b"mg k\r\n"
    assert meta.read_ttl(b"k") == b"mg k t\r\n"
    assert meta.count_and_read(b"f", 60, 5, b"k") == (
        b"ma f N60 J5 T60 v\r\nmg k v c\r\n"
    )


def test_split_reads_a_value_that_holds_crlf_by_its_length():
    value = b"a\r\nb"
    buffer = b"HD c5\r\nVA 4 c9\r\n" + value + b"\r\nNF\r\n"
    assert meta.split(buffer, 3) == [
        b"HD c5\r\n",
        b"VA 4 c9\r\n" + value + b"\r\n",
        b"NF\r\n",
    ]
    assert meta.value_of(meta.split(buffer, 2)[1]) == (value, 9, 0)


def test_split_waits_for_the_rest_wherever_the_bytes_are_cut():
    """Any prefix of the replies is not taken for them: None until the
    whole of each has come, then the same replies (a cut inside a value's
    CR LF, or inside the header, included)."""
    replies = [b"VA 7 c3 f16\r\nx\r\ny\r\nz\r\n", b"HD c4\r\n", b"EN\r\n"]
    whole = b"".join(replies)
    for cut in range(len(whole)):
        assert meta.split(whole[:cut], 3) is None, cut
    assert meta.split(whole, 3) == replies
    rng = random.Random(20261129)
    for _ in range(200):
        cut = rng.randrange(len(whole))
        first = meta.reply_end(whole, 0)
        assert first == len(replies[0])
        assert (meta.reply_end(whole[:cut], 0) == first) is (cut >= first)


def test_split_stops_at_error_which_answers_what_follows_too():
    assert meta.split(b"ERROR\r\nERROR\r\n", 2) == [b"ERROR\r\n"]


def test_a_va_header_without_a_length_is_an_error():
    with pytest.raises(MemcacheError, match="unexpected reply header"):
        meta.split(b"VA x c1\r\nab\r\n", 1)


def test_taken_reads_the_cas_id_refusal_and_servers_without_cas():
    assert meta.taken(b"HD c12\r\n") == 12
    assert meta.taken(b"HD k c12 b\r\n") == 12  # (flags in another order)
    assert meta.taken(b"NS c0\r\n") is None
    assert meta.taken(b"HD\r\n") == 0  # memcached -C: no CAS ids
    with pytest.raises(MemcacheError, match="unexpected reply to ms"):
        meta.taken(b"SERVER_ERROR out of memory\r\n")
    assert "restart it without -C" in str(meta.no_cas("h:1"))


def test_writes_and_deletes_are_told_apart_by_their_reply():
    assert meta.swapped(b"HD c13\r\n") == 13
    assert meta.swapped(b"EX\r\n") is None
    assert meta.swapped(b"NF\r\n") is None
    assert (meta.deleted(b"HD\r\n"), meta.deleted(b"EX\r\n")) == (True, False)
    assert meta.deleted(b"NF\r\n") is False
    with pytest.raises(MemcacheError, match="unexpected reply to md"):
        meta.deleted(b"CLIENT_ERROR bad command line format\r\n")
    # On the connection that took it: EX (another CAS id) is for the value
    # to tell, as is a reply that says neither.
    assert meta.removed(b"HD\r\n") is True
    assert meta.removed(b"NF\r\n") is False
    assert meta.removed(b"EX\r\n") is None
    assert meta.removed(b"") is None


def test_reads_of_items_ttls_and_counters():
    assert meta.value_of(b"EN\r\n") is None
    assert meta.value_of(b"VA 3 c7 f16\r\ntok\r\n") == (b"tok", 7, 16)
    with pytest.raises(MemcacheError, match="unexpected reply to mg"):
        meta.value_of(b"HD\r\n")
    assert meta.ttl_of(b"HD t42\r\n") == 42.0
    assert meta.ttl_of(b"HD t-1\r\n") == float("inf")
    assert meta.ttl_of(b"EN\r\n") is None
    assert meta.present(b"HD\r\n") and not meta.present(b"EN\r\n")
    assert meta.drawn([b"VA 2\r\n17\r\n", b"VA 3 c8\r\ntok\r\n"]) == (17, b"tok", 8)
    assert meta.drawn([b"VA 2\r\n17\r\n", b"EN\r\n"]) is None
    with pytest.raises(ValueError, match="non-numeric"):
        meta.drawn([b"CLIENT_ERROR non-numeric value\r\n", b"EN\r\n"])


def _run(steps, items, writes):
    """Drive ``while_ours`` with scripted answers: each READ takes the next
    of ``items``, each write the next of ``writes``; the steps seen too."""
    seen = []
    items, writes = iter(items), iter(writes)

    def read():
        seen.append("read")
        return next(items)

    def write(cas):
        seen.append(cas)
        return next(writes)

    return meta.drive(steps, read, write), seen


def test_a_write_at_the_proven_cas_settles_unless_a_unique_value_moved():
    """The drivers' first write, on the connection that took the item: it
    settles the check if it wrote, or if the value cannot prove a move; else
    the value tells from now on."""
    token = "host:1-2-3-s:ab:1:2"  # (a lock token: unique)
    hold = MemcachedHold(5, object())
    assert meta.settled(hold, token, "written") and hold.sock is not None
    assert meta.settled(hold, "3", None) and hold.sock is not None
    assert not meta.settled(hold, token, None) and hold.sock is None


def test_owner_check_learns_a_moved_items_cas_and_tries_again():
    """A unique token of the holder's under a new CAS id is its item, moved:
    the new id is learnt; an EX after it (moved again) reads once more."""
    hold = MemcachedHold(5, object())
    token = "host:1-2-3-s:ab:1:2"
    steps = meta.while_ours("k", hold, token)
    done, seen = _run(steps, [(token, 9), (token, 11)], [None, "written"])
    assert (done, seen) == ("written", ["read", 9, "read", 11])
    assert hold.cas == 11 and hold.sock is None


def test_owner_check_refuses_another_value_a_gone_item_or_an_unproven_one():
    token = "host:1-2-3-s:ab:1:2"
    hold = MemcachedHold(5, None)
    assert _run(meta.while_ours("k", hold, token), [("other", 5)], [])[0] is None
    assert _run(meta.while_ours("k", hold, token), [None], [])[0] is None
    # A value other code may store (a rate limit's state) proves nothing
    # under another CAS id.
    plain = MemcachedHold(5, None)
    assert _run(meta.while_ours("k", plain, "3"), [("3", 6)], [])[0] is None
    assert plain.cas == 5
    done, seen = _run(meta.while_ours("k", plain, "3"), [("3", 5)], [None])
    assert (done, seen) == (None, ["read", 5])  # not written: not tried again


def test_owner_check_gives_up_after_its_tries_without_calling_it_lost():
    token = "host:1-2-3-s:ab:1:2"
    hold = MemcachedHold(5, None)
    moves = [(token, 6 + n) for n in range(meta.MOVES_IN_A_ROW)]
    with pytest.raises(MemcacheError, match="new CAS id 5 times in a row"):
        _run(meta.while_ours("k", hold, token), moves, [None] * 5)
    done, seen = _run(meta.while_ours("k", hold, token, 2), moves, [None, "ok"])
    assert (done, seen) == ("ok", ["read", 6, "read", 7])
    with pytest.raises(MemcacheError):
        _run(meta.while_ours("k", hold, token, 2), moves, [None, None])
