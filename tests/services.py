"""Private memcached and Redis servers for the tests, on free loopback ports.

A missing binary is a failure, never a skip: ``make test`` installs both.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

INSTALL_HINT = (
    "is not installed. Run the README's test command (make test), which installs it "
    "with apt-get, or install it yourself: apt-get install -y memcached redis-server "
    "nutcracker"
)


#: What coverage (``patch = ["subprocess"]``, pyproject.toml) leaves in the
#: environment so that every Python process a test starts measures itself too.
COVERAGE_VARIABLES = ("COVERAGE_PROCESS_CONFIG", "COVERAGE_PROCESS_START")


@contextlib.contextmanager
def unmeasured() -> Iterator[None]:
    """Python processes started inside are not traced by coverage.

    For the storms of many processes and the benchmarks' short runs: they run
    the lock's hot paths, which tests in the pytest process cover, and tracing
    costs them about 70 % more CPU (and would skew what a benchmark counts).
    The processes whose code runs nowhere else (Celery workers, fault runs)
    stay measured.
    """
    saved = {
        name: os.environ.pop(name) for name in COVERAGE_VARIABLES if name in os.environ
    }
    try:
        yield
    finally:
        os.environ.update(saved)


#: Ports below 10000 that machines like this one give their own services
#: (PostgreSQL, MariaDB, Redis, RabbitMQ, pgbouncer...): never drawn.
WELL_KNOWN = frozenset(
    {1433, 1521, 2375, 2376, 2379, 2380, 3000, 3306, 4369, 5000, 5432, 5433}
    | {5555, 5672, 5984, 6379, 6380, 6432, 8000, 8080, 8443, 8888, 9000, 9042}
    | {9090, 9092, 9200, 9300}
)


def free_port() -> int:
    """A free port for a server a test starts: drawn from 1024-9999, below the
    kernel's range of ephemeral ports (32768 on) and apart from the clusters'
    and the session's, so no outgoing connection and no other worker's bind
    to port 0 takes it between this draw and the server's own bind. (A bind
    to port 0 handed two workers' servers the same port: a Sentinel whose
    port another server had was found listening and never asked who it was;
    MasterNotFoundError in CI.)"""
    while (port := _free_below_ephemeral(1024, 10000, (0,))) in _HANDED:
        pass
    # Never twice in one process: a lock backend remembers the run of the
    # server it met at an address, so a new server on a port an earlier one
    # had looks restarted there, and is refused for the grace (a fault part
    # that started ~100 servers drew a port twice, and refused its lock).
    _HANDED.add(port)
    return port


#: The ports handed out by free_port in this process, and the well-known ones.
_HANDED: set[int] = set(WELL_KNOWN)


def wait_for_port(
    port: int, timeout: float = 10.0, process: subprocess.Popen[bytes] | None = None
) -> None:
    """Until something listens on ``port``; raises after ``timeout`` seconds,
    or at once if ``process`` (the server meant to listen) exited."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                pass
        except OSError:
            if process is not None and process.poll() is not None:
                raise RuntimeError(
                    f"the server for 127.0.0.1:{port} exited ({process.returncode})"
                ) from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing listens on 127.0.0.1:{port}") from None
            time.sleep(0.02)
            continue
        if process is not None and process.poll() is not None:
            raise RuntimeError(  # (what answered is another's server)
                f"the server for 127.0.0.1:{port} exited ({process.returncode})"
            )
        return


