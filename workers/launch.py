"""Starting and stopping a job's or sweep's workers: StageWorker and ShardWorker actors,
each on its device's node.

**StageWorkers** are created by their runner (inside the runner actor), which makes the
runner their owner: they die with it, and nothing else needs to clean them up.
**ShardWorkers** (one per device of the SHARP executor, ``workers.sharp.shard_host``) are owned
the same way by the runner that trains their models. The runner and sweep actors
themselves are started by ``workers.actors``.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.actor import ActorHandle
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from shoal.scheduler.devices import DEVICE_RESOURCE, Device
from shoal.workers.pipeline.stage_types import StageSetup
from shoal.workers.pipeline.stage_worker import StageWorker
from shoal.workers.sharp.shard_worker import ShardWorker
from shoal.workers.snapshot import StagePlan

COPIES_GROUP = "copies"
"""The workers' concurrency group for the calls beside their training calls:
``workers.pipeline.stage_worker.COPIES``, ``workers.sharp.shard_worker.BESIDE``."""
MOOT_GROUP = "moot"
"""A stage worker's concurrency group for ``workers.pipeline.stage_worker.MOOT``, which
must not wait behind a call of either other thread."""
# Ray's typing of remote classes is partial; the actor classes are used untyped.
_remote: Any = ray.remote
_StageWorkerActor: Any = _remote(concurrency_groups={COPIES_GROUP: 1, MOOT_GROUP: 1})(StageWorker)
_ShardWorkerActor: Any = _remote(concurrency_groups={COPIES_GROUP: 1})(ShardWorker)


def node_alive(node_id: str) -> bool:
    """Whether Ray's cluster table has node ``node_id`` alive."""
    return node_id in alive_nodes()


def alive_nodes() -> set[str]:
    """The nodes Ray's cluster table has alive."""
    nodes = ray.nodes()  # type: ignore[no-untyped-call]
    return {n["NodeID"] for n in nodes if n.get("Alive")}


def start_stage_worker(plan: StagePlan, setup: StageSetup) -> ActorHandle[Any]:
    """A StageWorker actor holding ``plan``'s blocks, pinned to its device's node.

    A GPU device takes one ``GPU`` (Ray sets CUDA_VISIBLE_DEVICES for it); a virtual device
    takes one ``shoal_device``. One thread for its training calls, never restarted and
    never retried, so Ray runs those calls from the runner in submission order (see
    ``workers.pipeline.group``) and a lost worker is reported, not silently replaced without its
    state; a second thread runs the in-memory copies' calls beside them (``COPIES_GROUP``),
    a third the signal that a loss is surveyed (``MOOT_GROUP``).
    """
    options = _on_device(plan.device, len(plan.group))
    worker: ActorHandle[Any] = _StageWorkerActor.options(**options).remote(plan, setup)
    return worker


def _on_device(device: Device, count: int = 1) -> dict[str, Any]:
    """Actor options that take ``device`` (with a tensor-parallel group, ``count`` devices
    of its node): ``GPU``s (Ray sets CUDA_VISIBLE_DEVICES) or ``shoal_device``s, on its
    node; single-threaded, never restarted or retried."""
    accelerator: dict[str, Any] = (
        {"num_gpus": count} if device.gpu else {"resources": {DEVICE_RESOURCE: count}}
    )
    return {
        "num_cpus": 0,
        "scheduling_strategy": NodeAffinitySchedulingStrategy(device.node_id, soft=False),
        "max_restarts": 0,
        "max_task_retries": 0,
        "max_concurrency": 1,
        **accelerator,
    }


def start_shard_worker(device: Device, budget_bytes: int) -> ActorHandle[Any]:
    """A ShardWorker actor on ``device``, holding up to ``budget_bytes`` of shards there;
    its tasks run one at a time in submission order, and a second thread hands copies over
    beside them (``COPIES_GROUP``): a copy is made within the task queue on a CPU device
    (its cores are the device) and on a side stream on a GPU, and what Ray then does with
    it (storing the states it returns) never holds up the next task."""
    worker: ActorHandle[Any] = _ShardWorkerActor.options(**_on_device(device)).remote(
        device, budget_bytes
    )
    return worker


def kill_worker(worker: ActorHandle[Any]) -> None:
    ray.kill(worker, no_restart=True)
