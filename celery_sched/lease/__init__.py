"""The leader lease: which beat process may dispatch a shard.

- :mod:`celery_sched.lease.elector`: :class:`~celery_sched.lease.elector.LeaderElector`,
  which competes for the lease, renews it on its own thread, and bumps the
  shard's fencing epoch when it wins.
- :mod:`celery_sched.lease.redis`: the Redis backend (Lua scripts in ``lua/``).
- :mod:`celery_sched.lease.memory`: the in-memory fake for unit tests.
"""
