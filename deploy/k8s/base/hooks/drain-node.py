"""preStop hook of a spot Ray worker pod: drain this pod's Ray node, then wait for Shoal to leave.

Kubernetes runs it before it stops the pod: a spot VM's preemption notice (the node shuts down
gracefully), `kubectl drain`, a scale-down, `kubectl delete pod`. A draining Ray node is how Shoal
learns of a preemption: the controller moves every job off the node's devices at their next step
boundary without losing a step (checkpoint and relayout take seconds; README, "Devices"). The hook
returns as soon as no actor is left on the node, or after --deadline-s, whichever comes first;
then the kubelet stops the container. Keep --deadline-s below the pod's
terminationGracePeriodSeconds. Any failure falls back to waiting out the deadline, so a broken
hook still gives Ray the time to notice the node going.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import time

POLL_S = 2.0
DRAIN_TIMEOUT_S = 30


def _drain_and_wait(deadline_s: int, deadline: float) -> None:
    import ray
    from ray.util.state import list_actors

    ray.init(address="auto", logging_level=logging.ERROR, log_to_driver=False)
    node_id = ray.get_runtime_context().get_node_id()
    # Ray's own command (README, "Devices"); run by this interpreter, whatever PATH the hook has.
    subprocess.run(
        [
            sys.executable, "-m", "ray.scripts.scripts", "drain-node",
            "--node-id", node_id,
            "--reason", "DRAIN_NODE_REASON_PREEMPTION",
            "--reason-message", "Kubernetes is stopping this pod",
            "--deadline-remaining-seconds", str(deadline_s),
        ],
        check=True,
        timeout=DRAIN_TIMEOUT_S,
    )  # fmt: skip
    print(f"drain-node: node {node_id} is draining; waiting up to {deadline_s} s", flush=True)
    # Only Shoal's stage and shard workers live on a worker node; none left means every job moved.
    while time.monotonic() < deadline:
        if not list_actors(filters=[("node_id", "=", node_id), ("state", "=", "ALIVE")]):
            print("drain-node: no actor left on this node", flush=True)
            return
        time.sleep(POLL_S)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Drain this Ray node before the pod stops.")
    parser.add_argument(
        "--deadline-s",
        type=int,
        default=100,
        help="seconds until the pod is stopped anyway (below terminationGracePeriodSeconds)",
    )
    deadline_s = parser.parse_args(argv).deadline_s
    deadline = time.monotonic() + deadline_s
    try:
        _drain_and_wait(deadline_s, deadline)
        return 0
    except Exception as exc:  # one attempt, no retry: what is left to do is wait
        print(f"drain-node: {exc!r}; waiting until the deadline", file=sys.stderr, flush=True)
    time.sleep(max(0.0, deadline - time.monotonic()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
