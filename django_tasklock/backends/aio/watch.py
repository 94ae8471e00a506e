"""The watch on async connections' replies: one thread per process, not a
timer per command or per connection on the event loop.

A connection (``Pipeline``) that sends with a timeout is watched from then
on. A few times a timeout, the thread looks at the first waiter in line of
each: the same one for a whole timeout means no reply came for that long
(a stalled server, a frozen network), and the connection is failed on its
own loop, every command in flight with it. The event loop pays nothing for
this: no timer in its heap, no call per command.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import asyncio
    from typing import Protocol

    class Pipeline(Protocol):
        """What the watch reads of a connection (``pipeline.Pipeline``)."""

        pending: Any
        broken: bool
        timeout: float
        loop: asyncio.AbstractEventLoop

        def stalled(self, head: Any) -> None: ...


__all__ = ["watch"]

#: How many looks a timeout is watched in: a stall is seen after a timeout
#: and at most a quarter more.
LOOKS = 4

_mutex = threading.Lock()
_watched: weakref.WeakSet[Pipeline] = weakref.WeakSet()
_thread: list[threading.Thread | None] = [None]
_pid = [os.getpid()]


def watch(conn: Pipeline) -> None:
    """Watch ``conn``'s replies from now on (its ``timeout``)."""
    with _mutex:
        if _pid[0] != os.getpid():  # a forked child: the thread stayed behind
            _pid[0], _thread[0] = os.getpid(), None
            _watched.clear()
        _watched.add(conn)
        thread = _thread[0]
        if thread is None or not thread.is_alive():
            thread = _thread[0] = threading.Thread(
                target=_run, name="tasklock-reply-watch", daemon=True
            )
            thread.start()


def _run() -> None:
    seen: weakref.WeakKeyDictionary[Pipeline, tuple[Any, float]] = (
        weakref.WeakKeyDictionary()
    )
    while True:
        with _mutex:
            conns = [conn for conn in _watched if not conn.broken]
            if not conns:  # nothing left to watch: the next watch() restarts it
                _thread[0] = None
                return
        now = time.monotonic()
        tick = min(min(conn.timeout for conn in conns), 60.0) / LOOKS
        for conn in conns:
            try:
                head = conn.pending[0]
            except IndexError:  # nothing awaited
                seen.pop(conn, None)
                continue
            last = seen.get(conn)
            if last is None or last[0] is not head:
                seen[conn] = (head, now)
            elif now - last[1] >= conn.timeout:
                seen.pop(conn, None)
                # (Its loop closed meanwhile: nothing left to fail.)
                with contextlib.suppress(RuntimeError):
                    conn.loop.call_soon_threadsafe(conn.stalled, head)
        del conns
        time.sleep(tick)
