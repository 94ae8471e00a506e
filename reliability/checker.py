"""A seeded, randomized fault checker: many clients on hosts of their own take,
hold, check and release locks on a few ids while a nemesis kills, pauses,
restarts, flushes and cuts the servers, the clients and the network between
them; a witness outside the store records every hold, and the verdict names
every pair of holds of one id that overlapped while both holders believed.

    python -m reliability.checker [--flavour NAME|all] [--seconds N]
                                  [--clients N] [--seed N]

Flavours: ``memcached`` (one server), ``pool`` (three), ``twemproxy``
(nutcracker over two), ``redis`` (a primary with a replica), ``sentinel``
(a primary and a replica that a Sentinel fails over, through django-redis's
SentinelClient), ``cluster`` (a Redis Cluster, three primaries with a
replica each), ``postgres`` (a PostgreSQL server, ``PostgresCache``) and
``pgbouncer`` (the same behind PgBouncer in transaction pooling mode). A
paused PostgreSQL is every process of it stopped (a frozen VM); a killed one,
its postmaster SIGKILLed (its backends follow), then started again. The
``postgres`` flavour's server has a streaming standby, and its ``promote``
fault crashes the primary, promotes the standby and sends the clients to it
(then makes the next standby); a run draws whether the primary replicates
synchronously (``synchronous_standby_names = '*'``, the alias's
``OPTIONS["FAILOVER"] = "synchronous"``: a promotion waits no grace) or
asynchronously (new locks wait the grace while holders put theirs back). Every
server sits behind a ``nemesis.Proxy`` but a cluster's and Sentinel's
(whose nodes and Sentinel name the servers' own addresses). A violation
prints the seed and the faults injected around it; the same seed draws the
same schedule, options and client choices again (the timing of the machine
decides the rest).

An overlap is "by design" when a fault the guarantees page names as losing
locks came between the two holds (``flush_all`` anywhere; a server restarted
behind twemproxy or a Redis without persistence, whose restarts cannot be
seen; a Sentinel failover, whose replication is asynchronous); every other
overlap is a violation.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reliability.nemesis import Proxy
from tests.services import Memcached, Nutcracker, Redis, RedisCluster, Sentinel
from tests.services_pg import PgBouncer, Postgres

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

FLAVOURS = (
    "memcached",
    "pool",
    "twemproxy",
    "redis",
    "sentinel",
    "cluster",
    "postgres",
    "pgbouncer",
)
ROOT = Path(__file__).resolve().parent.parent
MEMCACHED_BACKEND = "django.core.cache.backends.memcached.PyMemcacheCache"
CLUSTER_CACHE = "django_valkey.cluster_cache.cache.ClusterValkeyCache"
#: Faults whose losses the guarantees page states, by flavour.
BY_DESIGN = {
    "memcached": {"flush"},
    "pool": {"flush"},
    "twemproxy": {"flush", "kill-server"},
    "redis": {"flush", "kill-server"},
    "sentinel": {"flush", "kill-server", "failover"},
    "cluster": {"flush"},
    "postgres": {"flush"},
    "pgbouncer": {"flush"},
}
#: The flavours whose store is memcached (nothing kept across a restart).
MEMCACHED_FLAVOURS = ("memcached", "pool", "twemproxy")
POSTGRES_CACHE = "django_tasklock.backends.postgres.cache.PostgresCache"


@dataclass
class Fault:
    at: float  # time.monotonic()
    kind: str
    target: str
    seconds: float = 0.0

    def __str__(self) -> str:
        span = f" for {self.seconds:.2f}s" if self.seconds else ""
        return f"{self.kind} {self.target}{span}"


@dataclass
class Hold:
    lock_id: str
    client: str
    start: float
    last: float
    token: str
    fence: int | None = None
    released: bool | None = None
    ended: bool = False
    #: When its holder let it go (its release returned), if it did.
    let_go: float | None = None


@dataclass
class Result:
    flavour: str
    seed: int
    #: time.monotonic() when the run began (violations say how far into it).
    began: float = 0.0
    client_seconds: float = 0.0
    faults: Counter[str] = field(default_factory=Counter)
    holds: int = 0
    #: Holds taken by blocking acquires (in the lock's line, where kept).
    waited: int = 0
    by_design: int = 0
    violations: list[str] = field(default_factory=list)
    fence_inversions: list[str] = field(default_factory=list)
    #: The fenced register's writes (applied, refused, failed), and each
    #: write the database took with an older fence than one it took before.
    writes: Counter[str] = field(default_factory=Counter)
    regressions: list[str] = field(default_factory=list)
    #: Parked calls (``reliability.checker_calls``): made, ran, parked,
    #: promoted, refused, dropped, errors, still in line at the end.
    calls: Counter[str] = field(default_factory=Counter)
    #: Where the witness and the clients' logs were kept (runs that found any).
    kept: str = ""

    def register_row(self) -> str:
        """The fenced register's line: its writes, and its regressions."""
        counts = ", ".join(f"{n} {k}" for k, n in sorted(self.writes.items()))
        return (
            f"fenced register: {counts or 'no writes'}; "
            f"{len(self.regressions)} regressions; "
            f"{self.waited} holds taken by waiters"
        )

    def calls_row(self) -> str:
        """The parked calls' line: their outcomes."""
        counts = ", ".join(f"{n} {k}" for k, n in sorted(self.calls.items()))
        return f"parked calls: {counts or 'none'}"

    def row(self) -> str:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.faults.items()))
        return (
            f"{self.flavour:<10} {self.client_seconds:>8.0f} {self.holds:>6} "
            f"{self.by_design:>9} {len(self.violations):>10}  {kinds}"
        )


