"""One-off jobs from a CSV or JSON-lines file, into ``Client.schedule_many``.

Each row is one job with the fields a ``schedule_many`` row takes: ``task``,
``key``, ``eta`` (``due`` is the same), ``countdown``, ``args``, ``kwargs``
and the options (``queue``, ``priority``, ``expires``, ...). A CSV file has
a header row naming its columns; its cells are text, read by column (JSON
for ``args``, ``kwargs`` and ``headers``, numbers for the numeric options,
an empty cell is no value). A JSON-lines file has one JSON object per line.

The rule of :func:`import_rows`: every row is validated on its own before
anything is written; a row that fails is refused (with its line number and
reason) and the others go on. Valid rows are written in chunks, each one
all-or-nothing transaction: a chunk the store refuses as a whole (a key
already stored) writes none of its rows and is reported with its lines.
"""

from __future__ import annotations

import csv
import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator
from pathlib import PurePath
from typing import Any

from celery_sched.client import Client
from celery_sched.errors import DuplicateJob, InvalidImport, InvalidJob
from celery_sched.transfer import json_text
from celery_sched.validation import ALLOWED_OPTIONS

FORMATS = ("csv", "jsonl")
_EXTENSIONS = {".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl"}

#: The fields of a row that are not options (``due`` is read as ``eta``).
ROW_FIELDS = frozenset({"task", "key", "eta", "due", "countdown", "args", "kwargs", "check_task"})
#: Every column a CSV header may name.
COLUMNS = ROW_FIELDS | ALLOWED_OPTIONS

#: How a CSV cell becomes a value, by column (others stay text).
_JSON_COLUMNS = frozenset({"args", "kwargs", "headers"})
_INT_COLUMNS = frozenset({"priority", "max_attempts"})
_NUMBER_COLUMNS = frozenset(
    {"countdown", "time_limit", "soft_time_limit", "visibility_timeout", "max_runtime"}
)
_BOOL_COLUMNS = frozenset({"ignore_result", "check_task"})
_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def format_of(path: str, given: str | None) -> str:
    """The format of ``path`` (``-`` is stdin): ``given``, else by extension."""
    if given is not None:
        return given
    if path == "-":
        raise InvalidImport("reading stdin needs --format csv or --format jsonl")
    fmt = _EXTENSIONS.get(PurePath(path).suffix.lower())
    if fmt is None:
        raise InvalidImport(
            f"cannot tell the format of {path!r} from its extension "
            "(.csv, .jsonl or .ndjson); pass --format csv or --format jsonl"
        )
    return fmt


#: One input row: its line number and either the row or why it is refused.
Read = tuple[int, dict[str, Any] | str]


def read_rows(stream: Iterable[str], fmt: str) -> Iterator[Read]:
    """The rows of ``stream`` in format ``fmt``, each with its (first) line number.

    A row that cannot be read (malformed JSON, a cell of the wrong type) is
    yielded as its reason. A CSV header that is missing, names an unknown
    column or lacks ``task`` raises :class:`~celery_sched.errors.InvalidImport`
    before any row is read.
    """
    if fmt == "csv":
        return _csv_rows(stream)
    if fmt == "jsonl":
        return _jsonl_rows(stream)
    raise InvalidImport(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")


def _jsonl_rows(stream: Iterable[str]) -> Iterator[Read]:
    for line_number, line in enumerate(stream, start=1):
        if not line.strip():
            continue
        try:
            value = json_text.loads(line)
        except ValueError as exc:
            yield line_number, str(exc)
            continue
        if not isinstance(value, dict):
            yield line_number, f"expected a JSON object, got {type(value).__name__}"
            continue
        yield line_number, _due_as_eta(value)


def _csv_rows(stream: Iterable[str]) -> Iterator[Read]:
    reader = csv.reader(stream)
    try:
        header = next(reader)
    except StopIteration:
        raise InvalidImport("the CSV file is empty: it needs a header row") from None
    except csv.Error as exc:
        raise InvalidImport(f"malformed CSV at line 1: {exc}") from None
    columns = [name.strip() for name in header]
    unknown = [name for name in columns if name not in COLUMNS]
    if unknown:
        raise InvalidImport(
            f"CSV header (line 1) has unknown column(s) {', '.join(map(repr, unknown))}; "
            f"allowed: {', '.join(sorted(COLUMNS))}"
        )
    if "task" not in columns:
        raise InvalidImport("CSV header (line 1) has no 'task' column")
    if len(set(columns)) != len(columns):
        raise InvalidImport("CSV header (line 1) names a column twice")
    return _csv_records(reader, columns)


def _csv_records(reader: Any, columns: list[str]) -> Iterator[Read]:
    while True:
        start = reader.line_num + 1
        try:
            cells = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            yield start, f"malformed CSV: {exc}"
            continue
        if not any(cell.strip() for cell in cells):
            continue
        if len(cells) != len(columns):
            yield start, f"expected {len(columns)} cells as in the header, got {len(cells)}"
            continue
        try:
            row = {
                name: _cell(name, cell)
                for name, cell in zip(columns, cells, strict=True)
                if cell.strip()
            }
        except ValueError as exc:
            yield start, str(exc)
            continue
        yield start, _due_as_eta(row)


def _cell(column: str, text: str) -> Any:
    """The value of one CSV cell; ValueError names the column and the problem."""
    text = text.strip()
    if column in _JSON_COLUMNS:
        try:
            return json_text.loads(text)
        except ValueError as exc:
            raise ValueError(f"column {column}: {exc}") from None
    if column in _INT_COLUMNS:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"column {column}: not an integer: {text!r}") from None
    if column in _NUMBER_COLUMNS:
        return _number(column, text)
    if column in _BOOL_COLUMNS:
        value = _BOOLS.get(text.lower())
        if value is None:
            raise ValueError(f"column {column}: not true or false: {text!r}")
        return value
    if column == "expires":
        # Seconds after the due time, or an ISO 8601 instant.
        try:
            return _number(column, text)
        except ValueError:
            return text
    return text


