"""Stand-ins for a local Ray cluster's node processes and its record, for the tests of
`shoal up`'s local Ray (``service.localray``)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from shoal.service.localray_record import ClusterRecord, NodeRecord, ProcessId
from shoal.service.raynode import free_port

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


def record_cluster(path: Path, nodes: dict[str, ProcessId]) -> ClusterRecord:
    """A record of a cluster of ``nodes`` (group: process) whose `shoal up` is gone."""
    gone_owner = ProcessId(os.getpid(), "a start time no process has")
    record = ClusterRecord(
        f"127.0.0.1:{free_port()}",
        "t" * 64,
        gone_owner,
        tuple(
            NodeRecord(group, process, str(path.parent / "x.log"))
            for group, process in nodes.items()
        ),
    )
    record.write(path)
    return record
