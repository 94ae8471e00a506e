"""A TCP proxy in front of a real server that can lose replies on purpose.

``drop_replies(pattern, times)``: the next ``times`` requests whose bytes contain
``pattern`` reach the server, which carries them out, but the proxy closes the
client's connection instead of passing the reply back: a reply lost after the
store acted, as a dropped connection or a failing network produces it.
``refuse(pattern)``: requests whose bytes contain ``pattern`` never reach the
server (the connection is closed instead) until ``heal()``: a network partition
for that kind of request, so a test can hold one call's effect in place while it
looks at it. ``dropped`` counts the replies it withheld and ``refused`` the
requests it kept from the server, so a test can tell the fault happened;
``requests`` counts the writes clients sent through it: one per round trip for a
client that sends each request, pipelined or not, in one write and waits for the
answer. ``split_replies(at)`` passes each reply on in two writes, its first
``at`` bytes and, a moment later, the rest, as a slow network may deliver it;
``split`` counts the replies it cut. ``hold(*patterns)`` keeps requests whose
bytes contain one of ``patterns`` from the server until ``let_go()``; ``held`` counts
them, so a test can act while a call waits on that request.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class FaultProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port: int = self.listener.getsockname()[1]
        self.dropped = 0
        self.refused = 0
        self.requests = 0
        self.split = 0
        self._split_at = 0
        self._pattern = b""
        self._times = 0
        self._refusing = b""
        self.held = 0
        self._holding: tuple[bytes, ...] = ()
        self._let_go = threading.Event()
        self._mutex = threading.Lock()
        self._connections: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def drop_replies(self, pattern: bytes, times: int = 1) -> None:
        with self._mutex:
            self._pattern, self._times = pattern, times

    def refuse(self, pattern: bytes) -> None:
        with self._mutex:
            self._refusing = pattern

    def split_replies(self, at: int) -> None:
        with self._mutex:
            self._split_at = at

    def hold(self, *patterns: bytes) -> None:
        with self._mutex:
            self._holding = patterns
            self._let_go.clear()

    def let_go(self) -> None:
        with self._mutex:
            self._holding = ()
        self._let_go.set()

    def heal(self) -> None:
        """Every request and reply passes again, whole."""
        with self._mutex:
            self._pattern, self._times, self._refusing = b"", 0, b""
            self._split_at = 0

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            with self._mutex:
                self._connections += [client, upstream]
            doomed = threading.Event()
            threading.Thread(
                target=self._forward_requests,
                args=(client, upstream, doomed),
                daemon=True,
            ).start()
            threading.Thread(
                target=self._forward_replies,
                args=(upstream, client, doomed),
                daemon=True,
            ).start()

    def _forward_requests(
        self, client: socket.socket, upstream: socket.socket, doomed: threading.Event
    ) -> None:
        try:
            while data := client.recv(65536):
                with self._mutex:
                    self.requests += 1
                    if self._refusing and self._refusing in data:
                        self.refused += 1
                        return
                    if self._times and self._pattern in data:
                        self._times -= 1
                        doomed.set()
                    holding = any(pattern in data for pattern in self._holding)
                    if holding:
                        self.held += 1
                if holding:
                    self._let_go.wait(timeout=60)
                upstream.sendall(data)
        except OSError:
            pass
        finally:
            _close(client, upstream)

    def _forward_replies(
        self, upstream: socket.socket, client: socket.socket, doomed: threading.Event
    ) -> None:
        try:
            while data := upstream.recv(65536):
                if doomed.is_set():
                    # The server answered, so it acted: lose the answer.
                    with self._mutex:
                        self.dropped += 1
                    return
                at = self._split_at
                if 0 < at < len(data):
                    # The client reads the first piece alone: it is sent well
                    # before the rest.
                    client.sendall(data[:at])
                    time.sleep(0.05)
                    data = data[at:]
                    with self._mutex:
                        self.split += 1
                client.sendall(data)
        except OSError:
            pass
        finally:
            _close(client, upstream)

    def close(self) -> None:
        # shutdown() wakes the blocked accept(); close() alone would leave it
        # accepting one more connection.
        _close(self.listener)
        self._let_go.set()
        with self._mutex:
            connections, self._connections = self._connections, []
        _close(*connections)


def _close(*sockets: socket.socket) -> None:
    for sock in sockets:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()
