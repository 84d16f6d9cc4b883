"""``python -m celery_sched.store.postgres``: print the named statements of
:mod:`~celery_sched.store.postgres.statements` as SQL, ready for ``EXPLAIN``."""

from __future__ import annotations

import argparse
import sys

from celery_sched.settings import Settings
from celery_sched.store.postgres.statements import render


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m celery_sched.store.postgres", description=render.__doc__
    )
    parser.add_argument("--schema", default=Settings().db_schema, help="the schema's name")
    parser.add_argument("names", nargs="*", metavar="STATEMENT", help="only these statements")
    args = parser.parse_args(argv)
    try:
        sql = render(args.schema, args.names or None)
    except ValueError as exc:
        parser.error(str(exc))
    sys.stdout.write(sql)


if __name__ == "__main__":
    main()
