"""Owner-checked locks on a Valkey or Redis Cluster, through django-valkey's
``ClusterValkeyCache`` (valkey-py's cluster client).

Every key of one lock, and its holder's liveness record, carries the hash tag
of the lock's own key (``cluster_key``, ``slot_tag``), so a script that touches
a lock and its fencing counter or record, or a read of a semaphore's slots,
stays in one hash slot, on one primary. ``ClusterKeys`` places keys and reads
across primaries; ``ValkeyClusterBackend`` takes locks on them, refuses new
ones on a primary that took over lately (``failover``), and keeps records
beside locks.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import socket
import time
from typing import TYPE_CHECKING, Any

from django.core.cache import caches
from django.core.checks import Error, Warning

from ...check_ids import KEY_BRACES, ONE_SLOT
from ...conf import settings
from ...exceptions import InvalidArgument, LockConfigurationError
from ...keys import (
    ROSTER_GROUP,
    ROSTER_PREFIX,
    ROSTER_SLOTS,
    encodable_key,
    lock_group,
    record_id,
)
from ...tokens import TOKENS, this_process
from ..base import Hold, LockBackend
from .backend import in_line_reply
from .failover import LEARNT, Promotions, relearn
from .scripts import ACQUIRE, ACQUIRE_IN_LINE, PUT_BACK, REPLACE, TAKE_OVER, Script
from .valkey import ValkeyBackend

if TYPE_CHECKING:
    from django.core.checks import CheckMessage

__all__ = [
    "KEY_TAG_ADVICE",
    "ClusterKeys",
    "ValkeyClusterBackend",
    "cluster_key",
    "key_tag_problem",
    "slot_tag",
]


def cluster_key(cache: Any, lock_id: str) -> str:
    """The key of ``lock_id`` on a cluster. A lock's own key is Django's, the
    one ``cache.add(lock_id)`` uses (the cookbook's recipe contends for it, and
    ``cache.get(lock_id)`` reads its owner). An id derived from it (its
    fencing counter, a semaphore's slots, a call's run lock and queued mark:
    ``keys.lock_group``) is Django's key behind the hash tag of its group's
    key (``slot_tag``), so every key of one lock hashes to one slot."""
    own = encodable_key(cache, lock_id)
    group = lock_group(lock_id)
    if group == lock_id:
        return own
    return slot_tag(encodable_key(cache, group)) + own


# The Redis backend's scripts, with the holder's liveness record written
# first (KEYS[2], in the lock's own slot; ARGV's last two: its value and
# seconds): a lock taken with a token that promises a record has it beside
# it from the same step on.
_RECORD_FIRST = 'redis.call("set", KEYS[2], ARGV[#ARGV - 1], "EX", ARGV[#ARGV])\n'
_WITH_RECORD = {
    script: script.after(_RECORD_FIRST)
    for script in (ACQUIRE, ACQUIRE_IN_LINE, PUT_BACK, REPLACE, TAKE_OVER)
}


#: The one place of a cluster's records, as warnings name it.
_BESIDE_LOCKS = "the primaries of its locks"


def slot_tag(key: str) -> str:
    """A hash tag that puts another key in ``key``'s hash slot: ``key``'s own
    tag (a cluster hashes only the part between the first ``{`` and the first
    ``}`` after it, if that part is not empty), else the whole key in braces,
    which hashes as the key does."""
    start = key.find("{")
    if start >= 0:
        end = key.find("}", start + 1)
        if end > start + 1:
            return key[start : end + 1]
    if "}" in key:
        raise InvalidArgument(
            f"The cache key {key!r} has braces that are no hash tag (an empty "
            "'{}', or a '}' with no '{' before it), so no other key can share "
            "its cluster hash slot: a lock's fencing counter and liveness "
            "records could not be kept beside it. Use a lock id without '}', or "
            "one with a hash tag of its own ('{feeds}-import-1')."
        )
    return "{" + key + "}"


#: What to write instead, for a cluster alias whose keys break hash tags
#: (check E022/W004, and the first lock's refusal).
KEY_TAG_ADVICE = (
    "Use a KEY_PREFIX (and KEY_FUNCTION) that puts no '{' or '}' in keys, or "
    "give locks an alias of their own"
)


def key_tag_problem(cache: Any) -> tuple[str, bool] | None:
    """What is wrong with the keys a cluster alias makes (its KEY_PREFIX,
    VERSION and KEY_FUNCTION), and whether it is an error (no other key could
    share a lock's slot) or a warning (every lock in one slot); None if
    nothing."""
    key = str(cache.make_key("tasklock-check"))
    try:
        tag = slot_tag(key)
    except ValueError:
        return (
            f"its keys have braces that are no hash tag (an id 'tasklock-check' "
            f"becomes {key!r}), so a lock's fencing counter and liveness records "
            "cannot share its hash slot",
            True,
        )
    if tag != "{" + key + "}":
        return (
            f"its keys carry a hash tag of their own ({tag}, from KEY_PREFIX or "
            "KEY_FUNCTION): every lock lands in one hash slot, on one primary",
            False,
        )
    return None


class ClusterKeys(ValkeyBackend):
    """Where a cluster keeps each key (``cluster_key``), and the reads that
    span primaries: one pipelined round trip per primary (the plain writes,
    ``RedisBackend``'s, are pipelined the same way)."""

    def key_for(self, lock_id: str) -> str:
        return cluster_key(self.cache, lock_id)

    def _mget(self, keys: list[str]) -> list[Any]:
        client = self._redis(keys[0])
        tag = slot_tag(keys[0])
        if all(slot_tag(key) == tag for key in keys):  # a semaphore's slots
            values: list[Any] = client.mget(keys)
        else:  # one MGET per slot, pipelined: a round trip per primary
            values = client.mget_nonatomic(keys)
        return values

    def uptimes(self) -> dict[str, float]:
        # What the console asks, to tell whether its listing may be missing
        # locks: the primaries that serve the roster's hash slots (at most
        # ROSTER_SLOTS / ROSTER_GROUP of them, however large the cluster); a
        # restart elsewhere loses no listing.
        client = self._redis("")
        keys = [
            self.key_for(f"{ROSTER_PREFIX}{n}")
            for n in range(0, ROSTER_SLOTS, ROSTER_GROUP)
        ]
        nodes = {client.get_node_from_key(key).name: None for key in keys}
        found: dict[str, float] = {}
        for name in nodes:
            node = client.get_node(node_name=name)
            info = node.valkey_connection.info("server")
            found[name] = float(info["uptime_in_seconds"])
        return found


class ValkeyClusterBackend(ClusterKeys):
    """Locks on a django-valkey ``ClusterValkeyCache``.

    Every command goes to the primary that serves its key's slot now
    (valkey-py's cluster client follows ``MOVED`` and ``ASK``; it never reads
    from a replica unless ``read_from_replicas`` is set, which the system
    checks refuse).

    A holder's liveness record lives beside each of its locks, in the lock's
    own hash slot (``records_beside``): written in the script that takes
    the lock, renewed beside every lock still held at each beat (one pipelined
    round trip per primary holding some), and moved and failed over with the
    lock, never apart from it. A contender reads it in that slot, on the
    slot's primary; on a primary that took over within the grace, it reads
    nothing ("could not tell"), since the record may be one the failover lost.
    """

    kind = "Valkey cluster"
    clients = (
        "django_valkey.cluster_cache.client.DefaultClusterClient",
        "django_valkey.cluster_cache.client.default.DefaultClusterClient",
    )
    other_client = (
        "django-valkey's ClusterValkeyCache with CLIENT_CLASS {client!r}: only "
        "its DefaultClusterClient is known to send each lock's commands to the "
        "primary of its hash slot. Give locks an alias with that client"
    )

    @classmethod
    def refusal(cls, options: dict[str, Any]) -> str | None:
        kwargs = options.get("BASE_CLIENT_KWARGS") or {}
        if kwargs.get("read_from_replicas"):
            return (
                "django-valkey's ClusterValkeyCache with BASE_CLIENT_KWARGS "
                "{'read_from_replicas': True}: a replica lags behind its primary, "
                "so a lock's owner check could read a value it no longer holds. "
                "Remove read_from_replicas from that alias, or give locks an alias "
                "without it"
            )
        return super().refusal(options)

    @classmethod
    def alias_checks(
        cls, alias: str, config: dict[str, Any], protocol: object, hint: str
    ) -> list[CheckMessage]:
        """E022/W004: the hash tags in the alias's keys."""
        problem = key_tag_problem(caches[alias])
        if problem is None:
            return []
        what, fatal = problem
        message = f"CACHES[{alias!r}] is a cluster, and {what}."
        advice = f"{KEY_TAG_ADVICE}. {hint}"
        if fatal:
            return [Error(message, hint=advice, id=KEY_BRACES)]
        return [Warning(message, hint=advice, id=ONE_SLOT)]

    def __init__(self, cache: Any, alias: str, protocol: str = "auto") -> None:
        super().__init__(cache, alias, protocol)
        # The cluster client's own failures ("cannot be connected", no slot
        # map) are not ValkeyErrors: an outage all the same.
        exceptions = importlib.import_module(self.client_exceptions)
        self.errors = (*self.errors, exceptions.ValkeyClusterException)
        self.records_beside = self.restarts = self
        problem = key_tag_problem(cache)
        if problem is not None and problem[1]:
            raise LockConfigurationError(
                f"CACHES[{alias!r}] is a cluster, and {problem[0]}. "
                f"{KEY_TAG_ADVICE} (check E022)."
            )
        self.promotions = Promotions(self.errors)
        #: key -> its hash slot, remembered (the CRC is computed in Python).
        self._slots: dict[str, int] = {}
        #: lock key -> the key of this process's liveness record beside it.
        self._beside: dict[str, str] = {}
        self._tokens = TOKENS
        self._record_id = record_id(socket.gethostname(), this_process())

    def _connected(self, connection: Any) -> None:
        # A node reconnected to: its run is asked again before a lock there
        # stands (a restart in place breaks every connection).
        relearn(f"{connection.host}:{connection.port}")

    # -- taking a lock: with the record beside it, refused after a failover --

    def acquire(self, key: str, token: str, expire: float) -> Hold | None:
        hold = self._take(ACQUIRE, key, None, token, expire)
        if hold is not None:
            self._keep_unless_promoted(key, token)
        return hold

    def take_in_line(
        self, key: str, token: str, expire: float, waiter: str, mark: float
    ) -> tuple[Hold | None, float]:
        value = self._encode(token)
        args = (value, math.ceil(expire * 1000), waiter, math.ceil(mark * 1000))
        try:
            reply = self._run(ACQUIRE_IN_LINE, key, token, args)
        except self._dropped:
            reply = self._run(ACQUIRE_IN_LINE, key, token, args)
        taken = in_line_reply(value, reply)
        if taken[0] is not None:
            self._keep_unless_promoted(key, token)
        return taken

    def reassert(self, key: str, token: str, expire: float) -> Hold | None:
        # A lock the failover lost, put back by its live holder: never refused.
        return self._take(PUT_BACK, key, None, token, expire)

    def take_over(
        self, key: str, expected: str, token: str, expire: float
    ) -> Hold | None:
        hold = self._take(TAKE_OVER, key, expected, token, expire)
        if hold is None:  # a mark another serializer wrote: compared decoded
            hold = LockBackend.take_over(self, key, expected, token, expire)
        if hold is not None:
            self._keep_unless_promoted(key, token)
        return hold

    def replace(
        self, key: str, hold: Hold, old: object, new: str, expire: float
    ) -> Hold | None:
        value = self._encode(new)
        arguments = (hold, value, math.ceil(expire * 1000))
        if self._run(REPLACE, key, new, arguments):
            return value
        return None

    def _take(
        self, script: Script, key: str, expected: str | None, token: str, expire: float
    ) -> Hold | None:
        """Run ``ACQUIRE`` or ``TAKE_OVER`` (``expected``: the queued mark)
        for ``token``, once more if the reply was lost (as the Redis backend's
        acquire)."""
        value = self._encode(token)
        milliseconds = math.ceil(expire * 1000)
        arguments: tuple[object, ...] = (value, milliseconds)
        if expected is not None:
            arguments = (self._encode(expected), *arguments)
        try:
            taken = self._run(script, key, token, arguments)
        except self._dropped:
            taken = self._run(script, key, token, arguments)
        return value if taken else None

    def _run(
        self, script: Script, key: str, token: str, arguments: tuple[object, ...]
    ) -> Any:
        """Run ``script`` on the lock at ``key`` for ``token``: with this
        process's liveness record written first, beside the lock, in the same
        script, when the token promises one. Every time: a lock is never
        there without its holder's record, which a contender would read as
        its holder dead (a record written moments ago may be gone since: a
        flush, an eviction, a failover that lost it)."""
        ttl = settings.LIVENESS
        if ttl is not None and self._tokens.live_prefix in token:  # it promises one
            record_key = self._beside.get(key) or self._record_key(key)
            return self._script(
                _WITH_RECORD[script],
                (key, record_key),
                *arguments,
                b"%.3f" % time.time(),
                math.ceil(ttl),
            )
        return self._script(script, (key,), *arguments)

    def _record_key(self, key: str, record: str | None = None) -> str:
        """The key of a liveness record (this process's by default) beside the
        lock at ``key``: in its hash slot."""
        if record is not None:
            return slot_tag(key) + str(self.cache.make_key(record))
        made = self._beside.get(key)
        if made is None:
            if len(self._beside) >= 10_000:
                self._beside.clear()
            made = self._beside[key] = slot_tag(key) + str(
                self.cache.make_key(self._record_id)
            )
        return made

    def _slot(self, client: Any, key: str) -> int:
        slot = self._slots.get(key)
        if slot is None:
            if len(self._slots) >= 10_000:
                self._slots.clear()
            slot = self._slots[key] = client.keyslot(key)
        return slot

    def _keep_unless_promoted(self, key: str, token: str) -> None:
        """Give back a lock just taken on a primary that took over within the
        grace (``failover``), and raise; also when its run cannot be read."""
        client = self._primary or self._redis(key)
        slot = self._slots.get(key)
        if slot is not None:  # the fast path: its primary known and quiet
            learnt = LEARNT.get(client.nodes_manager.slots_cache[slot][0].name)
            if (
                learnt is not None
                and learnt[1] is None
                and learnt[2] > time.monotonic()
            ):
                return
        why = self._promoted(key)
        if why is None:
            return
        with contextlib.suppress(*self.errors):  # else it expires, held by nobody
            self.discard(key, token)
        raise self.errors[0](why)

    def _promoted(self, key: str) -> str | None:
        """Why the primary of ``key``'s slot must not be trusted with new locks
        (it took over within the grace, or whether it did could not be read),
        or None."""
        client = self._redis(key)
        try:
            return self.promotions.refusal(client, self._slot(client, key))
        except self.errors as exc:
            return f"whether its primary took over lately could not be read ({exc})"

    def restarted_at(self, key: str) -> float | None:
        client = self._redis(key)
        return self.promotions.started(client, self._slot(client, key))

    # -- liveness records, beside each lock ------------------------------------

    def record_places(self) -> list[object]:
        return [_BESIDE_LOCKS]

    def record_place(self, key: str) -> object:
        return _BESIDE_LOCKS

    def write_records_beside(
        self, record_id: str, value: str, ttl: int, keys: list[str]
    ) -> None:
        if not keys:
            return
        client = self._redis(keys[0])
        pipe = client.pipeline()
        stamp = value.encode()
        for record_key in {self._record_key(key, record_id) for key in keys}:
            pipe.set(record_key, stamp, ex=ttl)
        pipe.execute()  # one round trip per primary; raises if any failed

    def write_record(self, place: object, record_id: str, value: str, ttl: int) -> None:
        """Nothing: on a cluster a record lives beside each lock."""

    def delete_record(self, place: object, record_id: str) -> None:
        """Nothing: the records beside locks expire with ``LIVENESS``; a
        process on its way out releases its locks first, so none needs them."""

    def read_record(self, key: str, record_id: str) -> object | None:
        why = self._promoted(key)
        if why is not None:
            raise self.errors[0](f"the record may be one the failover lost: {why}")
        record_key = self._record_key(key, record_id)
        raw = self._redis(record_key).get(record_key)
        return None if raw is None else raw.decode()
