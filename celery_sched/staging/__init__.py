"""Staging: the near-future copy of due job ids, one sorted set per shard.

:class:`RedisStaging` is the real backend; :class:`MemoryStaging` is the
in-memory fake for unit tests. Both pass ``tests/contract/test_staging_contract.py``.
"""

from __future__ import annotations

from celery_sched.staging.memory import MemoryStaging
from celery_sched.staging.redis import RedisStaging

__all__ = ["MemoryStaging", "RedisStaging"]