HEADER = (
    f"{'flavour':<10} {'client-s':>8} {'holds':>6} {'by design':>9} "
    f"{'violations':>10}  faults injected"
)


class Deployment:
    """The servers of one flavour, each behind a proxy, and the CACHES entry
    the clients lock through."""

    def __init__(
        self, flavour: str, chance: random.Random, pooling: bool | None = None
    ) -> None:
        self.flavour = flavour
        self.servers: list[Any] = []
        #: The DATABASES entries the clients need (PostgreSQL's flavours).
        self.databases: dict[str, dict[str, Any]] = {}
        self.proxies: list[Proxy] = []
        self.front: Nutcracker | None = None
        self.stack = contextlib.ExitStack()
        if flavour in ("memcached", "pool", "twemproxy"):
            count = {"memcached": 1, "pool": 3, "twemproxy": 2}[flavour]
            for _ in range(count):
                self._serve(Memcached())
            if flavour == "twemproxy":
                front = Nutcracker(servers=[_at(p.port) for p in self.proxies])
                self.front = front.start()  # type: ignore[assignment]
                self.stack.callback(front.stop)
                location: Any = front.address
            else:
                addresses = [p.address for p in self.proxies]
                location = addresses[0] if count == 1 else addresses
            if pooling is None:
                pooling = chance.random() < 0.5
            options = {"use_pooling": True} if pooling else {}
            self.cache = {
                "BACKEND": MEMCACHED_BACKEND,
                "LOCATION": location,
                "OPTIONS": options,
            }
        elif flavour == "cluster":
            # No proxies: a cluster's nodes name their own addresses in their
            # redirections. Its faults are the processes'.
            cluster = RedisCluster(node_timeout=2000).start()
            self.stack.callback(cluster.stop)
            self.servers.extend(cluster.nodes)
            self.cluster = cluster
            self.cache = {"BACKEND": CLUSTER_CACHE, "LOCATION": cluster.url}
        elif flavour == "sentinel":
            self._sentinel()
        elif flavour in ("postgres", "pgbouncer"):
            self._postgres(bouncer=flavour == "pgbouncer", chance=chance)
        else:
            primary = self._serve(Redis())
            replica = Redis(args=["--replicaof", "127.0.0.1", str(primary.port)])
            replica.start()
            self.stack.callback(lambda: _stop(replica))
            self.cache = {
                "BACKEND": "django.core.cache.backends.redis.RedisCache",
                "LOCATION": f"redis://{self.proxies[0].address}/0",
            }

    def _postgres(self, *, bouncer: bool, chance: random.Random) -> None:
        """A PostgreSQL server with the lock table (and PgBouncer before it,
        or, without, a streaming standby to promote), the last of them behind
        a proxy."""
        from django_tasklock.backends.postgres.statements import CREATE

        database = Postgres().start()
        self.stack.callback(_stop, database)
        database.execute(CREATE)
        self.servers.append(database)
        self.postgres = database
        self.standby: Postgres | None = None
        options: dict[str, str] = {}
        front: Any = database
        if not bouncer:
            if chance.random() < 0.5:
                database.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
                database.execute("SELECT pg_reload_conf()")
                options["FAILOVER"] = "synchronous"
            self.standby = database.standby()
            self.stack.callback(self._remove_standby)
        if bouncer:
            front = PgBouncer(database).start()
            self.stack.callback(_stop, front)
            self.servers.append(front)
        proxy = Proxy(front.port)
        self.stack.callback(proxy.close)
        self.proxies.append(proxy)
        self.databases = {"checked": database.database_settings(proxy.port)}
        self.cache = {
            "BACKEND": POSTGRES_CACHE,
            "LOCATION": "checked",
            "OPTIONS": options,
        }

    def _remove_standby(self) -> None:
        if self.standby is not None:
            _stop(self.standby)

    def promote(self, lag: float, stop: threading.Event) -> None:
        """The primary's WAL sender stopped for ``lag`` seconds (the standby
        falls behind: an asynchronous primary commits on, a synchronous one's
        commits wait), then the primary crashed (SIGKILL), its standby
        promoted, the proxy sent to it (every client connection cut), and a
        new standby of it made for the next promotion (a synchronous
        primary's commits wait for it meanwhile)."""
        standby, old = self.standby, self.postgres
        if standby is None:
            return
        self.standby = None
        senders = [pid for (pid,) in old.execute("SELECT pid FROM pg_stat_replication")]
        for pid in senders:
            os.kill(pid, signal.SIGSTOP)
        stop.wait(lag)
        old.stop(signal.SIGKILL)
        for pid in senders:  # (stopped, they outlive the postmaster)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        assert standby.execute("SELECT pg_promote()") == [(True,)]
        self.postgres = self.servers[0] = standby
        self.stack.callback(_stop, standby)  # (now the primary: removed at the end)
        self.proxies[0].upstream_port = standby.port
        self.proxies[0].reset()
        old.remove()
        self.standby = standby.standby()

    def _sentinel(self) -> None:
        """A primary, its replica and a Sentinel, no proxies (Sentinel hands
        clients the servers' own addresses). Slow to judge the primary down
        (10 s, past the nemesis's longest pause), so failovers are the
        nemesis's own ``failover`` faults."""
        primary = Redis()
        primary.start()
        replica = Redis(args=["--replicaof", "127.0.0.1", str(primary.port)])
        replica.start()
        # Restarted, either comes back a primary of its own that nobody is
        # sent to; Sentinel makes it a replica of whichever leads by then.
        replica.args = []
        for server in (primary, replica):
            self.stack.callback(_stop, server)
            self.servers.append(server)
        watcher = Sentinel(primary=primary, down_after=10000)
        watcher.start()
        self.stack.callback(watcher.stop)
        self.sentinel = watcher
        self.cache = watcher.cache()

    def failover(self, stop: threading.Event) -> None:
        """Sentinel promotes the replica (refused, raising, while the replica is
        down or not yet known); returns once the old primary has been made a
        replica, when the locks it took meanwhile are dropped (or after 15 s,
        or once ``stop`` is set)."""
        import redis

        before = self.sentinel.primary_port()
        self.sentinel.ask("SENTINEL", "failover", self.sentinel.name)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not stop.wait(0.1):
            with contextlib.suppress(redis.RedisError):
                if self.sentinel.primary_port() == before:
                    continue
                with redis.Redis(port=before, socket_timeout=1) as old:
                    if old.info("replication")["role"] == "slave":
                        return

    def _serve(self, server: Memcached | Redis) -> Memcached | Redis:
        server.start()
        self.stack.callback(lambda: _stop(server))
        proxy = Proxy(server.port)
        self.stack.callback(proxy.close)
        self.servers.append(server)
        self.proxies.append(proxy)
        return server

    def flush(self, index: int) -> None:
        server = self.servers[index]
        if self.flavour in ("postgres", "pgbouncer"):
            self.postgres.clear()
        elif self.flavour == "cluster":
            self.cluster.flush()
        elif isinstance(server, Redis):
            import redis

            with redis.Redis(port=server.port, socket_timeout=5) as client:
                client.flushall()
        else:
            server.flush_all(keep_run=False)

    def close(self) -> None:
        self.stack.close()


