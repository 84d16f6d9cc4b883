"""The shard count the rows were placed for: ``placement``.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-05

- ``placement (singleton, shards, placed_at)``, at most one row: the value
  of ``celery_sched_shards`` every unfinished job row was last placed for.
  Shard 0's leader moves rows to the shard their key hashes to when its
  count differs, then records it; the table is how it knows a full pass is
  due without reading every row each pass.

Created empty: the count the existing rows were written with is not known,
so the first leader after the upgrade makes one full pass.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | None = None
depends_on: str | None = None


def _schema() -> str:
    schema: str = context.config.attributes["schema"]
    return schema


def upgrade() -> None:
    op.create_table(
        "placement",
        sa.Column("singleton", sa.Boolean(), server_default=sa.text("true"), nullable=False),
        sa.Column("shards", sa.SmallInteger(), nullable=False),
        sa.Column(
            "placed_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False
        ),
        sa.CheckConstraint("singleton", name="placement_singleton_check"),
        sa.PrimaryKeyConstraint("singleton"),
        schema=_schema(),
    )


def downgrade() -> None:
    op.drop_table("placement", schema=_schema())
