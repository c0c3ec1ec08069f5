"""Per-rank fixtures for suites that run under mpirun (every rank runs the same tests)."""

from __future__ import annotations

import pytest

import unison


@pytest.fixture(scope="session", autouse=True)
def _unison_session():
    unison.init()
    yield
    unison.shutdown()
