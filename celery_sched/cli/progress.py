"""Progress bars of long commands (``import``, ``prune``), on a terminal only.

The bar goes to stderr and only when stderr is a terminal: piped or logged
output gets the command's plain summary alone, never bar frames.
"""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm


def on_terminal() -> bool:
    return sys.stderr.isatty()


def progress_bar(description: str, *, unit: str, total: int | None = None) -> tqdm[Any]:
    """A tqdm bar counting ``unit`` on stderr; inert when stderr is no terminal."""
    return tqdm(
        desc=description,
        unit=unit,
        total=total,
        file=sys.stderr,
        disable=not on_terminal(),
        dynamic_ncols=True,
        leave=False,
    )
