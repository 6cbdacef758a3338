"""Stand-ins for a local Ray cluster's node processes, for the tests of `shoal up`'s local
Ray (``service.localray``)."""

from __future__ import annotations

import subprocess

FAKE_NODE = """
import subprocess, time
subprocess.Popen(["sleep", "600"], process_group=0)
time.sleep(600)
"""
"""A stand-in for a node's `ray start`: run in a session of its own, it starts a process
in a process group of its own (as a raylet starts its workers)."""


def running_in_session(session: int) -> list[str]:
    """The processes of ``session`` still running (zombies left out), as ``ps`` lists them."""
    listing = subprocess.run(
        ["ps", "-A", "-o", "sess=,stat=,args="], capture_output=True, text=True, check=True
    ).stdout
    return [
        line
        for line in listing.splitlines()
        if int(line.split()[0]) == session and not line.split()[1].startswith("Z")
    ]