def wait_for_closed(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                time.sleep(0.02)
        except OSError:
            return
    raise RuntimeError(f"127.0.0.1:{port} still accepts connections")


class PortTaken(RuntimeError):
    """What answers on a server's port is not the server just started."""


@dataclass
class Server:
    """One server process; ``stop()``/``start()`` keep the same port."""

    binary: str
    args: list[str]
    #: 0: a port drawn here (``free_port``), drawn again if another process
    #: takes it before the server binds it.
    port: int = 0
    process: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        self._redraw: Callable[[], int] | None = None
        if self.port == 0:
            self.port, self._redraw = free_port(), free_port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        raise NotImplementedError

    def start(self, redraw: Callable[[], int] | None = None) -> Server:
        """Start it; on a port drawn again (``redraw``, or the one that drew
        it) when another process had its port, four times at most: on its
        first start only (eight workers' session servers, drawing at once,
        met one another's port). Started again after a stop, it keeps its
        port: the test stopped that server."""
        redraw = redraw or self._redraw
        for tries_left in range(4, -1, -1):
            try:
                self._start_once()
                self._redraw = None  # from now on, started again on this port
                return self
            except PortTaken:
                if redraw is None or not tries_left:
                    raise
                self.port = redraw()
        raise AssertionError("unreachable")

    def _start_once(self) -> Server:
        # Debian puts nutcracker in /usr/sbin, which a user's PATH may lack.
        path = shutil.which(self.binary) or shutil.which(self.binary, path="/usr/sbin")
        if path is None:
            raise RuntimeError(f"{self.binary} {INSTALL_HINT}")
        self.process = subprocess.Popen(
            [path, *self.command()],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_for_port(self.port, process=self.process)
        except RuntimeError as exc:
            if self.process.poll() is None:
                raise
            self.process = None  # it exited: its port may be another's
            raise PortTaken(f"{exc}: its port may be another process's") from exc
        serving = self._serving_pid_soon()
        if self.process.poll() is not None or (
            serving is not None and serving != self.process.pid
        ):
            # (It took the port while this one was stopped, or between our
            # check that the port was free and our server's bind.)
            self.process.kill()
            self.process.wait()
            self.process = None
            raise PortTaken(
                f"{self.address} is served by process {serving}, not by the "
                f"{self.binary} just started: another server has its port"
            )
        return self

    def serving_pid(self) -> int | None:
        """The pid of the process that answers on the port, where the server
        says (None: it does not, or runs under a wrapper)."""
        return None

    def _serving_pid_soon(self, timeout: float = 10.0) -> int | None:
        """``serving_pid``, asked again while the connection fails: the first
        to connect may have met whatever had the port a moment before (a test's
        listener that closes connections, in tests/backends/test_never_robbed.py)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.serving_pid()
            except (OSError, redis_errors()):
                if self.process is not None and self.process.poll() is not None:
                    return None  # ours exited: what answered was another's
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(timeout=10)
        self.process = None
        wait_for_closed(self.port)

    def restart(self) -> None:
        self.stop()
        self._start_once()


@dataclass
class Memcached(Server):
    binary: str = "memcached"
    args: list[str] = field(default_factory=list)

    def serving_pid(self) -> int | None:
        # (Under a wrapper, unshare --pid, memcached's pid is another.)
        return int(self.stats()["pid"]) if self.binary == "memcached" else None

    def command(self) -> list[str]:
        user = ["-u", "root"] if os.geteuid() == 0 else []
        fixed = shlex.split("-l 127.0.0.1 -U 0 -t 2")
        return [*fixed, "-p", str(self.port), *user, *self.args]

    def _ask(
        self, line: bytes, ends: tuple[bytes, ...], timeout: float = 5
    ) -> tuple[bytes, bool]:
        """Send one text-protocol line; the reply up to one of ``ends``, and
        whether it got there (False: the server closed the connection first)."""
        with socket.create_connection(
            ("127.0.0.1", self.port), timeout=timeout
        ) as sock:
            sock.sendall(line + b"\r\n")
            data = b""
            while not data.endswith(ends):
                chunk = sock.recv(65536)
                if not chunk:
                    return data, False
                data += chunk
        return data, True

    def raw(self, line: bytes) -> bytes:
        """Send one text-protocol line, return the first reply line."""
        return self._ask(line, (b"\r\n",))[0].strip()

    def idle(self) -> bool:
        """True when no connection but the one asking is open (and the server
        had room to answer it)."""
        data, complete = self._ask(b"stats", (b"END\r\n", b"connections\r\n"))
        return complete and b"STAT curr_connections 1\r\n" in data

    def flush_all(self, *, keep_run: bool = True) -> None:
        """Drop every item; with ``keep_run``, put the server's run mark back
        (``django_tasklock.backends.memcached.restarts``), so processes that
        saw this run do not take the flush for a restart, and without the
        word that the run follows a restart (a test's restart is over for the
        next test: its processes need not wait out a grace)."""
        mark = self._ask(b"get tasklock-run-mark", (b"END\r\n",))[0]
        assert self.raw(b"flush_all") == b"OK"
        if keep_run and mark.startswith(b"VALUE "):
            header, value = mark.split(b"\r\n")[:2]
            flags = header.split()[2]
            value = value.removesuffix(b":r")
            line = b"set tasklock-run-mark %s 0 %d\r\n%s" % (flags, len(value), value)
            assert self.raw(line) == b"STORED"

    def keys(self) -> set[str]:
        """Every key the server holds (``lru_crawler metadump all``)."""
        from urllib.parse import unquote

        # The crawler may be busy with a crawl of its own (memcached's LRU
        # crawler runs by itself too): asked again until it takes the dump.
        busy = b"BUSY currently processing crawler request\r\n"
        for _ in range(100):
            data = self._ask(b"lru_crawler metadump all", (b"END\r\n", busy), 30)[0]
            if not data.endswith(busy):
                break
            time.sleep(0.1)
        else:
            raise AssertionError("memcached's LRU crawler stayed busy for 10 s")
        return {
            unquote(line.split(" ", 1)[0].removeprefix("key="))
            for line in data.decode().splitlines()
            if line.startswith("key=")
        }

    def stats(self, kind: str = "") -> dict[str, str]:
        """``stats`` (or ``stats items``, ``stats slabs``...), by name."""
        data = self._ask(f"stats {kind}".strip().encode(), (b"END\r\n",))[0]
        found = {}
        for line in data.decode().splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0] == "STAT":
                found[parts[1]] = parts[2]
        return found

    def stat(self, name: str) -> int:
        return int(self.stats()[name])


@dataclass
class Redis(Server):
    binary: str = "redis-server"
    args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def serving_pid(self) -> int | None:
        return redis_process_id(self.port)

    def command(self) -> list[str]:
        import tempfile

        # A directory of its own: a replica writes the primary's data there during
        # a full sync, and a server loads any dump.rdb it finds at start.
        workdir = tempfile.mkdtemp(prefix="redis-")
        fixed = shlex.split("--bind 127.0.0.1 --appendonly no --daemonize no")
        own = ["--port", str(self.port), "--dir", workdir, "--save", ""]
        return [*fixed, *own, *self.args]


@dataclass
class Sentinel(Server):
    """A Redis Sentinel (``redis-server --sentinel``) watching one primary as
    ``name``; quick to judge it down, so a failover takes seconds."""

    binary: str = "redis-server"
    args: list[str] = field(default_factory=list)
    primary: Redis | None = None
    #: How long the primary may not answer before a failover (ms).
    down_after: int = 1000

    @property
    def name(self) -> str:
        """The primary's name here, this Sentinel's own: django-redis keeps a
        process-wide pool per LOCATION, so a second Sentinel's cache under the
        same name would be served the first one's (gone) Sentinel."""
        return f"primary-{self.port}"

    def command(self) -> list[str]:
        import tempfile

        assert self.primary is not None
        config = Path(tempfile.mkdtemp(prefix="sentinel-")) / "sentinel.conf"
        config.write_text(
            f"port {self.port}\nbind 127.0.0.1\n"
            f"sentinel monitor {self.name} 127.0.0.1 {self.primary.port} 1\n"
            f"sentinel down-after-milliseconds {self.name} {self.down_after}\n"
            f"sentinel failover-timeout {self.name} 5000\n"
        )
        return [str(config), "--sentinel", *self.args]

    def cache(self) -> dict[str, object]:
        """A django-redis CACHES entry whose SentinelClient asks this Sentinel."""
        return {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": f"redis://{self.name}/0",
            "OPTIONS": {
                "CLIENT_CLASS": "django_redis.client.SentinelClient",
                "CONNECTION_FACTORY": "django_redis.pool.SentinelConnectionFactory",
                "SENTINELS": [("127.0.0.1", self.port)],
                "SOCKET_TIMEOUT": 2,
            },
        }

    def ask(self, *command: str) -> object:
        import redis

        with redis.Redis(port=self.port) as client:
            return client.execute_command(*command)

    def knows_replica(self, port: int) -> bool:
        """Whether the Sentinel has found the replica on ``port``, and finds it up."""
        import redis

        with redis.Redis(port=self.port) as client:
            replicas = client.sentinel_slaves(self.name)
        return any(
            int(replica["port"]) == port
            and not replica["is_sdown"]
            and not replica["is_disconnected"]
            for replica in replicas
        )

    def serving_pid(self) -> int | None:
        return redis_process_id(self.port)

    def describe(self) -> str:
        """What a failure message should show of this Sentinel: whether its
        process runs, and what it says of its primary (or why it said nothing)."""
        running = self.process is not None and self.process.poll() is None
        try:
            flags = self.ask("SENTINEL", "master", self.name)
        except Exception as exc:  # what a client met: the message says it
            flags = f"no answer ({exc!r}: {exc})"
        return f"process {'running' if running else 'gone'}, {self.name}: {flags}"

    def primary_port(self) -> int:
        host_port = self.ask("SENTINEL", "get-master-addr-by-name", self.name)
        return int(host_port[1])  # type: ignore[index]


def redis_process_id(port: int) -> int:
    """The pid a Redis (or a Sentinel) on ``port`` gives in ``INFO server``."""
    import redis

    # (LOADING: a replica that syncs, or a node that loads, still says.)
    with redis.Redis(port=port, socket_timeout=10) as client:
        return int(client.execute_command("INFO", "server")["process_id"])


def redis_errors() -> type[Exception]:
    import redis

    return redis.RedisError


def _cluster_port() -> int:
    """A free port whose cluster bus port (10000 above) is free too; both below
    the kernel's range of ephemeral ports (32768 on), where an outgoing
    connection could take one between this check and the server's bind."""
    # Client ports 10000-19999, bus ports 20000-29999: no node's client port
    # is another node's bus port.
    return _free_below_ephemeral(10000, 20000, (0, 10000))


def session_port() -> int:
    """A free port for a server of the whole session, which tests stop and
    start again on the same port: below the kernel's range of ephemeral ports
    and apart from the clusters' (30000-32767), so no other worker's server
    (bind to port 0) nor outgoing connection takes it while it is stopped.
    (Beside two CPU hogs, a session memcached a test had stopped left its
    port accepting connections for 10 s after its process exited, and every
    later test of that worker met a server that was not its own.)"""
    return _free_below_ephemeral(30000, 32768, (0,))


def _free_below_ephemeral(low: int, high: int, offsets: tuple[int, ...]) -> int:
    """A port in [low, high) such that it and each port ``offsets`` above it
    are free now."""
    # Not the random module: pytest-randomly seeds it with the commit's seed in
    # every worker of the main run and of the matrix, which then drew the very
    # same ports at the same moment and raced for them (a matrix session's
    # cluster "would not start on 5 port pairs").
    draw = secrets.SystemRandom()
    for _ in range(200):
        port = draw.randrange(low, high)
        candidates = [port + offset for offset in offsets]
        if not all(_claim(candidate) for candidate in candidates):
            continue
        sockets = []
        try:
            for candidate in candidates:
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
        return port
    raise RuntimeError(f"no free port in {low}-{high - 1}")


def _claim(port: int) -> bool:
    """Whether this process now holds ``port`` against every other process
    that draws ports here, until it exits: a lock on byte ``port`` of one
    shared file (POSIX record locks: one per byte, freed by the kernel when
    their process dies, not inherited by its children). A bind check alone
    is not a claim: two matrix sessions' workers drew the same free port at
    once, the second's PgBouncer could not bind it and exited, and its
    waiting for the port met the first's PgBouncer, which its tests then used
    (a NOTIFY sent to the other session's database, never heard here)."""
    global _CLAIMS
    if port in _CLAIMED:
        return False  # (a lock of this process's own would be granted again)
    if _CLAIMS is None:
        path = Path(tempfile.gettempdir()) / "tasklock-test-ports.lock"
        _CLAIMS = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.lockf(_CLAIMS, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, port)
    except OSError:
        return False  # another process's
    _CLAIMED.add(port)
    return True


#: The open file whose bytes are this process's claims on ports (never closed:
#: closing any descriptor of it would free every claim).
_CLAIMS: int | None = None
_CLAIMED: set[int] = set()


class RedisCluster:
    """A real Redis Cluster on free loopback ports: ``primaries`` primaries with
    one replica each (``redis-server --cluster-enabled yes``, joined by
    ``redis-cli --cluster create``); a node that stops is judged failed after
    ``node_timeout`` ms and its replica promoted."""

    def __init__(self, primaries: int = 3, node_timeout: int = 2000) -> None:
        import tempfile

        self.node_timeout = node_timeout
        self.workdir = Path(tempfile.mkdtemp(prefix="redis-cluster-"))
        self.nodes = [
            Redis(args=self._node_args(index), port=_cluster_port())
            for index in range(primaries * 2)
        ]

    def _node_args(self, index: int) -> list[str]:
        config = str(self.workdir / f"nodes-{index}.conf")
        # A replica may be promoted however long its primary was away (its
        # validity factor 0).
        fixed = shlex.split("--cluster-enabled yes --cluster-replica-validity-factor 0")
        timeout = ["--cluster-node-timeout", str(self.node_timeout)]
        return [*fixed, "--cluster-config-file", config, *timeout]

    @property
    def url(self) -> str:
        """A URL of one node, from which a cluster client finds the others."""
        return f"redis://{self.nodes[0].address}"

    def start(self, attempts: int = 3) -> RedisCluster:
        """Start the nodes and join them; a cluster that has not formed in 30 s
        (a node that never met the others, seen once on a busy machine) is
        stopped and formed again from new nodes on new ports."""
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError(f"redis-cli {INSTALL_HINT}")
        problem = ""
        for _ in range(attempts):
            for index in range(len(self.nodes)):
                self._start_node(index)
            try:
                addresses = [node.address for node in self.nodes]
                create = [cli, "--cluster", "create", *addresses]
                subprocess.run(
                    [*create, "--cluster-replicas", "1", "--cluster-yes"],
                    check=True,
                    capture_output=True,
                    timeout=60,
                )
                self.wait_until_ok(timeout=30, joined=True)
                return self
            except (RuntimeError, subprocess.SubprocessError) as error:
                problem = str(error)
                self._discard_nodes()
        raise RuntimeError(f"no cluster formed in {attempts} tries: {problem}")

    def _discard_nodes(self) -> None:
        """Stop every node and forget its configuration; new nodes on new ports."""
        for index, node in enumerate(self.nodes):
            if node.process is not None:
                node.process.kill()
                node.process.wait()
                node.process = None
            (self.workdir / f"nodes-{index}.conf").unlink(missing_ok=True)
            self.nodes[index] = Redis(args=self._node_args(index), port=_cluster_port())

    def _start_node(self, index: int) -> None:
        """Start node ``index``; on another port pair if its own was taken
        meanwhile (another test session's server, started side by side)."""
        for _ in range(5):
            node = self.nodes[index]
            try:
                node.start()
                # Its own process answers (not another listener on the port:
                # its own configuration file), and still runs (its bus port
                # bound too).
                mine = str(self.workdir / f"nodes-{index}.conf")
                answer = self.ask(node, "CONFIG", "GET", "cluster-config-file")
                running = node.process.poll() is None  # type: ignore[union-attr]
                if answer.get("cluster-config-file") == mine and running:
                    return
                raise RuntimeError(f"cluster node {node.address} did not start")
            except (RuntimeError, OSError, redis_errors()):
                if node.process is not None:
                    node.process.kill()
                    node.process.wait()
                    node.process = None
                (self.workdir / f"nodes-{index}.conf").unlink(missing_ok=True)
                self.nodes[index] = Redis(
                    args=self._node_args(index), port=_cluster_port()
                )
        raise RuntimeError(f"cluster node {index} would not start on 5 port pairs")

    def ask(self, node: Redis, *command: str) -> Any:
        import redis

        with redis.Redis(
            port=node.port, decode_responses=True, socket_timeout=10
        ) as client:
            return client.execute_command(*command)

    def wait_until_ok(self, timeout: float = 60, *, joined: bool = False) -> None:
        """Until every running node says the cluster is ok, every slot served,
        and each primary has its replica; with ``joined``, until every node
        knows every other too."""
        deadline = time.monotonic() + timeout
        while True:
            running = [n for n in self.nodes if n.process is not None]
            states = [self.ask(n, "CLUSTER", "INFO") for n in running]
            known = f"cluster_known_nodes:{len(self.nodes)}\r\n"
            if (
                all("cluster_state:ok" in state for state in states)
                and all(known in state for state in states if joined)
                and all(
                    self.ask(n, "INFO", "replication").get("role")
                    in ("master", "slave")
                    for n in running
                )
            ):
                replicas = sum(
                    self.ask(n, "INFO", "replication").get("role") == "slave"
                    for n in running
                )
                if replicas == len(running) // 2:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster is not ok: {states}")
            time.sleep(0.05)

    def primary_of(self, key: str) -> Redis:
        """The node serving ``key``'s slot now."""
        slot = int(self.ask(self.nodes[0], "CLUSTER", "KEYSLOT", key))
        for start, end, primary, *_ in self.ask(self.nodes[0], "CLUSTER", "SLOTS"):
            if int(start) <= slot <= int(end):
                port = int(primary[1])
                return next(n for n in self.nodes if n.port == port)
        raise RuntimeError(f"no node serves slot {slot}")

    def node_id(self, node: Redis) -> str:
        return str(self.ask(node, "CLUSTER", "MYID"))

    def evidence(self, pattern: str = "*tasklock-alive*") -> str:
        """What each node holds and believes, for a failure message: its role
        and epochs, the slots it claims, and every key matching ``pattern``
        with its time to live (ms) and value."""
        lines = []
        for node in self.nodes:
            if node.process is None:
                lines.append(f"{node.address}: stopped")
                continue
            try:
                info = dict(
                    line.split(":", 1)
                    for line in str(self.ask(node, "CLUSTER", "INFO")).split()
                    if ":" in line
                )
                role = self.ask(node, "INFO", "replication").get("role")
                myself = next(
                    line
                    for line in str(self.ask(node, "CLUSTER", "NODES")).splitlines()
                    if "myself" in line
                )
                found = (
                    {
                        key: (self.ask(node, "PTTL", key), self.ask(node, "GET", key))
                        for key in self.ask(node, "KEYS", pattern)
                    }
                    if role == "master"
                    else "(a replica)"
                )
            except Exception as exc:  # evidence, never a failure of its own
                lines.append(f"{node.address}: {type(exc).__name__}: {exc}")
                continue
            lines.append(
                f"{node.address} {role} state={info.get('cluster_state')} "
                f"epoch={info.get('cluster_current_epoch')} "
                f"known={info.get('cluster_known_nodes')}\n  {myself}\n  {found}"
            )
        return "\n".join(lines)

    def move_slot(self, slot: int, source: Redis, target: Redis) -> int:
        """Move hash slot ``slot`` and its keys from ``source`` to ``target``,
        as ``redis-cli --cluster reshard`` does (IMPORTING/MIGRATING, MIGRATE
        in batches, then the new owner told to every primary); the keys moved.
        Clients see ASK while it moves and MOVED after."""
        import redis

        source_id, target_id = self.node_id(source), self.node_id(target)
        self.ask(target, "CLUSTER", "SETSLOT", str(slot), "IMPORTING", source_id)
        self.ask(source, "CLUSTER", "SETSLOT", str(slot), "MIGRATING", target_id)
        moved = 0
        with redis.Redis(port=source.port) as client:
            while True:
                keys = client.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 50)
                if not keys:
                    break
                client.execute_command(
                    "MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys
                )
                moved += len(keys)
        for node in (target, source, *self.nodes):
            if (
                node.process is not None
                and self.ask(node, "INFO", "replication").get("role") == "master"
            ):
                self.ask(node, "CLUSTER", "SETSLOT", str(slot), "NODE", target_id)
        return moved

    def flush(self) -> None:
        for node in self.nodes:
            if (
                node.process is not None
                and self.ask(node, "INFO", "replication").get("role") == "master"
            ):
                self.ask(node, "FLUSHALL")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


@dataclass
class Nutcracker(Server):
    """twemproxy (Debian's ``nutcracker``) in front of real memcached servers.

    It speaks the classic text protocol only: a meta command or a ``cas`` with a
    negative expiry makes it close the client's connection. Its stats listener
    gets a free port of its own, so several can run at once.
    """

    binary: str = "nutcracker"
    args: list[str] = field(default_factory=list)
    servers: list[Memcached] = field(default_factory=list)
    stats_port: int = field(default_factory=free_port)

    def command(self) -> list[str]:
        import tempfile

        lines = [
            "pool:",
            f"  listen: 127.0.0.1:{self.port}",
            "  hash: murmur",
            "  distribution: ketama",
            # A node that fails stays in the ring: its keys are never handed to
            # another node, so a lock cannot be taken twice there.
            "  auto_eject_hosts: false",
            "  timeout: 2000",
            "  servers:",
            *(f"   - {server.address}:1" for server in self.servers),
        ]
        config = Path(tempfile.mkdtemp(prefix="nutcracker-")) / "nutcracker.yml"
        config.write_text("\n".join(lines) + "\n")
        log = str(config.with_suffix(".log"))
        places = ["-c", str(config), "-o", log, "-s", str(self.stats_port)]
        return [*places, "-a", "127.0.0.1", *self.args]


class PreMetaMemcached:
    """A real memcached behind a proxy that answers like memcached 1.5.

    Classic commands go through to the server; meta commands (and, as an old
    server would read it, the data line after ``ms``) get ``ERROR``. It proves
    that the library falls back to ``gets``/``cas`` against a server without the
    meta protocol, with real storage semantics behind it.
    """

    STORAGE = {b"set", b"add", b"replace", b"append", b"prepend", b"cas"}
    MULTILINE = {b"get", b"gets", b"stats"}
    SINGLE = {b"delete", b"touch", b"incr", b"decr", b"flush_all", b"version"}

    def __init__(self, upstream: Memcached) -> None:
        import threading

        self.upstream = upstream
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.port: int = self.listener.getsockname()[1]
        self.meta_refused = 0
        self._stopped = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        import threading

        while not self._stopped:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        upstream = socket.create_connection(("127.0.0.1", self.upstream.port))
        reader, up_reader = conn.makefile("rb"), upstream.makefile("rb")
        try:
            while True:
                line = reader.readline()
                if not line:
                    return
                name = line.split(b" ", 1)[0].strip()
                if name in self.STORAGE:
                    size = int(line.split()[4])
                    upstream.sendall(line + reader.read(size + 2))
                    conn.sendall(up_reader.readline())
                elif name in self.MULTILINE:
                    upstream.sendall(line)
                    while True:
                        reply = up_reader.readline()
                        conn.sendall(reply)
                        if reply in (b"END\r\n", b"") or reply.startswith(b"ERROR"):
                            break
                elif name in self.SINGLE:
                    upstream.sendall(line)
                    conn.sendall(up_reader.readline())
                else:
                    if name.startswith(b"m"):
                        self.meta_refused += 1
                    conn.sendall(b"ERROR\r\n")
        except OSError:
            return
        finally:
            for closable in (reader, up_reader, conn, upstream):
                closable.close()

    def stop(self) -> None:
        self._stopped = True
        self.listener.close()


ROOT = Path(__file__).resolve().parent.parent


def celery_worker(
    app: str,
    name: str,
    concurrency: int,
    env: dict[str, str],
    *,
    loglevel: str = "ERROR",
    logfile: Path | None = None,
    stderr: int = subprocess.DEVNULL,
) -> subprocess.Popen[bytes]:
    """A real ``celery worker`` process with the prefork pool, quiet on the network
    (no gossip, mingle or heartbeat), started from the repository's root."""
    quiet = shlex.split("--without-gossip --without-mingle --without-heartbeat")
    command = [sys.executable, "-m", "celery", "-A", app, "worker", "-P", "prefork"]
    command += ["-c", str(concurrency), "-n", f"{name}@%h", *quiet, "-l", loglevel]
    if logfile is not None:
        command += ["-f", str(logfile)]
    return subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr
    )


