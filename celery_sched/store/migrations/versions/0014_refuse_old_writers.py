"""Refuse keyed jobs from writers older than 0012, which would store a key twice.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-07

Clients from before 0012 relied on the unique index on ``jobs.key`` that
0012 replaced with ``job_keys``: one still running after ``sched migrate``
wrote keyed rows without an entry, so it and a new client could both store
one key. Every connection of this code now says the revision it writes for
(the session setting ``celery_sched.writer_revision``, sent at start-up or
with each transaction behind PgBouncer; ``store/postgres/connection.py``).
``jobs_key_entry`` is a deferred constraint trigger for the rows of writers
that do not say it: at commit, each such row that takes an entry (a caller
key, or an id that is not a version-7 UUID; ``store/postgres/keys.py``)
must find it, with its own id, in ``job_keys``, or the transaction fails
with a foreign-key violation naming ``job_keys``.

The trigger's WHEN clause filters the rows of current writers (and every
row that takes no entry) as they are written: they are never queued, so
``schedule_many`` pays one setting look-up per row (README, "Storage that
stays flat").
Rows written before this revision are not checked.
"""

from __future__ import annotations

from alembic import context, op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | None = None
depends_on: str | None = None


def _schema() -> str:
    schema: str = context.config.attributes["schema"]
    return schema


def upgrade() -> None:
    schema = _schema()
    # Schema-qualified: the trigger runs under the writer's search_path.
    op.execute(
        f"""
        CREATE FUNCTION "{schema}".jobs_key_entry_check() RETURNS trigger
        LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM 1 FROM "{schema}".job_keys
            WHERE key = coalesce(NEW.key, NEW.id::text) AND job_id = NEW.id;
            IF NOT FOUND THEN
                RAISE EXCEPTION
                    'job % (key %) has no job_keys entry: a client from before '
                    'migration 0012 wrote it; stop it and upgrade it '
                    '(README, "Storage that stays flat")',
                    NEW.id, coalesce(NEW.key, NEW.id::text)
                    USING ERRCODE = 'foreign_key_violation', TABLE = 'job_keys';
            END IF;
            RETURN NULL;
        END
        $$
        """
    )
    # WHEN is evaluated as the row is written, so the rows it filters are
    # never queued for the commit-time check: those of writers that say
    # revision 0014 or later (the revisions compare as text), and those
    # that take no entry (key NULL and a version-7 id: the 15th character
    # of its text is the version).
    op.execute(
        f"""
        CREATE CONSTRAINT TRIGGER jobs_key_entry AFTER INSERT ON "{schema}".jobs
        DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
        WHEN (coalesce(current_setting('celery_sched.writer_revision', true), '') < '0014'
              AND (NEW.key IS NOT NULL OR substr(NEW.id::text, 15, 1) <> '7'))
        EXECUTE FUNCTION "{schema}".jobs_key_entry_check()
        """
    )


def downgrade() -> None:
    schema = _schema()
    op.execute(f'DROP TRIGGER jobs_key_entry ON "{schema}".jobs')
    op.execute(f'DROP FUNCTION "{schema}".jobs_key_entry_check()')
