"""Fault tests reuse the end-to-end cluster fixtures."""

from __future__ import annotations

from tests.e2e.conftest import e2e_settings, make_cluster

__all__ = ["e2e_settings", "make_cluster"]
