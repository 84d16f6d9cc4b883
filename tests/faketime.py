"""A process whose wall clock can be moved while it runs (libfaketime), for the
fault tests and the soak.

:class:`FakeClock` gives a process the environment that preloads Debian's
``libfaketime`` with a timestamp file: :meth:`FakeClock.shift` writes an
offset (``+3600``) that the process picks up within
``FAKETIME_CACHE_DURATION`` (1 s). Only the wall clock moves
(``FAKETIME_DONT_FAKE_MONOTONIC=1``): a clock step does not move
``CLOCK_MONOTONIC``. ``tests/faketime_monotonic_fix.c``, compiled here with
``gcc`` and preloaded first, works around that libfaketime's broken
monotonic ``clock_nanosleep`` (see the file). The packages (``faketime``,
``gcc``) come from ``scripts/bootstrap.sh``.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1")
FIX_SOURCE = Path(__file__).with_name("faketime_monotonic_fix.c")


def faketime_missing() -> str | None:
    """Why a clock cannot be faked here, or None."""
    if not LIBFAKETIME.exists():
        return f"{LIBFAKETIME} is missing: install Debian's faketime (scripts/bootstrap.sh)"
    if shutil.which("gcc") is None:
        return "gcc is missing (scripts/bootstrap.sh installs it): it builds the sleep fix"
    return None


class FakeClock:
    """A timestamp file and the environment that makes a process follow it."""

    def __init__(self, directory: Path, name: str = "clock") -> None:
        self.file = directory / f"{name}.faketime"
        self.fix = directory / "faketime_monotonic_fix.so"
        self.offset = 0.0
        if not self.fix.exists():
            subprocess.run(
                ["gcc", "-shared", "-fPIC", "-O2", "-o", str(self.fix), str(FIX_SOURCE), "-ldl"],
                check=True,
                capture_output=True,
            )
        self.shift(0)

    def env(self) -> dict[str, str]:
        return {
            # The fix first: its clock_nanosleep must win over libfaketime's.
            "LD_PRELOAD": f"{self.fix} {LIBFAKETIME}",
            "FAKETIME_TIMESTAMP_FILE": str(self.file),
            "FAKETIME_CACHE_DURATION": "1",
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        }

    def shift(self, seconds: float) -> None:
        """Set the wall clock ``seconds`` away from the real one (0: back to it)."""
        # Written whole and renamed: the process never reads half a line.
        partial = self.file.with_suffix(".tmp")
        partial.write_text(f"{seconds:+.0f}\n")
        partial.replace(self.file)
        self.offset = seconds
