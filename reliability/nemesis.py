"""The fault checker's TCP proxy: one in front of every server, and the faults
it can put between clients and that server.

``Proxy(upstream_port)`` listens on a free loopback port and forwards each
connection to the server. Its faults, each until ``heal()``:

- ``delay(seconds)``: every chunk, either way, waits that long first;
- ``stall()``: nothing is forwarded (connections stay open, bytes wait);
- ``close_new()``: new connections are accepted and closed unanswered (a
  stopping server, a container's port proxy, a load balancer with no backend);
- ``reset()`` (at once): every open connection is reset (RST), mid-reply or not;
- ``drop(times)``: the next ``times`` replies are swallowed and their
  connections closed (the server acted; the client never hears).

A server that is down behind it is met as it would be behind a real port
proxy: the connection is accepted, then closed.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time


class Proxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(128)
        self.port: int = self.listener.getsockname()[1]
        self._mutex = threading.Lock()
        self._open: list[socket.socket] = []
        self._flowing = threading.Event()
        self._flowing.set()
        self._delay = 0.0
        self._closing_new = False
        self._drops = 0
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    # -- faults --------------------------------------------------------------

    def delay(self, seconds: float) -> None:
        self._delay = seconds

    def stall(self) -> None:
        self._flowing.clear()

    def close_new(self) -> None:
        self._closing_new = True

    def drop(self, times: int) -> None:
        with self._mutex:
            self._drops = times

    def reset(self) -> None:
        with self._mutex:
            doomed, self._open = self._open, []
        for sock in doomed:
            _reset(sock)

    def heal(self) -> None:
        self._delay = 0.0
        self._closing_new = False
        with self._mutex:
            self._drops = 0
        self._flowing.set()

    def close(self) -> None:
        self._closed = True
        self._flowing.set()
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self.reset()

    # -- forwarding ----------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self._closing_new:
                _close(client)
                continue
            try:
                upstream = socket.create_connection(
                    ("127.0.0.1", self.upstream_port), timeout=2
                )
                upstream.settimeout(None)
            except OSError:
                _close(client)  # the server is down: accepted, then closed
                continue
            with self._mutex:
                self._open += [client, upstream]
            for source, sink, replies in (
                (client, upstream, False),
                (upstream, client, True),
            ):
                threading.Thread(
                    target=self._pump, args=(source, sink, replies), daemon=True
                ).start()

    def _pump(self, source: socket.socket, sink: socket.socket, replies: bool) -> None:
        try:
            while data := source.recv(65536):
                self._flowing.wait()
                if self._delay:
                    time.sleep(self._delay)
                if replies:
                    with self._mutex:
                        dropping = self._drops > 0
                        if dropping:
                            self._drops -= 1
                    if dropping:
                        return
                sink.sendall(data)
        except OSError:
            pass
        finally:
            _close(source, sink)


def _close(*sockets: socket.socket) -> None:
    for sock in sockets:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            sock.close()


def _reset(sock: socket.socket) -> None:
    """Close with a reset (RST), not a clean FIN: SO_LINGER with a zero time."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()
