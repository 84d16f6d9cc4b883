"""Which claims went out: ``jobs.claim_id`` and ``published_claims``.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-07

- ``jobs.claim_id``: a random number per claim, set on every row it
  dispatches.
- ``published_claims (claim_id PRIMARY KEY, shard, published_at)``: one row
  per claim whose messages went out, written by the beat after the publish.

The reconciler marks a dispatched job of a task that no worker tracks
``sent`` only when its claim is in ``published_claims``; any other is
requeued (before 0013 every such job ended ``sent``, so a job claimed by a
beat that died before publishing it was never run). Rows dispatched before
0013 have no ``claim_id`` and keep the old rule.

Adding a nullable column without a default changes only the catalogs: no
row is rewritten, on any partition.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | None = None
depends_on: str | None = None


def _schema() -> str:
    schema: str = context.config.attributes["schema"]
    return schema


def upgrade() -> None:
    schema = _schema()
    op.add_column("jobs", sa.Column("claim_id", sa.BigInteger, nullable=True), schema=schema)
    op.create_table(
        "published_claims",
        sa.Column("claim_id", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("shard", sa.SmallInteger, nullable=False),
        sa.Column(
            "published_at",
            sa.DateTime(timezone=True),
            nullable=False,
            server_default=sa.text("now()"),
        ),
        schema=schema,
    )
    op.create_index("published_claims_at_idx", "published_claims", ["published_at"], schema=schema)


def downgrade() -> None:
    schema = _schema()
    op.drop_table("published_claims", schema=schema)
    op.drop_column("jobs", "claim_id", schema=schema)