def _number(column: str, text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"column {column}: not a number: {text!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"column {column}: not a finite number: {text!r}")
    return value


def _due_as_eta(row: dict[str, Any]) -> dict[str, Any] | str:
    if "due" in row:
        if "eta" in row:
            return "give eta or due, not both"
        row["eta"] = row.pop("due")
    return row


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class FailedChunk:
    """A chunk of valid rows the store refused as a whole: none was written."""

    first_line: int
    last_line: int
    rows: int
    reason: str


@dataclasses.dataclass(kw_only=True, slots=True)
class JobImport:
    """What an import did so far (kept up to date as it runs, so a caller
    can report it even when a lost connection ends the import early)."""

    read: int = 0
    valid: int = 0
    written: int = 0
    refused: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    failed_chunks: list[FailedChunk] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.refused and not self.failed_chunks


def import_rows(
    client: Client,
    rows: Iterable[Read],
    *,
    chunk_size: int,
    dry_run: bool = False,
    report: JobImport | None = None,
    progress: Callable[[int], object] | None = None,
) -> JobImport:
    """Validate every row, refuse the bad ones, write the good ones in chunks.

    Each chunk of up to ``chunk_size`` valid rows is one
    ``Client.schedule_many`` call (all or nothing). A key given twice in the
    input is refused at its second line. ``dry_run`` validates only.
    ``progress`` is called with the number of rows read since its last call.
    Lost connections propagate (:class:`~celery_sched.errors.StoreUnavailable`);
    ``report`` then holds what was done.
    """
    if chunk_size < 1:
        raise ValueError("chunk_size must be at least 1")
    report = report if report is not None else JobImport()
    seen_keys: dict[str, int] = {}
    chunk: list[tuple[int, dict[str, Any]]] = []

    def flush() -> None:
        if not chunk:
            return
        if not dry_run:
            try:
                report.written += client.schedule_many(row for _, row in chunk)
            except (DuplicateJob, InvalidJob) as exc:
                report.failed_chunks.append(
                    FailedChunk(
                        first_line=chunk[0][0],
                        last_line=chunk[-1][0],
                        rows=len(chunk),
                        reason=f"{type(exc).__name__}: {exc}",
                    )
                )
        chunk.clear()

    for line, row in rows:
        report.read += 1
        if progress is not None:
            progress(1)
        if isinstance(row, str):
            report.refused.append((line, json_text.one_line(row)))
            continue
        try:
            client.check_row(row)
        except InvalidJob as exc:
            report.refused.append((line, json_text.one_line(f"{type(exc).__name__}: {exc}")))
            continue
        key = row.get("key")
        if isinstance(key, str):
            if key in seen_keys:
                report.refused.append((line, f"key {key!r} is already on line {seen_keys[key]}"))
                continue
            seen_keys[key] = line
        report.valid += 1
        chunk.append((line, row))
        if len(chunk) >= chunk_size:
            flush()
    flush()
    return report
