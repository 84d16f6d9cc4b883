# One image for every celery_sched role in docker-compose.yml: migrate, worker,
# beat and flower all run the example project (examples/proj) with it.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# The package first, so editing the example does not reinstall dependencies.
# The solar extra (ephem) because the example's beat_schedule has a solar
# entry, which Celery refuses to build without it; web for the console
# service (`celery -A proj sched web`); flower for its service.
# tests/integration/test_image_env.py runs this very RUN line in a fresh venv.
COPY pyproject.toml README.md ./
COPY celery_sched ./celery_sched
RUN pip install ".[solar,web]" "flower>=2.0"

COPY examples ./examples
# `celery -A proj` imports proj from the working directory.
WORKDIR /app/examples

# Celery refuses to run a worker as root without a warning; run unprivileged.
RUN useradd --create-home --uid 1000 celery
USER celery

CMD ["celery", "-A", "proj", "worker", "--loglevel=INFO"]