def _at(port: int) -> Memcached:
    """A stand-in for twemproxy's configuration: the proxy's address."""
    return Memcached(port=port)


def _stop(server: Any) -> None:
    if isinstance(server, Postgres):
        if server.process is not None:
            with contextlib.suppress(OSError):
                server.thaw()
        server.remove()
        return
    if server.process is not None:
        with contextlib.suppress(ProcessLookupError):
            server.process.send_signal(signal.SIGCONT)
    server.stop()


class Clients:
    """The client processes, each under a hostname of its own."""

    def __init__(
        self,
        config: dict[str, Any],
        seconds: float,
        chance: random.Random,
        tasklock: dict[str, Any] | None = None,
    ) -> None:
        self.config, self.seconds, self.chance = config, seconds, chance
        self.tasklock = tasklock or {}
        self.running: dict[str, subprocess.Popen[bytes]] = {}
        self.started: dict[str, float] = {}
        self.spent = 0.0
        self.count = 0
        self.mutex = threading.Lock()

    def spawn(self, until: float, **extra: Any) -> str:
        with self.mutex:
            self.count += 1
            name = f"checker-{self.count}"
        liveness = self.chance.choice([3, 5])
        config = {
            **self.config,
            **extra,
            "client": name,
            "seed": self.chance.randrange(2**32),
            "seconds": max(until - time.monotonic(), 0.5),
            "tasklock": {"LIVENESS": liveness, **self.tasklock},
        }
        rename = f'hostname {name} && exec "$@"'
        command = ["unshare", "--uts", "sh", "-c", rename, "-"]
        command += [sys.executable, "-m", "reliability.checker_client"]
        process = subprocess.Popen(
            command,
            cwd=ROOT,
            env={
                **os.environ,
                "PYTHONPATH": str(ROOT),
                "TASKLOCK_CHECKER": json.dumps(config),
                "TASKLOCK_TEST_EXTRA_CACHES": json.dumps({"checked": config["cache"]}),
                "TASKLOCK_TEST_EXTRA_DATABASES": json.dumps(config["databases"]),
            },
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        with self.mutex:
            self.running[name] = process
            self.started[name] = time.monotonic()
        return name

    def pick(self) -> tuple[str, subprocess.Popen[bytes]] | None:
        with self.mutex:
            live = [(n, p) for n, p in self.running.items() if p.poll() is None]
        return self.chance.choice(live) if live else None

    def retire(self, name: str) -> None:
        with self.mutex:
            self.spent += time.monotonic() - self.started.pop(name)
            self.running.pop(name, None)

    def wait(self, limit: float) -> None:
        deadline = time.monotonic() + limit
        for name, process in list(self.running.items()):
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGCONT)
            try:
                process.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            self.retire(name)


