"""The leader lease: which beat process may dispatch a shard.

- :mod:`celery_sched.lease.elector`: :class:`~celery_sched.lease.elector.LeaderElector`,
  which competes for the lease, renews it on its own thread, and bumps the
  shard's fencing epoch when it wins.
- :mod:`celery_sched.lease.redis`: the Redis backend (Lua scripts in ``lua/``).
- :mod:`celery_sched.lease.board`: the leader board on Redis (who leads each
  shard, the lease's time left, the leader's last pass), for operators.
- :mod:`celery_sched.lease.membership`: the live beats of a fleet that shares
  the shards (a Redis sorted set), read by :mod:`celery_sched.leader.fleet`.
- :mod:`celery_sched.lease.memory`: the in-memory fakes for unit tests.
"""
