"""The suite's own servers: one started on a port another server has is
refused, never taken for the one just started (a session's server stopped by
a test and started again once met another worker's in its place)."""

from __future__ import annotations

import pytest

from tests.services import Memcached, Redis


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
