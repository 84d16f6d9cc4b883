"""JSON read from an import's input, with limits a hostile row cannot pass.

``json.loads`` raises RecursionError on an array nested a few thousand
deep and ValueError on an integer of more than 4,300 digits; a value
nested just under Python's recursion limit loads, then fails whatever
encodes it next (the task serializer, in the middle of a chunk of good
rows). :func:`loads` turns all of these into one ValueError with a
one-line reason, so the readers refuse the row and go on.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

#: The deepest nesting of arrays and objects a row may hold. Real task
#: arguments stay far below; encoders and workers must stay far from
#: Python's recursion limit (1,000 frames) while walking it.
MAX_DEPTH = 100


def loads(text: str | bytes, *, object_hook: Callable[[dict[str, Any]], Any] | None = None) -> Any:
    """The value of ``text``; ValueError (one line) when it is not JSON, is
    nested deeper than :data:`MAX_DEPTH` or holds a number Python refuses."""
    try:
        value = json.loads(text, object_hook=object_hook)
    except json.JSONDecodeError as exc:
        raise ValueError(f"malformed JSON: {exc.msg} at column {exc.colno}") from None
    except RecursionError:
        raise ValueError(f"JSON nested more than {MAX_DEPTH} levels deep") from None
    except ValueError as exc:  # an integer too long to convert, an object hook's refusal
        raise ValueError(f"unreadable JSON: {one_line(str(exc))}") from None
    check_depth(value)
    return value


def check_depth(value: Any) -> None:
    """ValueError when ``value`` nests lists, tuples or dicts deeper than
    :data:`MAX_DEPTH` (walked without recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        if depth > MAX_DEPTH:
            raise ValueError(f"JSON nested more than {MAX_DEPTH} levels deep")
        stack.extend((child, depth + 1) for child in children)


#: The longest reason a refused row or entry is reported with.
REASON_LIMIT = 300


def one_line(reason: str, limit: int = REASON_LIMIT) -> str:
    """``reason`` on one line, cut to ``limit`` characters (a hostile row can
    echo a ten-megabyte value into its error message)."""
    flat = " ".join(reason.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."
