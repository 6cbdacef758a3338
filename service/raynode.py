"""One Ray node of Shoal's devices: its ``ray start`` command, and the free ports a node
sharing this machine with the cluster's other nodes takes."""

from __future__ import annotations

import json
import socket
from collections.abc import Collection
from contextlib import ExitStack
from pathlib import Path

from shoal.scheduler.devices import DEVICE_RESOURCE
from shoal.service.devicespec import VirtualNode

LOOPBACK = "127.0.0.1"
"""The address the nodes of a local cluster (``shoal up``'s) share."""


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port nothing listens on right now (another process may still take it)."""
    (port,) = free_ports(1, host)
    return port


def free_ports(count: int, host: str = LOOPBACK, taken: Collection[int] = ()) -> list[int]:
    """``count`` distinct TCP ports nothing listens on right now, none of ``taken`` (ports
    chosen but not listened on yet). Each is held until all are chosen: the kernel hands a
    port just released out again, and one Ray node given the same port twice refuses to
    start ("trying to use a port number ... used by other components")."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    ports: list[int] = []
    with ExitStack() as held:
        while len(ports) < count:
            sock = held.enter_context(socket.socket(family))
            sock.bind((host, 0))
            port: int = sock.getsockname()[1]
            if port not in ports and port not in taken:
                ports.append(port)
    return ports


def node_command(
    ray: Path,
    spec: VirtualNode,
    *,
    address: str | None = None,
    head_port: int | None = None,
    shared_machine: bool = True,
) -> list[str]:
    """The ``ray start --block`` command of one node declaring ``spec``'s devices: the head
    (``head_port``) or a node joining the cluster at ``address``. ``shared_machine``: the
    node shares this machine (and its loopback address) with the cluster's other nodes, so
    it takes ports of its own; a node on a machine (a container) of its own does not."""
    args = [
        str(ray),
        "start",
        "--block",
        "--disable-usage-stats",
        f"--resources={json.dumps({DEVICE_RESOURCE: spec.count})}",
        "--labels=" + ",".join(f"{key}={value}" for key, value in spec.labels.items()),
    ]
    if spec.gpus is not None:
        args.append(f"--num-gpus={spec.gpus}")
    if shared_machine:
        # The head's port is chosen but not listened on yet when its command is made.
        agent, metrics = free_ports(2, taken=() if head_port is None else (head_port,))
        args += [
            f"--node-ip-address={LOOPBACK}",
            f"--dashboard-agent-listen-port={agent}",
            f"--metrics-export-port={metrics}",
        ]
    if head_port is not None:
        # One CPU beyond the devices, for the job runner actor and the control plane's work.
        return [
            *args,
            "--head",
            f"--port={head_port}",
            f"--num-cpus={spec.count + 1}",
            "--include-dashboard=false",
        ]
    if address is None:
        raise ValueError("a node either is the head (head_port) or joins one (address)")
    return [*args, f"--address={address}", f"--num-cpus={spec.count}"]