class Nemesis:
    """Faults at random times, in random combinations, each logged."""

    def __init__(
        self,
        deployment: Deployment,
        clients: Clients,
        chance: random.Random,
        until: float,
        kinds: list[str] | None = None,
    ) -> None:
        self.deployment, self.clients, self.chance = deployment, clients, chance
        self.until = until
        self.only = kinds
        self.log: list[Fault] = []
        self.stop = threading.Event()
        # One process fault at a time per server: a kill and a pause of one
        # server at once would race over its process.
        self.busy = [threading.Lock() for _ in deployment.servers]
        self.threads: list[threading.Thread] = []
        self.next_failover = 0.0

    def kinds(self) -> list[str]:
        kinds = [
            "kill-server",
            "pause-server",
            "flush",
            "pause-client",
            "kill-client",
            "proxy-stall",
            "proxy-close",
            "proxy-reset",
            "proxy-drop",
            "proxy-delay",
        ]
        if not self.deployment.proxies:
            kinds = [kind for kind in kinds if not kind.startswith("proxy-")]
        if self.deployment.flavour == "sentinel":
            kinds.append("failover")
        if self.deployment.flavour == "postgres":
            kinds.append("promote")
        return self.only or kinds

    def run(self) -> None:
        while not self.stop.wait(self.chance.uniform(0.5, 3.0)):
            if time.monotonic() > self.until - 2:
                return
            kind = self.chance.choice(self.kinds())
            failing_over = ("failover", "promote")
            if kind in failing_over and time.monotonic() < self.next_failover:
                # A failover's loss lasts until Sentinel has made the old primary
                # a replica (about 11 s), a promotion's grace LIVENESS: one in
                # 30 s (15 s) leaves time to judge.
                others = [k for k in self.kinds() if k != kind]
                if not others:
                    continue
                kind = self.chance.choice(others)
            if kind in failing_over:
                pause = 30 if kind == "failover" else 15
                self.next_failover = time.monotonic() + pause
            index = self.chance.randrange(len(self.deployment.servers))
            seconds = round(self.chance.uniform(0.3, 6.0), 2)
            thread = threading.Thread(
                target=self._inject, args=(kind, index, seconds), daemon=True
            )
            thread.start()
            self.threads.append(thread)

    def _note(self, kind: str, target: str, seconds: float = 0.0) -> None:
        self.log.append(Fault(time.monotonic(), kind, target, seconds))

    def _inject(self, kind: str, index: int, seconds: float) -> None:
        name = f"server-{index}"
        if kind == "failover":
            # Its span: from the request until the old primary is a replica.
            began = time.monotonic()
            with contextlib.suppress(Exception):
                self.deployment.failover(self.stop)
                span = time.monotonic() - began
                self.log.append(Fault(began, kind, "sentinel", round(span, 2)))
            return
        if kind == "promote":
            index = 0  # (the primary's lock: no kill or pause of it meanwhile)
        if kind in ("kill-server", "pause-server", "flush", "promote"):
            if not self.busy[index].acquire(blocking=False):
                return  # that server is in another fault of its process
            try:
                self._server_fault(kind, index, seconds)
            finally:
                self.busy[index].release()
            return
        with contextlib.suppress(Exception):
            if kind in ("pause-client", "kill-client"):
                picked = self.clients.pick()
                if picked is None:
                    return
                client, process = picked
                if kind == "kill-client":
                    self._note(kind, client)
                    process.kill()
                    process.wait()
                    self.clients.retire(client)
                    self.clients.spawn(self.until)
                else:
                    self._note(kind, client, seconds)
                    self._paused(process, seconds)
            else:
                self._proxy(kind, self.deployment.proxies[index], name, seconds)

    def _server_fault(self, kind: str, index: int, seconds: float) -> None:
        server = self.deployment.servers[index]
        name = f"server-{index}"
        with contextlib.suppress(Exception):
            if kind == "promote":
                # Its span: from the crash until the new standby is made.
                began = time.monotonic()
                try:
                    self.deployment.promote(seconds, self.stop)
                finally:
                    span = round(time.monotonic() - began, 2)
                    self.log.append(Fault(began, kind, name, span))
            elif kind == "kill-server":
                self._note(kind, name)
                server.stop(signal.SIGKILL)
                self.stop.wait(min(seconds, 2.0))
                server.start()
            elif kind == "pause-server" and isinstance(server, Postgres):
                self._note(kind, name, seconds)
                server.freeze()
                try:
                    self.stop.wait(seconds)
                finally:
                    server.thaw()
            elif kind == "pause-server":
                self._note(kind, name, seconds)
                self._paused(server.process, seconds)
            else:
                # Its span: a flush waits on a paused node (a cluster's flush
                # goes to every node, one after another).
                began = time.monotonic()
                try:
                    self.deployment.flush(index)
                finally:
                    span = round(time.monotonic() - began, 2)
                    self.log.append(
                        Fault(began, kind, name, span if span > 0.05 else 0)
                    )

    def _proxy(self, kind: str, proxy: Proxy, name: str, seconds: float) -> None:
        if kind == "proxy-reset":
            self._note(kind, name)
            proxy.reset()
            return
        start: dict[str, Callable[[], None]] = {
            "proxy-stall": proxy.stall,
            "proxy-close": proxy.close_new,
            "proxy-drop": lambda: proxy.drop(self.chance.randint(1, 3)),
            "proxy-delay": lambda: proxy.delay(self.chance.uniform(0.05, 0.5)),
        }
        self._note(kind, name, seconds)
        start[kind]()
        self.stop.wait(seconds)
        proxy.heal()

    def _paused(self, process: subprocess.Popen[bytes] | None, seconds: float) -> None:
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGSTOP)
        try:
            self.stop.wait(seconds)
        finally:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGCONT)

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(15)
        for proxy in self.deployment.proxies:
            proxy.heal()


