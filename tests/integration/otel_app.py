"""A Celery app instrumented by OpenTelemetry, run by the worker subprocess of
``test_opentelemetry.py``: every finished span is appended as one JSON line to
``OTEL_TEST_SPANS``. ``OTEL_TEST_BROKER`` is the broker URL and
``OTEL_TEST_QUEUE`` the queue its task is routed to.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from celery import Celery
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

TASK = "otel_app.touch"


class FileSpanExporter(SpanExporter):
    """Appends each span's ids, name and kind to a file, one JSON line each."""

    def __init__(self, path: str) -> None:
        self.path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with open(self.path, "a", encoding="utf-8") as out:
            for span in spans:
                context = span.get_span_context()
                parent = span.parent
                out.write(
                    json.dumps(
                        {
                            "name": span.name,
                            "kind": span.kind.name,
                            "trace_id": f"{context.trace_id:032x}",
                            "span_id": f"{context.span_id:016x}",
                            "parent_span_id": None if parent is None else f"{parent.span_id:016x}",
                            "task_id": (span.attributes or {}).get("messaging.message.id"),
                        }
                    )
                    + "\n"
                )
        return SpanExportResult.SUCCESS


def make_app(broker: str, queue: str) -> Celery:
    app = Celery("otel_app", broker=broker, set_as_current=False)
    app.conf.update(
        task_default_queue=queue,
        task_ignore_result=True,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
    )

    @app.task(name=TASK, shared=False)
    def touch(*args: Any, **kwargs: Any) -> None:
        """Runs, so the worker records a run span."""

    return app


app = make_app(
    os.environ.get("OTEL_TEST_BROKER", "redis://127.0.0.1:6379/0"),
    os.environ.get("OTEL_TEST_QUEUE", "otel_test"),
)

if "OTEL_TEST_SPANS" in os.environ:
    # The solo pool runs tasks in this process: instrumenting at import is enough.
    _provider = TracerProvider()
    _provider.add_span_processor(
        SimpleSpanProcessor(FileSpanExporter(os.environ["OTEL_TEST_SPANS"]))
    )
    CeleryInstrumentor().instrument(tracer_provider=_provider)
