"""Stopping a local Ray node's processes: its ``ray start``, its process group, and whatever
is left of its session (raylet, GCS, workers), signalling a process only while it is still
the one recorded (``ProcessId``), never by name: other Rays run on the same machine."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

from shoal.service.localray_record import ProcessId


def signal_group(pid: int, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signum)


def kill_node(leader: ProcessId, process: subprocess.Popen[bytes] | None, deadline: float) -> None:
    """SIGKILL a node's ``ray start`` (``leader``: ``process`` if it is this process's
    child) with its process group, then every process left of its session.

    Only a process that is still the recorded one is signalled. A session id is not given
    to a new process while any member of the old session lives; so once the pid belongs to
    another process, nothing of the node's session is left to stop.
    """
    if process is not None:
        signal_group(process.pid, signal.SIGKILL)
        process.wait()
    elif leader.alive():
        signal_group(leader.pid, signal.SIGKILL)
    elif leader.pid_reused():
        return
    kill_session(leader.pid, deadline)


def _live_session_members(session: int) -> list[int]:
    listing = subprocess.run(
        ["ps", "-A", "-o", "pid=,sess=,stat="], capture_output=True, text=True, check=False
    ).stdout
    members = []
    for line in listing.splitlines():
        pid, sid, state = line.split(maxsplit=2)
        if int(sid) == session and not state.startswith("Z"):
            members.append(int(pid))
    return members


def kill_session(session: int, deadline: float) -> None:
    """SIGKILL what is left of a node's session until nothing runs there (or the deadline).

    Ray's raylet starts its workers in process groups of their own, inside the session
    `ray start` was given; they would exit by themselves a while after the raylet, or not.
    """
    while members := _live_session_members(session):
        for pid in members:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)
