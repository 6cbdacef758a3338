"""Fixtures of the service's tests."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from shoal.service.nodeprocs import kill_session
from tests.service.stand_ins import FAKE_NODE, running_in_session


@pytest.fixture
def fake_node() -> Iterator[subprocess.Popen[bytes]]:
    """A running stand-in for a node (two processes in its session); killed at the end."""
    process = subprocess.Popen([sys.executable, "-c", FAKE_NODE], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while len(running_in_session(process.pid)) < 2:
            assert time.monotonic() < deadline, "the stand-in node did not start its child"
            time.sleep(0.05)
        yield process
    finally:
        kill_session(process.pid, time.monotonic() + 10)
        process.wait(timeout=10)