def holds_of(path: Path) -> list[Hold]:
    """The holds the witness file records."""
    holds: dict[str, Hold] = {}
    if not path.exists():
        return []
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        if record["e"] == "start":
            holds[record["tok"]] = Hold(
                record["id"], record["c"], record["t"], record["t"], record["tok"]
            )
        elif record["e"] == "end":
            hold = holds.get(record["tok"])
            if hold is not None:
                hold.last, hold.fence = record["last"], record["f"]
                hold.released, hold.ended = record["released"], True
                hold.let_go = record.get("end")
    return list(holds.values())


def waited_for(path: Path) -> int:
    """How many holds the witness says a blocking acquire took."""
    if not path.exists():
        return 0
    lines = path.read_text(encoding="utf-8").splitlines()
    return sum(1 for line in lines if json.loads(line).get("wt"))


def writes_of(path: Path) -> Counter[str]:
    """The fenced register's writes the holds' ``end`` lines count."""
    writes: Counter[str] = Counter()
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            writes.update(json.loads(line).get("w") or {})
    return writes


def regressions(path: Path) -> list[str]:
    """Each write the register took whose fence is older than one it took
    before (its history is in the order the database took them)."""
    if not path.exists():
        return []
    with contextlib.closing(sqlite3.connect(path)) as db:
        rows = db.execute(
            "SELECT register, fence, client FROM fenced_registerwrite ORDER BY id"
        ).fetchall()
    newest: dict[str, tuple[int, str]] = {}
    found = []
    for register, fence, client in rows:
        if register in newest and fence < newest[register][0]:
            top, by = newest[register]
            found.append(
                f"register {register}: {client} wrote fence {fence} after {by} "
                f"wrote fence {top}"
            )
        if register not in newest or fence > newest[register][0]:
            newest[register] = (fence, client)
    return found


