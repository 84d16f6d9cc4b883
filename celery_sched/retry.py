"""The one retry helper: bounded retries of transient failures, with backoff.

Backends wrap each I/O operation in :func:`call_with_retry`, naming the
exceptions that are transient for their driver and how to translate the final
failure into a celery_sched error. Each retry logs a WARNING with the
sanitized URL, never a password.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

from celery_sched.errors import CelerySchedError

logger = logging.getLogger(__name__)

T = TypeVar("T")


def call_with_retry(
    fn: Callable[[], T],
    *,
    transient: tuple[type[BaseException], ...],
    translate: Callable[[BaseException], CelerySchedError],
    what: str,
    url: str,
    attempts: int = 4,
    backoff: float = 0.25,
    max_delay: float = 5.0,
    sleep: Callable[[float], None] = time.sleep,
    delays: Iterable[float] | None = None,
) -> T:
    """Call ``fn``; on a ``transient`` exception retry up to ``attempts`` times.

    The delay starts at ``backoff`` seconds and doubles, capped at
    ``max_delay``; or, given ``delays``, each retry waits the next of them
    (the last one again once they run out). When every attempt failed, raise
    ``translate(exc)`` from the last exception. Non-transient exceptions
    propagate at once.
    """
    given = None if delays is None else iter(delays)
    delay = backoff
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except transient as exc:
            if attempt == attempts:
                raise translate(exc) from exc
            if given is not None:
                delay = next(given, delay)
            logger.warning(
                "%s failed (attempt %d/%d) against %s: %s: %s; retrying in %.2fs",
                what,
                attempt,
                attempts,
                url,
                type(exc).__name__,
                _first_line(exc),
                delay,
            )
            sleep(delay)
            if given is None:
                delay = min(delay * 2, max_delay)
    raise AssertionError("unreachable")  # pragma: no cover


def _first_line(exc: BaseException) -> str:
    # Driver messages can span lines (DETAIL, HINT, the SQL); the first line
    # names the problem and carries no parameters.
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else "(no message)"
