"""The suite's own servers: one started on a port another server has is
refused, never taken for the one just started (a session's server stopped by
a test and started again once met another worker's in its place)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.services import Memcached, Redis, Sentinel, free_port


@pytest.mark.parametrize("kind", [Memcached, Redis], ids=["memcached", "redis"])
def test_a_server_whose_port_another_has_is_refused_at_start(kind):
    first = kind().start()
    try:
        assert first.serving_pid() == first.process.pid
        second = kind(port=first.port)
        with pytest.raises(RuntimeError):
            second.start()
        assert second.process is None or second.process.poll() is not None
        assert first.serving_pid() == first.process.pid  # still the first's
    finally:
        first.stop()


def test_a_sentinel_whose_port_another_has_is_refused_at_start():
    primary = Redis().start()
    try:
        watcher = Sentinel(primary=primary, port=primary.port)
        with pytest.raises(RuntimeError):
            watcher.start()
        assert watcher.process is None or watcher.process.poll() is not None
        first = Sentinel(primary=primary).start()
        try:
            assert first.serving_pid() == first.process.pid
        finally:
            first.stop()
    finally:
        primary.stop()


def test_drawn_ports_are_below_the_ephemeral_range():
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
    low = int(ephemeral.split()[0])
    assert all(1024 <= free_port() < min(low, 10000) for _ in range(200))


@pytest.mark.parametrize("kind", [Memcached, Redis], ids=["memcached", "redis"])
def test_a_drawn_port_another_process_took_is_drawn_again_at_first_start(kind):
    server = kind()
    taken = server.port
    other = kind(port=taken).start()  # takes it between the draw and the bind
    try:
        server.start()
        try:
            assert server.port != taken
            assert server.serving_pid() == server.process.pid
        finally:
            server.stop()
        assert other.serving_pid() == other.process.pid  # left alone
    finally:
        other.stop()
    # Started again after a stop, it keeps its port (none is drawn again).
    server.start()
    try:
        assert server.serving_pid() == server.process.pid
    finally:
        server.stop()