def verdict(result: Result, holds: list[Hold], faults: list[Fault]) -> None:
    """Every pair of holds of one id that both believed at once, judged."""
    by_id: dict[str, list[Hold]] = {}
    for hold in holds:
        by_id.setdefault(hold.lock_id, []).append(hold)
    for its_holds in by_id.values():
        its_holds.sort(key=lambda hold: hold.start)
        for i, older in enumerate(its_holds):
            for newer in its_holds[i + 1 :]:
                if newer.start > older.last:
                    break  # (sorted by start: no later one overlaps either)
                if _by_design(result, older, newer, faults):
                    result.by_design += 1
                    continue
                result.violations.append(_explain(result, older, newer, faults))
        _fences(result, its_holds, faults)


def _by_design(result: Result, older: Hold, newer: Hold, faults: list[Fault]) -> bool:
    """Whether a fault that loses locks by design came between two holds."""
    design = BY_DESIGN[result.flavour]
    return any(
        f.kind in design
        for f in faults
        if older.start - 2 <= f.at + f.seconds and f.at <= newer.start
    )


def _fences(result: Result, holds: list[Hold], faults: list[Fault]) -> None:
    """Where a newer hold began before an older one was let go (its holder
    told it lost it, or not: a write it makes then is what its fence is for),
    and both drew a fence, the newer one's must be larger; unless a fault
    that loses locks by design came between, which can lose or split the
    counter with them (a failover's two primaries count on their own)."""
    for i, older in enumerate(holds):
        for newer in holds[i + 1 :]:
            if newer.start > max(older.last, older.let_go or older.last):
                continue
            if older.fence is None or newer.fence is None:
                continue
            if newer.fence <= older.fence and not _by_design(
                result, older, newer, faults
            ):
                result.fence_inversions.append(
                    f"{older.lock_id}: {older.client} fence {older.fence}, "
                    f"then {newer.client} fence {newer.fence}"
                )


