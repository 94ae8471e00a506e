"""A local HTTP server for the fixture feeds, slow on purpose.

Each response waits ``delay`` seconds, so an import takes long enough that two
imports of one feed at the same moment would be seen. Nothing reaches the
internet: the demo and the tests import from here.
"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "feeds" / "fixtures"
CONTENT_TYPES = {".rss": "application/rss+xml", ".atom": "application/atom+xml"}


class FeedServer:
    """Serves ``fixtures/<path>`` on a free loopback port in a background thread."""

    def busiest(self, seconds: float) -> int:
        """The most requests that arrived within any ``seconds``."""
        times = sorted(self.arrivals)
        best = start = 0
        for end, at in enumerate(times):
            while at - times[start] >= seconds:
                start += 1
            best = max(best, end - start + 1)
        return best

    def __init__(self, delay: float = 0.3) -> None:
        self.delay = delay
        self.requests = 0
        #: When each request arrived (time.monotonic()).
        self.arrivals: list[float] = []
        #: Answer 429 with this Retry-After (seconds) while set.
        self.throttle: int | None = None
        #: Requests being answered now, and the most at one moment.
        self.in_flight = self.peak = 0
        self._count = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                with server._count:
                    server.requests += 1
                    server.arrivals.append(time.monotonic())
                if server.throttle is not None:
                    self.send_response(429)
                    self.send_header("Retry-After", str(server.throttle))
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                with server._count:
                    server.in_flight += 1
                    server.peak = max(server.peak, server.in_flight)
                try:
                    time.sleep(server.delay)  # the slow work a fetch waits for
                finally:
                    with server._count:
                        server.in_flight -= 1
                # Uncounted from here: once the client has the whole answer it
                # frees its slot, and the next fetch may arrive before this
                # thread runs again (a loaded CI's demo counted 3 of 2 so).
                self._answer()

            def _answer(self) -> None:
                path = (FIXTURES / self.path.lstrip("/")).resolve()
                if FIXTURES not in path.parents or not path.is_file():
                    self.send_error(404, "no such feed")
                    return
                body = path.read_bytes()
                self.send_response(200)
                self.send_header(
                    "Content-Type", CONTENT_TYPES.get(path.suffix, "text/xml")
                )
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port: int = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}"

    def feed_urls(self) -> list[str]:
        return [
            self.url(f"feeds/{p.name}") for p in sorted((FIXTURES / "feeds").iterdir())
        ]

    def start(self) -> FeedServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join()
