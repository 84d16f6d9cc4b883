"""``sched reshard``: move job rows to the shard their key hashes to, now.

What shard 0's leader does a bounded batch at a time after
``celery_sched_shards`` changed (:mod:`celery_sched.leader.rehoming`), at
once: rows stranded in shards no beat leads first, then every unfinished row
in id order; then the count is recorded so the leader's full pass is not
repeated. Safe while beats and workers run: each row moves in its own
re-checked update, a batch per transaction.
"""

from __future__ import annotations

import click

from celery_sched.cli.base import clean_errors, client_of, echo_json, sched
from celery_sched.cli.progress import on_terminal, progress_bar
from celery_sched.leader.rehoming import reshard as reshard_pass
from celery_sched.models import UNFINISHED_STATUSES, RehomeResult


@sched.command()
@click.option("--dry-run", is_flag=True, help="Count what would move; move nothing.")
@click.option(
    "--batch",
    type=click.IntRange(min=1, max=100_000),
    default=None,
    help="Rows read and moved per transaction (default: celery_sched_batch_size).",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object: what was read and moved.")
@click.pass_context
def reshard(ctx: click.Context, dry_run: bool, batch: int | None, as_json: bool) -> None:
    """Move unfinished jobs to the shard their key hashes to under celery_sched_shards.

    Needed after the shard count changed, only to do at once what shard 0's
    leader does by itself a few batches per pass. On a terminal a progress
    bar counts the unfinished rows read.
    """
    client = client_of(ctx)
    settings = client.settings
    size = batch or settings.batch_size
    shards = settings.shards
    with clean_errors(), client:
        counts = client.counts_by_status()
        total = sum(counts.get(status, 0) for status in UNFINISHED_STATUSES)
        with progress_bar("Counting" if dry_run else "Resharding", unit="row", total=total) as bar:

            def on_batch(result: RehomeResult) -> None:
                bar.update(result.scanned)
                if on_terminal():
                    bar.set_postfix(moved=len(result.moved))

            report = reshard_pass(
                client.store,
                shards=shards,
                shard_of=client.builder.shard_of,
                batch=size,
                dry_run=dry_run,
                on_batch=on_batch,
            )
    moves = [
        {"from_shard": source, "to_shard": target, "jobs": count}
        for (source, target), count in sorted(report.by_shards.items())
    ]
    if as_json:
        echo_json(
            {
                "shards": shards,
                "dry_run": dry_run,
                "scanned": report.scanned,
                "moved": report.moved,
                "batches": report.batches,
                "moves": moves,
            }
        )
        return
    verb = "would move" if dry_run else "moved"
    click.echo(
        f"{shards} shard(s): read {report.scanned} unfinished job(s) in {report.batches} "
        f"batch(es), {verb} {report.moved}."
    )
    for move in moves:
        click.echo(f"  shard {move['from_shard']} -> {move['to_shard']}: {move['jobs']}")
