"""The HTTP endpoint: ``/metrics``, ``/healthz`` and ``/readyz`` on one port.

A ``ThreadingHTTPServer`` on a daemon thread: a slow scraper holds only its
own thread, and the process exits without waiting for it. The health
endpoints answer 200 or 503 with one line per check. Nothing it does may
stop the process serving it: a port it cannot bind is logged and nothing is
served (:func:`start`).
"""

from __future__ import annotations

import http.server
import logging
import threading
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

logger = logging.getLogger(__name__)

#: A check answers ``(ok, body)``.
Check = Callable[[], tuple[bool, str]]


class MetricsServer:
    """Serves ``registry`` on ``/metrics`` and each check on its path.

    Binds in the constructor (raises ``OSError`` when the port is taken);
    :meth:`start` serves on a daemon thread, :meth:`stop` closes the socket.
    """

    def __init__(
        self, port: int, registry: CollectorRegistry, checks: dict[str, Check], *, host: str = ""
    ) -> None:
        self.registry = registry
        self.checks = checks
        handler = type("Handler", (_Handler,), {"owner": self})
        self._httpd = _Server((host, port), handler)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The port bound (the one asked for, or the one picked for 0)."""
        return int(self._httpd.server_address[1])

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.5},
            name="celery_sched-metrics",
            daemon=True,
        )
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._httpd.server_close()


def start(
    setting: str, port: int, registry: CollectorRegistry, checks: dict[str, Check]
) -> MetricsServer | None:
    """Serve on ``port`` (the value of ``setting``, named in the errors);
    ``None`` when it cannot, after logging why at ERROR. Never raises."""
    try:
        server = MetricsServer(port, registry, checks)
        server.start()
    except OSError as exc:
        logger.error(
            "celery_sched: cannot serve metrics on port %d (%s): %s; set %s to a free port "
            "(0 turns metrics off). Going on without metrics.",
            port,
            setting,
            exc.strerror or exc,
            setting,
        )
        return None
    except Exception:
        logger.exception("celery_sched: cannot serve metrics on port %d (%s)", port, setting)
        return None
    logger.info("celery_sched: serving /metrics, /healthz and /readyz on port %d", server.port)
    return server


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True


class _Handler(http.server.BaseHTTPRequestHandler):
    owner: MetricsServer
    protocol_version = "HTTP/1.0"

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        try:
            if path == "/metrics":
                encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
                self._reply(200, encoder(self.owner.registry), content_type)
                return
            check = self.owner.checks.get(path)
            if check is None:
                self._reply(404, b"not found: try /metrics, /healthz or /readyz\n")
                return
            ok, text = check()
            self._reply(200 if ok else 503, text.encode() + b"\n")
        except Exception:
            logger.exception("celery_sched: metrics request %s failed", path)
            self._reply(500, b"internal error (logged)\n")

    def _reply(
        self, status: int, body: bytes, content_type: str = "text/plain; charset=utf-8"
    ) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            pass  # the client went away

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("metrics: %s - %s", self.address_string(), format % args)