def stop_and_wait(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it has stopped.

    The signal takes effect asynchronously: on a busy machine a server can still
    answer a request sent right after ``kill()`` returned, unless one waits for
    the kernel to report each thread stopped ("T" in /proc).
    """
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    tasks = Path(f"/proc/{pid}/task")
    while True:
        states = []
        for task in tasks.iterdir():
            try:
                stat = (task / "stat").read_text()
            except OSError:  # a thread that just ended
                continue
            states.append(stat.rsplit(")", 1)[1].split()[0])
        if states and all(state in ("T", "t") for state in states):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"process {pid} did not stop: thread states {states}")
        time.sleep(0.001)


def module_run(
    module: str, *args: str, timeout: float, measured: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m module args`` from the repository's root, as README says,
    and return what it did (exit code, stdout, stderr). ``measured``: whether
    coverage traces it (see ``unmeasured``)."""
    with contextlib.nullcontext() if measured else unmeasured():
        return subprocess.run(
            [sys.executable, "-m", module, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
        )


def run_module(module: str, *args: str, timeout: float, measured: bool = True) -> str:
    """``module_run``'s output, or a failure with what it printed."""
    result = module_run(module, *args, timeout=timeout, measured=measured)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def stop_process(process: subprocess.Popen[bytes], timeout: float = 30) -> None:
    """SIGTERM (a Celery worker's warm shutdown), then SIGKILL if it hangs."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