def _explain(result: Result, older: Hold, newer: Hold, faults: list[Fault]) -> str:
    nearby = [f for f in faults if older.start - 15 <= f.at <= newer.start + 1]
    schedule = (
        "; ".join(f"{f.at - older.start:+.2f}s {f}" for f in nearby) or "no fault"
    )
    return (
        f"seed {result.seed}, {result.flavour}, {newer.start - result.began:.0f}s "
        f"into the run: lock {older.lock_id!r} held by "
        f"{older.client} (believed until {older.last - older.start:.2f}s) and "
        f"taken by {newer.client} at {newer.start - older.start:.2f}s; "
        f"faults, from the first hold's start: {schedule}"
    )


def calls_verdict(
    result: Result, path: Path, faults: list[Fault], lossy: frozenset[str] = frozenset()
) -> None:
    """Each parked call ran at most once (unless a fault that loses the
    store's items came between its runs), and each call that parked ran, was
    told (refused, dropped, an error) or is still in its line at the end.
    ``lossy``: faults that lose parked calls in this run beyond the lock
    faults (a promotion of an asynchronously replicated PostgreSQL)."""
    if not path.exists():
        return
    records = [
        json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()
    ]
    runs: dict[str, list[float]] = {}
    parked: dict[str, float] = {}
    told: set[str] = set()
    left: set[str] = set()
    drained = False
    for record in records:
        event = record["e"]
        if event == "start" and record.get("call"):
            runs.setdefault(record["call"], []).append(record["t"])
        elif event == "parked":
            parked.setdefault(record["call"], record["t"])
        elif event in ("refused", "dropped", "error"):
            told.add(record["call"])
        elif event == "line":
            drained = True
            left.update(record["parked"], record["promoted"])
        if event in ("call", "parked", "promoted", "refused", "dropped", "error"):
            result.calls[event] += event != "parked" or record.get("head") is False
    result.calls["ran"] = len(runs)
    result.calls["still in line"] = len(left)
    # memcached keeps nothing across a restart: the lines and messages of
    # the calls parked there go with it (locks are put back by their live
    # holders; a parked call has none).
    design = (
        BY_DESIGN[result.flavour]
        | lossy
        | ({"kill-server"} if result.flavour in MEMCACHED_FLAVOURS else set())
    )

    def lossy(after: float, before: float = float("inf")) -> bool:
        return any(
            f.kind in design
            for f in faults
            if after - 2 <= f.at + f.seconds and f.at <= before
        )

    for call_id, starts in runs.items():
        if len(starts) > 1:
            if lossy(starts[0], starts[-1]):
                result.by_design += 1
                continue
            at = ", ".join(f"{t - result.began:.2f}s" for t in starts)
            result.violations.append(
                f"parked call {call_id} ran {len(starts)} times: at {at}"
            )
    if not drained and parked:
        result.violations.append(
            "the parked calls' drain wrote nothing: losses unknown"
        )
        return
    for call_id, at in parked.items():
        if call_id in runs or call_id in told or call_id in left:
            continue
        if lossy(at):
            result.by_design += 1
            continue
        result.violations.append(
            f"parked call {call_id} (parked {at - result.began:.2f}s in) was lost: "
            "it never ran, was never told, and its line no longer lists it"
        )


