"""Micro-benchmark of RedisStaging: bulk add, then pop everything in batches.

Usage: python benchmarks/staging.py [--n 100000] [--batch 1000] [--redis-url URL]

Prints one JSON object as its last line: ids/s for add and for pop.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import time
import uuid

import redis

from celery_sched.staging import RedisStaging
from tests.e2e.harness import unique_name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=100_000, help="ids to stage")
    parser.add_argument("--batch", type=int, default=1000, help="ids per pop")
    parser.add_argument(
        "--redis-url",
        default=os.environ.get("CELERY_SCHED_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"),
    )
    opts = parser.parse_args()

    prefix = unique_name("bench_staging")
    client = redis.Redis.from_url(opts.redis_url)
    staging = RedisStaging(client, prefix=prefix)
    now = dt.datetime.now(dt.UTC)
    items = [(uuid.uuid4(), now - dt.timedelta(microseconds=i)) for i in range(opts.n)]
    try:
        started = time.perf_counter()
        added = staging.add(0, items)
        add_seconds = time.perf_counter() - started

        popped = 0
        pops = 0
        started = time.perf_counter()
        while batch := staging.pop_due(0, now, opts.batch):
            popped += len(batch)
            pops += 1
        pop_seconds = time.perf_counter() - started
    finally:
        client.delete(staging.key(0))
        client.close()

    if added != opts.n or popped != opts.n:
        raise SystemExit(f"expected {opts.n} ids, added {added} and popped {popped}")
    print(
        json.dumps(
            {
                "benchmark": "staging",
                "ids": opts.n,
                "pop_batch": opts.batch,
                "add_seconds": round(add_seconds, 3),
                "adds_per_s": round(opts.n / add_seconds),
                "pop_seconds": round(pop_seconds, 3),
                "pops_per_s": round(opts.n / pop_seconds),
                "pop_calls": pops,
            }
        )
    )


if __name__ == "__main__":
    main()
