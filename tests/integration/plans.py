"""Query-plan checks that hold whatever the time of day.

A test's jobs, spread over hours from now, may leave only a few rows (or
none) in one day's partition near midnight; a sequential scan of such a
partition is the planner's right choice. What a plan test guards is that
no partition holding many rows is read whole.
"""

from __future__ import annotations

import psycopg

from celery_sched.settings import Settings


def large_partitions(settings: Settings, at_least: int = 1000) -> list[str]:
    """The partitions of the test schema's ``jobs`` holding ``at_least`` rows."""
    with psycopg.connect(settings.libpq_conninfo(), autocommit=True) as conn:
        rows = conn.execute(
            f'SELECT tableoid::regclass::text FROM "{settings.db_schema}".jobs '
            "GROUP BY 1 HAVING count(*) >= %s",
            (at_least,),
        ).fetchall()
    return [str(name).rsplit(".", 1)[-1].strip('"') for (name,) in rows]


def assert_no_large_partition_read_whole(plan: str, settings: Settings) -> None:
    large = large_partitions(settings)
    assert large, "the test loaded no partition of 1,000 rows or more"
    for name in large:
        # A partition's scan names it, then its alias.
        assert f"Seq Scan on {name} " not in plan, plan
