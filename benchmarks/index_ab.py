"""What an index costs the hot paths: claims and bulk scheduling with and without it.

Runs ``benchmarks/claim.py`` and ``benchmarks/bulk_schedule.py`` as they
are, alternating invocations with the schema as migrated ("with") and with
the named indexes dropped right after migrating ("without"), ``--pairs``
times each, so that the machine's drift falls on both sides alike. Reports
the median of each side and the ratios with/without (1.0: no cost; the
target of #16 for the indexes the CLI listings need is within 10%, a ratio
of at least 0.9).

    .venv/bin/python benchmarks/index_ab.py [--index jobs_dead_idx] [--pairs 3]
        [--future 1000000] [--jobs 1000000]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from _common import emit, load_avg, median, progress, rounded

HERE = Path(__file__).resolve().parent
TARGET_RATIO = 0.9


def invoke(script: str, args: list[str]) -> dict[str, Any]:
    """Run one benchmark script; its last stdout line is its JSON result."""
    done = subprocess.run(
        [sys.executable, str(HERE / script), *args],
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    )
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--index", action="append", default=None, metavar="NAME")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--future", type=int, default=1_000_000, help="claim.py --future")
    parser.add_argument("--jobs", type=int, default=1_000_000, help="bulk_schedule.py --jobs")
    ns = parser.parse_args()
    indexes: list[str] = ns.index or ["jobs_dead_idx"]
    drop = [arg for name in indexes for arg in ("--without-index", name)]
    load_start = load_avg()

    claims: dict[str, list[float]] = {"with": [], "without": []}
    bulk: dict[str, list[float]] = {"with": [], "without": []}
    for pair in range(ns.pairs):
        for side in ("with", "without"):
            extra = drop if side == "without" else []
            # claim.py: only the beat's claim loop count, on --future rows,
            # on the store's (partitioned) jobs table only.
            claim = invoke(
                "claim.py",
                ["--future", str(ns.future), "--claimers", "3", "--layouts", "partitioned", *extra],
            )
            claims[side].append(float(claim["rows_per_s"][str(ns.future)]))
            loaded = invoke("bulk_schedule.py", ["--jobs", str(ns.jobs), "--runs", "1", *extra])
            bulk[side].append(float(loaded["schedule_many_jobs_per_s"]))
            progress(
                "pair %d, %s %s: claims %.0f rows/s, schedule_many %.0f jobs/s",
                pair + 1,
                side,
                ", ".join(indexes),
                claims[side][-1],
                bulk[side][-1],
            )

    def ratio(runs: dict[str, list[float]]) -> float | None:
        with_, without = median(runs["with"]), median(runs["without"])
        return rounded(with_ / without, 3) if with_ and without else None

    claim_ratio, bulk_ratio = ratio(claims), ratio(bulk)
    emit(
        {
            "benchmark": "index_ab",
            "indexes": indexes,
            "pairs": ns.pairs,
            "claim_rows_per_s": {side: rounded(median(v), 0) for side, v in claims.items()},
            "claim_runs": claims,
            "schedule_many_jobs_per_s": {side: rounded(median(v), 0) for side, v in bulk.items()},
            "schedule_many_runs": bulk,
            "claim_ratio_with_vs_without": claim_ratio,
            "bulk_ratio_with_vs_without": bulk_ratio,
            "target_ratio": TARGET_RATIO,
            "met": bool(
                claim_ratio
                and bulk_ratio
                and claim_ratio >= TARGET_RATIO
                and bulk_ratio >= TARGET_RATIO
            ),
            "load_avg_1m_start": load_start,
            "load_avg_1m_end": load_avg(),
        }
    )


if __name__ == "__main__":
    main()
