#!/usr/bin/env bash
# Regenerate docs/screenshots/*.png, the web console pages README.md shows:
# demo data in a throwaway schema of the local PostgreSQL (dropped after),
# the console on a free loopback port, and headless Chromium (scripts/browser.sh)
# driven by the browser test's own code. Tests never write into the tree; this does.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/bootstrap.sh --python-only
bash scripts/browser.sh
mkdir -p docs/screenshots

"$ROOT/.venv/bin/python" - <<'PY'
from __future__ import annotations

import os
import uuid
from pathlib import Path

from celery_sched.client import Client
from celery_sched.settings import Settings
from tests.e2e.harness import drop_schema
from tests.integration import cli_app
from tests.integration.test_web_browser import seed_demo, serving, take_screenshots

url = os.environ.get("CELERY_SCHED_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
schema = f"screenshots_{uuid.uuid4().hex[:8]}"
settings = Settings(
    database_url=url,
    redis_url=os.environ.get("CELERY_SCHED_REDIS_URL", "redis://127.0.0.1:6379/0"),
    db_schema=schema,
    key_prefix=schema,
)
try:
    with Client(cli_app.app, settings=settings) as client:
        client.migrate()
        seed_demo(client)
        with serving(client) as base:
            for shot in take_screenshots(base, Path("docs/screenshots")):
                print(f"screenshots.sh: wrote {shot}")
finally:
    drop_schema(url, schema)
PY