def check(
    flavour: str,
    seconds: float,
    clients: int,
    seed: int,
    *,
    quiet: bool = False,
    tasklock: dict[str, Any] | None = None,
    kinds: list[str] | None = None,
    pooling: bool | None = None,
) -> Result:
    """One run of ``seconds`` on ``flavour``; its result, verdict included.
    ``tasklock``: settings every client adds to its own; ``kinds``: the only
    faults to inject (a control run, say); ``pooling``: whether memcached
    aliases pool their connections (None: as the seed draws)."""
    chance = random.Random(f"{seed}-{flavour}")
    result = Result(flavour, seed)
    deployment = Deployment(flavour, chance, pooling)
    if flavour == "postgres" and not quiet:
        drawn = deployment.cache["OPTIONS"].get("FAILOVER", "asynchronous")
        print(f"postgres: the primary replicates to its standby {drawn}ly")
    workdir = Path(tempfile.mkdtemp(prefix="tasklock-checker-"))
    path = workdir / "witness.jsonl"
    try:
        register = {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": str(workdir / "register.sqlite3"),
            "OPTIONS": {"timeout": 60},
        }
        config = {
            "alias": "checked",
            "cache": deployment.cache,
            "databases": {**deployment.databases, "register": register},
            "ids": [f"checked-{n}" for n in range(3)],
            "witness": str(path),
            "calls": 0.3,
        }
        result.began = time.monotonic()
        until = result.began + seconds
        group = Clients(config, seconds, chance, tasklock)
        for _ in range(clients):
            group.spawn(until)
        nemesis = Nemesis(deployment, group, chance, until, kinds)
        thread = threading.Thread(target=nemesis.run, daemon=True)
        thread.start()
        while time.monotonic() < until:
            time.sleep(0.2)
        nemesis.finish()
        thread.join(10)
        group.wait(30)
        result.client_seconds = group.spent
        # The parked calls' drain, the faults over: what is parked runs now.
        group.spawn(time.monotonic() + 60, drain=True)
        group.wait(90)
        result.faults = Counter(f.kind for f in nemesis.log)
        holds = holds_of(path)
        result.holds = len(holds)
        result.waited = waited_for(path)
        verdict(result, holds, nemesis.log)
        # A parked call is data, not a lock: one committed on a primary whose
        # standby it had not reached yet is gone with it, and has no live
        # holder to put it back after the grace (locks do).
        replication = deployment.cache.get("OPTIONS", {}).get("FAILOVER")
        asynchronous = flavour == "postgres" and replication != "synchronous"
        lossy = frozenset({"promote"}) if asynchronous else frozenset()
        calls_verdict(result, path, nemesis.log, lossy)
        result.writes = writes_of(path)
        result.regressions = regressions(workdir / "register.sqlite3")
    finally:
        deployment.close()
        if not (result.violations or result.fence_inversions or result.regressions):
            shutil.rmtree(workdir, ignore_errors=True)
        else:  # the witness and the clients' logs, for the violations' story
            result.kept = str(workdir)
    if not quiet:
        print(result.row(), flush=True)
        print("  " + result.register_row(), flush=True)
        print("  " + result.calls_row(), flush=True)
        for line in result.violations + result.fence_inversions + result.regressions:
            print("  " + line, flush=True)
        if result.kept:
            print(f"  witness and clients' logs kept in {result.kept}", flush=True)
    return result


def runs(
    flavours: list[str], seconds: float, clients: int, seed: int, **options: Any
) -> Iterator[Result]:
    for flavour in flavours:
        yield check(flavour, seconds, clients, seed, **options)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavour", default="all", choices=[*FLAVOURS, "all"])
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--clients", type=int, default=5)
    parser.add_argument(
        "--seed", type=int, default=random.SystemRandom().randrange(2**31)
    )
    parser.add_argument(
        "--kinds", help="only these faults, comma-separated (default: all)"
    )
    parser.add_argument(
        "--pooling", choices=["on", "off"], help="memcached connection pooling"
    )
    args = parser.parse_args(argv)
    options: dict[str, Any] = {}
    if args.kinds:
        options["kinds"] = args.kinds.split(",")
    if args.pooling:
        options["pooling"] = args.pooling == "on"
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    flavours = list(FLAVOURS) if args.flavour == "all" else [args.flavour]
    print(f"seed {args.seed}", flush=True)
    print(HEADER, flush=True)
    bad = 0
    for result in runs(flavours, args.seconds, args.clients, args.seed, **options):
        bad += len(result.violations) + len(result.fence_inversions)
        bad += len(result.regressions)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
