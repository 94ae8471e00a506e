"""Fault case 27: memcached over its connection limit answers ``ERROR Too many
open connections`` and closes. That must stay a transient error: never taken
for "no meta commands" (the classic protocol for good) or "no stats" (restart
detection off for good)."""

from __future__ import annotations

import signal
import socket

from reliability.faults import Row, use_cache
from tests.helpers import wait_until
from tests.services import Memcached


def _fill(server: Memcached) -> list[socket.socket]:
    """Open connections until the server refuses one; keep them open."""
    held = []
    while len(held) < 50:
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        sock.sendall(b"mn\r\n")
        if sock.recv(100).startswith(b"ERROR Too many open connections"):
            sock.close()
            break
        held.append(sock)
    return held


def connection_limit(tries: int) -> Row:
    """Per try: every connection slot taken, then a lock tried (it must fail
    naming the server's reason), the slots freed, and the lock tried again (it
    must be taken with meta commands). Then the server is SIGKILLed and
    restarted: restart detection must still refuse new locks on it."""
    from django.test import override_settings

    from django_tasklock import Lock, LockBackendError
    from django_tasklock.backends import close_thread_connections
    from django_tasklock.backends import memcached as backend

    server = Memcached(args=["-c", "20"]).start()  # room for 4 connections
    address = ("127.0.0.1", server.port)
    attempts = wrong = named = verdicts = taken = detected = 0
    try:
        with (
            use_cache(server.address),
            override_settings(
                TASKLOCK={"CACHE": "default", "LOCK_EXPIRE": 60, "RESTART_GRACE": 60}
            ),
        ):
            for attempt in range(tries):
                attempts += 1
                close_thread_connections()
                held = _fill(server)
                try:
                    Lock(f"limit-{attempt}").acquire()
                except LockBackendError as exc:
                    named += "Too many open connections" in str(exc)
                finally:
                    for sock in held:
                        sock.close()
                # The server frees the slots when it sees them closed.
                wait_until(server.idle, 10)
                verdicts += address in backend._classic_servers
                verdicts += address in backend._unlearnable
                holder = Lock(f"limit-{attempt}")
                taken += holder.acquire() and server.raw(
                    f"mg :1:limit-{attempt} f".encode()
                ).startswith(b"HD f16")  # stored by a meta command
            server.stop(signal.SIGKILL)
            server.start()
            try:
                Lock("limit-after-restart").acquire()
            except LockBackendError as exc:
                detected += "restarted" in str(exc)
    finally:
        close_thread_connections()
        server.stop()
    wrong = (attempts - named) + verdicts + (attempts - taken) + (1 - detected)
    row = Row("27. memcached over its connection limit", attempts, None, wrong)
    row.figures.append(
        f"refused naming the server's reason {named}/{attempts}; taken as 'no meta "
        f"commands' or 'no stats' {verdicts}; locked with meta commands once free "
        f"{taken}/{attempts}; restart detected after {detected}/1"
    )
    return row


def run(quick: bool) -> list[Row]:
    return [connection_limit(2 if quick else 5)]
