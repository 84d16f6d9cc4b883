"""The leader's presence: a report of who leads the shard, after its passes.

``sched leader`` shows, per shard, the lease's holder and time left (from
the lease itself) and the end of the leader's last pass: a leader whose
lease is renewed (its renewal has a thread of its own) but whose loop is
stuck shows an old last pass. The report is posted to the
:class:`~celery_sched.interfaces.LeaderBoard` at the end of a pass, at most
once per :data:`INTERVAL` (one small Redis write; a busy leader passes many
times a second), and at once after an election.

Only informative: a failed post is logged once per outage and never backs
the loop off or counts as a failed pass.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING

from celery_sched.errors import CelerySchedError
from celery_sched.models import LeaderReport

if TYPE_CHECKING:
    from celery_sched.interfaces import LeaderBoard
    from celery_sched.leader.clock import StoreClock

logger = logging.getLogger(__name__)

#: Least seconds between two posts of one leader.
INTERVAL = 1.0


class Presence:
    """Posts this process's leader report for ``shard``."""

    def __init__(
        self,
        board: LeaderBoard,
        *,
        shard: int,
        store_clock: StoreClock,
        clock: Callable[[], float],
        host: str | None = None,
        pid: int | None = None,
    ) -> None:
        self.board = board
        self.shard = shard
        self._store_clock = store_clock
        self._clock = clock
        self.host = host or socket.gethostname()
        self.pid = os.getpid() if pid is None else pid
        self._next = 0.0
        self._failing = False

    def elected(self) -> None:
        """Post after the next pass, whenever the last post was."""
        self._next = 0.0

    def run(self, epoch: int) -> bool:
        """Post the report of a pass that just ended, unless one was posted
        less than :data:`INTERVAL` ago; True if it was posted."""
        now = self._clock()
        if now < self._next:
            return False
        self._next = now + INTERVAL
        try:
            self.board.post(
                LeaderReport(
                    shard=self.shard,
                    host=self.host,
                    pid=self.pid,
                    epoch=epoch,
                    pass_at=self._store_clock.now(),
                )
            )
        except CelerySchedError as exc:
            if not self._failing:
                logger.warning(
                    "shard %d: cannot post the leader report (%s); `sched leader` will show "
                    "an old last pass until it can",
                    self.shard,
                    exc,
                )
            self._failing = True
            return False
        self._failing = False
        return True
